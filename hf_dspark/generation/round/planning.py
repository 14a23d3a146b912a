"""Round planning, one implementation for every batch size (the batch-1 loop runs it at R = 1): what each running
request proposes this round (the drafter's block, a suffix match over its own text, or nothing), priced by
`scheduling.round_planner.RoundPlanner`, and what each round teaches the planner (per-request drafter acceptance,
suffix acceptance, the measured cost of the round's passes).

A loop asks `RoundPlanning.plan` before drafting, drafts only the rows the plan gives the drafter (and runs the
drafter only when some row drafts), verifies each suffix row's proposal in place of drafts, and reports the round's
outcome to `record`. With `dspark_round_planning=False` every row drafts its whole budget every round (the drafter's
block, never a suffix), as without a planner.
"""

from __future__ import annotations

import time

from ...scheduling.round_costs import RoundCosts
from ...scheduling.round_planner import (DRAFTER, NO_DRAFT, SUFFIX, RoundPlan, RoundPlanner, RowOptions, SlotAcceptance,
                                        SuffixAcceptance, expected_tokens)
from .suffix import SuffixProposer

# How many observations the batch's pooled drafter acceptance weighs in each request's own estimate, and the
# pooled estimate's own prior (an even chance per slot, one observation: the drafter is tried early).
_REQUEST_PRIOR_WEIGHT = 4.0
_POOL_PRIOR, _POOL_PRIOR_WEIGHT = 0.5, 1.0
_OPTIMISM_WEIGHT = 2.0
_OPTIMISM_MEMORY = 8.0


class RequestProposals:
    """One request's proposers: its suffix index over its text (prompt and output) and its drafter acceptance."""

    def __init__(self, slots: int, suffix_acceptance: SuffixAcceptance | None):
        self.suffix = SuffixProposer(suffix_acceptance) if suffix_acceptance is not None else None
        self.acceptance = SlotAcceptance.empty(slots)
        self.seen = 0  # tokens of the request's text given to the suffix index
        self.proposal: list[int] = []

    def catch_up(self, tokens: list[int]) -> None:
        if self.suffix is not None and len(tokens) > self.seen:
            self.suffix.extend(tokens[self.seen :])
            self.seen = len(tokens)


def _remembered_costs(memory: dict | None, cost_table, learn_costs: bool) -> RoundCosts:
    """The `RoundCosts` kept in `memory` for this setting (the table itself, not another at its address), else new."""
    key = ("round_costs", learn_costs, id(cost_table))
    remembered = memory.get(key) if memory is not None else None
    if remembered is None or remembered.cost_table is not cost_table:
        remembered = RoundCosts(cost_table, learn_costs)
        if memory is not None:
            memory[key] = remembered
    return remembered


