"""Configuration of the Eagle3 drafter: one decoder layer on fused low/mid/high target features, drafting a chain."""

from __future__ import annotations

from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .common import EAGLE3_DRAFTER_TYPE, QK_NORM_FAMILIES, check_target_layer_ids, target_shape_fields


def default_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3 reads the inputs of decoder layers 2, L//2 and L-3, i.e. the outputs of layers 1, L//2-1, L-4."""
    last_allowed = num_target_layers - 2
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    return sorted({min(max(i, 0), last_allowed) for i in ids})


@strict
class Eagle3DraftConfig(PreTrainedConfig):
    r"""
    Configuration of an [`Eagle3DraftModel`]: a single decoder layer whose attention input is
    `[norm(embed(x_t)) ; norm(g_t)]`, where `g_t` is `fc` of the target's low/mid/high features for context
    positions and the drafter's own previous output state for drafted positions. It drafts `block_size`
    tokens autoregressively and shares the target's embedding and LM head.

    Args:
        vocab_size (`int`), hidden_size (`int`), intermediate_size (`int`), num_attention_heads (`int`),
        num_key_value_heads (`int`), head_dim (`int`), hidden_act (`str`), rms_norm_eps (`float`),
        max_position_embeddings (`int`), rope_parameters (`dict`): Copied from the target.
        num_hidden_layers (`int`): Drafter depth (EAGLE-3 uses 1).
        attention_bias (`bool`): Biases on the attention projections.
        qk_norm (`bool`): RMSNorm on queries and keys per head before the rotary embedding (Qwen3 style, as in
            DeepSpec's Qwen3 Eagle3 drafter). `from_target_config` turns it on for targets whose attention has it.
        block_size (`int`): Chain length drafted per round.
        target_layer_ids (`list[int]`): Target decoder layers whose outputs are fused (HF `hidden_states[i + 1]`;
            -1 is the embedding output, `hidden_states[0]`, as in DeepSpec).
        target_num_hidden_layers (`int`): Depth of the target the drafter was built for.
        target_model_type (`str`): `model_type` of that target (informational).
        draft_vocab_size (`int`, *optional*): Draft over only this many target tokens (the most frequent in
            the training answers; ids in the `draft_to_target` buffer). Drafting and the draft LM head get
            cheaper; verification stays exact over the full vocabulary. `None` drafts over all tokens.
        suffix_drafting (`bool`): Let generation at batch 1 also propose suffix matches over the prompt and the
            text so far (`hf_dspark.generation.suffix`) and verify, each round, whichever of the drafter's block, the
            suffix proposal or no draft promises the most tokens per second. Lossless either way; the drafter's
            `suffix_drafting` attribute starts from this value and can be switched per model.
        deepspec_fields (`dict`, *optional*): Fields of an imported DeepSpec config.json that hf_dspark does not
            use (e.g. `step_loss_decay`), written back unchanged by `hf-dspark convert` when the drafter is exported
            again.
        initializer_range (`float`): Std of the normal initialiser.
    """

    model_type = EAGLE3_DRAFTER_TYPE
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
    block_size: int = 7
    target_layer_ids: list[int] | None = None
    target_num_hidden_layers: int | None = None
    target_model_type: str | None = None
    draft_vocab_size: int | None = None
    suffix_drafting: bool = False
    deepspec_fields: dict | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_layer_ids is None:
            self.target_layer_ids = default_eagle3_layer_ids(self.target_num_hidden_layers or 32)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), got {self.draft_vocab_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1, got {self.num_hidden_layers}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        check_target_layer_ids(self.target_layer_ids)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_draft_slots(self) -> int:
        """gamma, the tokens one round drafts at most (one autoregressive step each)."""
        return self.block_size

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "Eagle3DraftConfig":
        """Derive an Eagle3 drafter config from any causal-LM config; any field can be overridden."""
        fields = target_shape_fields(target_config)
        fields["qk_norm"] = fields["target_model_type"] in QK_NORM_FAMILIES
        fields.update(overrides)
        if "target_layer_ids" not in overrides:
            fields["target_layer_ids"] = default_eagle3_layer_ids(fields["target_num_hidden_layers"])
        return cls(**fields)


__all__ = ["Eagle3DraftConfig"]
