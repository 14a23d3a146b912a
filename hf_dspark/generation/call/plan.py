"""One plan per `generate()` call: the settings resolved once into what the batch-1 loop and the engine run.

A `DraftingPlan` holds the checked settings, the verification policy and its draft-length rule, the stopping limits,
and makes the round planner and the target runner. What rounds learn goes to the plan's `DraftingState`
(`settings.state`): the one the call was given, else, while the call runs, its drafter's own for the target
(`remembered_state`), which later calls start from.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import StoppingCriteriaList

from ...models.errors import UserInputError
from ...scheduling.draft_length import DraftLengthRule, resolve_verification_policy
from .settings import DraftingSettings
from ..round.planning import RoundPlanning
from ..round.stopping import HostStoppingRule, StopLimits
from ..one_prompt.target_runners import target_runner_for


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
            settings.verification_policy, has_confidence=has_confidences, cost_table=settings.cost_table,
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

    def length_rule(self) -> DraftLengthRule:
        return DraftLengthRule(self.policy, self.policy_arg, self.settings.confidence_threshold_rule)

    def round_planning(self, slots: int, timed: bool = True) -> RoundPlanning:
        """The round planning of a loop of any batch size drafting up to `slots` tokens per row, learning into the
        call's state; its costs are learnt from timings only where they are `timed` (the batch-1 loop's phase
        clock is off on accelerators, where rounds are not read back at every phase)."""
        settings = self.settings
        return RoundPlanning(slots, planning=settings.round_planning, suffix_drafting=settings.suffix_drafting,
                             cost_table=settings.cost_table, learn_costs=settings.learn_round_costs and timed,
                             suffix_acceptance=self.state.statistics.suffix,
                             drafter_acceptance=self.state.statistics.drafter, memory=self.state.round_costs)

    def stop_rule(self) -> HostStoppingRule | None:
        return HostStoppingRule.from_limits(self.stop_limits)

    def target_runner(self, target, cache, generation_config, layer_indices: list[int]):
        return target_runner_for(target, cache, generation_config, layer_indices, self.num_draft_slots,
                                 self.settings.cost_table)
