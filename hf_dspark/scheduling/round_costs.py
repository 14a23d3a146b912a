"""What a round costs on this machine, as the loop measures it (`RoundCosts`), for the round planner to price rounds.

Timed between the host reads a round makes anyway: a plain step's seconds per row count and, relative to it, what
each width of forward and the drafter's pass cost. A `VerificationCostTable`, when given, prices what was not measured
yet. One `RoundCosts` serves every batch size; a call keeps it in its `DraftingState`, so later calls start from it.
"""

from __future__ import annotations

import math

from .cost_table import VerificationCostTable


class RoundCosts:
    """What a round costs, as a plain step's seconds per row count and ratios to it, so that a change of load
    (which scales every forward alike) moves one measured figure, not every shape's:

        F(R, W) = plain(R) * widening(R, W)             the target forward, R rows of W tokens
        D(R)    = plain(R) * draft_ratio(R)             the drafter's pass over R rows

    `plain(R)` is measured in this loop (smoothed; a burst clipped at twice the estimate; a shape's first run, which
    may warm caches, provisional until its second; lowered by any wider forward that ran faster), else interpolated
    over the row counts measured (flat beyond them), else the cost table's (R tokens), else 1. `widening(R, W)` is
    learnt per shape from every wider forward: at the row count measured nearest to R, linear between the widths
    measured there (1 at W = 1), beyond the widest extended (`extended`: for several rows as a power through the last
    two widths; for one row, whose step from 1 to 2 tokens is mostly a fixed cost, held or its last rise continued);
    else the table's, else 1 (a flat machine). A width not measured at R itself costs at least a plain step of R x W
    rows (`tokens_seconds`, from the plain steps of 2+ rows measured).
    `knows_widths` tells the planner whether wide rounds are priced from a measure."""

    def __init__(self, cost_table: VerificationCostTable | None = None, learn: bool = True, smoothing: float = 0.3):
        self.cost_table, self.learn, self.smoothing = cost_table, learn, smoothing
        self.plain: dict[int, float] = {}
        self.widening: dict[tuple[int, int], float] = {}  # (rows, width) -> F(R, W) / plain(R), as measured
        self.draft_ratio: dict[int, float] = {}
        self._runs: dict = {}  # shape -> how many times it ran

    def record_forward(self, rows: int, width: int, seconds: float) -> None:
        if not self.learn:
            return
        if width == 1:
            self.plain[rows] = self._learnt(("forward", rows, 1), self.plain.get(rows), seconds)
        elif self.knows_plain() and not self.plain_provisional(rows):  # a ratio to a cold price measures nothing
            if rows in self.plain and seconds < self.plain[rows]:
                # A wider forward never costs less than a plain step: the plain estimate is stale (load fell).
                self.plain[rows] = seconds
            ratio = max(seconds / self.plain_seconds(rows), 1.0)
            shape = ("forward", rows, width)
            self.widening[rows, width] = self._learnt(shape, self.widening.get((rows, width)), ratio)

    def record_draft(self, rows: int, seconds: float) -> None:
        if self.learn and self.knows_plain():
            ratio = seconds / self.plain_seconds(rows)
            self.draft_ratio[rows] = self._learnt(("draft", rows), self.draft_ratio.get(rows), ratio)

    def _learnt(self, shape, previous: float | None, value: float) -> float:
        """The estimate after a run of `shape`. A shape's first run may fill cold caches or pick kernels, seconds
        that later rounds do not pay: it stands only until the second run replaces it (until then it prices the
        shape high, which keeps the planner from repeating a round that did not pay). Later runs are smoothed in."""
        runs = self._runs[shape] = self._runs.get(shape, 0) + 1
        if runs == 1:
            return value if previous is None else previous
        if runs == 2:
            return value
        return previous + self.smoothing * (min(value, 2.0 * previous) - previous)

    def knows_plain(self) -> bool:
        """Whether a plain step has a price: measured, tabled, or fixed (not learning: flat without a table)."""
        return bool(self.plain) or self.cost_table is not None or not self.learn

    def plain_provisional(self, rows: int) -> bool:
        """Whether the plain step at this row count rests on one timed run alone. That run may be a cold one (kernels
        picked, caches filled: 1.8x a later step has been seen at R = 12), and a plain step priced high prices every
        wider round low beside it, so wide rounds would win and the plain step would never run again to correct it.
        The planner takes a plain step then, which costs nothing against plain decoding."""
        return self.learn and self._runs.get(("forward", rows, 1), 0) == 1

    def knows_widths(self) -> bool:
        return bool(self.widening) or self.cost_table is not None or not self.learn

    def plain_seconds(self, rows: int) -> float:
        if rows in self.plain:
            return self.plain[rows]
        if self.plain:
            return interpolated(self.plain, rows)
        return self._tabled(rows) if self.cost_table is not None else 1.0

    def forward_seconds(self, rows: int, width: int) -> float:
        plain = self.plain_seconds(rows)
        if width == 1:
            return plain
        if self.widening:
            nearest = min({r for r, _ in self.widening}, key=lambda r: (abs(r - rows), r))
            measured = {w: ratio for (r, w), ratio in self.widening.items() if r == nearest}
            estimate = plain * extended({1: 1.0, **measured}, width, several_rows=nearest >= 2)
            if nearest == rows and width <= max(measured):
                return estimate  # measured at this shape's row count, within its widths
            # Borrowed from another row count or extended past the widest width: on a CPU a forward nearly free to
            # widen at 4 rows costs 3x a plain step at 10 rows x 8 tokens, so it costs at least what plain steps of
            # as many tokens cost (an upper estimate: those rows read their own contexts).
            return max(estimate, self.tokens_seconds(rows * width))
        if self.cost_table is not None:
            return plain * self._tabled(rows * width) / self._tabled(rows)
        return plain

    def tokens_seconds(self, tokens: int) -> float:
        """What a plain step of `tokens` rows costs, from the plain steps measured at three or more row counts of
        two or more rows (one row is another kernel path, far cheaper per row): between them interpolated, beyond the
        largest their least-squares rise per row continued (never a fall); 0 without such a curve."""
        points = {r: t for r, t in self.plain.items() if r >= 2}
        if not self.learn or len(points) < 3:
            return 0.0
        keys = sorted(points)
        if tokens <= keys[-1]:
            return interpolated(points, tokens)
        mean_rows, mean_seconds = sum(keys) / len(keys), sum(points.values()) / len(keys)
        rise = sum((r - mean_rows) * (points[r] - mean_seconds) for r in keys) / sum((r - mean_rows) ** 2 for r in keys)
        return points[keys[-1]] + max(rise, 0.0) * (tokens - keys[-1])

    def draft_seconds(self, rows: int) -> float:
        if self.draft_ratio:
            return self.plain_seconds(rows) * interpolated(self.draft_ratio, rows)
        return self.cost_table.draft_seconds if self.cost_table is not None else 0.0

    def _tabled(self, tokens: int) -> float:
        return self.cost_table.round_seconds(tokens) - self.cost_table.draft_seconds


