"""DFlash 2 drafter (z-lab's `DFlash2DraftModel`, read here by `formats/zlab_dflash`): DFlash's backbone (the
`DSparkDraftModel` without its heads) with two additions.

* Each layer wraps its attention and its MLP in a grouped dynamic causal convolution over the slots of the block:
  with x the sublayer's normed input and K taps, the input becomes `sum_o (b0[o] + a0[t, o, g]) * x[t - o]` and the
  output y becomes `sum_o (b1[o] + a1[t, o, g]) * y[t - o]`, where b are learned per-channel kernels and a the
  per-group scalars a linear map gives from x at slot t. Slots before the block's first count as zeros: a slot never
  sees the context through the convolution, nor a later slot or another packed block.
* A candidate selector after the backbone: slot k's candidates are the backbone's top `selector_top_k` tokens, each
  scored `logit(c) + <P[x_{k-1}] * W h_k, S[c]>` with x_{k-1} the token drafted at the slot before (the anchor for the
  first) and P, S low-rank predecessor and successor codebooks. The draft is drawn from the softmax of these scores
  (argmax when greedy), so the slot's draft distribution q is that softmax over the candidates, zero elsewhere:
  `slot_logits` returns the scores at the candidates and -inf elsewhere, which `draft_block` processes and samples
  as every drafter's logits and hands to verification as q. Exact at every temperature, whatever the selector learnt.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_dflash2 import DFlash2DraftConfig
from .modeling_dspark import DSparkDecoderLayer, DSparkDraftModel


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer (attention or MLP). `base_kernel[0]` / `[1]` are the per-channel
    kernels before / after it; `kernel_projection` gives, from the sublayer's normed input, each slot's per-group taps
    of both (2 x K x groups numbers), so the kernel after the sublayer is also decided by what went in."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def dynamic_taps(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, length, hidden) normed sublayer input -> (batch, length, 2, K, groups) taps."""
        return self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))

    def mix(self, x: torch.Tensor, stage: int, taps: torch.Tensor, block_size: int) -> torch.Tensor:
        """Convolve `x` (batch, length, hidden) causally within each block of `block_size` slots (the whole length
        when it is no multiple of it), with `base_kernel[stage]` plus the dynamic taps of `stage` (0 before the
        sublayer, 1 after it)."""
        batch, length, hidden = x.shape
        block = block_size if length % block_size == 0 else length
        # (batch, blocks, slot, group, channel): taps broadcast over a group's channels, kernels over slots.
        values = x.reshape(batch, length // block, block, self.groups, self.group_size)
        dynamic = taps[:, :, stage].reshape(batch, length // block, block, self.kernel_size, self.groups, 1)
        kernel = self.base_kernel[stage].to(x.dtype).view(self.kernel_size, self.groups, self.group_size)
        out = (kernel[0] + dynamic[:, :, :, 0]) * values
        for offset in range(1, min(self.kernel_size, block)):
            earlier = F.pad(values[:, :, :-offset], (0, 0, 0, 0, offset, 0))  # slot t reads slot t - offset, or 0
            out = out + (kernel[offset] + dynamic[:, :, :, offset]) * earlier
        return out.reshape(batch, length, hidden)


class DFlash2DecoderLayer(DSparkDecoderLayer):
    """DFlash's pre-norm layer with the attention's and the MLP's convolutions: z-lab's `Qwen3DFlashDecoderLayer`
    with `attention_conv` / `mlp_conv`. The context keys and values are the fused target features as in DFlash (the
    convolution only mixes block slots), so `DSparkDraftModel.cache_context` holds for this layer too."""

    def __init__(self, config: DFlash2DraftConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.block_size = config.block_size
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,
                                                       config.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def forward(self, hidden_states, context, block_rope, context_rope, attention_mask, cache) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        taps = self.attention_conv.dynamic_taps(normed)
        attention_input = self.attention_conv.mix(normed, 0, taps, self.block_size)
        attention_output = self.self_attn(attention_input, context, block_rope, context_rope, attention_mask, cache)
        hidden_states = hidden_states + self.attention_conv.mix(attention_output, 1, taps, self.block_size)
        normed = self.post_attention_layernorm(hidden_states)
        taps = self.mlp_conv.dynamic_taps(normed)
        mlp_output = self.mlp(self.mlp_conv.mix(normed, 0, taps, self.block_size))
        return hidden_states + self.mlp_conv.mix(mlp_output, 1, taps, self.block_size)


class CandidateSelector(nn.Module):
    """The low-rank pairwise term of the selector: a predecessor row P[x] and a successor row S[c] per target token
    (the codebooks, `selector_rank` wide) and a projection W of the slot's hidden state; candidate c after token x
    at a slot with state h gains `<P[x] * W h, S[c]>`."""

    def __init__(self, config: DFlash2DraftConfig):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def query(self, hidden: torch.Tensor, previous_tokens: torch.LongTensor) -> torch.Tensor:
        """P[x_{k-1}] * W h_k: (..., hidden) states and (...) target ids -> (..., rank)."""
        return self.predecessor_codebook(previous_tokens) * self.hidden_projection(hidden)


class DFlash2DraftModel(DSparkDraftModel):
    r"""
    The DFlash 2 drafter: block `[anchor, MASK x (block_size-1)]`, slot k predicts the token at anchor + k + 1 (or
    with `config.sample_from_anchor` False, as z-lab saves it, slot k >= 1 predicts anchor + k), the target's hidden
    states at `config.target_layer_ids` fused into every layer's keys and values, as [`DSparkDraftModel`] without
    heads; the layers add their convolutions and drafting goes through the candidate selector (see the module).
    Shares its target's embedding and LM head like every hf_dspark drafter.
    """

    config_class = DFlash2DraftConfig
    config: DFlash2DraftConfig
    _no_split_modules = ["DFlash2DecoderLayer"]
    decoder_layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlash2DraftConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicCausalConv):
            # The identity convolution plus small dynamic taps: a fresh drafter starts as its DFlash backbone.
            with torch.no_grad():
                module.base_kernel.zero_()
                module.base_kernel[:, 0] = 1.0

    def successor_rows(self) -> torch.Tensor:
        """S over the drafter's output vocabulary: a row per draft-vocabulary token (its target id's row) or per
        target token."""
        weight = self.candidate_selector.successor_codebook.weight
        return weight if self.draft_to_target is None else weight[self.draft_to_target.to(weight.device)]

    def slot_logits(self, hidden: torch.Tensor, base_logits: torch.Tensor, previous_tokens: torch.LongTensor,
                    state: torch.Tensor | None) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """One drafting slot for N rows: `hidden` (N, d), `base_logits` (N, V) the backbone's, `previous_tokens`
        (N,) target ids x_{k-1} -> (the selector's scores at the backbone's top-k candidates and -inf at every other
        token, None (no confidence head reads a token embedding), `state` unchanged: the selector keeps none)."""
        candidates = base_logits.topk(self.candidate_selector.top_k, dim=-1).indices
        scores = self.candidate_scores(hidden, base_logits, previous_tokens, candidates)
        logits = torch.full_like(base_logits, float("-inf"))
        return logits.scatter(-1, candidates, scores), None, state

    def candidate_scores(self, hidden: torch.Tensor, base_logits: torch.Tensor, previous_tokens: torch.LongTensor,
                         candidates: torch.LongTensor) -> torch.Tensor:
        """The selector's scores (N, C) of `candidates` (N, C) output-vocabulary indices: `base_logits` (N, V) at
        them plus the pairwise term from `hidden` (N, d) and `previous_tokens` (N,) target ids. Drafting scores
        the backbone's top-k; training scores them with the label put in when it is missing
        (`training.losses.selector_candidates`)."""
        query = self.candidate_selector.query(hidden, previous_tokens)
        successors = self.successor_rows()[candidates]  # (N, C, rank)
        pairwise = torch.einsum("nr,ncr->nc", query, successors)
        return base_logits.gather(-1, candidates) + pairwise.to(base_logits.dtype)

    def _head_outputs(self, hidden_states: torch.Tensor, previous_token_ids: torch.LongTensor | None,
                      logits_mask: torch.Tensor | None):
        """(base logits, logits, None). Under teacher forcing (`previous_token_ids` given) the logits are the
        selector's score of every token of the output vocabulary, `base + (P[x_{k-1}] * W h_k) S^T`, of which
        drafting keeps the backbone's top-k (`slot_logits`); training reads the base logits and the candidates'
        scores instead (`training.trainer`), as the drafter serves them."""
        selected = hidden_states if logits_mask is None else hidden_states[logits_mask]
        base_logits = self.compute_logits(selected)
        if previous_token_ids is None:
            return base_logits, base_logits, None
        previous = previous_token_ids if logits_mask is None else previous_token_ids[logits_mask]
        query = self.candidate_selector.query(selected, previous)
        return base_logits, base_logits + (query @ self.successor_rows().T).to(base_logits.dtype), None


__all__ = ["DFlash2DraftModel"]
