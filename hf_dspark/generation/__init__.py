from .batched import BatchedOutput, SpeculativeEngine, batched_speculative_generate
from .candidates import DraftCandidateGenerator, DSparkCandidateGenerator, Eagle3CandidateGenerator
from .decoding import SpeculativeDecoderOnlyOutput, speculative_decoding
from .stats import SpeculativeStats
from .verification import greedy_verify, rejection_sample

__all__ = [
    "BatchedOutput",
    "DraftCandidateGenerator",
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
