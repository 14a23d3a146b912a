"""Initialise drafter layers from target decoder layers (same width and heads, so the shapes line up)."""

from __future__ import annotations

import torch

from ..models.common import DraftPreTrainedModel

_COPIED = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
    "post_attention_layernorm",
)


@torch.no_grad()
def init_layers_from_target(drafter: DraftPreTrainedModel, target, target_layer_indices: list[int]) -> list[str]:
    """Copy every matching tensor of target layer `target_layer_indices[i]` into drafter layer i; returns the
    names copied. Gemma-style norms (stored as w - 1) are converted to plain RMSNorm weights."""
    target_layers = target.get_decoder().layers
    offset_norms = "gemma" in target.config.get_text_config().model_type
    copied = []
    for draft_index, target_index in enumerate(target_layer_indices):
        source = dict(target_layers[target_index].named_parameters())
        for name, param in drafter.layers[draft_index].named_parameters():
            module_name = name.rsplit(".", 1)[0]
            if module_name not in _COPIED or name not in source or source[name].shape != param.shape:
                continue
            value = source[name].to(param.dtype)
            if offset_norms and name.endswith("norm.weight"):
                value = value + 1.0
            param.copy_(value)
            copied.append(f"layers.{draft_index}.{name}")
    return copied
