"""hf_dspark: lossless DSpark / DFlash / Eagle3 speculative decoding for Hugging Face transformers.

`import hf_dspark` registers the drafter classes with the Auto classes and routes
`target.generate(..., assistant_model=drafter)` to hf_dspark's verifier when the drafter is one of ours;
`target.generate(..., custom_generate=hf_dspark.custom_generate_for(drafter))` is the same loop through
transformers' public `custom_generate` hook.
"""

from transformers import AutoConfig, AutoModel

from . import hub  # noqa: F401  (installs the save/push hooks of the drafters)
from . import models
from ._version import __version__
from .generation import (SpeculativeDecoderOnlyOutput, SpeculativeEngine, SpeculativeStats, greedy_verify,
                         rejection_sample)
from .generation.routing.custom_generate import custom_generate_for
from .generation.routing.integration import install_generate_hooks
from .models import *  # noqa: F401,F403  (the drafter API, `hf_dspark.models.__all__`, is the package's too)
from .models import (DFlash2DraftConfig, DFlash2DraftModel, DSparkDraftConfig, DSparkDraftModel, Eagle3DraftConfig,
                     Eagle3DraftModel)
from .models.loading import shipped_drafter_path
from .policy import DraftingState, DSparkScheduler, VerificationCostTable
from .targets.default_target import default_target_dir, load_default_target

_DRAFTER_CLASSES = ((DSparkDraftConfig, DSparkDraftModel), (Eagle3DraftConfig, Eagle3DraftModel),
                    (DFlash2DraftConfig, DFlash2DraftModel))
for _config_class, _model_class in _DRAFTER_CLASSES:
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    AutoModel.register(_config_class, _model_class, exist_ok=True)
    # save_pretrained then copies the modeling code and writes `auto_map`, so a folder loads without hf_dspark too.
    _config_class.register_for_auto_class("AutoConfig")
    _model_class.register_for_auto_class("AutoModel")
install_generate_hooks()


def build_dflash_config(target_config, **overrides) -> DSparkDraftConfig:
    """Config of a DFlash drafter for `target_config`: the DSpark backbone without sequential/confidence heads."""
    return DSparkDraftConfig.dflash_from_target_config(target_config, **overrides)


__all__ = [
    *models.__all__,
    "DSparkScheduler",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeEngine",
    "SpeculativeStats",
    "VerificationCostTable",
    "DraftingState",
    "build_dflash_config",
    "custom_generate_for",
    "default_target_dir",
    "greedy_verify",
    "load_default_target",
    "rejection_sample",
    "shipped_drafter_path",
]
