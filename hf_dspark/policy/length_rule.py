"""How many drafts a round verifies after drafting (`dspark_verification_policy`), at every batch size, on the
device: up to a length decided from the confidences c_1..c_k alone, so the output distribution is untouched. The
default for a drafter with a confidence head is the admission rule (`admission.DSparkScheduler`) on the loop's own
prices; the others are fixed rules a user may choose."""

from __future__ import annotations

import torch

from ..models.configuration_common import CONFIDENCE_THRESHOLD_RULES
from .admission import DSparkScheduler
from .costs import CostModel

POLICIES = ("all", "fixed", "threshold", "scheduler")


class DraftLengthRule:
    """Per-row verified draft lengths from (R, G) confidences and (R,) budgets, without leaving the device.

    `policy`: ``"all"`` (every slot the budget allows), ``"fixed"`` (`policy_arg` slots), ``"threshold"`` (up to the
    first slot whose survival c_1...c_j, or c_j under `threshold_rule` ``"per_slot"``, is below `policy_arg`),
    ``"scheduler"`` (`policy_arg`, a `DSparkScheduler`, else one on `costs`, `calibration` and `acceptance`).
    """

    def __init__(self, policy: str = "all", policy_arg=None, threshold_rule: str = "cumulative", costs=None,
                 calibration=None, acceptance=None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
        if policy == "fixed" and not (isinstance(policy_arg, int) and policy_arg >= 0):
            raise ValueError(f"policy 'fixed' takes the number of slots to verify (an int >= 0), got {policy_arg!r}.")
        if policy == "threshold" and not (isinstance(policy_arg, (int, float)) and policy_arg >= 0):
            raise ValueError(f"policy 'threshold' takes a survival threshold >= 0 (above 1 verifies no drafts), got "
                             f"{policy_arg!r}.")
        if policy == "scheduler" and policy_arg is None:  # the admission rule on the loop's own prices
            policy_arg = DSparkScheduler(costs if costs is not None else CostModel(), calibration=calibration,
                                         acceptance=acceptance)
        if policy == "scheduler" and not hasattr(policy_arg, "select_lengths"):
            raise ValueError("policy 'scheduler' takes a hf_dspark.DSparkScheduler as policy_arg.")
        if threshold_rule not in CONFIDENCE_THRESHOLD_RULES:
            raise ValueError(f"threshold_rule must be one of {CONFIDENCE_THRESHOLD_RULES}, got {threshold_rule!r}.")
        self.policy, self.policy_arg, self.threshold_rule = policy, policy_arg, threshold_rule

    def max_draft_length(self, draft_length: int) -> int:
        """Of `draft_length` drafts a round may propose, those worth drafting at all (a fixed rule verifies no more)."""
        return min(draft_length, self.policy_arg) if self.policy == "fixed" else draft_length

    def lengths(self, confidences: torch.Tensor | None, budget: torch.LongTensor) -> torch.LongTensor:
        """confidences (R, G) (None without a confidence head), budget (R,) slots drafted per row -> (R,)."""
        if self.policy == "fixed":
            return budget.clamp(max=self.policy_arg)
        if self.policy == "all" or confidences is None:
            return budget
        if self.policy == "threshold":
            compared = confidences if self.threshold_rule == "per_slot" else confidences.cumprod(dim=-1)
            passing = (compared >= self.policy_arg).long().cumprod(dim=-1).sum(dim=-1)
            return torch.minimum(passing, budget)
        return self.policy_arg.select_lengths(confidences, max_lengths=budget)


def resolve_verification_policy(policy=None, *, has_confidence: bool, planning: bool = True,
                                confidence_threshold: float | None = None) -> tuple[str, object]:
    """`(policy, policy_arg)` of the `dspark_verification_policy` setting: a policy name, a `(policy, policy_arg)` pair
    such as `("fixed", 2)`, a scheduler (anything with `select_lengths`), or `None` (the default), alike at every batch
    size: `("threshold", confidence_threshold)` with a threshold and a confidence head, else the admission rule on the
    loop's own prices (`("scheduler", None)`) with a head and `planning`, else `"all"`."""
    if policy is None:
        if has_confidence and confidence_threshold is not None:
            return "threshold", confidence_threshold
        return ("scheduler", None) if has_confidence and planning else ("all", None)
    if isinstance(policy, str):
        return policy, None
    if hasattr(policy, "select_lengths"):
        return "scheduler", policy
    if isinstance(policy, (tuple, list)) and len(policy) == 2:
        return policy[0], policy[1]
    raise ValueError(
        "dspark_verification_policy must be None, a policy name, a (policy, policy_arg) pair or a scheduler; "
        f"got {policy!r}."
    )
