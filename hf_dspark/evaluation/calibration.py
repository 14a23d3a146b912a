"""Sequential Temperature Scaling (STS) for the confidence head, and the calibration metrics it minimises.

The scheduler ranks draft positions by cumulative survival c_1 * ... * c_j, so it is the *products* that must be
calibrated, not each c_j alone. STS fits one temperature per slot, left to right: T_1 minimises the ECE of c_1
against "slot 1 accepted"; with T_1 fixed, T_2 minimises the ECE of c_1 c_2 against "slots 1-2 accepted"; and so
on. Store the result in `drafter.config.confidence_temperatures`; generation applies it before the admission rule reads them.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch


class RoundRecords(Protocol):
    """Per-round records of a generation (`hf_dspark.generation.SpeculativeStats` is one): the drafter's confidence
    per drafted slot and how many drafts were accepted. Named by its shape, so that the policy, below generation,
    does not import it."""

    confidences: Sequence[Sequence[float]]
    accepted: Sequence[int]

DEFAULT_GRID = tuple(round(0.25 * 1.1**i, 4) for i in range(40))  # 0.25 .. ~10


def expected_calibration_error(predicted: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> float:
    """Weighted mean |mean prediction - observed rate| over equal-width probability bins."""
    predicted, outcome = predicted.double().flatten(), outcome.double().flatten()
    if predicted.numel() == 0:
        return float("nan")
    index = (predicted * bins).long().clamp(max=bins - 1)
    error = 0.0
    for b in range(bins):
        in_bin = index == b
        if in_bin.any():
            error += float(in_bin.sum()) * abs(float(predicted[in_bin].mean() - outcome[in_bin].mean()))
    return error / predicted.numel()


def survival_pairs(stats: RoundRecords, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(recorded confidences c_1..c_{slot+1} as logits (N, slot+1), whether those slots were all accepted (N,)),
    over rounds that drafted slot `slot` (0-based)."""
    logits, outcome = [], []
    for confidences, accepted in zip(stats.confidences, stats.accepted):
        if len(confidences) > slot:
            c = torch.tensor(confidences[: slot + 1], dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
            logits.append(torch.log(c) - torch.log1p(-c))
            outcome.append(float(accepted > slot))
    if not logits:
        return torch.zeros(0, slot + 1, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.stack(logits), torch.tensor(outcome, dtype=torch.float64)


def fit_sequential_temperatures(stats: RoundRecords, block_size: int, grid=DEFAULT_GRID,
                                bins: int = 10) -> list[float]:
    """STS from generation records made with unscaled confidences (`confidence_temperatures=None`). Slots never
    reached keep temperature 1."""
    temperatures: list[float] = []
    for slot in range(block_size):
        logits, outcome = survival_pairs(stats, slot)
        if outcome.numel() == 0:
            temperatures.append(1.0)
            continue
        fixed = torch.sigmoid(logits[:, :slot] / torch.tensor(temperatures, dtype=torch.float64)).prod(dim=1)
        best = min(grid, key=lambda t: expected_calibration_error(fixed * torch.sigmoid(logits[:, slot] / t),
                                                                 outcome, bins))
        temperatures.append(float(best))
    return temperatures


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random negative."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    positives, negatives = scores[labels], scores[~labels]
    if positives.numel() == 0 or negatives.numel() == 0:
        return math.nan
    ranks = torch.empty_like(scores)
    order = scores.argsort()
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    for value in scores.unique():  # average ranks over ties
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[labels].sum() - positives.numel() * (positives.numel() + 1) / 2)
                 / (positives.numel() * negatives.numel()))
