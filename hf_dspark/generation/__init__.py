from .batched import BatchedOutput, SpeculativeEngine
from .generate_batch import batched_speculative_generate
from .candidates import DraftCandidateGenerator, DSparkCandidateGenerator, Eagle3CandidateGenerator
from .decoding import speculative_decoding
from .outputs import SpeculativeDecoderOnlyOutput
from .plan import DraftingPlan
from .settings import DraftingSettings
from .stats import SpeculativeStats
from .verification import greedy_verify, rejection_sample

__all__ = [
    "BatchedOutput",
    "DraftCandidateGenerator",
    "DraftingPlan",
    "DraftingSettings",
    "DSparkCandidateGenerator",
    "Eagle3CandidateGenerator",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeEngine",
    "SpeculativeStats",
    "batched_speculative_generate",
    "greedy_verify",
    "rejection_sample",
    "speculative_decoding",
]
