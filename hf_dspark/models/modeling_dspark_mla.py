"""DSpark drafters whose layers attend with multi-head latent attention (MLA), as Kimi K3's `k3_dspark` drafter does
(`formats/k3_dspark.py` reads it). Each layer's attention is transformers' own `DeepseekV3Attention` (DeepSeek-V3's
MLA, which the K3 drafter's attention is: tokenspeed's `K3DSparkAttention` subclasses its DeepSeek-V3 MLA), so its
weights, its per-head expansion of the latent keys/values (`expand_kv`), its interleaved rotary
(`apply_rotary_pos_emb_interleave`, `rope_interleave=True`), its rotary embedding (YaRN included) and its softmax
scale (`yarn_apply_mscale`) are transformers'. What differs is DSpark's, as in `DSparkAttention`: the queries come
from the block; the keys and values from the fused target context followed by the block, the context rows cached
per layer (expanded per head) by `DraftContextCache`; attention within the block is bidirectional.

The K3 drafter normalises its low-rank latents with its own `rms_norm_eps` (tokenspeed builds `q_a_layernorm` /
`kv_a_layernorm` from the config), where transformers' attention fixes 1e-6: the layer sets it. Everything else
(the DFlash fusion `fc` + `hidden_norm`, the pre-norm layer with a SwiGLU MLP, the final norm, the Markov and
confidence heads, drafting) is `DSparkDraftModel`'s. hf_dspark's own saved layout has no MLA fields yet:
`save_pretrained` and every `hf-dspark convert` destination refuse these drafters (read them from their folder).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3RotaryEmbedding,
                                                                   apply_rotary_pos_emb_interleave)

from .configuration_dspark import DSparkDraftConfig
from .drafter_base import DraftPreTrainedModel
from .errors import UserInputError
from .layers import DraftContextCache, DraftDecoderLayer, DraftRMSNorm, attend
from .modeling_dspark import DSparkDecoderLayer, DSparkDraftModel, DSparkSequentialHead

MLA_EXPORT_REFUSAL = (
    "this drafter's layers are multi-head latent attention (Kimi K3's k3_dspark: q_lora_rank, kv_lora_rank), which "
    "hf_dspark's own layout, DeepSpec's Qwen3DSparkModel and speculators' layer configs cannot describe; load it from "
    "its k3_dspark folder with hf_dspark.AutoDrafter.from_pretrained(path) instead of converting it")


@strict
class DSparkMLADraftConfig(DSparkDraftConfig):
    r"""`DSparkDraftConfig` with MLA layers (`head_dim` is `qk_rope_head_dim`, the rotary width).

    Args:
        q_lora_rank (`int`, *optional*): Rank of the low-rank query projection (None: one `q_proj`).
        kv_lora_rank (`int`): Rank of the shared key/value latent.
        qk_nope_head_dim (`int`), qk_rope_head_dim (`int`), v_head_dim (`int`): Per-head widths of the keys'
            position-free and rotary parts and of the values.
    """

    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def deepseek_v3_config(self) -> DeepseekV3Config:
        """transformers' DeepSeek-V3 config of the layers' attention (interleaved rotary, no biases)."""
        return DeepseekV3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, rope_parameters=dict(self.rope_parameters),
            rope_interleave=True, attention_bias=False, attention_dropout=0.0)


class DSparkMLAAttention(DeepseekV3Attention):
    """transformers' DeepSeek-V3 MLA with DSpark's inputs: queries from the block, keys/values from the context rows
    (cached) followed by the block's own (module docstring)."""

    def __init__(self, config: DSparkMLADraftConfig, layer_idx: int):
        super().__init__(config.deepseek_v3_config(), layer_idx)
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = config.rms_norm_eps

    def _keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Per-head keys (position-free part, then the rotated shared part) and values of rows `x`."""
        batch, length, _ = x.shape
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(batch, 1, length, self.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, length, self.qk_rope_head_dim)
        k_rot = apply_rotary_pos_emb_interleave(k_rot, k_rot, *rope)[1]
        return self.expand_kv(latent, k_rot)

    def forward(self, hidden_states, context, block_rope, context_rope, attention_mask,
                cache: DraftContextCache | None) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        queries = self.q_proj(hidden_states) if self.q_lora_rank is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        queries = queries.view(batch, length, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(queries, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rot = apply_rotary_pos_emb_interleave(q_rot, q_rot, *block_rope)[0]
        queries = torch.cat([q_pass, q_rot], dim=-1)
        block_keys, block_values = self._keys_values(hidden_states, block_rope)
        if context is not None:
            context_keys, context_values = self._keys_values(context, context_rope)
        else:
            context_keys = block_keys[..., :0, :]
            context_values = block_values[..., :0, :]
        if cache is not None:
            context_keys, context_values = cache.update(self.layer_idx, context_keys, context_values)
        keys = torch.cat([context_keys, block_keys], dim=-2)
        values = torch.cat([context_values, block_values], dim=-2)
        out = attend(queries, keys, values, attention_mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DSparkMLADecoderLayer(DSparkDecoderLayer):
    """`DSparkDecoderLayer` (pre-norm, SwiGLU MLP) around `DSparkMLAAttention`."""

    def __init__(self, config: DSparkMLADraftConfig, layer_idx: int):
        DraftDecoderLayer.__init__(self, config, DSparkMLAAttention(config, layer_idx))


class _MLARotary(nn.Module):
    """transformers' `DeepseekV3RotaryEmbedding` with the drafter's call: (positions, dtype) -> (cos, sin)."""

    def __init__(self, config: DSparkMLADraftConfig):
        super().__init__()
        self.rotary = DeepseekV3RotaryEmbedding(config.deepseek_v3_config())

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return self.rotary(torch.empty(0, dtype=dtype, device=position_ids.device), position_ids)


class DSparkMLADraftModel(DSparkDraftModel):
    """`DSparkDraftModel` with `DSparkMLADecoderLayer`s (built here: the parent's constructor would first allocate
    grouped-query layers of the same width only to discard them)."""

    config: DSparkMLADraftConfig
    config_class = DSparkMLADraftConfig
    _no_split_modules: ClassVar[list[str]] = ["DSparkMLADecoderLayer"]
    export_refusal = MLA_EXPORT_REFUSAL

    def __init__(self, config: DSparkMLADraftConfig):
        DraftPreTrainedModel.__init__(self, config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DraftRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkMLADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DraftRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = _MLARotary(config)
        self.sequential_head = DSparkSequentialHead(config) if config.markov_head is not None else None
        extra = config.markov_rank if self.sequential_head is not None else 0
        self.confidence_proj = nn.Linear(config.hidden_size + extra, 1) if config.confidence_head else None
        self.post_init()

    def save_pretrained(self, save_directory, *args, **kwargs):
        raise UserInputError(f"cannot save to {save_directory}: {MLA_EXPORT_REFUSAL}.")


__all__ = ["DSparkMLAAttention", "DSparkMLADecoderLayer", "DSparkMLADraftConfig", "DSparkMLADraftModel"]
