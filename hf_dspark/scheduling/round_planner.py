"""What a round of R requests verifies, decided before drafting from earlier rounds only: the round planner of every
batch size (batch 1 is R = 1; `generation/round/planning.py` feeds it).

Each round, for the whole batch, `RoundPlanner.plan` picks the verification width W (every row's forward is
W tokens wide: its anchor and up to W - 1 drafts, padded to the longest row) and whether the drafter runs; then each
row takes the best of its own proposals within W: the drafter's block, a suffix match over its own text, or nothing
(its anchor alone). Every option is priced as what the round is worth per second:

    rate(W, drafter) = value / (F(R, W) + [drafter runs] * D(R))

F is the target forward's seconds at that shape and D the drafter pass's. In a server the value is the round's
expected tokens, sum over rows of E_r (1 + S_1 + ... + S_k for k proposed tokens surviving with S_j). A
`generate()` batch returns only when its last row is done, so there a round is worth the plain steps it takes off the
batch's remaining work (`finishing_value`), the better of two estimates: this round alone followed by plain steps
(`shortening`: only the longest rows' gains count, so with rows tied it is worth little), and rounds like it until
the batch is done (`steady_shortening`: rows that gain now are ahead later, so the laggards set the pace and each
row's rate counts, less a spread for the slowest of R random finishes). A plain step is W = 1 without
the drafter: R tokens, or one step, for F(R, 1). A proposal must beat the plain step by `margin` (estimates err; the
plain step is measured). When the best option is the plain step, no row drafts and the drafter does not run.

Costs are learnt by the loop (`RoundCosts`), timed between the host reads a round makes anyway: a plain step's
seconds per row count, and, relative to it, what each width of forward and the drafter's pass cost. The
first round is a plain step, and so is the second at a row count (its first timing may be a cold one, and priced
high it would make every wider round look cheap); until a wider forward has been timed, rounds verify at most
`probe_width` tokens per row. A cost table, when given, prices what was not measured yet. With a table and nothing
learnt (or `learn=False` without a table: every forward costs the same and drafting is free, a GPU-like machine) the
prices stay the table's.

The drafter's expected tokens per row come from what verification accepted (`SlotAcceptance`: per draft slot, the
chance it is accepted when the slots before it were), kept per request on top of the batch's pooled rates (whose
prior is what earlier loops of the drafter measured), so any drafter kind is priced by what it really achieves. A
drafter that has not run for `probe_every` rounds runs once to refresh its estimate, verifying at most `probe_width`
tokens per row (a probe is a round expected to lose), as long as its optimistic estimate
(`RowOptions.drafter_optimistic`: what few measurements leave possible) could still win; each probe that does not
win doubles the wait up to `max_probe_every`.

What the picked rounds delivered corrects what later ones are priced at (`RoundCalibration`, per band of row counts):
each proposer's expected extra tokens are scaled by the share its proposals delivered, each round's seconds by how
far rounds overran their price. Only ever a brake, as the plain step is measured and the picked estimates err high.

Lossless: every choice depends on earlier rounds (and on a row's own committed text, for suffix proposals), never on
this round's drafts; the verifier's rule keeps every row's output exactly the target's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from statistics import NormalDist

from .round_costs import RoundCosts

DRAFTER, SUFFIX, NO_DRAFT = "drafter", "suffix", "none"


@dataclass
class SlotAcceptance:
    """Decayed counts, per draft slot j, of rounds that reached slot j (its drafts before it accepted) and of those
    that accepted it: `rates()` are the conditional acceptance rates, each over a Beta prior of `prior_weight`
    observations at `prior` rates (another estimate, e.g. the batch's pooled one)."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    decay: float = 0.9

    @classmethod
    def empty(cls, slots: int, decay: float = 0.9) -> "SlotAcceptance":
        return cls([0.0] * slots, [0.0] * slots, decay)

    def cover(self, slots: int) -> None:
        """Count at least `slots` slots (a later loop may draft more than earlier ones did)."""
        missing = slots - len(self.reached)
        if missing > 0:
            self.reached.extend([0.0] * missing)
            self.accepted.extend([0.0] * missing)

    def record(self, verified: int, accepted: int) -> None:
        """A round verified `verified` drafts and accepted the first `accepted` of them."""
        for slot in range(min(accepted + 1, verified, len(self.reached))):
            self.reached[slot] = self.decay * self.reached[slot] + 1.0
            self.accepted[slot] = self.decay * self.accepted[slot] + (1.0 if slot < accepted else 0.0)

    def rates(self, prior: list[float], prior_weight: float) -> list[float]:
        return [(a + prior_weight * p) / (r + prior_weight) for a, r, p in zip(self.accepted, self.reached, prior)]

    def pooled_rates(self, first_prior: float, prior_weight: float, priors: list[float] | None = None) -> list[float]:
        """`rates` where each slot's prior is `priors[j]` when given, else the estimate of the slot before it (the
        first slot's is `first_prior`): a slot rarely verified (rounds verify few drafts) is priced like the one
        before it."""
        rates, prior = [], first_prior
        for slot, (accepted, reached) in enumerate(zip(self.accepted, self.reached)):
            if priors is not None:
                prior = priors[slot]
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


@dataclass
class RowOptions:
    """What one row may verify this round: at most `budget` drafts; `suffix_expected[m]`, the expected tokens of
    verifying the first m tokens of its suffix proposal (m = 0..len); `drafter_expected[k]`, of k drafter slots.
    `left`: the tokens the row has left when the batch returns only once every row is done (a `generate()` call),
    None for a server's row (see `RoundPlanner`)."""

    budget: int
    suffix_expected: list[float] = field(default_factory=lambda: [1.0])
    drafter_expected: list[float] = field(default_factory=lambda: [1.0])
    left: int | None = None
    drafter_optimistic: list[float] | None = None  # the same, optimistic (what a probe could still find); None: as is


@dataclass
class RoundPlan:
    """The round's decision: whether the drafter runs, and per row its proposer and how many tokens it verifies at
    most (the drafter's rows may verify fewer: the draft-length rule reads their confidences)."""

    use_drafter: bool
    sources: list[str]
    lengths: list[int]
    expected_rate: float = 0.0
    seconds: float = 0.0  # the round's priced seconds (before calibration)

    @property
    def width(self) -> int:
        return max(self.lengths, default=0) + 1


class RoundCalibration:
    """What planned rounds delivered against what they were priced at, per band of row counts (1, 2-3, 4-7, 8-15,
    ...): per proposer (drafter, suffix) the decayed sums of expected and accepted proposed tokens, and per band the
    decayed sums of priced and measured seconds, each over `prior_weight` rounds that delivered as priced.

    Why: the planner picks the best of many estimated options, so what it picks is where the estimates erred high
    the most (the winner's curse), and a shape not measured yet is priced from others. At 12 rows on a 2-core CPU the
    rounds it picked delivered about three quarters of the rate they were priced at, which the margin over the plain
    step did not cover. Only ever a brake: a proposer's factor on its expected extra tokens is at most 1, the factor
    on a round's priced seconds at least 1."""

    def __init__(self, decay: float = 0.8, prior_weight: float = 2.0):
        self.decay, self.prior_weight = decay, prior_weight
        self._tokens: dict[tuple[int, str], list[float]] = {}  # (band, proposer) -> [rows, expected, accepted]
        self._seconds: dict[int, list[float]] = {}  # band -> [rounds, priced, measured]

    def record_tokens(self, rows: int, proposer: str, expected_extra: float, accepted: int) -> None:
        """One row's proposal in a round of `rows` rows: its expected accepted tokens (as priced) and the accepted."""
        self._add(self._tokens, (rows.bit_length(), proposer), expected_extra, accepted)

    def record_seconds(self, rows: int, priced: float, measured: float) -> None:
        if priced > 0.0:
            self._add(self._seconds, rows.bit_length(), priced, measured)

    def _add(self, table: dict, key, priced: float, delivered: float) -> None:
        sums = table.setdefault(key, [0.0, 0.0, 0.0])
        for index, value in enumerate((1.0, priced, delivered)):
            sums[index] = self.decay * sums[index] + value

    def tokens_factor(self, rows: int, proposer: str) -> float:
        return min(self._ratio(self._tokens.get((rows.bit_length(), proposer))), 1.0)

    def seconds_factor(self, rows: int) -> float:
        return max(self._ratio(self._seconds.get(rows.bit_length())), 1.0)

    def _ratio(self, sums: list[float] | None) -> float:
        """Delivered over priced, over `prior_weight` observations of the mean price that delivered it."""
        if sums is None or sums[1] <= 0.0:
            return 1.0
        count, priced, delivered = sums
        prior = self.prior_weight * priced / count
        return (delivered + prior) / (priced + prior)


def _shrunk(expected: list[float], factor: float) -> list[float]:
    """Expected tokens with every proposed token's survival scaled by `factor` (the first, the target's, kept)."""
    return [1.0 + (value - 1.0) * factor for value in expected]


class RoundPlanner:
    """`plan(options)` -> `RoundPlan` for the running rows (see the module); `record_*` feed it the round's costs."""

    def __init__(self, costs: RoundCosts, drafter_allowed: bool = True, margin: float = 1.05, probe_every: int = 16,
                 max_probe_every: int = 64, probe_width: int = 3, max_width: int = 1 << 30):
        self.costs, self.drafter_allowed, self.margin = costs, drafter_allowed, margin
        self.probe_width = probe_width  # a probe verifies at most this many tokens per row: it is a round that loses
        self.max_width = max_width
        self.probe_every, self.max_probe_every = probe_every, max(probe_every, max_probe_every)
        self.probe_interval = probe_every
        self.rounds_without_drafter = 0
        self.calibration = RoundCalibration()
        self._seconds_factor = 1.0  # this plan's calibration of priced seconds

    def plan(self, options: list[RowOptions], drafter_possible: bool = True, probe_allowed: bool = True) -> RoundPlan:
        """The best round for these rows; `drafter_possible` False (e.g. a scheduler's plain round) leaves the
        drafter out this round, `probe_allowed` False runs it only where it is expected to pay."""
        rows = len(options)
        if not self.costs.knows_plain() or self.costs.plain_provisional(rows):
            # A plain step: the price every other round is relative to, until it was timed at this row count twice.
            return RoundPlan(False, [NO_DRAFT] * rows, [0] * rows)
        options = self._calibrated(options)
        # Until a wider forward was timed, rounds stay as narrow as a probe: the first wide one measures widening.
        widest = min(max(row.budget for row in options) + 1,
                     self.probe_width if not self.costs.knows_widths() else self.max_width)
        plain_value = 1.0 if _finishing_together(options) else float(rows)  # a plain step: one token per row
        best = RoundPlan(False, [NO_DRAFT] * rows, [0] * rows, plain_value / self.costs.forward_seconds(rows, 1))
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
        if probe_allowed and self.rounds_without_drafter + 1 >= self.probe_interval and self._worth_probing(
                options, best_drafter.width, bar):
            # A probe costs a round that does not pay; while probes keep finding that, probe half as often.
            self._drafter_ran(True, won=False)
            return best_drafter
        self._drafter_ran(False, won=False)
        return best

    def _calibrated(self, options: list[RowOptions]) -> list[RowOptions]:
        """The rows' options with each proposer's expected tokens scaled by what its proposals delivered at this row
        count, and this plan's seconds factor set (`RoundCalibration`); the optimistic estimates are kept."""
        rows = len(options)
        self._seconds_factor = self.calibration.seconds_factor(rows)
        suffix, drafter = (self.calibration.tokens_factor(rows, SUFFIX), self.calibration.tokens_factor(rows, DRAFTER))
        if suffix == 1.0 and drafter == 1.0:
            return options
        return [replace(row, suffix_expected=_shrunk(row.suffix_expected, suffix),
                        drafter_expected=_shrunk(row.drafter_expected, drafter),
                        drafter_optimistic=row.drafter_optimistic or row.drafter_expected) for row in options]

    def _worth_probing(self, options: list[RowOptions], width: int, bar: float) -> bool:
        """Whether the drafter's optimistic estimate (few observations leave much to find) could still beat the best
        round at a probe's width: once many probes have measured a drafter that does not pay here, none is run."""
        optimistic = [RowOptions(row.budget, [1.0], row.drafter_optimistic or row.drafter_expected, row.left)
                      for row in options]
        return self._candidate(optimistic, width, use_drafter=True).expected_rate > bar

    def _drafter_ran(self, ran: bool, won: bool) -> None:
        if not ran:
            self.rounds_without_drafter += 1
            return
        self.rounds_without_drafter = 0
        self.probe_interval = self.probe_every if won else min(2 * self.probe_interval, self.max_probe_every)

    def _candidate(self, options: list[RowOptions], width: int, use_drafter: bool) -> RoundPlan:
        sources, lengths, chosen = [], [], []
        limit = width - 1
        for row in options:
            source, length, expected = NO_DRAFT, 0, [1.0]
            m = min(limit, row.budget, len(row.suffix_expected) - 1)
            if m > 0 and row.suffix_expected[m] > expected[-1]:
                source, length, expected = SUFFIX, m, row.suffix_expected[: m + 1]
            k = min(limit, row.budget, len(row.drafter_expected) - 1)
            if use_drafter and k > 0 and row.drafter_expected[k] > expected[-1]:
                source, length, expected = DRAFTER, k, row.drafter_expected[: k + 1]
            sources.append(source)
            lengths.append(length)
            chosen.append(expected)
        if _finishing_together(options):
            value = finishing_value([row.left for row in options], chosen)
        else:
            value = sum(expected[-1] for expected in chosen)
        used_width = max(lengths) + 1
        seconds = self.costs.forward_seconds(len(options), used_width)
        drafting = use_drafter and DRAFTER in sources
        if drafting:
            seconds += self.costs.draft_seconds(len(options))
        return RoundPlan(drafting, sources, lengths, value / (seconds * self._seconds_factor), seconds)


def _finishing_together(options: list[RowOptions]) -> bool:
    return all(row.left is not None for row in options)


def finishing_value(left: list[int], expected: list[list[float]]) -> float:
    """What a round of a batch that returns once its last row is done is worth, in plain steps taken off its
    remaining work: the better of spending this one round on proposals (`shortening`) and spending every round like
    it (`steady_shortening`); the planner may choose either future, so the round is worth at least both."""
    return max(shortening(left, expected), steady_shortening(left, expected))


def steady_shortening(left: list[int], expected: list[list[float]]) -> float:
    """Plain steps per round if every remaining round were like this one: max(left) plain steps against the
    rounds the slowest row needs. Row r emits X_r tokens a round (mean m, variance v, from `expected`), so it needs
    about N_r = left_r / m rounds with variance left_r v / m^3 (a renewal count); the batch needs max_r N_r, whose
    mean for R rows is taken as max_r(mean_r + z_R sd_r), z_R the expected largest of R standard normals (exact for
    identical rows, above it otherwise, so the estimate errs low). One row that cannot gain keeps it at 1."""
    spread = _largest_of_normals(len(left))
    rounds = 1.0
    for row_left, row_expected in zip(left, expected):
        mean, variance = emission_moments(row_expected)
        rounds = max(rounds, row_left / mean + spread * math.sqrt(row_left * variance / mean**3))
    return max(left) / rounds


def emission_moments(expected: list[float]) -> tuple[float, float]:
    """Mean and variance of the tokens a round emits for a row whose first k proposed tokens emit `expected[k]`
    (P(X >= j + 1) = expected[j] - expected[j - 1], X >= 1)."""
    mean = expected[-1]
    second = 1.0 + sum((2 * j + 1) * (expected[j] - expected[j - 1]) for j in range(1, len(expected)))
    return mean, max(second - mean * mean, 0.0)


@lru_cache(maxsize=None)
def _largest_of_normals(count: int) -> float:
    """The expected largest of `count` independent standard normals (Blom's approximation; 0 for one)."""
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25)) if count > 1 else 0.0


