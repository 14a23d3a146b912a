"""DSpark drafter: a parallel block backbone on fused target features, a sequential head against suffix decay,
and a confidence head. Without the two heads it is DFlash. One file serves every target family: Gemma 4's layers
(DeepSpec's `Gemma4DSparkModel`) are `config.layer_style == "gemma4"` of the same classes (`layers.DraftDecoderLayer`,
`layers.DraftAttention`), its per-layer head size is the config's `head_dim` (Gemma 4's global_head_dim), and its
scaled embedding and soft-capped logits are the target's embedding module and `config.final_logit_softcapping`."""


from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .configuration_dspark import DSparkDraftConfig
from .drafter_base import DraftPreTrainedModel
from .layers import (DraftAttention, DraftContextCache, DraftDecoderLayer, DraftRMSNorm, DraftRotaryEmbedding,
                     apply_rotary, attend)


@dataclass
class DSparkDraftOutput(ModelOutput):
    r"""
    logits (`torch.FloatTensor` of shape `(batch, block_len, vocab_size)`):
        Slot logits, corrected by the sequential head when `previous_token_ids` was given (else equal to
        `base_logits`).
    base_logits (`torch.FloatTensor` of shape `(batch, block_len, vocab_size)`):
        Logits of the parallel backbone alone (U_k in the paper).
    confidence_logits (`torch.FloatTensor` of shape `(batch, block_len)`, *optional*):
        Logit of the probability that each slot is accepted given that its prefix was.
    last_hidden_state (`torch.FloatTensor` of shape `(batch, block_len, hidden_size)`):
        Final normed hidden state h_k of every slot.
    cache ([`DraftContextCache`], *optional*):
        Projected context keys and values.
    """

    logits: torch.FloatTensor | None = None
    base_logits: torch.FloatTensor | None = None
    confidence_logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    cache: DraftContextCache | None = None


