from .calibration import auroc, expected_calibration_error, fit_sequential_temperatures
from .cost_table import VerificationCostTable, profile_verification_costs
from .draft_length import ThroughputDraftLength
from .scheduler import DSparkScheduler

__all__ = [
    "DSparkScheduler",
    "ThroughputDraftLength",
    "VerificationCostTable",
    "auroc",
    "expected_calibration_error",
    "fit_sequential_temperatures",
    "profile_verification_costs",
]
