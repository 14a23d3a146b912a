"""The admission rule: how wide a round verifies, from survivals and prices, before drafting and after.

A round of R rows verifies every row's anchor and up to W - 1 proposed tokens per row in one forward of R x W
tokens (rows are padded to the widest, so within a width every row verifies all it has: a slot under the width
costs nothing more). With S[r, j] the survival of row r's slot j (the chance that its first j proposed tokens are
all accepted), a round of width W emits in expectation

    E(W) = sum over rows of (1 + S[r, 1] + ... + S[r, W - 1])

tokens in F(R, W) (+ the drafter's pass, when it is still to be paid) seconds (`costs.CostModel`). Widths are
admitted one at a time while the expected tokens per second E(W) / seconds(W) still rise, and the rule **stops at
the first width that does not raise it**. After drafting that early stop is what keeps the rule lossless: whether
slot j is verified depends on the survivals up to slot j only, S[., j] = c_1 ... c_j, which do not depend on the
token drafted at slot j (the confidence c_{j+1} does: a rule that looked further, such as the global best over all
widths, verifies slot j *because* its draft made the next confidence high, and biases the output; `early_stop=False`
keeps that rule for the tests that show it). At one row this is the DSpark paper's rule. Before drafting the same
rule runs on estimated survivals (`planner.RoundPolicy`, on the host).
"""

from __future__ import annotations

import torch

from .acceptance import ConfidenceShift
from .costs import CostModel


def hull(prices: list[float]) -> tuple[list[float], list[int]]:
    """Prices under their lower convex hull in the width, and each width's next hull corner. A CPU's forward jumps
    where a kernel changes (one row: 4 tokens cost 1.35x three, then 5 % a token), and the early stop would stop before
    a jump that wider rounds repay (measured: 0.73x verifying seven at an acceptance of 0.9). Under the hull the first
    drop is the best width; the rule verifies up to the next corner, which follows from the stop alone (lossless)."""
    low = [min(prices[a] + (prices[b] - prices[a]) * (w - a) / (b - a) if b > a else prices[w]
               for a in range(w + 1) for b in range(w, len(prices))) for w in range(len(prices))]
    corners = [w for w in range(len(prices)) if prices[w] <= low[w] + 1e-12]
    return low, [next(c for c in corners if c >= w) + 1 for w in range(len(prices))]


def first_drop(expected: list[float], seconds: list[float]) -> int:
    """The rule on the host (before drafting: no device value to wait for): the admitted width W, from the expected
    tokens and the seconds of a round of width 1, 2, ...; `admitted_width` reads survivals on the device."""
    low, corner = hull(seconds)
    width = 1
    while width < len(expected) and expected[width] / low[width] > expected[width - 1] / low[width - 1]:
        width += 1
    return corner[width - 1]


def admitted_width(survival: torch.Tensor, prices: list[float], early_stop: bool = True) -> torch.Tensor:
    """The admitted width W (a 0-d long tensor, 1 = anchors only) for `survival` (R, G) (0 where a row has no
    proposal) and `prices`, the seconds of a round of width 1..G + 1; on the survivals' device."""
    rows = survival.shape[0]
    expected = torch.cat([survival.new_full((1,), float(rows)), rows + survival.clamp(0, 1).sum(0).cumsum(0)])
    if not early_stop:  # the global best on the raw prices (the paper's Appendix A: biased)
        return (expected.double() / torch.tensor(prices, dtype=torch.float64, device=survival.device)).argmax() + 1
    low, corner = (torch.tensor(values, device=survival.device) for values in hull(prices))
    throughput = expected.double() / low.double()
    return corner[(throughput[1:] > throughput[:-1]).long().cumprod(0).sum()]


def survival_of(confidences: torch.Tensor, max_lengths: torch.Tensor | None) -> torch.Tensor:
    """Cumulative survivals (R, G) of conditional confidences, 0 past each row's `max_lengths`."""
    survival = confidences.detach().float().clamp(0, 1).cumprod(dim=1)
    if max_lengths is not None:
        slots = torch.arange(survival.shape[1], device=survival.device)
        survival = survival.masked_fill(slots[None, :] >= max_lengths.to(survival.device)[:, None], 0.0)
    return survival


class DSparkScheduler:
    """The admission rule after drafting, on the drafter's confidences: `select_lengths(confidences, max_lengths)`
    -> per-row verified lengths (R,), computed on the confidences' device without a host read.

    Args:
        costs: the `CostModel` that prices a round (a call's own, learnt as it runs), or a `VerificationCostTable`
            (priced by it alone).
        early_stop: stop at the first width that does not raise throughput (lossless); `False` takes the global
            best (biased, for comparison only).
        calibration: a `ConfidenceShift` the confidences are read through (a loop's, learnt from what it
            verified); None reads them as they are.
    """

    def __init__(self, costs, early_stop: bool = True, calibration: ConfidenceShift | None = None):
        self.costs = costs if isinstance(costs, CostModel) else CostModel(costs, learn=False)
        self.early_stop, self.calibration = early_stop, calibration

    def select_lengths(self, confidences: torch.Tensor, max_lengths: torch.Tensor | None = None) -> torch.LongTensor:
        rows, gamma = confidences.shape
        if self.calibration is not None:
            confidences = self.calibration.apply(confidences)
        survival = survival_of(confidences, max_lengths)
        width = admitted_width(survival, self.costs.forward_prices(rows, gamma + 1), self.early_stop)
        lengths = (width - 1).expand(rows)
        return lengths if max_lengths is None else torch.minimum(lengths, max_lengths.to(lengths.device))
