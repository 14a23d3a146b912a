"""Per-round acceptance records of a speculative generation, from which tau and the suffix-decay curve follow."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SpeculativeStats:
    """One entry per verification round.

    ``draft_lengths[i]`` tokens were proposed in round i and ``accepted[i]`` of them were accepted by the
    verifier; every round also emits one target token (the correction or the bonus token).
    ``confidences[i]`` holds the drafter's conditional confidence per drafted slot when it has a confidence head.
    ``sources[i]`` says what proposed round i's drafts: ``"drafter"``, ``"suffix"`` (a suffix match over the text
    so far) or ``"none"`` (no drafts: a plain decoding step).
    """

    draft_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per phase summed over rounds: `verification` (target forwards), `backbone` (DSpark/DFlash
    parallel pass), `sequential_head` (slot-by-slot head, confidence and sampling), `drafting` (Eagle3 steps), `planning` (choosing
    the round's proposer)."""

    def add_seconds(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def record(self, draft_length: int, accepted: int, confidences: list[float] | None = None,
               source: str = "drafter") -> None:
        self.draft_lengths.append(int(draft_length))
        self.accepted.append(int(accepted))
        self.confidences.append(list(confidences or []))
        self.sources.append(source if draft_length > 0 else "none")

    def only(self, source: str) -> "SpeculativeStats":
        """The rounds whose drafts came from `source` (e.g. the drafter's alone, to measure it without suffix
        drafting and plain steps)."""
        keep = [i for i, s in enumerate(self.sources) if s == source]
        return SpeculativeStats([self.draft_lengths[i] for i in keep], [self.accepted[i] for i in keep],
                                [self.confidences[i] for i in keep], [source] * len(keep))

    def count(self, source: str) -> int:
        """Rounds whose drafts came from `source`."""
        return sum(s == source for s in self.sources)

    @property
    def num_rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target verification forward, bonus token included."""
        if not self.accepted:
            return float("nan")
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted)

    @property
    def mean_draft_length(self) -> float:
        return sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else float("nan")

    def acceptance_by_slot(self) -> list[float]:
        """Conditional acceptance of slot j: accepted / reached, over rounds that drafted slot j and accepted
        every earlier slot. NaN where no round reached the slot."""
        longest = max(self.draft_lengths, default=0)
        rates = []
        for slot in range(longest):
            reached = [a for a, d in zip(self.accepted, self.draft_lengths) if d > slot and a >= slot]
            rates.append(sum(a > slot for a in reached) / len(reached) if reached else float("nan"))
        return rates

    def merge(self, other: "SpeculativeStats") -> "SpeculativeStats":
        seconds = dict(self.seconds)
        for phase, value in other.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + value
        return SpeculativeStats(
            self.draft_lengths + other.draft_lengths,
            self.accepted + other.accepted,
            self.confidences + other.confidences,
            self.sources + other.sources,
            seconds,
        )


class PhaseClock:
    """Reads the clock for per-phase seconds. On an accelerator the device is synchronised first (queued kernels
    would otherwise be billed to whichever phase waits for them), which costs a host round-trip per reading, so
    there it runs only when asked (`dspark_time_phases=True`); on the CPU it is free and always on."""

    def __init__(self, device: torch.device, enabled: bool | None = None):
        self.synchronise = device.type != "cpu"
        self.enabled = (not self.synchronise) if enabled is None else enabled
        self.device = device

    def now(self) -> float:
        if not self.enabled:
            return 0.0
        if self.synchronise:
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def lap(self, stats: "SpeculativeStats", phase: str, started: float) -> float:
        """Add the seconds since `started` to `phase`; returns the reading, the start of the next phase."""
        if not self.enabled:
            return 0.0
        now = self.now()
        stats.add_seconds(phase, now - started)
        return now
