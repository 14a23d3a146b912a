"""Confidence-scheduled draft length for one request: the DSpark scheduler's rule at batch size 1.

Slot k is admitted while the expected throughput still rises:

    E(k) = 1 + S_1 + ... + S_k            (expected tokens of a round with k drafts; the 1 is the bonus token)
    T(k) = E(k) / cost(k + 1)             (cost of verifying k drafts + 1, from a profiled cost table, where the
                                          verification may be padded to a cheaper larger size: `padded_tokens`)

with S_j = c_1 * ... * c_j the predicted survival of the first j drafts. Drafting stops at the first slot whose
admission would not raise T (the DSpark scheduler's early stop, `DSparkScheduler` at R = 1). The decision uses c_1..c_k only, never the drafted tokens' verification, so the output
distribution is untouched: it only changes how many drafts are verified.
"""

from __future__ import annotations

from .cost_table import VerificationCostTable


class ThroughputDraftLength:
    """Call `start()` at the beginning of a round, then `admit(survival)` for each slot in order."""

    def __init__(self, cost_table: VerificationCostTable):
        self.cost_table = cost_table
        self.start()

    def start(self) -> None:
        self.expected, self.length = 1.0, 0
        self.rate = self.expected / self.cost_table.padded_round_seconds(1)

    def admit(self, survival: float) -> bool:
        expected = self.expected + survival
        rate = expected / self.cost_table.padded_round_seconds(self.length + 2)
        if rate <= self.rate:
            return False
        self.expected, self.rate, self.length = expected, rate, self.length + 1
        return True
