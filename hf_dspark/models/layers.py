"""The layers every drafter is built from: RMSNorm, the gated MLP, the target's rotary embedding, grouped-KV
attention, and the cache of context keys and values a drafter has projected."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class DraftRMSNorm(nn.Module):
    """RMSNorm with a learned scale, or without one (`with_scale=False`: Gemma 4's norm of the values)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if with_scale else None
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight is None:
            return hidden_states.to(input_dtype)
        return self.weight * hidden_states.to(input_dtype)


class DraftMLP(nn.Module):
    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftRotaryEmbedding(nn.Module):
    """Rotary embedding with the target's rope type and parameters (default, llama3, yarn, ...)."""

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        rope_type = self.config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            dim = self.config.head_dim
            base = self.config.rope_parameters["rope_theta"]
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        return ROPE_INIT_FUNCTIONS[rope_type](self.config)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, length, head_dim) by per-position (batch, length, head_dim) angles."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DraftContextCache:
    """Per-layer keys and values of the context a drafter has already projected.

    Only context rows live here (target features for DSpark/DFlash, target features plus own chain steps for
    Eagle3); speculative rows are cropped away after each round so rejected tokens leave no trace.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def get_seq_length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (batch, kv_heads, new, head_dim) rows for one layer and return all rows of that layer."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is not None:
            keys = torch.cat([self.keys[layer_idx], keys], dim=-2)
            values = torch.cat([self.values[layer_idx], values], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` rows of every layer."""
        if length < 0:
            raise ValueError(f"cannot crop a drafter cache to a negative length ({length})")
        self.keys = [None if k is None else k[..., :length, :] for k in self.keys]
        self.values = [None if v is None else v[..., :length, :] for v in self.values]


class DraftAttention(nn.Module):
    """The projections of every drafter's attention: grouped-KV q/k/v from `input_size` features, o back to the
    hidden size (with biases when `config.attention_bias`), and per-head q/k RMSNorms when `config.qk_norm`. Each
    family's attention adds its `forward` (what the queries and keys are).

    Gemma 4 layers (`config.layer_style == "gemma4"`, DeepSpec's `Gemma4DSparkAttention` / `Gemma4Eagle3Attention`)
    differ in three ways: the values get an RMSNorm without a scale, the softmax scale is 1 (the per-head q/k norms
    set the logits' size), and with `config.attention_k_eq_v` there is no v_proj: the values are the keys'
    projection before the key norm."""

    def __init__(self, config: PreTrainedConfig, layer_idx: int, input_size: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        gemma4 = getattr(config, "layer_style", "llama") == "gemma4"
        self.scaling = 1.0 if gemma4 else attention_scaling(self.head_dim)
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = None if getattr(config, "attention_k_eq_v", False) else \
            nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DraftRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = DraftRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.v_norm = DraftRMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False) if gemma4 else nn.Identity()

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, before the rotary embedding) and values of rows `x`, each (batch, kv_heads, rows, head_dim)."""
        batch, length, _ = x.shape
        keys = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        values = keys if self.v_proj is None else self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        return self.k_norm(keys).transpose(1, 2), self.v_norm(values).transpose(1, 2)


class DraftDecoderLayer(nn.Module):
    """The norms and MLP around a drafter layer's attention (each family's layer adds its attention and `forward`).

    `config.layer_style` "llama" (Llama, Qwen3): pre-norm, `h + attn`, then `h + mlp(post_attention_layernorm(h))`.
    "gemma4" (Gemma 4's decoder layer, as DeepSpec's Gemma 4 drafters build it): sandwich norms,
    `h + post_attention_layernorm(attn)`, then `h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`,
    the result times the layer's `layer_scalar` (a stored buffer of one value)."""

    def __init__(self, config: PreTrainedConfig, attention: DraftAttention):
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention  # before the MLP: seeded initialisations draw the attention's weights first
        self.mlp = DraftMLP(config)
        self.input_layernorm = DraftRMSNorm(width, eps)
        self.post_attention_layernorm = DraftRMSNorm(width, eps)
        self.sandwich = getattr(config, "layer_style", "llama") == "gemma4"
        if self.sandwich:
            self.pre_feedforward_layernorm = DraftRMSNorm(width, eps)
            self.post_feedforward_layernorm = DraftRMSNorm(width, eps)
            self.layer_scalar = nn.Buffer(torch.ones(1))

    def add_attention_and_mlp(self, residual: torch.Tensor, attention_output: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input (`residual`) and its attention's output."""
        if not self.sandwich:
            hidden_states = residual + attention_output
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = residual + self.post_attention_layernorm(attention_output)
        mlp_output = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return (hidden_states + self.post_feedforward_layernorm(mlp_output)) * self.layer_scalar


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads; ``attention_mask`` is boolean (True = may attend)."""
    return nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=attention_mask, scale=scaling, enable_gqa=keys.shape[1] != query.shape[1]
    )


def attention_scaling(head_dim: int) -> float:
    """The softmax scale of dot-product attention over heads of width `head_dim`: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


__all__ = ["DraftAttention", "DraftContextCache", "DraftDecoderLayer", "DraftMLP", "DraftRMSNorm", "DraftRotaryEmbedding",
           "apply_rotary", "attend", "attention_scaling"]
