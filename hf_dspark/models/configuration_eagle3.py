"""Configuration of the Eagle3 drafter: one decoder layer on fused low/mid/high target features, drafting a chain."""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .configuration_common import DraftPreTrainedConfig
from .identity import EAGLE3_DRAFTER_TYPE


def default_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3 reads the inputs of decoder layers 2, L//2 and L-3, i.e. the outputs of layers 1, L//2-1, L-4."""
    last_allowed = num_target_layers - 2
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    return sorted({min(max(i, 0), last_allowed) for i in ids})


@strict
class Eagle3DraftConfig(DraftPreTrainedConfig):
    r"""
    Configuration of an [`Eagle3DraftModel`]: a single decoder layer whose attention input is
    `[norm(embed(x_t)) ; norm(g_t)]`, where `g_t` is `fc` of the target's low/mid/high features for context
    positions and the drafter's own previous output state for drafted positions. It drafts `block_size`
    tokens autoregressively and shares the target's embedding and LM head.

    Its fields are every drafter's ([`DraftPreTrainedConfig`]: the sizes copied from the target, the target
    layers read, the draft vocabulary, ...), with these meanings and defaults for Eagle3:

    Args:
        num_hidden_layers (`int`): Drafter depth (EAGLE-3 uses 1).
        qk_norm (`bool`): RMSNorm on queries and keys per head before the rotary embedding (Qwen3 style, as in
            DeepSpec's Qwen3 Eagle3 drafter). `from_target_config` turns it on for targets whose attention has it.
        block_size (`int`): Chain length drafted per round.
        target_layer_ids (`list[int]`): Target decoder layers whose outputs are fused into g_t (low, mid, high;
            by default the outputs of layers 1, L//2-1 and L-4).
        deepspec_fields (`dict`, *optional*): e.g. DeepSpec's `step_loss_decay`.
        final_logit_softcapping (`float`, *optional*): Soft-cap the drafter's logits to `cap * tanh(logits / cap)`
            (a Gemma 4 target's own cap, which DeepSpec's `Gemma4Eagle3Model` applies); `None`: uncapped.
    """

    model_type = EAGLE3_DRAFTER_TYPE
    config_kind = "eagle3"  # its fields are checked by `config_checks` (`DraftPreTrainedConfig.check_fields`)
    # Every field but one is `DraftPreTrainedConfig`'s, with its defaults (one decoder layer, no q/k norm).
    final_logit_softcapping: float | None = None

    def _default_layer_ids(self) -> list[int]:
        return default_eagle3_layer_ids(self.target_num_hidden_layers or 32)

    @property
    def num_draft_slots(self) -> int:
        """The draft length the drafter was trained for (gamma in the paper): the tokens one round drafts at most, one
        autoregressive step each."""
        return self.block_size

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "Eagle3DraftConfig":
        """Derive an Eagle3 drafter config from any causal-LM config; any field can be overridden."""
        fields = cls._fields_from_target(target_config, overrides)
        if "target_layer_ids" not in overrides:
            fields["target_layer_ids"] = default_eagle3_layer_ids(fields["target_num_hidden_layers"])
        return cls(**fields)


__all__ = ["Eagle3DraftConfig"]
