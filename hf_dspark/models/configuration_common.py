"""The fields every hf_dspark drafter config has alike (`DSparkDraftConfig`, `Eagle3DraftConfig`): the sizes and
rotary parameters copied from the target, the target layers read, the draft vocabulary, and their defaults and
checks. Each family's config adds its own fields and sets its own defaults on top."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .config_checks import CONFIDENCE_THRESHOLD_RULES, check_config_fields, config_source
from .errors import UserInputError
from .target_info import QK_NORM_FAMILIES, target_shape_fields


@strict
class DraftPreTrainedConfig(PreTrainedConfig):
    r"""
    The fields shared by every drafter config; the families' configs document them with their own.

    Args:
        vocab_size (`int`), hidden_size (`int`), intermediate_size (`int`), num_attention_heads (`int`),
        num_key_value_heads (`int`), head_dim (`int`), hidden_act (`str`), rms_norm_eps (`float`),
        max_position_embeddings (`int`), rope_parameters (`dict`): Copied from the target
            (`from_target_config`), because the drafter shares the target's frozen embedding and LM head.
        num_hidden_layers (`int`): Drafter depth.
        attention_bias (`bool`): Biases on the attention projections.
        qk_norm (`bool`): RMSNorm on queries and keys per head (Qwen3 style); `from_target_config` turns it on
            for targets whose attention has it.
        layer_style (`str`): `"llama"`: pre-norm layers (Llama, Qwen3). `"gemma4"`: Gemma 4's layers, as DeepSpec's
            Gemma 4 drafters build them: sandwich norms (`post_attention_layernorm` on the attention output,
            `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP), a per-layer `layer_scalar`,
            an RMSNorm without scale on the values and softmax scale 1. `from_target_config` picks it from the target.
        attention_k_eq_v (`bool`): No value projection: the values are the keys' projection (Gemma 4's field).
        block_size (`int`): Tokens drafted per round (see each family for the exact count).
        target_layer_ids (`list[int]`): Target decoder layers whose outputs the drafter reads (HF
            `hidden_states[i + 1]`; -1 is the embedding output, `hidden_states[0]`, as in DeepSpec).
        target_num_hidden_layers (`int`): Depth of the target the drafter was built for.
        target_model_type (`str`): `model_type` of that target (informational).
        draft_vocab_size (`int`, *optional*): Draft over only this many target tokens (the most frequent in
            the training answers; ids in the `draft_to_target` buffer). Drafting and the draft LM head get
            cheaper; verification stays exact over the full vocabulary. `None` drafts over all tokens.
        suffix_drafting (`bool`): Let generation at batch 1 also propose suffix matches over the prompt and the
            text so far (`hf_dspark.models.suffix`) and verify, each round, whichever of the drafter's block, the
            suffix proposal or no draft promises the most tokens per second. Lossless either way; seeds the
            drafter's `generation_config.dspark_suffix_drafting`, which a `generate()` call may override.
        deepspec_fields (`dict`, *optional*): Fields of an imported DeepSpec config.json that hf_dspark does not
            use, written back unchanged by `hf-dspark convert` when the drafter is exported again.
        initializer_range (`float`): Std of the normal initialiser.
    """

    required_saved_fields: ClassVar[dict[str, str]] = {
        "rope_parameters": "The drafter's rotary embedding must be its target's, and a default would change its "
                           "outputs: add the target's, e.g. \"rope_parameters\": {\"rope_type\": \"default\", "
                           "\"rope_theta\": <the target's rope_theta>}.",
    }
    """config.json fields a saved drafter must have: loading refuses it without them rather than guess."""

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_parameters: dict | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    layer_style: str = "llama"
    attention_k_eq_v: bool = False
    block_size: int = 7
    target_layer_ids: list[int] | None = None
    target_num_hidden_layers: int | None = None
    target_model_type: str | None = None
    draft_vocab_size: int | None = None
    suffix_drafting: bool = False
    deepspec_fields: dict | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    config_kind: ClassVar[str | None] = None
    """The family whose own consistency rules `config_checks` applies ("dspark", "eagle3")."""

    def __post_init__(self, **kwargs):
        # Every field checked before anything is derived from it (head_dim = hidden_size // num_attention_heads,
        # the dtype looked up in torch, ...): one DrafterLoadError naming the field, not an error from deep inside.
        self.check_fields(config_source(kwargs, type(self).__name__), kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_layer_ids is None:
            self.target_layer_ids = self._default_layer_ids()
        super().__post_init__(**kwargs)

    def _default_layer_ids(self) -> list[int]:
        """The target layers a config that names none reads: each family has its rule."""
        raise NotImplementedError(f"{type(self).__name__} has no rule for default target_layer_ids")

    def check_fields(self, source: str | None = None, legacy: dict | None = None) -> None:
        """Refuse a field of this config that `config_checks` finds bad (type, range, consistency), with a
        `DrafterLoadError` naming `source` (default: the class), the field, its value and the fix. `legacy`: the
        transformers 4 keyword arguments (`torch_dtype`, `rope_scaling`, `rope_theta`) passed with the fields."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values.update({name: value for name, value in (legacy or {}).items()
                       if name in ("torch_dtype", "rope_scaling", "rope_theta")})
        check_config_fields(values, source or type(self).__name__, kind=self.config_kind)

    def validate_fields(self):
        """Part of `@strict`-powered validation (`config.validate()`, after fields were changed)."""
        self.check_fields()

    @staticmethod
    def _fields_from_target(target_config: PreTrainedConfig, overrides: dict[str, Any]) -> dict[str, Any]:
        """The target's shapes and rotary parameters, per-head q/k norms for families that use them, then
        `overrides` on top: the start of every family's `from_target_config`."""
        fields = target_shape_fields(target_config)
        fields["qk_norm"] = fields["target_model_type"] in QK_NORM_FAMILIES
        fields.update(overrides)
        if fields["intermediate_size"] is None:
            raise UserInputError(
                f"the {fields['target_model_type']} target's config names no MLP width (intermediate_size, GPT-2's "
                "n_inner or OPT's ffn_dim), which a drafter's layers take from it: pass intermediate_size=... (e.g. "
                "4 x hidden_size) to from_target_config.")
        return fields


__all__ = ["CONFIDENCE_THRESHOLD_RULES", "DraftPreTrainedConfig"]
