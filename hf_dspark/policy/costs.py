"""What a round costs: one model of the target's forward and the drafter's pass, from what the loop measures and a
profiled table. The admission rule prices every round with it, before drafting and after, at every batch size.

    F(R, W) = seconds of a target forward over R rows of W tokens (N = R * W tokens)
    D(R)    = seconds of the drafter's pass over R rows

A shape the loop ran is priced by its measurements' moving average. A shape never run is priced by the least it can
cost (a forward over more tokens never costs less than one over fewer): the dearest shape measured over at most N
tokens, next to nothing with none, and at least a profiled table's price. That optimism keeps prices honest without
probes: a shape is tried once while its least price could win, then priced by what it cost. (A line through the
measured shapes prices a convex curve's middle high, and a shape priced out is never run to correct it: 0.92x the
best fixed width at 64 rows in the GPU-shaped simulation, against 0.98x.) D(R) likewise (free until it ran once).
"""

from __future__ import annotations

from ..models.cost_table import VerificationCostTable

# The weight of a new timing in a shape's moving average: about the last three runs count (a change of load, which
# scales every forward alike, is followed within a few rounds), and one burst of other work moves it a third.
SMOOTHING = 0.3
_UNBOUNDED = 1e-9  # the price of a shape nothing bounds from below: tried next


class CostModel:
    """F(R, W) and D(R) (see the module); `record_forward` / `record_draft` feed it what the loop timed."""

    def __init__(self, table: VerificationCostTable | None = None, learn: bool = True):
        self.table, self.learn = table, learn
        self.forwards: dict[tuple[int, int], float] = {}  # (rows, width) -> seconds, as measured
        self.drafts: dict[int, float] = {}  # rows -> seconds, as measured

    def record_forward(self, rows: int, width: int, seconds: float) -> None:
        if self.learn and seconds > 0.0:
            _smooth(self.forwards, (rows, width), seconds)

    def record_draft(self, rows: int, seconds: float) -> None:
        if self.learn and seconds > 0.0:
            _smooth(self.drafts, rows, seconds)

    def forward_seconds(self, rows: int, width: int) -> float:
        measured = self.forwards.get((rows, width))
        if measured is not None:
            return measured
        tabled = self._tabled(rows, width)
        if not self.forwards:
            return tabled if tabled is not None else 1.0  # nothing known: every forward alike, until one ran
        tokens = rows * width
        # Nothing measured over as few tokens: no bound but zero, so this shape is the next one tried.
        least = max([seconds for (r, w), seconds in self.forwards.items() if r * w <= tokens], default=_UNBOUNDED)
        return least if tabled is None else max(least, tabled)

    def forward_prices(self, rows: int, widths: int) -> list[float]:
        """F(rows, W) for W = 1..widths."""
        return [self.forward_seconds(rows, width) for width in range(1, widths + 1)]

    def draft_seconds(self, rows: int) -> float:
        measured = self.drafts.get(rows)
        if measured is not None:
            return measured
        tabled = self.table.draft_seconds if self.table is not None else 0.0
        below = [seconds for r, seconds in self.drafts.items() if r <= rows]
        return max(below + [tabled])

    def _tabled(self, rows: int, width: int) -> float | None:
        if self.table is None:
            return None
        # One row's verification is padded to the table's cheapest size at least as wide (the batch-1 loop).
        tokens = self.table.padded_tokens(width) if rows == 1 else rows * width
        return self.table.round_seconds(tokens) - self.table.draft_seconds


def _smooth(table: dict, key, seconds: float) -> None:
    previous = table.get(key)
    table[key] = seconds if previous is None else previous + SMOOTHING * (seconds - previous)