def shortening(left: list[int], expected: list[list[float]]) -> float:
    """How many steps one round is expected to take off a batch that returns once its last row is done: the drop of
    max over rows of (tokens left - tokens emitted), rows independent, each row's `expected[k]` the expected tokens of
    its first k proposed tokens (so P(emits >= j + 1) = expected[j] - expected[j - 1]). A plain step is worth 1; a
    row ahead of the longest shortens nothing until the round could make it the longest.

        E[drop] = sum over d >= 1 of P(every row r emits >= left_r - max(left) + d tokens)
    """
    longest = max(left)
    drop, steps = 0.0, 1
    while True:
        chance = 1.0
        for row_left, row_expected in zip(left, expected):
            needed = row_left - longest + steps  # tokens this row must emit
            if needed <= 1:
                continue  # every round emits at least one token per row
            chance *= row_expected[needed - 1] - row_expected[needed - 2] if needed <= len(row_expected) else 0.0
            if chance <= 0.0:
                return drop
        drop += chance
        steps += 1


@dataclass
class SuffixAcceptance:
    """Accepted / reached counts of proposed suffix tokens per match length, decayed so that the text being
    written now weighs most, on top of a Beta(prior) start.

    `rate(n)` is the estimated probability that a proposed token is accepted given that the tokens before it in
    the same proposal were; `expected_tokens(n, m)` the expected tokens a round verifying m proposed tokens emits
    (the target's own token included). Statistics only steer which drafts are verified, never what is emitted.
    """

    prior_accepted: float = 1.0
    prior_rejected: float = 3.0
    decay: float = 0.9
    accepted: dict[int, float] = field(default_factory=dict)
    reached: dict[int, float] = field(default_factory=dict)

    def rate(self, match_length: int) -> float:
        accepted = self.accepted.get(match_length, 0.0) + self.prior_accepted
        reached = self.reached.get(match_length, 0.0) + self.prior_accepted + self.prior_rejected
        return accepted / reached

    def expected_tokens(self, match_length: int, num_tokens: int) -> float:
        rate = self.rate(match_length)
        return 1.0 + sum(rate**j for j in range(1, num_tokens + 1))

    def record(self, match_length: int, proposed: int, accepted: int) -> None:
        """A proposal of `proposed` tokens after a match of `match_length` had its first `accepted` accepted."""
        reached = min(accepted + 1, proposed)  # the first rejected token was reached too
        self.accepted[match_length] = self.decay * self.accepted.get(match_length, 0.0) + accepted
        self.reached[match_length] = self.decay * self.reached.get(match_length, 0.0) + reached
