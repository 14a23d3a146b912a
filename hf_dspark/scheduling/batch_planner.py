"""What a round of R requests verifies, decided before drafting from earlier rounds only (the engine's round planner).

Each round, for the whole batch, `BatchRoundPlanner.plan` picks the verification width W (every row's forward is
W tokens wide: its anchor and up to W - 1 drafts, padded to the longest row) and whether the drafter runs; then each
row takes the best of its own proposals within W: the drafter's block, a suffix match over its own text, or nothing
(its anchor alone). Every option is priced as expected tokens per second of the round:

    rate(W, drafter) = sum over rows of w_r E_r(W) / (F(R, W) + [drafter runs] * D(R))

with E_r the row's expected tokens, w_r what its tokens are worth (1 in a server; see `EngineRoundPlanning`) (1 + S_1 + ... + S_k for k proposed tokens surviving with S_j), F the target
forward's seconds at that shape and D the drafter pass's. A plain step is W = 1 without the drafter: R tokens for
F(R, 1). A proposal must beat the plain step by `margin` (estimates err; the plain step is measured). When the best
option is the plain step, no row drafts and the drafter does not run.

Costs are learnt by the loop (`RoundCosts`): seconds of each (rows, width) forward and of the drafter pass per row
count, measured between the host reads the engine makes anyway. Without a cost table an unmeasured shape is priced
from measured ones (linearly in tokens R * W between them, proportionally below the smallest, flat above the
largest: optimistic, so a shape that might pay is tried once and then known). With a table, its figures (scaled by
how measured shapes compare with them) price unmeasured shapes. With neither a table nor any measurement every
forward costs the same and drafting is free, a GPU-like machine where drafting always pays.

The drafter's expected tokens per row come from what verification accepted (`SlotAcceptance`: per draft slot, the
chance it is accepted when the slots before it were), kept per request on top of the batch's pooled rates, so any
drafter kind is priced by what it really achieves. A drafter that has not run for `probe_every` rounds runs once to
refresh its estimate, verifying at most `probe_width` tokens per row (a probe is a round expected to lose); each probe
that does not win doubles the wait up to `max_probe_every`. Without a cost table a new batch's prefill gives the
first price of wide forwards.

Lossless: every choice depends on earlier rounds (and on a row's own committed text, for suffix proposals), never on
this round's drafts; the verifier's rule keeps every row's output exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost_table import VerificationCostTable

DRAFTER, SUFFIX, NO_DRAFT = "drafter", "suffix", "none"


class SlotAcceptance:
    """Decayed counts, per draft slot j, of rounds that reached slot j (its drafts before it accepted) and of those
    that accepted it: `rates()` are the conditional acceptance rates, each over a Beta prior of `prior_weight`
    observations at `prior` rates (another estimate, e.g. the batch's pooled one)."""

    def __init__(self, slots: int, decay: float = 0.9):
        self.decay = decay
        self.reached = [0.0] * slots
        self.accepted = [0.0] * slots

    def record(self, verified: int, accepted: int) -> None:
        """A round verified `verified` drafts and accepted the first `accepted` of them."""
        for slot in range(min(accepted + 1, verified)):
            self.reached[slot] = self.decay * self.reached[slot] + 1.0
            self.accepted[slot] = self.decay * self.accepted[slot] + (1.0 if slot < accepted else 0.0)

    def rates(self, prior: list[float], prior_weight: float) -> list[float]:
        return [(a + prior_weight * p) / (r + prior_weight) for a, r, p in zip(self.accepted, self.reached, prior)]

    def pooled_rates(self, first_prior: float, prior_weight: float) -> list[float]:
        """`rates` where each slot's prior is the estimate of the slot before it (the first slot's is
        `first_prior`): a slot rarely verified (rounds verify few drafts) is priced like the one before it."""
        rates, prior = [], first_prior
        for accepted, reached in zip(self.accepted, self.reached):
            prior = (accepted + prior_weight * prior) / (reached + prior_weight)
            rates.append(prior)
        return rates


def expected_tokens(rates: list[float], num_tokens: int) -> list[float]:
    """E(k) for k = 0..num_tokens proposed tokens with conditional acceptance `rates` (the bonus token included)."""
    expected, survival = [1.0], 1.0
    for rate in rates[:num_tokens]:
        survival *= rate
        expected.append(expected[-1] + survival)
    return expected


class RoundCosts:
    """Seconds of the target's verification forward per (rows, width) and of the drafter's pass per row count:
    measured in this loop (smoothed, a burst clipped at twice the estimate), else estimated (see the module)."""

    def __init__(self, cost_table: VerificationCostTable | None = None, learn: bool = True, smoothing: float = 0.3):
        self.cost_table, self.learn, self.smoothing = cost_table, learn, smoothing
        self.forward: dict[tuple[int, int], float] = {}
        self.draft: dict[int, float] = {}

    def record_forward(self, rows: int, width: int, seconds: float) -> None:
        if self.learn:
            self.forward[rows, width] = self._smoothed(self.forward.get((rows, width)), seconds)

    def record_draft(self, rows: int, seconds: float) -> None:
        if self.learn:
            self.draft[rows] = self._smoothed(self.draft.get(rows), seconds)

    def _smoothed(self, previous: float | None, seconds: float) -> float:
        if previous is None:
            return seconds
        return previous + self.smoothing * (min(seconds, 2.0 * previous) - previous)

    def forward_seconds(self, rows: int, width: int) -> float:
        if (rows, width) in self.forward:
            return self.forward[rows, width]
        tokens = rows * width
        if self.cost_table is not None:
            tabled = self._tabled(tokens)
            if not self.forward:
                return tabled
            ratios = [seconds / self._tabled(r * w) for (r, w), seconds in self.forward.items()]
            return tabled * sum(ratios) / len(ratios)
        return _interpolated({r * w: s for (r, w), s in self.forward.items()}, tokens, default=1.0)

    def draft_seconds(self, rows: int) -> float:
        if rows in self.draft:
            return self.draft[rows]
        if self.draft:
            return _interpolated(self.draft, rows, default=0.0)
        return self.cost_table.draft_seconds if self.cost_table is not None else 0.0

    def _tabled(self, tokens: int) -> float:
        return self.cost_table.round_seconds(tokens) - self.cost_table.draft_seconds


def _interpolated(points: dict[int, float], x: int, default: float) -> float:
    """Linear in x between measured points; proportional to x below the smallest, flat above the largest."""
    if not points:
        return default
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]] * x / keys[0]
    if x >= keys[-1]:
        return points[keys[-1]]
    upper = next(k for k in keys if k >= x)
    lower = max(k for k in keys if k <= x)
    if upper == lower:
        return points[lower]
    share = (x - lower) / (upper - lower)
    return points[lower] + share * (points[upper] - points[lower])


