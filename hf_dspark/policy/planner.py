"""The round's decision before drafting, at every batch size (batch 1 is R = 1): per row its proposer (the
drafter's block, a suffix match over its own text, or nothing), the round's width and whether the drafter runs, by
the admission rule (`admission`) on estimated survivals and this machine's prices (`costs.CostModel`).

The drafter's slots are estimated by a Thompson draw from the posterior of what its rows delivered (a slot the plan
allowed and the rule after drafting cut counts as reached, not accepted: the rule's own rates are learnt from slots it
chose as confident, optimistic for a plan that cannot see confidences; learnt from drafting rounds only, so a drafter
measured seldom is tried in proportion to the chance that it pays), a suffix proposal by its posterior mean (every
proposal is scored against the text that followed it). At each width each row takes its better proposer; the rule
admits widths with the drafter's pass paid and without it, and the better round is the plan.
Lossless: every choice depends on earlier rounds, the committed text and the policy's own random stream only.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..models.suffix import SuffixProposer
from .acceptance import ConfidenceShift, SlotAcceptance, SuffixAcceptance, survivals
from .admission import best_width
from .costs import CostModel
from .length_rule import DraftLengthRule

DRAFTER, SUFFIX, NO_DRAFT = "drafter", "suffix", "none"


@dataclass
class RoundPlan:
    """Whether the drafter runs, and per row its proposer and how many tokens it verifies at most (the drafter's
    rows may verify fewer: the admission rule reads their confidences after drafting)."""

    use_drafter: bool
    sources: list[str]
    lengths: list[int]
    expected_rate: float = 0.0  # expected tokens per second, as priced

    @property
    def width(self) -> int:
        return max(self.lengths, default=0) + 1


class RoundPolicy:
    """A loop's policy: `plan` before each round, `record` after it (see the module). `draft_length`: the most tokens
    a row proposes; `planning` False drafts every row's whole budget every round; `suffix_acceptance` (None: no suffix
    drafting), `drafter_acceptance` and `delivered` (a `DraftingState`'s, so later calls start from them) are learnt
    into, as is `costs` (the `CostModel`) and `calibration` (the `ConfidenceShift` the rule after drafting reads
    confidences through); `seed` starts the Thompson draws' stream; `clock` times the passes (a simulation's own);
    `rule` is the `DraftLengthRule` that decides after drafting how many of a drafter row's slots it verifies."""

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
        self._started = 0.0
        self._recorded: tuple[int, float] | None = None  # the last round's rows and when its outcome was read

    def forget(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
        self.proposals.pop(request_id, None)

    def plan(self, request_ids: list[int], requests, budgets: list[int], drafter_possible: bool = True,
             explore: bool = True) -> RoundPlan:
        """This round's plan; starts the round's clock. `explore` False prices the drafter by its posterior mean
        instead of a draw (for tests and comparisons)."""
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
        best = self._best(suffix, None, budgets, prices, 0.0)
        if drafter_possible and widest:
            rates = self.delivered.draws(widest, self.rng) if explore else self.delivered.means(widest)
            drafted = [survivals(rates[:budget]) for budget in budgets]
            candidate = self._best(suffix, drafted, budgets, prices, self.costs.draft_seconds(rows))
            if candidate.use_drafter and candidate.expected_rate > best.expected_rate:
                best = candidate
        return best

    def _best(self, suffix, drafted, budgets, prices, draft_seconds: float) -> RoundPlan:
        """The admitted round when each row takes its better proposer at each width (`drafted` None: no drafter)."""
        def gains(row: int, count: int) -> tuple[float, float]:  # a row's expected accepted tokens by proposer
            return sum(suffix[row][:count]), sum(drafted[row][:count]) if drafted else 0.0

        expected = [len(budgets) + sum(max(gains(row, count)) for row in range(len(budgets)))
                    for count in range(len(prices))]  # at width count + 1, each row by its better proposer
        width = best_width(expected, [price + draft_seconds for price in prices])
        sources, lengths = [], []
        for row, budget in enumerate(budgets):
            by_suffix, by_drafter = gains(row, width - 1)
            sources.append(DRAFTER if by_drafter > by_suffix else SUFFIX if by_suffix > 0.0 else NO_DRAFT)
            lengths.append(min(width - 1, {DRAFTER: budget, SUFFIX: len(suffix[row]), NO_DRAFT: 0}[sources[-1]]))
        use_drafter = DRAFTER in sources
        rate = expected[width - 1] / (prices[width - 1] + (draft_seconds if use_drafter else 0.0))
        return RoundPlan(use_drafter, sources, lengths, rate)

    def interrupt(self) -> None:
        """What runs before the next round is not the loop's per-round work (a prefill, a wait): not O(R)."""
        self._recorded = None

    def drafted(self) -> float:
        """The drafter's pass is done (its outcome read on the host): returns the time, the verification's start."""
        return self.clock()

    def record(self, plan: RoundPlan, request_ids: list[int], lengths: list[int], accepted: list[int], width: int,
               verification_started: float, draft_timed: bool = True, confidences: list | None = None) -> None:
        """The round's outcome (host values): the drafter rows' acceptance (and their verified slots' confidences,
        where the drafter has a head) and the passes' seconds (the drafter's only when `draft_timed`: a pass that
        also caught up on a whole prompt costs what later rounds do not)."""
        finished = self.clock()
        rows = len(request_ids)
        if plan.use_drafter and draft_timed:
            self.costs.record_draft(rows, verification_started - self._started)
        self.costs.record_forward(rows, width, finished - verification_started)
        self._recorded = rows, finished
        self.acceptance.age(), self.delivered.age()
        if self.suffix_acceptance is not None:
            self.suffix_acceptance.age()
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
