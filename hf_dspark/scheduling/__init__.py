from .cost_table import VerificationCostTable, profile_verification_costs
from .draft_length import ThroughputDraftLength

__all__ = ["ThroughputDraftLength", "VerificationCostTable", "profile_verification_costs"]
