"""What a round costs: one model of the target's forward and the drafter's pass, from what the loop measures and a
profiled table. The admission rule prices every round with it, before drafting and after, at every batch size.

    F(R, W) = seconds of a target forward over R rows of W tokens (N = R * W tokens)
    D(R)    = seconds of the drafter's pass over R rows
    O(R)    = seconds of the loop's own work between two rounds of R rows (committing, emitting, planning)

A round of width W is priced F(R, W) + O(R) (+ D(R) when it drafts): fewer, wider rounds save O(R).

A shape the loop ran is priced by its base times the load now (see below). A shape never run is priced by the least
it can cost, at least a profiled table's price (a plain step by the dearest plain step over fewer rows, a wider one by
the dearest shape over at most N tokens, next to nothing with none), tried once while that could win, then priced by
what it cost (a line through the measured shapes priced a convex curve's middle high). D(R) likewise.
"""

import numpy

from ..models.cost_table import VerificationCostTable

# A pass's seconds are its shape's base price times the machine's load now (other work slows every forward alike). A
# timing moves the load by LOAD_SMOOTHING of its log ratio to the price (about the last two runs; it scales every
# price alike, so its noise changes no choice) and its shape's base by 1 / n of what the load left unexplained, n its
# runs so far, at least SHAPE_SMOOTHING (about the last fifty runs). Without the shared load a burst of other work
# priced the shapes it hit for good (16 rows: width 2 left at 1.28 s where it costs 0.18 s, never run again).
LOAD_SMOOTHING = 0.5
SHAPE_SMOOTHING = 0.02
_UNBOUNDED = 1e-9  # the price of a shape nothing bounds from below: tried next


class CostModel:
    """F(R, W) and D(R) (see the module); `record_forward` / `record_draft` feed it what the loop timed."""

    def __init__(self, table: VerificationCostTable | None = None, learn: bool = True):
        self.table, self.learn = table, learn
        self.forwards: dict[tuple[int, int], float] = {}  # (rows, width) -> base seconds (at a load of 1)
        self.drafts: dict[int, float] = {}  # rows -> base seconds
        self.overheads: dict[int, float] = {}  # rows -> base seconds of O(R)
        self.load = 1.0  # how much slower than the bases every pass runs now
        self._runs: dict = {}  # (which bases, key) -> timings recorded

    def record_forward(self, rows: int, width: int, seconds: float) -> None:
        self._record(self.forwards, (rows, width), seconds)

    def record_draft(self, rows: int, seconds: float) -> None:
        self._record(self.drafts, rows, seconds)

    def record_overhead(self, rows: int, seconds: float) -> None:
        self._record(self.overheads, rows, seconds, moves_load=False)  # Python's work: too uneven to read load by

    def _record(self, bases: dict, key, seconds: float, moves_load: bool = True) -> None:
        if not self.learn or seconds <= 0.0:  # a model that does not learn keeps its prices
            return
        runs = self._runs[id(bases), key] = self._runs.get((id(bases), key), 0) + 1
        base = bases.get(key)
        if base is None:  # a new shape: its first timing, at today's load
            bases[key] = seconds / self.load
            return
        if moves_load:
            self.load *= (seconds / (base * self.load)) ** LOAD_SMOOTHING
        bases[key] = base * (seconds / (base * self.load)) ** max(1.0 / runs, SHAPE_SMOOTHING)

    def forward_seconds(self, rows: int, width: int) -> float:
        if (rows, width) in self.forwards:
            return self.forwards[rows, width] * self.load
        tabled = self._tabled(rows, width)
        if not self.forwards:
            return tabled if tabled is not None else 1.0  # nothing known: every forward alike, until one ran
        below = [seconds for (r, w), seconds in self.forwards.items() if w == width == 1 and r < rows]
        if not below:  # a wider shape, or no plain step below
            below = [seconds for (r, w), seconds in self.forwards.items() if r * w <= rows * width]
        least = self.load * max(below, default=_UNBOUNDED)  # none: no bound but zero, so it is tried next
        return least if tabled is None else max(least, tabled)

    def forward_prices(self, rows: int, widths: int) -> list[float]:
        """F(rows, W) + O(rows) for W = 1..widths: a round's seconds besides drafting."""
        overhead = self._at_most_rows(self.overheads, rows)
        return [self.forward_seconds(rows, width) + overhead for width in range(1, widths + 1)]

    def row_seconds(self, rows: int) -> float:
        """One row's part of a plain step at `rows` rows: the least-squares slope of the measured plain steps over their
        row counts less its standard error, in [0, the step's seconds per row]; 0 before three row counts ran (a slope
        through a few noisy steps met the cap, where a draining batch counts tokens again: 0.83x plain all at once)."""
        plain = numpy.array([(r, seconds) for (r, w), seconds in self.forwards.items() if w == 1]).reshape(-1, 2)
        if len(plain) < 3:
            return 0.0
        (slope, _), covariance = numpy.polyfit(plain[:, 0], plain[:, 1], 1, cov=True)
        return min(max(self.load * float(slope - covariance[0, 0] ** 0.5), 0.0), self.forward_seconds(rows, 1) / rows)

    def draft_seconds(self, rows: int) -> float:
        if rows in self.drafts:
            return self.drafts[rows] * self.load
        tabled = self.table.draft_seconds if self.table is not None else 0.0
        return max(self._at_most_rows(self.drafts, rows), tabled)

    def _at_most_rows(self, bases: dict, rows: int) -> float:
        """Seconds for `rows` rows: as measured, else at least the dearest measured over fewer (0 with none)."""
        measured = bases.get(rows)
        below = [seconds for r, seconds in bases.items() if r <= rows]
        return self.load * (measured if measured is not None else max(below, default=0.0))

    def _tabled(self, rows: int, width: int) -> float | None:
        if self.table is None:
            return None
        # One row's verification is padded to the table's cheapest size at least as wide (the batch-1 loop).
        tokens = self.table.padded_tokens(width) if rows == 1 else rows * width
        return self.table.round_seconds(tokens) - self.table.draft_seconds
