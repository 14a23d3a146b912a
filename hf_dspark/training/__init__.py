from .blocks import Blocks, build_blocks, sample_anchors
from .data import Decontaminator, iter_json_records, load_prompts, sharegpt_path, user_turns
from .losses import dspark_loss, l1_distance, position_weights, soft_cross_entropy
from .regenerate import RegenerationConfig, iter_regenerated, regenerate
from .trainer import DraftDataCollator, DSparkTrainer, RegeneratedDataset, most_frequent_tokens

__all__ = [
    "Blocks", "build_blocks", "sample_anchors", "Decontaminator", "iter_json_records", "load_prompts",
    "sharegpt_path", "user_turns", "dspark_loss", "l1_distance", "position_weights", "soft_cross_entropy",
    "RegenerationConfig", "iter_regenerated", "regenerate", "DraftDataCollator", "DSparkTrainer",
    "RegeneratedDataset", "most_frequent_tokens",
]
