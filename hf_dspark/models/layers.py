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
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
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
    family's attention adds its `forward` (what the queries and keys are)."""

    def __init__(self, config: PreTrainedConfig, layer_idx: int, input_size: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = attention_scaling(self.head_dim)
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DraftRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = DraftRMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else nn.Identity()


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


__all__ = ["DraftAttention", "DraftContextCache", "DraftMLP", "DraftRMSNorm", "DraftRotaryEmbedding", "apply_rotary", "attend",
           "attention_scaling"]
