"""The admission rule: how wide a round verifies, from survivals and prices, before drafting and after.

A round of R rows verifies each row's anchor and up to W - 1 proposed tokens in one forward of R x W tokens (rows are
padded to the widest: a slot under the width costs nothing more). With S[r, j] the survival of row r's slot j (the
chance that its first j proposed tokens are all accepted), a round of width W emits in expectation

    E(W) = sum over rows of (1 + S[r, 1] + ... + S[r, W - 1])

tokens in F(R, W) (+ the drafter's pass, when it is still to be paid) seconds (`costs.CostModel`).

Before drafting (`best_width`) every survival is an estimate and the rule takes the best width. After drafting
(`admitted_width`, on the device) slots are admitted while expected tokens per second rise, and it **stops at the
first width that no wider round beats**, later slots expected at the rates earlier rounds measured (`ahead`; None:
the next slot only, the paper's rule). The stop keeps it lossless: whether slot j is verified depends on c_1 ... c_j
and earlier rounds, not on the token drafted at slot j (the global best, `early_stop=False`, verifies slot j because
its draft made c_{j+1} high, and biases the output). The look ahead crosses a price jump (one row on a CPU: four
tokens cost 1.35x three, then 5 % a token) where the slots behind it repay it.
"""

import torch

from .acceptance import ConfidenceShift, SlotAcceptance
from .costs import CostModel


def best_width(expected: list[float], seconds: list[float]) -> int:
    """The width W (1 = anchors only) of the most expected tokens (or worth) a second, the first of equals, from a
    round of width 1, 2, ...'s (before drafting: estimates only, nothing to keep lossless)."""
    rates = [tokens / max(price, 1e-12) for tokens, price in zip(expected, seconds)]
    return rates.index(max(rates)) + 1


def _ahead_gains(ahead: list[float], width: int) -> list[list[float]]:
    """gains[k][k2] for k <= k2 < width: the tokens a survival of 1 at slot k is expected to add up to slot k2, later
    slots accepted at the rates `ahead` (slot j's at ahead[j - 1])."""
    gains = [[0.0] * width for _ in range(width)]
    for k in range(width):
        survival = 1.0
        for k2 in range(k + 1, width):
            survival *= ahead[k2 - 1] if k2 - 1 < len(ahead) else 0.0
            gains[k][k2] = gains[k][k2 - 1] + survival
    return gains


def admitted_width(survival: torch.Tensor, prices: list[float], early_stop: bool = True,
                   ahead: list[float] | None = None) -> torch.Tensor:
    """The admitted width W (a 0-d long tensor, 1 = anchors only) for `survival` (R, G) (0 where a row has no
    proposal) and `prices`, the seconds of a round of width 1..G + 1; on the survivals' device. `ahead`: the rates
    later slots are expected to be accepted at (host values from earlier rounds; None: none looked at)."""
    rows, slots = survival.shape
    device = survival.device
    mass = torch.cat([survival.new_full((1,), float(rows)), survival.clamp(0, 1).sum(0)]).double()  # (G + 1,)
    expected = rows + torch.cat([mass.new_zeros(1), mass[1:].cumsum(0)])  # at width 1 .. G + 1
    price = torch.tensor(prices[: slots + 1], dtype=torch.float64, device=device)
    if not early_stop:  # the global best on the survivals themselves (the paper's Appendix A: biased)
        return (expected / price).argmax() + 1
    gains = torch.tensor(_ahead_gains(ahead or [], slots + 1), dtype=torch.float64, device=device)
    upper = torch.ones(slots + 1, slots + 1, dtype=torch.bool, device=device).triu()
    projected = (expected[:, None] + mass[:, None] * gains) / price[None, :]  # from width k + 1 to k2 + 1
    best_from = projected.masked_fill(~upper, float("-inf")).amax(1)  # the best round seen from each width
    rises = best_from[1:] > expected[:-1] / price[:-1]  # admitting slot k + 1 (its survival known) can pay
    return rises.long().cumprod(0).sum() + 1


def survival_of(confidences: torch.Tensor, max_lengths: torch.Tensor | None) -> torch.Tensor:
    """Cumulative survivals (R, G) of conditional confidences, 0 past each row's `max_lengths`."""
    survival = confidences.detach().float().clamp(0, 1).cumprod(dim=1)
    if max_lengths is not None:
        slots = torch.arange(survival.shape[1], device=survival.device)
        survival = survival.masked_fill(slots[None, :] >= max_lengths.to(survival.device)[:, None], 0.0)
    return survival


class DSparkScheduler:
    """The admission rule after drafting: `select_lengths(confidences, max_lengths)` -> per-row verified lengths
    (R,), on the confidences' device without a host read. `costs`: a `CostModel` or a `VerificationCostTable`;
    `early_stop` False takes the global best (biased, for comparison only); `calibration`: the `ConfidenceShift` the
    confidences are read through; `acceptance`: the `SlotAcceptance` later slots are expected at (None: none)."""

    def __init__(self, costs, early_stop: bool = True, calibration: ConfidenceShift | None = None,
                 acceptance: SlotAcceptance | None = None):
        self.costs = costs if isinstance(costs, CostModel) else CostModel(costs, learn=False)
        self.early_stop, self.calibration, self.acceptance = early_stop, calibration, acceptance

    def select_lengths(self, confidences: torch.Tensor, max_lengths: torch.Tensor | None = None) -> torch.LongTensor:
        rows, slots = confidences.shape
        if self.calibration is not None:
            confidences = self.calibration.apply(confidences)
        survival = survival_of(confidences, max_lengths)
        ahead = self.acceptance.means(slots) if self.acceptance is not None else None
        width = admitted_width(survival, self.costs.forward_prices(rows, slots + 1), self.early_stop, ahead)
        lengths = (width - 1).expand(rows)
        return lengths if max_lengths is None else torch.minimum(lengths, max_lengths.to(lengths.device))
