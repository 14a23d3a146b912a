"""Acceptance and calibration metrics of a drafter, computed from `SpeculativeStats` round records.

tau, per-slot conditional acceptance and mean draft length summarise how much each target forward buys. For a
drafter with a confidence head, ECE and AUROC say whether its confidences can be trusted by the scheduler: each
drafted slot j that was *reached* (slots 1..j-1 accepted) is one sample with prediction c_j and label "slot j
accepted"; the cumulative product c_1 * ... * c_j, which the scheduler actually ranks by, is scored against
"slots 1..j all accepted" over every drafted slot, reached or not.
"""

from __future__ import annotations

import math

import torch

from ..generation.round.stats import SpeculativeStats
from .calibration import auroc, expected_calibration_error


def _round(value: float, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) else round(float(value), digits)


def confidence_samples(stats: SpeculativeStats) -> dict[str, torch.Tensor]:
    """Per-slot calibration samples of the rounds that recorded confidences.

    `conditional` / `accepted`: c_j and "slot j accepted", over reached slots. `cumulative` / `survived`:
    c_1 ... c_j and "slots 1..j all accepted", over all drafted slots.
    """
    conditional, accepted, cumulative, survived = [], [], [], []
    for confidences, num_accepted in zip(stats.confidences, stats.accepted):
        product = 1.0
        for slot, confidence in enumerate(confidences):
            product *= confidence
            cumulative.append(product)
            survived.append(float(num_accepted > slot))
            if slot <= num_accepted:  # every earlier slot accepted: slot j was reached
                conditional.append(confidence)
                accepted.append(float(num_accepted > slot))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return {"conditional": as_tensor(conditional), "accepted": as_tensor(accepted),
            "cumulative": as_tensor(cumulative), "survived": as_tensor(survived)}


def calibration_summary(stats: SpeculativeStats, bins: int = 10) -> dict | None:
    """ECE / AUROC of the conditional confidences and ECE of their cumulative products; None without confidences
    (no confidence head, or no round drafted anything)."""
    samples = confidence_samples(stats)
    if samples["conditional"].numel() == 0:
        return None
    return {
        "ece": _round(expected_calibration_error(samples["conditional"], samples["accepted"], bins)),
        "auroc": _round(auroc(samples["conditional"], samples["accepted"])),
        "ece_cumulative": _round(expected_calibration_error(samples["cumulative"], samples["survived"], bins)),
        "samples": int(samples["conditional"].numel()),
        "cumulative_samples": int(samples["cumulative"].numel()),
        "mean_confidence": _round(float(samples["conditional"].mean())),
        "acceptance_rate": _round(float(samples["accepted"].mean())),
        "reliability": [[_round(c), _round(r), n] for c, r, n in reliability_curve(stats, bins)],
    }


def reached_by_slot(stats: SpeculativeStats) -> list[int]:
    """How many rounds reached each slot (drafted it with every earlier slot accepted): the sample size behind
    each per-slot acceptance rate, which thins out quickly for the last slots."""
    longest = max(stats.draft_lengths, default=0)
    return [sum(d > slot and a >= slot for d, a in zip(stats.draft_lengths, stats.accepted)) for slot in range(longest)]


def acceptance_summary(stats: SpeculativeStats) -> dict:
    """tau (tokens per target forward, bonus included), mean draft length verified, per-slot conditional
    acceptance (None where no round reached the slot) with its sample sizes, the share of round time per phase,
    and calibration."""
    if not stats.num_rounds:
        return {"rounds": 0}
    phases = stats.seconds
    total = sum(phases.values())
    out = {
        "rounds": stats.num_rounds,
        "tau": _round(stats.tau),
        "mean_draft_length": _round(stats.mean_draft_length),
        "acceptance_by_slot": [_round(rate) for rate in stats.acceptance_by_slot()],
        "reached_by_slot": reached_by_slot(stats),
        "time_share": {k: _round(v / total, 3) for k, v in sorted(phases.items())} if total else {},
    }
    calibration = calibration_summary(stats)
    if calibration is not None:
        out["calibration"] = calibration
    return out


def reliability_curve(stats: SpeculativeStats, bins: int = 10) -> list[tuple[float, float, int]]:
    """(mean confidence, observed acceptance, samples) per non-empty bin of the conditional confidences: the
    reliability diagram behind the ECE."""
    samples = confidence_samples(stats)
    predicted, outcome = samples["conditional"], samples["accepted"]
    index = (predicted * bins).long().clamp(max=bins - 1)
    curve = []
    for b in range(bins):
        in_bin = index == b
        if in_bin.any():
            curve.append((float(predicted[in_bin].mean()), float(outcome[in_bin].mean()), int(in_bin.sum())))
    return curve
