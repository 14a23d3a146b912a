"""DeepSpec's Gemma 4 drafters (`Gemma4DSparkModel`, `Gemma4Eagle3Model`): what their config.json holds beyond the
Qwen3 layout's fields, read into hf_dspark's configs (`layer_style="gemma4"`), and written back by the export.

Names and meanings come from DeepSpec (github.com/deepseek-ai/DeepSpec afdfa7c) `deepspec/modeling/{dspark,eagle3}/
gemma4/{config,modeling}.py`, which deep-copy the target's `Gemma4TextConfig` (transformers 5.10.2, DeepSpec's pin)
and add the drafter's fields:

    global_head_dim               the drafter's head size, in every layer (Gemma 4's full-attention head size)
    num_global_key_value_heads    its key/value heads when attention_k_eq_v (else num_key_value_heads)
    attention_k_eq_v              no v_proj: the values are k_proj's output (then an unscaled RMSNorm, v_norm)
    final_logit_softcapping       compute_logits soft-caps: cap * tanh(logits / cap); null: none
    hidden_activation             the MLP's activation (Gemma's name of hidden_act)
    head_dim, sliding_window,     the target's sliding layers' head size and window: the drafter's layers are all
      use_bidirectional_attention full attention (layer_types) and never read them
    hidden_size_per_layer_input,  DeepSpec asserts 0 / false (no per-layer inputs, no MoE block); the MoE sizes and
      enable_moe_block, ...       the per-layer vocabulary are then unused
    num_kv_shared_layers,         with use_double_wide_mlp, Gemma4TextMLP doubles the MLP of draft layers at or past
      use_double_wide_mlp         num_hidden_layers - num_kv_shared_layers (> 0): refused (one width per drafter)
    target_model_type,            the target's top-level and text model types ("gemma4", "gemma4_text"):
      target_text_model_type      informational, written back unchanged

Tensors: DeepSpec's names are ours (`layers.<i>.{pre,post}_feedforward_layernorm`, `layers.<i>.layer_scalar`, no
`v_proj` with attention_k_eq_v). Its embedding is `Gemma4TextScaledWordEmbedding(embed_scale=sqrt(hidden_size))`:
the stored copy is attached scaled so (`attach_stored_heads(embed_scale=...)`), as the target's own module scales it.
"""

from __future__ import annotations

from ...transformers_internals.accessors import global_config_value
from ..errors import DrafterLoadError

GEMMA4_TEXT_FIELDS = ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "final_logit_softcapping",
                      "hidden_activation", "use_bidirectional_attention", "vocab_size_per_layer_input",
                      "hidden_size_per_layer_input", "num_kv_shared_layers", "enable_moe_block",
                      "use_double_wide_mlp", "num_experts", "top_k_experts", "moe_intermediate_size")
"""The target `Gemma4TextConfig` fields a DeepSpec Gemma 4 drafter's config.json carries beyond the Qwen3 layout's."""
INFORMATIONAL_FIELDS = ("target_model_type", "target_text_model_type")
TARGET_FIELDS = ("global_head_dim", "num_global_key_value_heads")
"""Passed to transformers' `Gemma4TextConfig` when the target config is rebuilt (5.24+ turn them into per-layer
overrides of the full-attention layers, from which `DSparkDraftConfig.from_target_config` reads the drafter's
attention shape)."""
TEXT_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")
DEEPSPEC_TEXT_DEFAULTS = {"hidden_size_per_layer_input": 0, "enable_moe_block": False, "num_kv_shared_layers": 0,
                          "use_double_wide_mlp": False}
"""Fields DeepSpec's Gemma 4 builders assert present (`_validate_required_text_fields`) written with the values
that make its layers hf_dspark's (no per-layer inputs, no MoE block, one MLP width), whatever the target's."""


