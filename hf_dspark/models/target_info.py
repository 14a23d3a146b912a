"""What a drafter reads from its target's config: the shapes it copies, the rotary parameters, which target layers
it may read, and the check that a drafter fits a target before any token is produced."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from .errors import DrafterTargetMismatchError


def target_text_config(target_config: PreTrainedConfig) -> PreTrainedConfig:
    """The decoder config of a target (the text config of multimodal wrappers such as Gemma3)."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def global_rope_parameters(text_config: PreTrainedConfig) -> dict[str, Any]:
    """The rotary parameters of the target's full-attention layers.

    Families with per-layer-type rope (Gemma3: ``{"full_attention": {...}, "sliding_attention": {...}}``) are
    reduced to the full-attention entry because a drafter attends over the whole context.
    """
    rope = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    return rope


def full_attention_layer_config(text_config: PreTrainedConfig) -> PreTrainedConfig:
    """The config of the target's full-attention layers, whose attention shape a drafter takes (it attends over the
    whole context). transformers 5.24+ keeps attributes that differ between layers per layer (`per_layer_config`):
    Gemma 4's full-attention layers have `head_dim` = its `global_head_dim` and, with `attention_k_eq_v`,
    `num_key_value_heads` = its `num_global_key_value_heads`, and reading `config.head_dim` raises
    `AmbiguousGlobalPerLayerAttributeError`. A config without per-layer attributes is its own layers' config."""
    if not getattr(text_config, "is_heterogeneous", False):
        return text_config
    layers = text_config.per_layer_config
    types = getattr(text_config, "layer_types", None) or []
    try:
        return layers["full_attention"] if "full_attention" in types else layers[len(layers) - 1]
    except ValueError:  # full-attention layers that differ among themselves: the last one (Gemma's is full)
        return layers[len(layers) - 1]


GEMMA4_FAMILIES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
"""Targets whose drafters get Gemma 4's layers (`layer_style="gemma4"`), as DeepSpec's Gemma 4 drafters have."""


def mlp_width(text_config: PreTrainedConfig) -> int | None:
    """The width of the target's MLP, which a drafter's layers take by default: `intermediate_size`, or what the
    families that name it otherwise call it (GPT-2's `n_inner`, None there meaning 4 x the hidden size as GPT-2's
    MLP builds it; OPT's `ffn_dim`). None when the config names none (`from_target_config` then needs it given)."""
    for name in ("intermediate_size", "n_inner", "ffn_dim"):
        width = getattr(text_config, name, None)
        if width:
            return width
    return 4 * text_config.hidden_size if hasattr(text_config, "n_inner") else None


def check_shared_heads(text_config: PreTrainedConfig) -> None:
    """Refuse a target whose LM head does not read its last hidden state as is: OPT's `project_out` maps it from
    hidden_size to word_embed_proj_dim first, and a drafter shares the embedding and LM head at hidden_size."""
    projected = getattr(text_config, "word_embed_proj_dim", None)
    if projected is not None and projected != text_config.hidden_size:
        raise DrafterTargetMismatchError(
            f"this {text_config.model_type} target projects its hidden states (hidden_size {text_config.hidden_size})"
            f" to word_embed_proj_dim {projected} before its LM head, which a drafter sharing that head does not do; "
            "hf_dspark drafts for targets whose LM head reads the hidden states (OPT models whose two sizes agree).")


def target_shape_fields(target_config: PreTrainedConfig) -> dict[str, Any]:
    """Every size a drafter copies from its target so that it can share the target's embedding and LM head: the
    attention shape of the target's full-attention layers (`full_attention_layer_config`). A Gemma 4 target also
    gives its layer style (`layer_style`, `attention_k_eq_v`) and its logits' soft cap, as DeepSpec's Gemma 4
    drafters copy them (`deepspec/modeling/dspark/gemma4/`)."""
    text = target_text_config(target_config)
    check_shared_heads(text)
    layer = full_attention_layer_config(text)
    num_heads = layer.num_attention_heads
    head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // num_heads
    hidden_act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
    gemma4 = {"layer_style": "gemma4", "attention_k_eq_v": bool(getattr(text, "attention_k_eq_v", False)),
              "final_logit_softcapping": getattr(text, "final_logit_softcapping", None)} \
        if text.model_type in GEMMA4_FAMILIES else {}
    return {
        **gemma4,
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": mlp_width(text),
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(layer, "num_key_value_heads", None) or num_heads,
        "head_dim": head_dim,
        "hidden_act": hidden_act,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "max_position_embeddings": getattr(text, "max_position_embeddings", 4096),
        "rope_parameters": global_rope_parameters(text),
        "target_num_hidden_layers": text.num_hidden_layers,
        "target_model_type": text.model_type,
    }


EMBEDDING_OUTPUT = -1
"""A `target_layer_ids` entry for the target's embedding output (HF `hidden_states[0]`), as in DeepSpec."""


# Families whose attention normalises queries and keys per head; drafters for them do the same.
QK_NORM_FAMILIES = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "olmo2", "olmo3"}


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer L-3 (DFlash's rule; gives DeepSpec's Qwen3
    presets [1, 9, 17, 25, 33] for 36 layers). Shallow targets get fewer, distinct layers."""
    last_allowed = num_target_layers - 2  # HF returns the final layer only after the final norm
    if last_allowed < 0:
        raise ValueError(f"a target needs at least 2 decoder layers to feed a drafter, got {num_target_layers}")
    low, high = min(1, last_allowed), max(min(1, last_allowed), num_target_layers - 3)
    if count == 1:
        return [(low + high) // 2]
    ids = [round(low + (high - low) * i / (count - 1)) for i in range(count)]
    return sorted(set(ids))


def check_drafter_matches_target(draft_config: PreTrainedConfig, target_config: PreTrainedConfig) -> None:
    """Raise :class:`DrafterTargetMismatchError` naming the problem and the fix when a drafter cannot serve a
    target. Called before any token is produced."""
    text = target_text_config(target_config)
    check_shared_heads(text)
    name = type(draft_config).__name__
    fix = (
        "Use a drafter trained for this target, or build one with "
        f"`{name}.from_target_config(target.config)` and train it."
    )
    if draft_config.hidden_size != text.hidden_size:
        raise DrafterTargetMismatchError(
            f"The drafter's hidden_size ({draft_config.hidden_size}) differs from the target's ({text.hidden_size}): "
            f"it cannot share the target's embedding and LM head. {fix}"
        )
    if draft_config.vocab_size != text.vocab_size:
        raise DrafterTargetMismatchError(
            f"The drafter's vocab_size ({draft_config.vocab_size}) differs from the target's ({text.vocab_size}): "
            f"they do not share a tokenizer. {fix}"
        )
    last_allowed = text.num_hidden_layers - 2
    bad = [i for i in draft_config.target_layer_ids if not EMBEDDING_OUTPUT <= i <= last_allowed]
    if bad:
        raise DrafterTargetMismatchError(
            f"The drafter reads target layers {bad}, but this target has {text.num_hidden_layers} layers "
            f"(usable ids are 0..{last_allowed}, and -1 for the embedding output; the last layer is only exposed "
            f"after the final norm). {fix}"
        )
    mask_id = getattr(draft_config, "mask_token_id", None)
    if mask_id is not None and not 0 <= mask_id < text.vocab_size:
        raise DrafterTargetMismatchError(
            f"The drafter's mask_token_id ({mask_id}) is outside the target's vocabulary of {text.vocab_size}. {fix}"
        )
