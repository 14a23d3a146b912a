"""LiquidAI's LFM2.5 DSpark drafters (`Lfm2DSparkDraftModel`: LFM2.5-1.2B-Instruct-DSpark, LFM2.5-2.6B-DSpark,
LFM2.5-8B-A1B-DSpark), read into a `DSparkDraftModel` in memory. They draft for LFM2 targets (hybrid short-convolution
/ attention models), reading the target's residual stream at `target_layer_ids` (HF `hidden_states[i + 1]`).

Sources of every name (read, not copied):

* the published config, as Blaizzy/mlx-vlm (9b13f522a7f1d214f426c67bb292c9e1065e9108) pins it in
  `mlx_vlm/tests/test_models_dspark.py` (`_published_config`: `architectures: ["Lfm2DSparkDraftModel"]`,
  `model_type: "qwen3"`, block 9, 5 layers, GQA 32/8, head_dim 64, `dflash_config.{mask_token_id, target_layer_ids,
  num_target_layers}`, `markov_rank` 256, `markov_head_type` vanilla, `enable_confidence_head`,
  `rope_is_neox_style: false`) and reads it in `mlx_vlm/speculative/drafters/qwen3_dspark/config.py`
  (`DSparkConfig.from_dict`: `block_size` may also sit in `dflash_config`; `runtime_block_size`,
  `draft_window_size` from `dflash_config`) and `dspark.py` (input `[anchor, mask x (gamma - 1)]`, every one of
  the gamma slots a draft, the Markov head seeded with the anchor, confidence head over `[h ; W1[x_{k-1}]]`);
* `mlx_vlm/speculative/drafters/qwen3_dflash/dflash.py` `_build_rope`: `rope_is_neox_style: false` is the
  interleaved (GPT-J, "traditional") pairing of rotary channels;
* vLLM's `Lfm2DSparkForCausalLM` (a `Qwen3DSparkForCausalLM`): `rope_is_neox_style` defaults to false and
  `confidence_head_with_markov` to true when a confidence head is enabled;
* the tensor manifest of LiquidAI/LFM2.5-1.2B-Instruct-DSpark (`fc`, `hidden_norm`, `norm`, `layers.<i>.*` with
  per-head `q_norm` / `k_norm`, `markov_head.markov_w1/w2` (65536 x 256 each), `confidence_head.proj` (1 x 2304 =
  hidden 2048 + rank 256), no `embed_tokens` / `lm_head`), SGLang's `python/sglang/srt/models/lfm2_dspark.py`
  (sgl-project/sglang#31041: `Lfm2DSparkDraftModel`, a `DSparkDraftModel` with "Qwen3-style GQA with interleaved
  RoPE");
* lablup/mlxcel#1751: `runtime_block_size` caps the verification width (anchor + drafts), the trained width
  otherwise; ggml-org/llama.cpp#27383 converts these drafters with `rope_is_neox_style: false` by permuting the
  rows of `q_proj`, `k_proj`, `q_norm`, `k_norm` once (its converter test: [0, 2, 4, 6, 1, 3, 5, 7] for head_dim 8).

Interleaved rotary, exactly: rotating channel pairs (2i, 2i+1) by angle_i is rotating pairs (i, i + d/2) after the
head channels are reordered [0, 2, ..., d-2, 1, 3, ..., d-1]; the per-head RMSNorm commutes with that reordering
(its weight reordered alike) and q.k is a sum over channels, so reordering the query and key projections' output
rows and the q/k norms once, at load, gives hf_dspark's split-half (NeoX) layers the same attention (equal up to
float summation order) with no change to the layers. Values are not rotated and keep their order.

`runtime_block_size` becomes the drafter's default `num_assistant_tokens` (runtime_block_size - 1 drafts per round,
at most the block). `draft_window_size` (mlx-vlm's rotating draft cache) is refused when set.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config_checks import integer
from ..errors import DrafterLoadError
from ..weight_files import read_checkpoint_tensors
from .qwen3_shell import (built, dspark_config, heads_settings, nested_settings, our_state, qwen3_config,
                          setting)

FORMAT = "lfm2_dspark"
ARCHITECTURE = "Lfm2DSparkDraftModel"
DFLASH_CONFIG_KEYS = ("mask_token_id", "target_layer_ids", "num_target_layers", "runtime_block_size",
                      "draft_window_size", "block_size")
OWN_FIELDS = ("block_size", "dflash_config", "num_target_layers", "runtime_block_size", "markov_rank",
              "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "rope_is_neox_style")
FIX = "Restore the folder (config.json and model.safetensors) as LiquidAI published it."


def matches(config: dict) -> bool:
    architectures = config.get("architectures")
    return isinstance(architectures, list) and ARCHITECTURE in architectures


def load(folder: Path, config: dict):
    """The drafter in `folder` (config.json read as `config`), float32, eval mode, every stored tensor used."""
    folder = Path(folder)
    source = str(folder / "config.json")
    if config.get("architectures") != [ARCHITECTURE]:
        raise DrafterLoadError(f"{source} lists architectures {config.get('architectures')}; LiquidAI's drafters "
                               f"name exactly [{ARCHITECTURE!r}].")
    nested = nested_settings(config, "dflash_config", DFLASH_CONFIG_KEYS, source, "LFM2.5 DSpark")
    qwen3 = qwen3_config(config, source, OWN_FIELDS, "LFM2.5 DSpark")
    neox = config.get("rope_is_neox_style", False)
    if not isinstance(neox, bool):
        raise DrafterLoadError(f"{source} has rope_is_neox_style={neox!r}; write true or false.")
    if nested.get("draft_window_size") is not None:
        raise DrafterLoadError(
            f"{source} has dflash_config.draft_window_size={nested['draft_window_size']!r}: mlx-vlm keeps only that "
            "many recent rows in the drafter's cache, which hf_dspark's drafter (attending over the whole context) "
            "does not do; supporting it would take a context window in DraftContextCache. Set it to null.")
    fields, with_markov = _draft_fields(config, nested, source)
    ours = dspark_config(qwen3, source, **fields)
    runtime = _runtime_drafts(config, nested, ours.num_draft_slots, source)
    weights = read_checkpoint_tensors(folder, "LFM2.5 DSpark drafter", FIX)
    state = our_state(weights, ours, with_markov)
    reorder = (lambda state: state) if neox else (lambda state: interleaved_to_split_half(state, ours))
    drafter = built(folder, ours, state, "LFM2.5 DSpark drafter", FIX, prepare=reorder)  # head_dim checked first
    if runtime is not None:
        drafter.generation_config.num_assistant_tokens = runtime
    return drafter


def _draft_fields(config: dict, nested: dict, source: str) -> tuple[dict, bool]:
    rank = config.get("markov_rank", 0)
    head_type = config.get("markov_head_type", "vanilla")
    confidence = config.get("enable_confidence_head", False)
    with_markov = config.get("confidence_head_with_markov", True)  # vLLM's Lfm2DSparkForCausalLM default
    if not isinstance(with_markov, bool):
        raise DrafterLoadError(f"{source} has confidence_head_with_markov={with_markov!r}; write true or false.")
    with_markov = with_markov and rank not in (0, None)  # the default reads W1 only when there is a Markov head
    markov_head, rank, confidence = heads_settings(rank, head_type, confidence, with_markov, source)
    block = setting("block_size", nested, config, source)
    depth = setting("num_target_layers", nested, config, source, default=None)
    mask = nested.get("mask_token_id")
    layer_ids = nested.get("target_layer_ids")
    if isinstance(mask, bool) or not isinstance(mask, int) or layer_ids is None:
        raise DrafterLoadError(f"{source} has dflash_config.mask_token_id={mask!r}, target_layer_ids="
                               f"{layer_ids!r}: LiquidAI's drafters name both there (the mask slots' token id, the "
                               "target layers read).")
    fields = {"block_size": block, "sample_from_anchor": True, "mask_token_id": mask, "target_layer_ids": layer_ids,
              "target_num_hidden_layers": depth, "markov_head": markov_head, "markov_rank": rank,
              "confidence_head": confidence}
    return fields, with_markov


def _runtime_drafts(config: dict, nested: dict, slots: int, source: str) -> int | None:
    """`runtime_block_size` (verification rows: the anchor and the drafts) as drafts per round, at most `slots`."""
    width = setting("runtime_block_size", nested, config, source, default=None)
    if width is None:
        return None
    problem = integer(2)(width)
    if problem:
        raise DrafterLoadError(f"{source} has runtime_block_size={width!r}, which {problem.replace('{field}', 'it')}"
                               " (the anchor and at least one draft are verified).")
    return min(width - 1, slots)


def interleaved_to_split_half(state: dict, config) -> dict:
    """The query / key projections (rows, and biases) and q/k norms of every layer with each head's channels
    reordered [0, 2, ..., d-2, 1, 3, ..., d-1]: interleaved rotary pairs become split-half ones (module docstring).
    The order is built from `config.head_dim`: call it once the state is known to fit the config (`built`)."""
    head_dim = config.head_dim
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    state = dict(state)
    for layer in range(config.num_hidden_layers):
        prefix = f"layers.{layer}.self_attn."
        for name in ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"):
            tensor = state.get(prefix + name)
            if tensor is not None and tensor.shape[0] % head_dim == 0:
                heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
                state[prefix + name] = heads[:, order].reshape(tensor.shape).contiguous()
        for name in ("q_norm.weight", "k_norm.weight"):
            tensor = state.get(prefix + name)
            if tensor is not None and tuple(tensor.shape) == (head_dim,):
                state[prefix + name] = tensor[order].contiguous()
    return state


__all__ = ["FORMAT", "interleaved_to_split_half", "load", "matches"]
