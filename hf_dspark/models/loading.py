"""Loading a target and drafters by path or by default: the embedded SmolLM2 target and the drafters shipped for
it in the repository's `checkpoints/`. Shared by the CLI, the evaluation harness and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHIPPED_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def load_target(path: str | None, dtype: str):
    """(model, tokenizer) of the target at ``path``, or of the embedded SmolLM2 default when ``path`` is None."""
    if path is None:
        from .default_target import load_default_target

        return load_default_target(dtype=DTYPES[dtype])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    return model, AutoTokenizer.from_pretrained(path)


def shipped_drafter_path(kind: str = "dspark") -> Path:
    """The drafter for the embedded default target that ships in this repository's `checkpoints/`."""
    path = SHIPPED_CHECKPOINTS / f"{kind}-smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no shipped {kind} drafter at {path} (it ships with the hf_dspark repository); "
                                "pass --drafter PATH")
    return path


def load_drafter(path: str | Path, dtype: torch.dtype):
    """A saved drafter in eval mode (`import hf_dspark` has registered its classes with `AutoModel`)."""
    from transformers import AutoModel  # the drafter classes are registered on `import hf_dspark`, our parent

    return AutoModel.from_pretrained(str(path), dtype=dtype).eval()
