"""Speculative decoding with hf_dspark drafters, grouped by concern:

* `call/`: a `generate()` call: the hooks that route it (`integration`, `custom_generate`), its checks, its settings
  and one `DraftingPlan`, `dispatch` (one prompt to the batch-1 loop, several to the engine), outputs;
* `round/`: the steps both loops share: drafting, verification, sampling, suffix matches, stopping, statistics;
* `one_prompt/`: the batch-1 loop, its proposers and target runners;
* `engine/`: the batched engine (`SpeculativeEngine`): rows with holes, its passes, requests, planning, masks.
"""

from .engine.speculative_engine import BatchedOutput, SpeculativeEngine
from .call.batch import batched_speculative_generate
from .one_prompt.proposers import DraftCandidateGenerator, DSparkCandidateGenerator, Eagle3CandidateGenerator
from .call.dispatch import speculative_decoding
from .call.outputs import SpeculativeDecoderOnlyOutput
from .call.plan import DraftingPlan
from .call.settings import DraftingSettings
from .round.stats import SpeculativeStats
from .round.verification import greedy_verify, rejection_sample
from ..models.drafting_config import install_drafting_settings_check

# A drafter folder's saved drafting settings are refused when it loads, by the rules every generate() call applies.
install_drafting_settings_check(DraftingSettings.resolve)

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
