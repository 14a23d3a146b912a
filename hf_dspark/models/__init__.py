"""The drafters: their configs and modeling classes, the base class and layers they share, `AutoDrafter` (which
loads every layout hf_dspark reads), and the errors a user can fix. `hf_dspark` re-exports all of `__all__`."""

from .auto import AutoDrafter
from .configuration_dflash2 import DFlash2DraftConfig
from .configuration_dspark import DSparkDraftConfig
from .configuration_eagle3 import Eagle3DraftConfig
from .drafter_base import DraftPreTrainedModel
from .errors import DrafterLoadError, DrafterTargetMismatchError, UserInputError
from .layers import DraftContextCache
from .modeling_dflash2 import DFlash2DraftModel
from .modeling_dspark import DSparkDraftModel, DSparkDraftOutput
from .modeling_eagle3 import Eagle3DraftModel, Eagle3DraftOutput

__all__ = [
    "AutoDrafter",
    "DFlash2DraftConfig",
    "DFlash2DraftModel",
    "DraftContextCache",
    "DrafterLoadError",
    "DrafterTargetMismatchError",
    "DraftPreTrainedModel",
    "DSparkDraftConfig",
    "DSparkDraftModel",
    "DSparkDraftOutput",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3DraftOutput",
    "UserInputError",
]