class RoundPlanning:
    """A loop's planner: per request proposals, the batch's pooled drafter acceptance and the round costs."""

    def __init__(self, slots: int, *, planning: bool, suffix_drafting: bool, cost_table=None, learn_costs: bool = True,
                 suffix_acceptance: SuffixAcceptance | None = None, drafter_acceptance: SlotAcceptance | None = None,
                 drafter: bool = True, memory: dict | None = None):
        """`memory`: a `DraftingState.round_costs` whose round costs (what this machine's forwards and drafter passes
        cost, measured by earlier loops with the same cost-table setting) the loop starts from and learns into.
        What the drafter's drafts achieve is learnt afresh by each loop (a call's prompts are its own, and a
        drafter priced out by a few unlucky rounds would otherwise never be probed again), over a prior per slot of
        one observation's weight: `drafter_acceptance`, what earlier loops measured (`ProposalStatistics.drafter`),
        which this loop learns into."""
        self.slots, self.planning = slots, planning
        self.suffix_acceptance = (suffix_acceptance if suffix_acceptance is not None else SuffixAcceptance()) \
            if planning and suffix_drafting else None
        self.costs = _remembered_costs(memory, cost_table, learn_costs)
        self.planner = RoundPlanner(self.costs, drafter_allowed=drafter)
        self.pool = SlotAcceptance.empty(slots)
        self.remembered_pool = drafter_acceptance if drafter_acceptance is not None else SlotAcceptance.empty(slots)
        self.remembered_pool.cover(slots)
        # Each slot's prior: what earlier loops of this drafter measured (taken now: this loop's own rounds, which
        # it learns into, must not count twice), else the slot before it.
        self._slot_priors = self.remembered_pool.pooled_rates(_POOL_PRIOR, _POOL_PRIOR_WEIGHT)[:slots] \
            if any(self.remembered_pool.reached[:slots]) else None
        self._remembered_reached = list(self.remembered_pool.reached[:slots])
        self.requests: dict[int, RequestProposals] = {}
        self._started = 0.0
        self._options: list[RowOptions] | None = None  # the latest plan's, uncalibrated
        # A batch that returns when its last row is done (generate()): a round is worth the steps it takes off the
        # batch's remaining work (`round_planner.finishing_value`), which the slowest rows set, not the tokens' sum.
        self.finish_together = False

    def forget(self, request_id: int) -> None:
        self.requests.pop(request_id, None)

    def _proposals(self, request_id: int) -> RequestProposals:
        if request_id not in self.requests:
            self.requests[request_id] = RequestProposals(self.slots, self.suffix_acceptance)
        return self.requests[request_id]

    def plan(self, request_ids: list[int], requests, budgets: list[int], drafter_possible: bool,
             probe_allowed: bool = True) -> RoundPlan:
        """This round's plan (from earlier rounds and the rows' committed text only); starts the round's clock.
        `probe_allowed` False: the drafter runs only where it is expected to pay (its pass would catch up on whole
        prompts)."""
        self._started = time.perf_counter()
        if not self.planning:
            drafting = drafter_possible and max(budgets) > 0
            return RoundPlan(drafting, [DRAFTER if drafting and b > 0 else NO_DRAFT for b in budgets],
                             list(budgets) if drafting else [0] * len(budgets))
        pooled = self.pool.pooled_rates(_POOL_PRIOR, _POOL_PRIOR_WEIGHT, self._slot_priors)
        optimistic = self._optimistic_rates()
        options = []
        for request_id, request, budget in zip(request_ids, requests, budgets):
            own = self._proposals(request_id)
            own.proposal, match = [], 0
            if own.suffix is not None and budget > 0:
                own.catch_up(request.tokens)
                own.proposal, match = own.suffix.propose(budget)
            suffix = [own.suffix.expected_tokens(match, m) for m in range(len(own.proposal) + 1)] \
                if own.proposal else [1.0]
            drafted = expected_tokens(own.acceptance.rates(pooled, _REQUEST_PRIOR_WEIGHT), budget)
            left = request.max_new_tokens - request.emitted if self.finish_together else None
            options.append(RowOptions(budget, suffix, drafted, left, expected_tokens(optimistic, budget)))
        self._options = options  # as priced before calibration, which `record` measures against
        return self.planner.plan(options, drafter_possible, probe_allowed)

    def _optimistic_rates(self) -> list[float]:
        """An upper estimate of the drafter's acceptance per slot, what a probe could still find: two
        pseudo-observations of acceptance on top of what this loop measured, which stays high until probes have
        measured enough, and beside them at most `_OPTIMISM_MEMORY` of what earlier loops measured (a drafter known to
        be poor is not probed where only a good one would pay, as at many rows on a CPU, but the two keep it probed
        where a better one would)."""
        rates = []
        for slot, (accepted, reached) in enumerate(zip(self.pool.accepted, self.pool.reached)):
            weight = min(self._remembered_reached[slot], _OPTIMISM_MEMORY)
            known = self._slot_priors[slot] if self._slot_priors is not None else 1.0
            rates.append((accepted + _OPTIMISM_WEIGHT + weight * known) / (reached + _OPTIMISM_WEIGHT + weight))
        return rates

    def drafted(self) -> float:
        """The drafter's pass is done (its outcome read on the host): returns the time, the verification's start."""
        return time.perf_counter()

    def record(self, plan: RoundPlan, request_ids: list[int], lengths: list[int], accepted: list[int],
               width: int, verification_started: float, draft_timed: bool = True) -> None:
        """The round's outcome (host values): each drafter row's acceptance, the passes' costs (the drafter's only
        when `draft_timed`: a pass that also caught up on a whole prompt costs what later rounds do not)."""
        finished = time.perf_counter()
        rows = len(request_ids)
        if plan.use_drafter and draft_timed:
            self.costs.record_draft(rows, verification_started - self._started)
        self.costs.record_forward(rows, width, finished - verification_started)
        if any(plan.lengths) and self._options is not None:
            self._calibrate(plan, accepted, finished - self._started if draft_timed or not plan.use_drafter else None)
        for request_id, source, length, count in zip(request_ids, plan.sources, lengths, accepted):
            if source == DRAFTER and length > 0:
                self._proposals(request_id).acceptance.record(length, count)
                self.pool.record(length, count)
                self.remembered_pool.record(length, count)

    def _calibrate(self, plan: RoundPlan, accepted: list[int], seconds: float | None) -> None:
        """What the planned round delivered against its price, per proposal and in seconds (when timed and the costs
        are learnt: a table's prices are the table's), for the planner's calibration."""
        calibration, rows = self.planner.calibration, len(plan.sources)
        for option, source, length, count in zip(self._options, plan.sources, plan.lengths, accepted):
            if source != NO_DRAFT and length > 0:
                expected = option.suffix_expected if source == SUFFIX else option.drafter_expected
                calibration.record_tokens(rows, source, expected[length] - 1.0, count)
        if seconds is not None and self.costs.learn:
            calibration.record_seconds(rows, plan.seconds, seconds)

    def suffix_rows(self, plan: RoundPlan, request_ids: list[int]) -> dict[int, list[int]]:
        """Row -> the tokens its suffix proposal verifies this round."""
        return {row: self.requests[request_id].proposal[: plan.lengths[row]]
                for row, (request_id, source) in enumerate(zip(request_ids, plan.sources)) if source == SUFFIX}