def normalized(config: dict) -> dict:
    """The config.json with its per-layer-type `rope_parameters` alone: transformers 5.10.2 saves a Gemma 4 config's
    rotary parameters as {"full_attention": {...}, "sliding_attention": {...}} plus a top-level "rope_type":
    "default", "rope_theta": null that its rotary embedding never reads (it indexes rope_parameters[layer_type])."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and any(isinstance(entry, dict) for entry in rope.values()):
        config = {**config, "rope_parameters": {key: value for key, value in rope.items() if isinstance(value, dict)}}
    return config


def check(config: dict, source: str) -> None:
    """Refuse what DeepSpec's Gemma 4 drafters never are, or what hf_dspark's Gemma 4 layers cannot compute."""
    missing = [name for name in ("global_head_dim", "attention_k_eq_v", "num_target_layers") if name not in config]
    if missing:
        raise DrafterLoadError(f"{source} lacks {missing}, which DeepSpec's Gemma 4 drafters write (the target's "
                               "Gemma4TextConfig fields and num_target_layers); restore them from the training run.")
    if config.get("model_type") not in TEXT_MODEL_TYPES:
        raise DrafterLoadError(f"{source} has model_type={config.get('model_type')!r}; DeepSpec's Gemma 4 drafters "
                               f"copy the target's text config, one of {list(TEXT_MODEL_TYPES)}.")
    if config.get("hidden_size_per_layer_input") or config.get("enable_moe_block"):
        raise DrafterLoadError(
            f"{source} has hidden_size_per_layer_input={config.get('hidden_size_per_layer_input')} / enable_moe_block="
            f"{config.get('enable_moe_block')}: DeepSpec's Gemma 4 drafter layers have neither per-layer inputs nor "
            "a MoE block (its builder asserts 0 and false), nor do hf_dspark's.")
    if config.get("attention_k_eq_v") and not isinstance(config.get("num_global_key_value_heads"), int):
        raise DrafterLoadError(f"{source} has attention_k_eq_v true but num_global_key_value_heads="
                               f"{config.get('num_global_key_value_heads')!r}: write the target's global KV head "
                               "count.")
    layers, shared = config.get("num_hidden_layers"), config.get("num_kv_shared_layers") or 0
    if config.get("use_double_wide_mlp") and isinstance(layers, int) and 0 < layers - shared < layers:
        raise DrafterLoadError(
            f"{source} has use_double_wide_mlp with num_kv_shared_layers={shared}: transformers 5.10's Gemma4TextMLP, "
            f"which DeepSpec builds, doubles the MLP of draft layers {layers - shared}..{layers - 1} only, while "
            "hf_dspark's drafters have one MLP width. Supporting it would take a per-layer intermediate_size.")
    rope = config.get("rope_parameters") or {}
    full = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    if full.get("rope_type", "default") != "proportional" and config.get("head_dim") != config["global_head_dim"]:
        raise DrafterLoadError(
            f"{source} has a {full.get('rope_type', 'default')!r} rotary embedding for full attention with head_dim="
            f"{config.get('head_dim')} != global_head_dim={config['global_head_dim']}: transformers 5.10 sizes that "
            "rotary by head_dim (only 'proportional' uses global_head_dim), so DeepSpec's own drafter cannot run it.")


def target_fields(config: dict) -> dict:
    """The fields to rebuild the target's `Gemma4TextConfig` with, besides the shared ones."""
    return {name: config[name] for name in TARGET_FIELDS if config.get(name) is not None}


def export_fields(config, target_text=None) -> dict:
    """DeepSpec's Gemma 4 text-config fields for an export of a `layer_style="gemma4"` drafter (`config`): the
    target's (`target_text`, its text config) when given, else those the drafter's own config determines."""
    fields = {"model_type": "gemma4_text", "target_model_type": "gemma4", "target_text_model_type": "gemma4_text"}
    if target_text is not None:
        for name in (*GEMMA4_TEXT_FIELDS, "head_dim", "num_key_value_heads", "sliding_window"):
            # Global values (Gemma 4 keeps head_dim / num_key_value_heads per layer), as DeepSpec's config holds them.
            value = global_config_value(target_text, name)
            if value is not None:
                fields[name] = value
        fields["target_text_model_type"] = target_text.model_type
    # What the drafter's own layers are, whatever the target's (a Gemma 4 E2B target's per-layer inputs, say):
    fields.update(DEEPSPEC_TEXT_DEFAULTS, hidden_activation=config.hidden_act, global_head_dim=config.head_dim,
                  attention_k_eq_v=bool(config.attention_k_eq_v),
                  final_logit_softcapping=config.final_logit_softcapping)
    if config.attention_k_eq_v:
        fields["num_global_key_value_heads"] = config.num_key_value_heads
    fields.setdefault("head_dim", config.head_dim)
    fields.setdefault("attention_dropout", 0.0)  # asserted present; the drafter runs without dropout
    fields.setdefault("num_key_value_heads", config.num_key_value_heads)
    fields["rope_parameters"] = {"full_attention": dict(config.rope_parameters),
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if target_text is not None and isinstance(getattr(target_text, "rope_parameters", None), dict):
        fields["rope_parameters"] = {**fields["rope_parameters"], **{
            key: dict(value) for key, value in target_text.rope_parameters.items() if isinstance(value, dict)}}
    return fields


__all__ = ["GEMMA4_TEXT_FIELDS", "INFORMATIONAL_FIELDS", "check", "export_fields", "normalized", "target_fields"]