@dataclass
class RowOptions:
    """What one row may verify this round: at most `budget` drafts; `suffix_expected[m]`, the expected tokens of
    verifying the first m tokens of its suffix proposal (m = 0..len); `drafter_expected[k]`, of k drafter slots.
    `weight`: what one of its tokens is worth to the batch (1; less for a row whose tokens shorten nothing)."""

    budget: int
    suffix_expected: list[float] = field(default_factory=lambda: [1.0])
    drafter_expected: list[float] = field(default_factory=lambda: [1.0])
    weight: float = 1.0


@dataclass
class RoundPlan:
    """The round's decision: whether the drafter runs, and per row its proposer and how many tokens it verifies at
    most (the drafter's rows may verify fewer: the draft-length rule reads their confidences)."""

    use_drafter: bool
    sources: list[str]
    lengths: list[int]
    expected_rate: float = 0.0

    @property
    def width(self) -> int:
        return max(self.lengths, default=0) + 1


class BatchRoundPlanner:
    """`plan(options)` -> `RoundPlan` for the running rows (see the module); `record_*` feed it the round's costs."""

    def __init__(self, costs: RoundCosts, drafter_allowed: bool = True, margin: float = 1.05, probe_every: int = 16,
                 max_probe_every: int = 64, probe_width: int = 3):
        self.costs, self.drafter_allowed, self.margin = costs, drafter_allowed, margin
        self.probe_width = probe_width  # a probe verifies at most this many tokens per row: it is a round that loses
        self.probe_every, self.max_probe_every = probe_every, max(probe_every, max_probe_every)
        self.probe_interval = probe_every
        self.rounds_without_drafter = 0

    def plan(self, options: list[RowOptions], drafter_possible: bool = True) -> RoundPlan:
        """The best round for these rows; `drafter_possible` False (e.g. a scheduler's plain round) leaves the
        drafter out this round."""
        rows = len(options)
        widest = max(row.budget for row in options) + 1
        plain_tokens = sum(row.weight for row in options)
        best = RoundPlan(False, [NO_DRAFT] * rows, [0] * rows, plain_tokens / self.costs.forward_seconds(rows, 1))
        bar = best.expected_rate * self.margin  # a proposal must beat the plain step by the margin
        best_drafter = None
        drafting = drafter_possible and self.drafter_allowed
        for use_drafter in (False, True) if drafting else (False,):
            for width in range(2, widest + 1):
                candidate = self._candidate(options, width, use_drafter)
                if candidate.expected_rate > bar:
                    best, bar = candidate, candidate.expected_rate
                if candidate.use_drafter and width <= self.probe_width and (
                        best_drafter is None or candidate.expected_rate > best_drafter.expected_rate):
                    best_drafter = candidate
        if best.use_drafter or best_drafter is None:
            self._drafter_ran(best.use_drafter, won=True)
            return best
        if self.rounds_without_drafter + 1 >= self.probe_interval:
            # A probe costs a round that does not pay; while probes keep finding that, probe half as often.
            self._drafter_ran(True, won=False)
            return best_drafter
        self._drafter_ran(False, won=False)
        return best

    def _drafter_ran(self, ran: bool, won: bool) -> None:
        if not ran:
            self.rounds_without_drafter += 1
            return
        self.rounds_without_drafter = 0
        self.probe_interval = self.probe_every if won else min(2 * self.probe_interval, self.max_probe_every)

    def _candidate(self, options: list[RowOptions], width: int, use_drafter: bool) -> RoundPlan:
        sources, lengths, expected = [], [], 0.0
        limit = width - 1
        for row in options:
            source, length, value = NO_DRAFT, 0, 1.0
            m = min(limit, row.budget, len(row.suffix_expected) - 1)
            if m > 0 and row.suffix_expected[m] > value:
                source, length, value = SUFFIX, m, row.suffix_expected[m]
            k = min(limit, row.budget, len(row.drafter_expected) - 1)
            if use_drafter and k > 0 and row.drafter_expected[k] > value:
                source, length, value = DRAFTER, k, row.drafter_expected[k]
            sources.append(source)
            lengths.append(length)
            expected += row.weight * value
        used_width = max(lengths) + 1
        seconds = self.costs.forward_seconds(len(options), used_width)
        drafting = use_drafter and DRAFTER in sources
        if drafting:
            seconds += self.costs.draft_seconds(len(options))
        return RoundPlan(drafting, sources, lengths, expected / seconds)
