"""SpecForge / RadixArk `DSparkDraftModel` drafters (`sgl-project/SpecForge`, PyPI `specforge` 0.2.0; RadixArk's
Qwen3.8 and Kimi-K3 GQA drafters are trained with it), read into a `DSparkDraftModel` in memory.

Sources of every name (read, not copied): sgl-project/SpecForge at a6b6b0230009d15ec2a97a57384e6f53f0f96946 (the
files are identical in the `specforge-0.2.0` wheel):

* `specforge/modeling/draft/dspark.py`: `DSparkDraftModel` (requires `dflash_config.projector_type` "dspark" and
  `attention_mode` "gqa" (kv heads < heads) or "mha" (kv heads == heads)), `_init_draft_head` (`markov_rank`,
  `markov_head_type` vanilla/gated/rnn, `enable_confidence_head` defaulting to `confidence_head_alpha > 0`,
  `confidence_head_with_markov` defaulting to false), `VanillaMarkovHead.markov_w1/w2`, `GatedMarkovHead.gate_proj`,
  `RNNMarkovHead.joint_proj`, `AcceptRatePredictor.proj`;
* `specforge/modeling/draft/dflash.py`: `DFlashDraftModel` (`block_size` and `num_target_layers` at the top level,
  `dflash_config.{target_layer_ids, mask_token_id, projector_type, pure_draft_prefix_len, shift_label}`,
  `build_target_layer_ids`, `normalize_draft_head_checkpoint_keys` for early `logit_head.*` names, tensor names
  `fc`, `hidden_norm`, `layers.*`, `norm`; no embedding or LM head);
* `specforge/algorithms/common/dflash_family_model.py`: `_build_dspark_labels_and_mask` (label offsets 1..B: slot
  k predicts the token at anchor + k + 1, DeepSpec's convention) and the DSpark forward (previous tokens
  `[anchor, labels[:-1]]` for the heads). Its `spec_generate`, inherited from DFlash, reads slots 1..B-1 instead;
  hf_dspark follows the training objective and SGLang, which serves these exports as DeepSpec's layout;
* `configs/qwen3-8b-dspark.json`, `configs/kimi-k3-dspark.json`, `configs/qwen3.6-27b-dspark.json`
  (`target_hidden_size`); `specforge/modeling/auto.py` (`AutoDraftModelConfig.from_file` writes `draft_vocab_size`);
* `scripts/gates/normalize_dflash_export.py`: an export rewritten for SGLang names `Qwen3DSparkModel` and copies
  `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov` to the top level (read
  here too; a copy must agree with `dflash_config`); sgl-project/sglang
  `python/sglang/srt/speculative/dspark_components/dspark_config.py` (01f4762) reads them so.

Training-only settings (`confidence_head_alpha`) are accepted; Domino's (`shift_label` true, a non-zero
`pure_draft_prefix_len`, `prefix_gru` / `embed_proj` heads) and sliding-window layers are refused by name.
"""

from __future__ import annotations

from pathlib import Path

from ..config_checks import is_finite_number
from ..errors import DrafterLoadError
from ..weight_files import read_checkpoint_tensors
from .qwen3_shell import (built, dspark_config, heads_settings, nested_settings, our_state, qwen3_config,
                          setting)
from .zlab_dflash import zlab_default_layer_ids

FORMAT = "specforge"
ARCHITECTURE = "DSparkDraftModel"
SGLANG_ARCHITECTURE = "Qwen3DSparkModel"  # after SpecForge's normalize_dflash_export.py
DFLASH_CONFIG_KEYS = ("attention_mode", "confidence_head_alpha", "confidence_head_with_markov",
                      "enable_confidence_head", "markov_head_type", "markov_rank", "mask_token_id", "projector_type",
                      "target_layer_ids", "pure_draft_prefix_len", "shift_label")
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
OWN_FIELDS = ("block_size", "dflash_config", "num_target_layers", "target_hidden_size", "draft_vocab_size",
              *HEAD_FIELDS)
OLD_HEAD_PREFIXES = ("logit_head.markov_head.", "logit_head.confidence_head.")  # normalize_draft_head_checkpoint_keys
FIX = "Restore the folder (config.json and model.safetensors) as SpecForge's `specforge export --to hf` wrote it."


def matches(config: dict) -> bool:
    """SpecForge's `DSparkDraftModel` (its `dflash_config` tags `projector_type` "dspark" or omits it), or the same
    export renamed `Qwen3DSparkModel` for SGLang (then tagged "dspark")."""
    architectures, nested = config.get("architectures"), config.get("dflash_config")
    if not isinstance(nested, dict) or "speculators_model_type" in config or not isinstance(architectures, list):
        return False
    if architectures == [ARCHITECTURE]:
        return nested.get("projector_type", "dspark") == "dspark"
    return architectures == [SGLANG_ARCHITECTURE] and nested.get("projector_type") == "dspark"


