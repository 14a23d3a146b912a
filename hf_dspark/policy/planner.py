"""The round's decision before drafting, at every batch size (batch 1 is R = 1): per row its proposer (the
drafter's block, a suffix match over its own text, or nothing), the round's width and whether the drafter runs, by
the admission rule (`admission`) on estimated survivals and this machine's prices (`costs.CostModel`).

The drafter's slots are estimated by a Thompson draw from the posterior of what its rows delivered (a slot the rule
after drafting cut counts as reached, not accepted: the rule's own rates, from slots it chose as confident, flatter a
plan that cannot see confidences), a suffix proposal by its posterior mean. At each width each row takes its better
proposer; the rule admits widths with the drafter's pass paid and without it, and the better round is the plan. A
draining batch values a round by the seconds it saves (`_draining`). Lossless: every choice depends on earlier rounds,
the committed text and the policy's own random stream only."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy

from ..models.suffix import SuffixProposer
from .acceptance import ConfidenceShift, SlotAcceptance, SuffixAcceptance, survivals
from .admission import best_width
from .costs import CostModel
from .length_rule import DraftLengthRule

DRAFTER, SUFFIX, NO_DRAFT = "drafter", "suffix", "none"
EOS_PRIOR_TOKENS = 256  # until requests end, one token in this many ends its request (a chat answer's length)
DRAIN_SAMPLES = 64  # draws a round of the rows' ends and acceptances (a saving's mean within 1/8 of its spread)


@dataclass
class RoundPlan:
    """Whether the drafter runs, and per row its proposer and how many tokens it verifies at most."""

    use_drafter: bool
    sources: list[str]
    lengths: list[int]
    expected_rate: float = 0.0  # expected tokens per second, as priced

    @property
    def width(self) -> int:
        return max(self.lengths, default=0) + 1


class RoundPolicy:
    """A loop's policy: `plan` before each round, `record` after it. `draft_length`: the most tokens a row proposes;
    `planning` False drafts every budget every round; `suffix_acceptance` (None: no suffix drafting),
    `drafter_acceptance`, `delivered`, `costs` and `calibration` (a `DraftingState`'s) are learnt into; `seed` starts
    the policy's random stream; `clock` times the passes; `rule` is the `DraftLengthRule` after drafting."""

    def __init__(self, draft_length: int, *, planning: bool, costs: CostModel,
                 suffix_acceptance: SuffixAcceptance | None = None, drafter_acceptance: SlotAcceptance | None = None,
                 delivered: SlotAcceptance | None = None, seed: int = 0, calibration: ConfidenceShift | None = None,
                 clock=None, rule: DraftLengthRule | None = None):
        self.draft_length, self.planning = draft_length, planning
        self.costs, self.suffix_acceptance = costs, suffix_acceptance
        self.acceptance = drafter_acceptance if drafter_acceptance is not None else SlotAcceptance.empty(draft_length)
        self.delivered = delivered if delivered is not None else SlotAcceptance.empty(draft_length)
        self.acceptance.cover(draft_length), self.delivered.cover(draft_length)
        self.rng, self.calibration = random.Random(seed), calibration
        self.rule = rule if rule is not None else DraftLengthRule()
        self.clock = clock if clock is not None else time.perf_counter
        self.requests: dict[int, SuffixProposer] = {}  # each request's suffix proposer over its text
        self.proposals: dict[int, tuple[list[int], int]] = {}  # this round's suffix proposals (tokens, match)
        self.progress: dict[int, tuple[float, float]] = {}  # each request's tokens emitted and rounds taken
        self.ends = [0.0, 0.0]  # requests that ended before their budget, tokens emitted
        self._started = 0.0
        self._recorded: tuple[int, float] | None = None  # the last round's rows and when its outcome was read

    def forget(self, request_id: int, emitted: int = 0, early: bool = False) -> None:
        """A request left after `emitted` tokens, `early` before its budget (an EOS, a stop, a cancel)."""
        self.requests.pop(request_id, None)
        self.proposals.pop(request_id, None)
        self.progress.pop(request_id, None)
        self.ends = [self.ends[0] + early, self.ends[1] + emitted]

    def plan(self, request_ids: list[int], requests, budgets: list[int], drafter_possible: bool = True,
             explore: bool = True, left: list[int] | None = None) -> RoundPlan:
        """This round's plan; starts the round's clock. `explore` False prices the drafter by its posterior mean;
        `left`: per row the most tokens it may still emit (None: a round is worth its tokens)."""
        self._started = self.clock()
        if self._recorded is not None:  # the loop's own work since the last round: O(R)
            self.costs.record_overhead(self._recorded[0], self._started - self._recorded[1])
            self._recorded = None
        rows = len(budgets)
        if not self.planning:
            drafting = drafter_possible and max(budgets, default=0) > 0
            return RoundPlan(drafting, [DRAFTER if drafting and b > 0 else NO_DRAFT for b in budgets],
                             list(budgets) if drafting else [0] * rows)
        widest = max(budgets, default=0)
        suffix = []  # per row, the survivals of its suffix proposal's tokens
        for request_id, request, budget in zip(request_ids, requests, budgets):
            proposal, match = [], 0
            if self.suffix_acceptance is not None and budget > 0:
                proposer = self.requests.setdefault(request_id, SuffixProposer(self.suffix_acceptance))
                proposal, match = proposer.propose(budget, request.tokens)
            self.proposals[request_id] = proposal, match
            suffix.append(survivals(self.suffix_acceptance.rates(match, len(proposal))) if proposal else [])
        prices = self.costs.forward_prices(rows, widest + 1)
        worth = self._draining(request_ids, left, prices[0]) if left is not None and rows > 1 else None
        best = self._best(suffix, None, budgets, prices, 0.0, worth)
        if drafter_possible and widest:
            rates = self.delivered.draws(widest, self.rng) if explore else self.delivered.means(widest)
            drafted = [survivals(rates[:budget]) for budget in budgets]
            candidate = self._best(suffix, drafted, budgets, prices, self.costs.draft_seconds(rows), worth)
            if candidate.use_drafter and candidate.expected_rate > best.expected_rate:
                best = candidate
        return best

    def _draining(self, request_ids: list[int], left: list[int], plain_seconds: float):
        """What a round is worth to a batch that drains: a function of each row's verified survivals to the seconds the
        round saves later rounds, over a plain step's seconds per row. A plain step costs f + c R: a row that ends
        sooner saves c a round, the batch (f) only with its last row. Row r takes about N_r = L_r / t_r more rounds
        (t_r its tokens per round so far, L_r its tokens left, cut by an end drawn at the rate requests ended early);
        a round saves c times its tokens / t plus f times what it takes off the largest N, averaged over draws of the
        ends and accepted drafts (rows alike and ending together: the round's tokens)."""
        rows, c = len(left), self.costs.row_seconds(len(left))
        f = max(plain_seconds - c * rows, 0.0)
        rate = numpy.array([t / n for t, n in map(self.progress.get, request_ids, [(1.0, 1.0)] * rows)])
        draws = numpy.random.default_rng(self.rng.getrandbits(64))
        hazard = (self.ends[0] + 1.0) / (self.ends[1] + EOS_PRIOR_TOKENS)
        ends = numpy.log(draws.random((DRAIN_SAMPLES, rows))) / numpy.log1p(-min(hazard, 0.5))
        length = numpy.minimum(numpy.array(left, dtype=float), ends)
        # Renewal: the rounds to emit L tokens at t a round (variance about t (t - 1)) spread as sqrt(L (t - 1)) / t.
        rounds = length / rate + draws.standard_normal(length.shape) * numpy.sqrt(length * (rate - 1.0)) / rate
        chance, last = draws.random((DRAIN_SAMPLES, rows, 1)), rounds.max(1)  # last: one largest N a draw, every width

        def worth(widths: list[list[list[float]]]) -> list[float]:  # per width, each row's verified survivals
            slots = max(len(values) for verified in widths for values in verified)
            survival = numpy.array([[v + [0.0] * (slots - len(v)) for v in verified] for verified in widths])
            gained = (1.0 + (survival.reshape(len(widths), rows, slots)[None] > chance[:, None]).sum(3)) / rate
            saved = c * gained.mean(0).sum(1) + f * (last[:, None] - (rounds[:, None] - gained).max(2)).mean(0)
            return list(saved / (c + f / rows))  # gained: (draws, widths, rows), the rounds each row saves
        return worth

    def _best(self, suffix, drafted, budgets, prices, draft_seconds: float, worth=None) -> RoundPlan:
        """The admitted round, each row by its better proposer per width (`drafted`, `worth` None: no drafter, tokens)."""
        def better(row: int, count: int) -> tuple[str, list[float]]:  # a row's better proposer, its survivals
            by_suffix, by_drafter = suffix[row][:count], drafted[row][:count] if drafted else []
            if sum(by_drafter) > sum(by_suffix):
                return DRAFTER, by_drafter
            return SUFFIX if sum(by_suffix) > 0.0 else NO_DRAFT, by_suffix

        rows = range(len(budgets))  # at width count + 1, each row by its better proposer
        chosen = [[better(row, count)[1] for row in rows] for count in range(len(prices))]
        expected = worth(chosen) if worth is not None else [len(budgets) + sum(map(sum, v)) for v in chosen]
        width = best_width(expected, [price + draft_seconds for price in prices])
        sources = [better(row, width - 1)[0] for row in rows]
        lengths = [min(width - 1, {DRAFTER: budget, SUFFIX: len(suffix[row]), NO_DRAFT: 0}[source])
                   for row, (source, budget) in enumerate(zip(sources, budgets))]
        use_drafter = DRAFTER in sources
        rate = expected[width - 1] / (prices[width - 1] + (draft_seconds if use_drafter else 0.0))
        return RoundPlan(use_drafter, sources, lengths, rate)

    def interrupt(self) -> None:
        """What runs before the next round is not the loop's per-round work (a prefill, a wait): not O(R)."""
        self._recorded = None

    def drafted(self) -> float:
        """The drafter's pass is done: returns the time, the verification's start."""
        return self.clock()

    def record(self, plan: RoundPlan, request_ids: list[int], lengths: list[int], accepted: list[int], width: int,
               verification_started: float, draft_timed: bool = True, confidences: list | None = None) -> None:
        """The round's outcome (host values): acceptances, confidences and the passes' seconds (the drafter's only when
        `draft_timed`: a pass that also caught up on a whole prompt costs what later rounds do not)."""
        finished = self.clock()
        rows = len(request_ids)
        if plan.use_drafter and draft_timed:
            self.costs.record_draft(rows, verification_started - self._started)
        self.costs.record_forward(rows, width, finished - verification_started)
        self._recorded = rows, finished
        self.acceptance.age(), self.delivered.age()
        if self.suffix_acceptance is not None:
            self.suffix_acceptance.age()
        for request_id, count in zip(request_ids, accepted):
            tokens, rounds = self.progress.get(request_id, (1.0, 1.0))
            self.progress[request_id] = tokens + count + 1, rounds + 1
        for row, (source, planned, length, count) in enumerate(zip(plan.sources, plan.lengths, lengths, accepted)):
            if source == DRAFTER and planned > 0:
                self.delivered.record(planned, count)
            if source == DRAFTER and length > 0:
                self.acceptance.record(length, count)
                if self.calibration is not None and confidences is not None and confidences[row]:
                    self.calibration.record(list(confidences[row])[:length], count)

    def suffix_rows(self, plan: RoundPlan, request_ids: list[int]) -> dict[int, list[int]]:
        """Row -> the tokens its suffix proposal verifies this round."""
        return {row: self.proposals[request_id][0][: plan.lengths[row]]
                for row, (request_id, source) in enumerate(zip(request_ids, plan.sources)) if source == SUFFIX}
