"""Eagle3 drafter: one decoder layer reading `[embed(x_t) ; g_t]`, where g_t is the fused target feature for
context positions and the drafter's own output state for drafted positions. One file for every target family:
Gemma 4's layers (DeepSpec's `Gemma4Eagle3Model`) are `config.layer_style == "gemma4"` of the same classes."""


from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .configuration_eagle3 import Eagle3DraftConfig
from .drafter_base import DraftPreTrainedModel
from .layers import (DraftAttention, DraftContextCache, DraftDecoderLayer, DraftRMSNorm, DraftRotaryEmbedding,
                     apply_rotary, attend)


@dataclass
class Eagle3DraftOutput(ModelOutput):
    r"""
    logits (`torch.FloatTensor` of shape `(batch, length, vocab_size)`):
        Next-next-token logits: row t predicts the token at t + 2 (row t reads g_t and the token at t + 1).
    hidden_states (`torch.FloatTensor` of shape `(batch, length, hidden_size)`):
        Output states before the final norm; fed back as g for the next drafted position.
    cache ([`DraftContextCache`], *optional*):
        Keys and values of all processed rows.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None
    cache: DraftContextCache | None = None


class Eagle3Attention(DraftAttention):
    """Causal self-attention over the rows (context, then drafted positions); the first layer's rows are 2d wide."""

    def forward(self, x, rope, attention_mask, cache) -> torch.Tensor:
        batch, length, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(batch, length, -1, self.head_dim))
        query = apply_rotary(query.transpose(1, 2), *rope)
        keys, values = self.keys_values(x)
        keys = apply_rotary(keys, *rope)
        if cache is not None:
            keys, values = cache.update(self.layer_idx, keys, values)
        out = attend(query, keys, values, attention_mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Eagle3DecoderLayer(DraftDecoderLayer):
    """The first layer attends over `[input_layernorm(embed) ; hidden_norm(g)]` (2d wide) with g as residual;
    any further layers are plain pre-norm layers. Pre-norm (Llama / Qwen3) or Gemma 4 norms around the attention
    (`config.layer_style`, see `DraftDecoderLayer`): DeepSpec's `Qwen3Eagle3Model` and `Gemma4Eagle3Model` layers."""

    def __init__(self, config: Eagle3DraftConfig, layer_idx: int):
        width = config.hidden_size
        super().__init__(config, Eagle3Attention(config, layer_idx, 2 * width if layer_idx == 0 else width))
        self.reads_embeddings = layer_idx == 0
        if self.reads_embeddings:
            self.hidden_norm = DraftRMSNorm(width, config.rms_norm_eps)

    def forward(self, hidden_states, input_embeds, rope, attention_mask, cache) -> torch.Tensor:
        if self.reads_embeddings:
            x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)], dim=-1)
        else:
            x = self.input_layernorm(hidden_states)
        return self.add_attention_and_mlp(hidden_states, self.self_attn(x, rope, attention_mask, cache))


def causal_mask(query_len: int, past_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (query_len, past_len + query_len) mask letting row i see keys up to past_len + i."""
    if query_len == 1:
        return None
    keys = torch.arange(past_len + query_len, device=device)
    rows = torch.arange(query_len, device=device)[:, None] + past_len
    return keys[None, :] <= rows


class Eagle3DraftModel(DraftPreTrainedModel):
    r"""
    The Eagle3 drafter. Row t reads the fused target feature at t (or, while drafting, the drafter's own
    previous output state) together with the embedding of the token at t + 1, and predicts the token at t + 2.
    Embedding and LM head are the target's (see [`~DraftPreTrainedModel.attach_target`]).
    """

    config: Eagle3DraftConfig
    _no_split_modules = ["Eagle3DecoderLayer"]

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(Eagle3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DraftRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DraftRotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DraftContextCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> Eagle3DraftOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`):
            For row t, the token at t + 1.
        target_hidden_states (`torch.Tensor` of shape `(batch, length, len(target_layer_ids) * hidden_size)`, *optional*):
            Concatenated target features at t (context rows). Exactly one of this and `hidden_states` is given.
        hidden_states (`torch.Tensor` of shape `(batch, length, hidden_size)`, *optional*):
            The drafter's own output states from the previous step (drafted rows).
        position_ids (`torch.LongTensor` of shape `(batch, length)`, *optional*):
            Row positions t (default: right after the cached rows).
        attention_mask (`torch.BoolTensor` of shape `(batch, 1, length, cached + length)`, *optional*):
            True where a row may attend; default causal.
        cache ([`DraftContextCache`], *optional*):
            Keys/values of earlier rows; new rows are appended.
        logits_mask (`torch.BoolTensor` of shape `(batch, length)`, *optional*):
            Compute logits only for these rows (training); logits then have shape `(num_selected, vocab)`.
        use_cache (`bool`, *optional*):
            Create a cache when none is passed.
        """
        if (target_hidden_states is None) == (hidden_states is None):
            raise ValueError("pass exactly one of `target_hidden_states` (context rows) and `hidden_states` (drafted rows)")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        dtype = self.fc.weight.dtype
        inputs_embeds = inputs_embeds.to(dtype)
        if target_hidden_states is not None:
            hidden_states = self.fc(target_hidden_states.to(dtype))
        hidden_states = hidden_states.to(dtype)
        batch, length, _ = hidden_states.shape
        if cache is None and use_cache:
            cache = DraftContextCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=hidden_states.device).expand(batch, -1)
        if attention_mask is None:
            attention_mask = causal_mask(length, past, hidden_states.device)
        rope = self.rotary_emb(position_ids, dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, inputs_embeds, rope, attention_mask, cache)
        normed = self.norm(hidden_states)
        logits = self.compute_logits(normed if logits_mask is None else normed[logits_mask])
        return Eagle3DraftOutput(logits=logits, hidden_states=hidden_states, cache=cache)


__all__ = ["Eagle3DraftModel", "Eagle3DraftOutput"]
