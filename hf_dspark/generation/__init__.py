from .candidates import DraftCandidateGenerator, DSparkCandidateGenerator, Eagle3CandidateGenerator
from .decoding import SpeculativeDecoderOnlyOutput, speculative_decoding
from .stats import SpeculativeStats
from .verification import greedy_verify, rejection_sample

__all__ = [
    "DraftCandidateGenerator",
    "DSparkCandidateGenerator",
    "Eagle3CandidateGenerator",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeStats",
    "greedy_verify",
    "rejection_sample",
    "speculative_decoding",
]
