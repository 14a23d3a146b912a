from .calibration import auroc, expected_calibration_error, fit_sequential_temperatures
from .cost_table import VerificationCostTable, profile_verification_costs
from .draft_length import DraftLengthRule, resolve_verification_policy
from .drafting_state import DraftingState, ProposalStatistics
from .round_planner import RoundPlanner
from .scheduler import DSparkScheduler

__all__ = [
    "DSparkScheduler",
    "DraftLengthRule",
    "DraftingState",
    "ProposalStatistics",
    "RoundPlanner",
    "VerificationCostTable",
    "auroc",
    "expected_calibration_error",
    "fit_sequential_temperatures",
    "profile_verification_costs",
    "resolve_verification_policy",
]
