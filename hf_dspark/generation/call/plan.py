"""One plan per `generate()` call: the settings resolved once into what the batch-1 loop and the engine run.

A `DraftingPlan` holds the checked settings, the verification policy and its draft-length rule, the stopping limits,
and makes a loop's cost model and round policy. What rounds learn goes to the plan's `DraftingState`
(`settings.state`): the one the call was given, else, while the call runs, its drafter's own for the target
(`remembered_state`), which later calls start from.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import StoppingCriteriaList

from ...models.errors import UserInputError
from ...policy.length_rule import DraftLengthRule, resolve_verification_policy
from .settings import DraftingSettings
from ...policy.costs import CostModel
from ...policy.planner import RoundPolicy
from ..round.stopping import HostStoppingRule, StopLimits


# Verification policies that read the drafter's confidence head.
CONFIDENCE_POLICIES = ("threshold", "scheduler")


def drafter_has_confidences(drafter) -> bool:
    return getattr(drafter, "confidence_proj", None) is not None


@dataclass
class DraftingPlan:
    settings: DraftingSettings
    has_confidences: bool
    num_draft_slots: int
    policy: str
    policy_arg: object
    stop_limits: StopLimits

    @classmethod
    def for_call(cls, drafter, call_settings: dict | None = None,
                 stopping_criteria: StoppingCriteriaList | None = None) -> "DraftingPlan":
        """Resolve `drafter`'s defaults and the call's settings, refusing bad ones before any work."""
        settings = DraftingSettings.resolve(drafter, call_settings)
        has_confidences = drafter_has_confidences(drafter)
        policy, policy_arg = resolve_verification_policy(
            settings.verification_policy, has_confidence=has_confidences, planning=settings.round_planning,
            confidence_threshold=settings.assistant_confidence_threshold)
        if policy in CONFIDENCE_POLICIES and not has_confidences:
            # The same refusal at every batch size (a rule that reads confidences would otherwise verify every slot
            # at batch 1 while the engine refuses): only a policy given explicitly gets here.
            raise UserInputError(
                f"dspark_verification_policy={settings.verification_policy!r} reads the drafter's confidences, and "
                f"this {type(drafter).__name__} has no confidence head (DFlash and Eagle3 drafters have none). Use "
                "\"all\" or (\"fixed\", k), or leave it unset."
            )
        plan = cls(settings, has_confidences, drafter.config.num_draft_slots, policy, policy_arg,
                   StopLimits.read(stopping_criteria or StoppingCriteriaList()))
        plan.length_rule()  # refuses a malformed policy argument now
        return plan

    @property
    def state(self):
        return self.settings.state

    @property
    def draft_length(self) -> int:
        """Drafts per round (`num_assistant_tokens`, every slot when unset)."""
        return self.settings.num_assistant_tokens

    def length_rule(self, costs: CostModel | None = None) -> DraftLengthRule:
        """The rule after drafting; the admission rule (``"scheduler"`` without a scheduler of its own) prices
        rounds with `costs`, the loop's cost model."""
        return DraftLengthRule(self.policy, self.policy_arg, self.settings.confidence_threshold_rule, costs,
                               self.state.confidence_shift, self.state.statistics.drafter)

    def cost_model(self, timed: bool = True) -> CostModel:
        """The loop's cost model: the one the call's state keeps for this cost-table setting (what earlier loops
        measured on this machine), else a new one kept there. Learnt from timings only where they are `timed` (the
        batch-1 loop's phase clock is off on accelerators, where rounds are not read back at every phase)."""
        settings = self.settings
        learn = settings.learn_round_costs and timed
        key = ("round_costs", learn, id(settings.cost_table))
        costs = self.state.round_costs.get(key)
        if costs is None or costs.table is not settings.cost_table:
            costs = self.state.round_costs[key] = CostModel(settings.cost_table, learn)
        return costs

    def round_policy(self, draft_length: int, costs: CostModel, rule: DraftLengthRule | None = None) -> RoundPolicy:
        """The policy of a loop of any batch size drafting up to `draft_length` tokens per row, learning into the
        call's state and `costs`; `rule` (the loop's `length_rule`) decides after drafting."""
        settings, statistics = self.settings, self.state.statistics
        return RoundPolicy(draft_length, planning=settings.round_planning, costs=costs,
                           suffix_acceptance=statistics.suffix if settings.round_planning and settings.suffix_drafting
                           else None, drafter_acceptance=statistics.drafter, delivered=statistics.delivered,
                           calibration=self.state.confidence_shift, rule=rule)

    def stop_rule(self) -> HostStoppingRule | None:
        return HostStoppingRule.from_limits(self.stop_limits)