class DSparkAttention(DraftAttention):
    """Queries come from the block; keys and values are the projected context followed by the block itself.
    Inside the block attention is bidirectional unless the layer is block-causal (`config.layer_attention`)."""

    def __init__(self, config: DSparkDraftConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.hidden_size)

    def _keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        keys, values = self.keys_values(x)
        return apply_rotary(keys, *rope), values

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: DraftContextCache | None,
    ) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        query = self.q_norm(self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim))
        query = apply_rotary(query.transpose(1, 2), *block_rope)
        block_keys, block_values = self._keys_values(hidden_states, block_rope)

        if context is not None:
            context_keys, context_values = self._keys_values(context, context_rope)
        else:
            context_keys = block_keys.new_zeros(batch, self.num_kv_heads, 0, self.head_dim)
            context_values = context_keys
        if cache is not None:
            context_keys, context_values = cache.update(self.layer_idx, context_keys, context_values)

        keys = torch.cat([context_keys, block_keys], dim=-2)
        values = torch.cat([context_values, block_values], dim=-2)
        out = attend(query, keys, values, attention_mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DSparkDecoderLayer(DraftDecoderLayer):
    """A pre-norm (Llama / Qwen3) or Gemma 4 layer (`config.layer_style`, see `DraftDecoderLayer`) around
    `DSparkAttention`: DeepSpec's `Qwen3DSparkModel` and `Gemma4DSparkModel` layers, one class."""

    def __init__(self, config: DSparkDraftConfig, layer_idx: int):
        super().__init__(config, DSparkAttention(config, layer_idx))

    def forward(self, hidden_states, context, block_rope, context_rope, attention_mask, cache) -> torch.Tensor:
        attention_output = self.self_attn(
            self.input_layernorm(hidden_states), context, block_rope, context_rope, attention_mask, cache
        )
        return self.add_attention_and_mlp(hidden_states, attention_output)


class DSparkSequentialHead(nn.Module):
    """Adds a bias from the previously sampled token x_{k-1} to slot k's logits (x_{-1} is the anchor).

    * ``markov``: bias = W2(W1[x_{k-1}])
    * ``gated``:  bias = W2(sigmoid(G [h_k ; W1[x_{k-1}]]) * W1[x_{k-1}])
    * ``rnn``:    (g, c, o) = split(R [s_{k-1} ; W1[x_{k-1}] ; h_k]),
                  s_k = g * s_{k-1} + (1 - g) * tanh(c),  bias = W2(tanh(o)),  s_{-1} = 0
    """

    def __init__(self, config: DSparkDraftConfig):
        super().__init__()
        self.kind = config.markov_head
        self.rank = config.markov_rank
        # Rows: draft-vocabulary tokens plus one shared row for tokens outside it, or every target token.
        compressed = config.draft_vocab_size and not config.markov_w1_full_vocab
        rows = config.draft_vocab_size + 1 if compressed else config.vocab_size
        self.token_embedding = nn.Embedding(rows, self.rank)
        self.output = nn.Linear(self.rank, config.draft_vocab_size or config.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate = nn.Linear(config.hidden_size + self.rank, self.rank)
        elif self.kind == "rnn":
            self.cell = nn.Linear(2 * self.rank + config.hidden_size, 3 * self.rank)

    def initial_state(self, batch_size: int, reference: torch.Tensor) -> torch.Tensor | None:
        if self.kind != "rnn":
            return None
        return reference.new_zeros(batch_size, self.rank)

    def step(
        self, hidden: torch.Tensor, previous_tokens: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One slot. ``hidden`` (N, d), ``previous_tokens`` (N,) rows of W1 (see `DSparkDraftModel.head_rows`)
        -> (z (N, r) with bias = W2(z), W1[x_{k-1}], state)."""
        previous = self.token_embedding(previous_tokens).to(hidden.dtype)
        if self.kind == "markov":
            mixed = previous
        elif self.kind == "gated":
            mixed = torch.sigmoid(self.gate(torch.cat([hidden, previous], dim=-1))) * previous
        else:
            gate, candidate, out = self.cell(torch.cat([state, previous, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            mixed = torch.tanh(out)
        return mixed, previous, state

    def forward(self, hidden: torch.Tensor, previous_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass over whole blocks: ``hidden`` (N, G, d), ``previous_tokens`` (N, G) ->
        (z (N, G, r), W1[x_{k-1}] (N, G, r)); the logit bias is ``self.output(z)``."""
        state = self.initial_state(hidden.shape[0], hidden)
        mixed, embeddings = [], []
        for k in range(hidden.shape[1]):
            z, previous, state = self.step(hidden[:, k], previous_tokens[:, k], state)
            mixed.append(z)
            embeddings.append(previous)
        return torch.stack(mixed, dim=1), torch.stack(embeddings, dim=1)


class DSparkDraftModel(DraftPreTrainedModel):
    r"""
    The DSpark drafter. Input block `[anchor, MASK x (block_size-1)]`; every slot produces logits and slot k
    predicts the token at anchor + k + 1 (or, with `config.sample_from_anchor` False, slot k >= 1 predicts anchor + k
    and slot 0 is unused). The context is the concatenation of the target's hidden states at
    `config.target_layer_ids`, fused by `fc` + RMSNorm and injected as extra keys/values in every layer.

    The embedding and LM head are the target's (frozen, not stored here): call [`~DraftPreTrainedModel.attach_target`]
    or let `target.generate(..., assistant_model=drafter)` do it.
    """

    config: DSparkDraftConfig
    _no_split_modules = ["DSparkDecoderLayer"]
    decoder_layer_class = DSparkDecoderLayer
    """The layer the backbone stacks; DFlash 2 (`modeling_dflash2`) wraps it in its convolutions."""

    def __init__(self, config: DSparkDraftConfig):
        super().__init__(config)
        num_fused = len(config.target_layer_ids)
        self.fc = nn.Linear(num_fused * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DraftRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = DraftRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DraftRotaryEmbedding(config)
        self.sequential_head = DSparkSequentialHead(config) if config.markov_head is not None else None
        if config.confidence_head:
            extra = config.markov_rank if self.sequential_head is not None else 0
            self.confidence_proj = nn.Linear(config.hidden_size + extra, 1)
        else:
            self.confidence_proj = None
        self.post_init()

    def fuse_context(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, length, n_layers * hidden) concatenated target states -> (batch, length, hidden)."""
        return self.hidden_norm(self.fc(target_hidden_states.to(self.fc.weight.dtype)))

    def cache_context(self, target_hidden_states: torch.Tensor, context_position_ids: torch.LongTensor,
                      cache: DraftContextCache) -> DraftContextCache:
        """Append new context rows' keys and values to `cache`, exactly what `forward` appends for them, without
        drafting a block: a context row's keys and values depend only on its target features and position, never on
        the block or on another layer's output. A server moves queued context into the cache this way when rows
        join, where a block's pass (its layers and the LM head over the vocabulary) would be thrown away."""
        context = self.fuse_context(target_hidden_states)
        rope = self.rotary_emb(context_position_ids, self.fc.weight.dtype)  # the dtype `forward` gives it
        for layer in self.layers:
            attention = layer.self_attn
            keys, values = attention._keys_values(context, rope)
            cache.update(attention.layer_idx, keys, values)
        return cache

    def confidence_logit(self, hidden: torch.Tensor, previous_embedding: torch.Tensor | None) -> torch.Tensor:
        """Logit of P(slot accepted | prefix accepted) from h_k and W1[x_{k-1}]; shape hidden.shape[:-1]."""
        features = hidden if previous_embedding is None else torch.cat([hidden, previous_embedding], dim=-1)
        return self.confidence_proj(features).squeeze(-1)

    def slot_logits(
        self, hidden: torch.Tensor, base_logits: torch.Tensor, previous_tokens: torch.LongTensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One drafting slot's logits after the backbone pass, for N rows: `hidden` (N, d) and `base_logits` (N, V)
        of the slot, `previous_tokens` (N,) target ids x_{k-1} (the anchor for slot 0) -> (logits corrected by the
        sequential head, W1[x_{k-1}] (what the confidence head also reads; None without a head), the head's next
        state). Start `state` at `sequential_head.initial_state(N, hidden)`."""
        if self.sequential_head is None:
            return base_logits, None, state
        mixed, previous_embedding, state = self.sequential_head.step(hidden, self.head_rows(previous_tokens), state)
        return base_logits + self.sequential_head.output(mixed).to(base_logits.dtype), previous_embedding, state

    def slot_confidences(self, hidden: torch.Tensor, previous_embeddings: torch.Tensor | None,
                         first_slot: int = 0) -> torch.Tensor | None:
        """Float32 confidences c_k of slots `first_slot`.. (N, S) from their hidden states (N, S, d) and W1[x_{k-1}]
        (N, S, r), scaled by `config.confidence_temperatures`; None without a confidence head. All slots of a block
        in one call: c_k depends on x_{k-1}, which is known once slot k-1 is drafted, never on x_k."""
        if self.confidence_proj is None:
            return None
        logit = self.confidence_logit(hidden, previous_embeddings).float()
        if self.config.confidence_temperatures is not None:
            logit = logit / self._confidence_temperatures(logit.device)[first_slot : first_slot + hidden.shape[-2]]
        return torch.sigmoid(logit)

    def _confidence_temperatures(self, device) -> torch.Tensor:
        """`config.confidence_temperatures` as a float32 tensor on `device`, made once (not a copy per round)."""
        key = (tuple(self.config.confidence_temperatures), device)
        if getattr(self, "_temperatures_key", None) != key:
            self._temperatures = torch.tensor(key[0], dtype=torch.float32, device=device)
            self._temperatures_key = key
        return self._temperatures

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DraftContextCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        previous_token_ids: torch.LongTensor | None = None,
        logits_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cached_position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> DSparkDraftOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, block_len)`):
            Block tokens, `[anchor, mask, ..., mask]` per block (several blocks may be packed along the length).
        target_hidden_states (`torch.Tensor` of shape `(batch, context_len, len(target_layer_ids) * hidden_size)`, *optional*):
            New context rows: the target's hidden states at `target_layer_ids`, concatenated on the last axis.
        position_ids (`torch.LongTensor` of shape `(batch, block_len)`, *optional*):
            Positions of the block slots (default: right after all context rows).
        context_position_ids (`torch.LongTensor` of shape `(batch, context_len)`, *optional*):
            Positions of the new context rows (default: right after the cached rows).
        attention_mask (`torch.BoolTensor` of shape `(batch, 1, block_len, cached + context_len + block_len)`, *optional*):
            True where a slot may attend. `None` lets every slot see all context and its whole block (inference).
            Block-causal and sliding-window layers (`config.layer_attention`) narrow it by position, per layer.
        cache ([`DraftContextCache`], *optional*):
            Context keys/values from earlier calls; new context rows are appended to it.
        previous_token_ids (`torch.LongTensor` of shape `(batch, block_len)`, *optional*):
            x_{k-1} for every slot (the anchor for slot 0). When given, the sequential head corrects the logits and
            the confidence head is evaluated (teacher forcing).
        logits_mask (`torch.BoolTensor` of shape `(batch, block_len)`, *optional*):
            Compute logits only for these slots (training skips padded and unsupervised slots); logits then have
            shape `(num_selected, vocab)` in row-major order.
        use_cache (`bool`, *optional*):
            Create a cache when none is passed.
        cached_position_ids (`torch.LongTensor` of shape `(batch, cached)`, *optional*):
            Positions of the rows in `cache` (default 0, 1, ...); read by block-causal and sliding-window layers.
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        hidden_states = inputs_embeds.to(self.fc.weight.dtype)
        batch, block_len, _ = hidden_states.shape
        if cache is None and use_cache:
            cache = DraftContextCache()
        past = cache.get_seq_length() if cache is not None else 0

        context = self.fuse_context(target_hidden_states) if target_hidden_states is not None else None
        context_len = context.shape[1] if context is not None else 0
        device = hidden_states.device
        if context_position_ids is None:
            context_position_ids = torch.arange(past, past + context_len, device=device).expand(batch, -1)
        if position_ids is None:
            start = past + context_len
            position_ids = torch.arange(start, start + block_len, device=device).expand(batch, -1)
        block_rope = self.rotary_emb(position_ids, hidden_states.dtype)
        context_rope = self.rotary_emb(context_position_ids, hidden_states.dtype) if context is not None else None

        masks = self._attention_masks(attention_mask, position_ids, context_position_ids, cached_position_ids, past)
        for layer, mask in zip(self.layers, masks):
            hidden_states = layer(hidden_states, context, block_rope, context_rope, mask, cache)
        hidden_states = self.norm(hidden_states)
        base_logits, logits, confidence_logits = self._head_outputs(hidden_states, previous_token_ids, logits_mask)
        return DSparkDraftOutput(
            logits=logits,
            base_logits=base_logits,
            confidence_logits=confidence_logits,
            last_hidden_state=hidden_states,
            cache=cache,
        )

    def _head_outputs(self, hidden_states: torch.Tensor, previous_token_ids: torch.LongTensor | None,
                      logits_mask: torch.Tensor | None):
        """(base logits, logits, confidence logits) of the final normed states, as `forward` returns them: the
        sequential head and the confidence head run only under teacher forcing (`previous_token_ids` given)."""
        selected = hidden_states if logits_mask is None else hidden_states[logits_mask]
        base_logits = self.compute_logits(selected)
        logits, confidence_logits = base_logits, None
        if previous_token_ids is not None:
            previous_embedding = None
            if self.sequential_head is not None:
                mixed, previous_embedding = self._teacher_forced_head(hidden_states, previous_token_ids)
                mixed = mixed if logits_mask is None else mixed[logits_mask]
                logits = base_logits + self.sequential_head.output(mixed).to(base_logits.dtype)
            if self.confidence_proj is not None:
                confidence_logits = self.confidence_logit(hidden_states, previous_embedding)
        return base_logits, logits, confidence_logits

    def _attention_masks(self, attention_mask, position_ids, context_position_ids, cached_position_ids, past: int):
        """Each layer's mask for a forward pass (see `layer_masks`); a plain drafter's is `attention_mask` itself."""
        if not self.config.restricts_attention:
            return [attention_mask] * len(self.layers)
        if cached_position_ids is None:  # a cache filled from position 0 without gaps, as at batch 1
            cached_position_ids = torch.arange(past, device=position_ids.device).expand(position_ids.shape[0], -1)
        key_positions = torch.cat([cached_position_ids, context_position_ids, position_ids], dim=1)
        return self.layer_masks(attention_mask, position_ids, key_positions)

    def layer_masks(self, attention_mask: torch.Tensor | None, query_positions: torch.LongTensor,
                    key_positions: torch.LongTensor) -> list[torch.Tensor | None]:
        """Each layer's attention mask: `attention_mask` (None = everything visible), narrowed in a block-causal
        layer to keys at positions p <= q and in a sliding layer to q - p < window (and, unless causal, p - q <
        window), q the query's position: z-lab DFlash's rule. Context keys precede every slot of their block, so
        only block keys (and, in a window, distant context) drop out; a slot always sees itself."""
        settings = self.config.layer_attention
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
        masks = {}
        for causal, window in set(settings):
            visible = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
            if window is not None:
                visible = visible & (distance < window)
                if not causal:
                    visible = visible & (distance > -window)
            masks[causal, window] = visible if attention_mask is None else visible & attention_mask
        return [masks[setting] for setting in settings]

    def _teacher_forced_head(self, hidden_states, previous_token_ids):
        """Run the sequential head over packed blocks of `block_size` slots (the RNN state restarts per block, at
        its first drafting slot, as in `draft_block`; an unused slot 0 gets zeros)."""
        batch, length, width = hidden_states.shape
        block = self.config.block_size if length % self.config.block_size == 0 else length
        first = self.config.first_draft_slot if block == self.config.block_size else 0
        hidden = hidden_states.reshape(-1, block, width)
        rows = self.head_rows(previous_token_ids).reshape(-1, block)
        mixed, previous = self.sequential_head(hidden[:, first:], rows[:, first:])
        if first:
            mixed = torch.cat([mixed.new_zeros(mixed.shape[0], first, mixed.shape[-1]), mixed], dim=1)
            previous = torch.cat([previous.new_zeros(previous.shape[0], first, previous.shape[-1]), previous], dim=1)
        return mixed.reshape(batch, length, -1), previous.reshape(batch, length, -1)

    def head_rows(self, token_ids: torch.LongTensor) -> torch.LongTensor:
        """Rows of the sequential head's W1 for target token ids: their draft-vocabulary index, or the shared
        out-of-vocabulary row, when the drafter has a draft vocabulary (and no `markov_w1_full_vocab`); the ids
        themselves otherwise."""
        if self.draft_to_target is None or self.config.markov_w1_full_vocab:
            return token_ids
        key = (self.draft_to_target.data_ptr(), self.draft_to_target._version, token_ids.device)
        if getattr(self, "_head_rows_key", None) != key:
            size = self.config.draft_vocab_size
            lookup = torch.full((self.config.vocab_size,), size, dtype=torch.long, device=token_ids.device)
            lookup[self.draft_to_target.to(token_ids.device)] = torch.arange(size, device=token_ids.device)
            self._head_rows_lookup, self._head_rows_key = lookup, key
        return self._head_rows_lookup[token_ids]


__all__ = ["DSparkDraftModel", "DSparkDraftOutput"]
