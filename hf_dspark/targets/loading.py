"""A target by path, or the embedded default target when no path is given: what the command line, the evaluation
harness and the benchmarks load a target with."""

from __future__ import annotations

import torch

from ..models.errors import UserInputError
from ..models.loading import DTYPES, load_target_model, load_target_tokenizer
from .default_target import load_default_target


def load_target(path: str | None, dtype: str, device: str | torch.device | None = None, device_map=None):
    """(model, tokenizer) of the target at ``path``, or of the embedded SmolLM2 default when ``path`` is None.

    Args:
        dtype: "float32", "bfloat16" or "float16" (a key of `DTYPES`).
        device: where the whole model runs: "auto", "cpu", "cuda", "cuda:1", "mps", ... (see `resolve_device`);
            None keeps transformers' default, the CPU.
        device_map: instead of ``device``, a transformers `device_map` ("auto", or {module name: device}) that
            spreads the target over several devices; a drafter then runs beside its LM head
            (`DraftPreTrainedModel.attach_target`).
    """
    if dtype not in DTYPES:
        raise UserInputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if path is None:
        return load_default_target(dtype=DTYPES[dtype], device=device, device_map=device_map)
    model = load_target_model(path, DTYPES[dtype], device=device, device_map=device_map)
    return model, load_target_tokenizer(path)


__all__ = ["load_target"]
