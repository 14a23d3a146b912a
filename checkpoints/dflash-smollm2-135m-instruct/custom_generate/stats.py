"""Per-round acceptance records of a speculative generation, from which tau and the suffix-decay curve follow."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    """One entry per verification round.

    ``draft_lengths[i]`` tokens were proposed in round i and ``accepted[i]`` of them were accepted by the
    verifier; every round also emits one target token (the correction or the bonus token).
    ``confidences[i]`` holds the drafter's conditional confidence per drafted slot when it has a confidence head.
    """

    draft_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per phase summed over rounds: `verification` (target forwards), `backbone` (DSpark/DFlash
    parallel pass), `sequential_head` (slot-by-slot head, confidence and sampling), `drafting` (Eagle3 steps)."""

    def add_seconds(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def record(self, draft_length: int, accepted: int, confidences: list[float] | None = None) -> None:
        self.draft_lengths.append(int(draft_length))
        self.accepted.append(int(accepted))
        self.confidences.append(list(confidences or []))

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
            seconds,
        )
