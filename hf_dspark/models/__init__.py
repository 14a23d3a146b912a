from .auto import AutoDrafter
from .common import DraftContextCache, DrafterLoadError, DrafterTargetMismatchError, DraftPreTrainedModel, UserInputError
from .configuration_dspark import DSparkDraftConfig
from .configuration_eagle3 import Eagle3DraftConfig
from .modeling_dspark import DSparkDraftModel, DSparkDraftOutput
from .modeling_eagle3 import Eagle3DraftModel, Eagle3DraftOutput

__all__ = [
    "AutoDrafter",
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