def extended(points: dict[int, float], x: int, several_rows: bool = False) -> float:
    """Linear in x between measured points. Beyond the last, for one row: its last segment's rise (never a fall)
    continues when two widths past the first were measured, else the last point holds. One row's step from one token
    to two is mostly a fixed cost (another kernel path, the wider LM head pass), not a rate per token: continued, it
    would price a long proposal at several plain steps, and a width priced out is never run, so never timed.

    For several rows (`several_rows`) a forward of R x W tokens is mostly arithmetic on its tokens, and widening a
    round adds R tokens per width, so held flat the price falls far short (on a 2-core CPU, 12 rows: 2x a plain
    step at W = 3, 3.1x at W = 8, priced 2x). It rises instead as the power through the last two points, x^a with
    a = log(rise) / log(width ratio) in [0, 1]: between holding flat (a = 0) and growing in proportion to the tokens
    (a = 1), concave as a forward's cost is (12 rows: 3.7x at W = 8 from W = 3; 8 rows, 1.45x at W = 2: 3.0x at
    W = 8, measured 2.7x)."""
    keys = sorted(points)
    if x <= keys[-1] or len(keys) < 2 or (len(keys) == 2 and not several_rows):
        return interpolated(points, x)
    last, before = keys[-1], keys[-2]
    if several_rows:  # widening ratios are at least 1 (`record_forward`), so the log is defined
        power = min(max(math.log(points[last] / points[before]) / math.log(last / before), 0.0), 1.0)
        return points[last] * (x / last) ** power
    rise = max(points[last] - points[before], 0.0) / (last - before)
    return points[last] + rise * (x - last)


def interpolated(points: dict[int, float], x: int) -> float:
    """Linear in x between measured points, flat beyond them."""
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]]
    if x >= keys[-1]:
        return points[keys[-1]]
    upper = next(k for k in keys if k >= x)
    lower = max(k for k in keys if k <= x)
    if upper == lower:
        return points[lower]
    return points[lower] + (x - lower) / (upper - lower) * (points[upper] - points[lower])
