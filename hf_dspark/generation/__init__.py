"""Speculative decoding with hf_dspark drafters, grouped by concern:

* `round/` (the bottom): one round (`skeleton`) and the steps it runs at every batch size: drafting, verification,
  sampling, stopping, statistics;
* `call/`: what a `generate()` call resolves before any token: its settings, one `DraftingPlan`, its outputs;
* `one_prompt/`: the batch-1 loop, its rows and target runners;
* `engine/`: the batched engine (`SpeculativeEngine`): rows with holes, its passes, requests, masks;
* `routing/` (the top): the hooks that take a `generate()` call (`integration`, `custom_generate`), its checks, and
  `dispatch` (one prompt to the batch-1 loop, several to the engine).

Each imports only those listed before it (`tests/project/test_layering.py`).
"""

from .engine.speculative_engine import BatchedOutput, SpeculativeEngine
from .routing.batch import batched_speculative_generate
from .routing.dispatch import speculative_decoding
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
    "DraftingPlan",
    "DraftingSettings",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeEngine",
    "SpeculativeStats",
    "batched_speculative_generate",
    "greedy_verify",
    "rejection_sample",
    "speculative_decoding",
]
