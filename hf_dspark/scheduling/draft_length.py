"""How many drafts a round verifies.

`DraftLengthRule` is the one draft-length rule of every batch size (the batch-1 loop and the batched engine call
it alike, on the device, after all slots are drafted): each row verifies its drafted slots up to a length decided
from the conditional confidences c_1..c_k alone (never from the drafted tokens' verification), so the output
distribution is untouched. With a cost table it is the DSpark scheduler's early stop (`DSparkScheduler`): slot
positions are admitted while the expected throughput E(B) / cost(B) still rises, which at R = 1 reads

    E(k) = 1 + S_1 + ... + S_k            (expected tokens of a round with k drafts; the 1 is the bonus token)
    T(k) = E(k) / cost(k + 1)             (`padded_round_seconds`: verification may be padded to a cheaper size)

with S_j = c_1 * ... * c_j the predicted survival of the first j drafts.
"""

from __future__ import annotations

import torch

from ..models.configuration_common import CONFIDENCE_THRESHOLD_RULES
from .scheduler import DSparkScheduler

POLICIES = ("all", "fixed", "threshold", "scheduler")


class DraftLengthRule:
    """Per-row verified draft lengths from (R, G) confidences and (R,) budgets, without leaving the device.

    Args:
        policy: ``"all"`` (every slot the budget allows), ``"fixed"`` (`policy_arg` slots), ``"threshold"`` (up to
            the first slot whose survival c_1...c_j, or its own c_j under the ``"per_slot"`` rule, is below
            `policy_arg`), ``"scheduler"`` (`policy_arg`, a `DSparkScheduler`, over all rows together).
        policy_arg: see `policy`.
        threshold_rule: ``"cumulative"`` or ``"per_slot"`` (the `dspark_confidence_threshold_rule` setting).
    """

    def __init__(self, policy: str = "all", policy_arg=None, threshold_rule: str = "cumulative"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
        if policy == "fixed" and not (isinstance(policy_arg, int) and policy_arg >= 0):
            raise ValueError(f"policy 'fixed' takes the number of slots to verify (an int >= 0), got {policy_arg!r}.")
        if policy == "threshold" and not (isinstance(policy_arg, (int, float)) and policy_arg >= 0):
            raise ValueError(
                f"policy 'threshold' takes a survival threshold >= 0 (above 1 verifies no drafts), got {policy_arg!r}."
            )
        if policy == "scheduler" and not hasattr(policy_arg, "select_lengths"):
            raise ValueError("policy 'scheduler' takes a hf_dspark.scheduling.DSparkScheduler as policy_arg.")
        if threshold_rule not in CONFIDENCE_THRESHOLD_RULES:
            raise ValueError(f"threshold_rule must be one of {CONFIDENCE_THRESHOLD_RULES}, got {threshold_rule!r}.")
        self.policy, self.policy_arg, self.threshold_rule = policy, policy_arg, threshold_rule

    def max_slots(self, gamma: int) -> int:
        """Slots worth drafting at all."""
        return min(gamma, self.policy_arg) if self.policy == "fixed" else gamma

    def needs_drafts(self) -> bool:
        """False when the scheduler decided, from earlier rounds, that this round is a plain step."""
        return self.policy != "scheduler" or self.policy_arg.needs_drafts()

    def reset(self) -> None:
        """A new batch: a stateful scheduler starts from its fallback."""
        if hasattr(self.policy_arg, "reset"):
            self.policy_arg.reset()

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


def resolve_verification_policy(policy=None, *, has_confidence: bool, cost_table=None,
                                confidence_threshold: float | None = None) -> tuple[str, object]:
    """`(policy, policy_arg)` of the `dspark_verification_policy` setting.

    `None` (the default) derives it from the other settings, so one drafter behaves alike at every batch size: a
    `DSparkScheduler(cost_table)` when a cost table is set and the drafter has a confidence head, else
    `("threshold", confidence_threshold)` when a threshold is set (confidence head again), else `"all"`. Otherwise it
    may be a policy name (`"all"`), a `(policy, policy_arg)` pair such as `("fixed", 2)` or `("threshold", 0.4)`, or
    a scheduler object (anything with `select_lengths`).
    """
    if policy is None:
        if has_confidence and cost_table is not None:
            return "scheduler", DSparkScheduler(cost_table)
        if has_confidence and confidence_threshold is not None:
            return "threshold", confidence_threshold
        return "all", None
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
