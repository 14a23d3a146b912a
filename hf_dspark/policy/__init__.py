"""The verification policy: what each round verifies, decided by one admission rule (`admission`) on one estimate of
acceptance per proposer and slot (`acceptance`) and one cost model (`costs`), before drafting (`planner`) and after
(`length_rule`); what calls remember (`state`, `remembered`)."""

from .admission import DSparkScheduler
from ..models.cost_table import VerificationCostTable
from .costs import CostModel
from .length_rule import DraftLengthRule, resolve_verification_policy
from .state import DraftingState, ProposalStatistics

__all__ = ["CostModel", "DSparkScheduler", "DraftLengthRule", "DraftingState", "ProposalStatistics",
           "VerificationCostTable", "resolve_verification_policy"]