def load(folder: Path, config: dict):
    """The drafter in `folder` (config.json read as `config`), float32, eval mode, every stored tensor used."""
    folder = Path(folder)
    source = str(folder / "config.json")
    nested = nested_settings(config, "dflash_config", DFLASH_CONFIG_KEYS, source, "SpecForge DSpark")
    qwen3 = qwen3_config(config, source, OWN_FIELDS, "SpecForge DSpark")
    _refuse_unsupported(config, nested, qwen3, source)
    fields = _draft_fields(config, nested, qwen3, source)
    with_markov = setting("confidence_head_with_markov", nested, config, source, default=False)
    ours = dspark_config(qwen3, source, **fields)
    weights = read_checkpoint_tensors(folder, "SpecForge DSpark drafter", FIX)
    renamed = {name: name.removeprefix("logit_head.") for name in weights if name.startswith(OLD_HEAD_PREFIXES)}
    if len(set(renamed.values()) | (set(weights) - set(renamed))) != len(weights):
        raise DrafterLoadError(f"the weights beside {source} hold a head twice (`logit_head.*` and its current "
                               f"name: {sorted(renamed)}); keep one, as SpecForge's loader does.")
    state = our_state(weights, ours, with_markov, renamed)
    return built(folder, ours, state, "SpecForge DSpark drafter", FIX)


def _refuse_unsupported(config: dict, nested: dict, qwen3, source: str) -> None:
    """What SpecForge's own class refuses, and what hf_dspark's drafter does not compute."""
    projector = nested.get("projector_type", "dspark")
    if projector != "dspark":
        raise DrafterLoadError(f"{source} has dflash_config.projector_type={projector!r}; SpecForge's "
                               "DSparkDraftModel requires 'dspark'.")
    mode, heads, kv = nested.get("attention_mode", "gqa"), qwen3.num_attention_heads, qwen3.num_key_value_heads
    if mode not in ("gqa", "mha") or (mode == "gqa") != (kv < heads):
        raise DrafterLoadError(
            f"{source} has dflash_config.attention_mode={mode!r} with {heads} heads and {kv} key/value heads; "
            "SpecForge's DSparkDraftModel accepts 'gqa' with fewer key/value heads or 'mha' with as many.")
    if nested.get("shift_label", False) is not False or nested.get("pure_draft_prefix_len", 0) != 0:
        raise DrafterLoadError(
            f"{source} has dflash_config.shift_label={nested.get('shift_label')!r} / pure_draft_prefix_len="
            f"{nested.get('pure_draft_prefix_len')!r}: SpecForge's Domino settings (labels shifted by one, a prefix "
            "of pure draft slots), which its DSpark drafters leave at false / 0. Supporting them would take Domino's "
            "label convention and its prefix GRU head in the drafting core.")
    alpha = nested.get("confidence_head_alpha", 0.0)
    if not is_finite_number(alpha) or alpha < 0:
        raise DrafterLoadError(f"{source} has dflash_config.confidence_head_alpha={alpha!r}; SpecForge needs a "
                               "non-negative number (the confidence loss weight).")
    draft_vocab = config.get("draft_vocab_size")  # AutoDraftModelConfig.from_file writes vocab_size when unset
    if draft_vocab is not None and draft_vocab != qwen3.vocab_size:
        raise DrafterLoadError(f"{source} has draft_vocab_size={draft_vocab!r} below vocab_size={qwen3.vocab_size}: "
                               "SpecForge's DSpark drafts over the whole vocabulary (no d2t), so this is not one of "
                               "its exports.")
    width = config.get("target_hidden_size")
    if width is not None and width != qwen3.hidden_size:
        raise DrafterLoadError(f"{source} has target_hidden_size={width!r}, not the drafter's hidden_size "
                               f"({qwen3.hidden_size}); hf_dspark's drafters share their target's width (fc fuses "
                               "len(target_layer_ids) x hidden_size features).")


def _draft_fields(config: dict, nested: dict, qwen3, source: str) -> dict:
    """Our DSparkDraftConfig's draft settings, read as SpecForge reads them."""
    alpha = nested.get("confidence_head_alpha", 0.0) or 0.0
    rank = setting("markov_rank", nested, config, source, default=0)
    head_type = setting("markov_head_type", nested, config, source, default="vanilla")
    confidence = setting("enable_confidence_head", nested, config, source, default=alpha > 0)
    with_markov = setting("confidence_head_with_markov", nested, config, source, default=False)
    markov_head, rank, confidence = heads_settings(rank, head_type, confidence, with_markov, source)
    if "block_size" not in config:
        raise DrafterLoadError(f"{source} lacks block_size, which SpecForge's DFlashDraftModel reads from the top "
                               "level; write the block size the drafter was trained with.")
    mask = nested.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise DrafterLoadError(f"{source} has dflash_config.mask_token_id={mask!r}: the drafter needs the integer "
                               "id whose embedding fills the block's mask slots.")
    depth = config.get("num_target_layers")
    layer_ids = nested.get("target_layer_ids")
    if layer_ids is None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 4:
            raise DrafterLoadError(f"{source} has neither dflash_config.target_layer_ids nor a usable "
                                   f"num_target_layers ({depth!r}): the target layers it reads are unknown.")
        layer_ids = zlab_default_layer_ids(depth, qwen3.num_hidden_layers)  # SpecForge's build_target_layer_ids
    return {"block_size": config["block_size"], "sample_from_anchor": True, "mask_token_id": mask,
            "target_layer_ids": layer_ids, "target_num_hidden_layers": depth, "markov_head": markov_head,
            "markov_rank": rank, "confidence_head": confidence}


__all__ = ["FORMAT", "load", "matches"]
