"""The DSpark scheduler: how many draft tokens each of R concurrent requests gets verified this round.

Every request always verifies its anchor slot (B starts at R, with R expected tokens). Draft positions (r, j) are
ranked by cumulative survival a[r, j] = c[r, 1] * ... * c[r, j] and admitted in that order, each adding one token
to the verification batch B and a[r, j] expected tokens, while the expected throughput E * SPS(B) keeps rising.
The **early stop** (stop at the first admission that does not raise it) is what keeps the rule lossless: whether
(r, j) is verified then depends only on positions ranked above it, never on x[r, j] through later confidences.
Without it, the global best can include (r, j) *because* c[r, j+1], which depends on x[r, j], is high, and the
output is biased (the paper's Appendix A; see tests).
"""

from __future__ import annotations

import torch

from .cost_table import VerificationCostTable


class DSparkScheduler:
    """`select_lengths(confidences)` -> per-request draft lengths to verify.

    Args:
        cost_table: SPS(B), the verification steps per second at B tokens in the batch, as a
            `VerificationCostTable` (profiled by `hf-dspark profile`, or given by hand for simulation).
        early_stop: stop at the first admission that does not raise throughput (lossless). `False` takes the
            global best over all prefixes of the ranking (biased; kept for comparison only).
    """

    def __init__(self, cost_table: VerificationCostTable, early_stop: bool = True):
        self.cost_table = cost_table
        self.early_stop = early_stop

    def select_lengths(self, confidences: torch.Tensor, max_lengths: torch.Tensor | None = None) -> torch.LongTensor:
        """confidences (R, gamma) conditional acceptance probabilities; max_lengths (R,) drafts available."""
        rows, gamma = confidences.shape
        survival = confidences.float().clamp(0, 1).cumprod(dim=1)
        if max_lengths is not None:
            survival = survival.masked_fill(torch.arange(gamma)[None, :] >= max_lengths[:, None].cpu(), -1.0)
        order = ranking(survival)
        expected, batch = float(rows), rows
        best_throughput = expected * self.cost_table.steps_per_second(batch)
        admitted = best_count = 0
        for row, slot in order:
            value = float(survival[row, slot])
            if value < 0:
                break
            expected, batch = expected + value, batch + 1
            throughput = expected * self.cost_table.steps_per_second(batch)
            admitted += 1
            if throughput > best_throughput:
                best_throughput, best_count = throughput, admitted
            elif self.early_stop:
                break
        lengths = torch.zeros(rows, dtype=torch.long)
        for row, _ in order[:best_count]:
            lengths[row] += 1
        return lengths


def ranking(survival: torch.Tensor) -> list[tuple[int, int]]:
    """All (row, slot) pairs by survival, highest first; ties go to the earlier slot, then the earlier row, so every
    prefix of the ranking is a prefix of each row's slots (survival never rises along a row)."""
    rows, gamma = survival.shape
    pairs = [(r, j) for r in range(rows) for j in range(gamma)]
    return sorted(pairs, key=lambda rj: (-float(survival[rj]), rj[1], rj[0]))
