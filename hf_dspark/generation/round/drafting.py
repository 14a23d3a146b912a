"""The drafting cores of every batch size (R rows at once; R = 1 in the batch-1 loop): the block core of DSpark,
DFlash and DFlash 2 drafters (`draft_block`) and Eagle3's chain (`context_pass`, `draft_chain`).

A block round: the backbone's single pass gives every slot's hidden state (`drafting_pass`: no logits), the LM head
then gives the base logits of the drafted slots only (`drafted_slots`: a round that drafts two of seven slots pays
the 49k-vocabulary head for two of each row's slots, not seven); the sequential head walks the drafted slots, each
correcting its logits with the token drawn at the slot before, picking a token through the user's processors
(`sampling`), and producing a confidence c_k. Every slot the round asks for is drafted, then `DraftLengthRule`
(policy) decides on the device how many each row verifies, from c_1..c_k alone: lossless, and no slot waits for
the host.

An Eagle3 context row t reads the target feature at t with the token at t + 1 and predicts the token at t + 2. A
round runs one context pass over the rows committed since the drafter last ran (`context_pass`), then one drafter
step per drafted token, each reading the token just drafted with the drafter's own previous output state
(`draft_chain`); the drafted rows leave the drafter cache afterwards, so rejected tokens leave no trace. The batch-1
loop passes no masks or positions (its cache has no holes); the engine's (`engine/eagle3.py`) does.

Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.layers import DraftContextCache
from ...models.modeling_dspark import DSparkDraftModel
from ...models.modeling_eagle3 import Eagle3DraftModel


@dataclass
class Drafts:
    """A round's drafts for R rows.

    tokens: (R, G) drafted tokens (slots past a row's length are never verified).
    probs: (R, G, V) the processed distributions sampled rows drew them from (0 for greedy rows), or None when
        no row samples.
    lengths: (R,) slots each row verifies.
    confidences: (R, G) conditional confidences c_k, or None without a confidence head.
    length: at batch 1, `lengths[0]` as read on the host (the verification's size depends on it).
    """

    tokens: torch.LongTensor
    probs: torch.Tensor | None
    lengths: torch.LongTensor
    confidences: torch.Tensor | None = None
    length: int | None = None

    @classmethod
    def empty(cls, num_rows: int, device) -> "Drafts":
        return cls(torch.zeros(num_rows, 0, dtype=torch.long, device=device), None,
                   torch.zeros(num_rows, dtype=torch.long, device=device), length=0)


def to_device(values: list[int], device, dtype=torch.long) -> torch.Tensor:
    """Host ints as a tensor on `device`, copied without waiting for the device's queue."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def pad_to(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Pad `tensor` with zeros (False) at the end of `dim` up to `width` entries: holes."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def draft_input_block(anchor: torch.LongTensor, config) -> torch.LongTensor:
    """The backbone's input for R rows: `[anchor, MASK x (block_size - 1)]`, (R, block_size)."""
    masks = anchor.new_full((anchor.shape[0], config.block_size - 1), config.mask_token_id)
    return torch.cat([anchor[:, None], masks], dim=1)


def round_tokens(draft_tokens: torch.LongTensor, num_accepted: torch.LongTensor,
                 next_token: torch.LongTensor) -> torch.LongTensor:
    """A round's tokens per row (R, k + 1): its accepted drafts, then the target's token at `num_accepted` (the
    positions after it are never emitted)."""
    tokens = torch.cat([draft_tokens, next_token[:, None]], dim=1)
    return tokens.scatter_(1, num_accepted[:, None], next_token[:, None])


def emitted_drafts(accepted: int, emitted: int) -> int:
    """Drafts a round emitted: its accepted ones, unless the row stopped inside them (EOS, a length limit), when the
    last emitted token stands for the target's own (drafts matched past the stop were never emitted; llama.cpp
    counts alike)."""
    return min(accepted, emitted - 1)


def drafting_pass(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The `logits_mask` of a drafting backbone pass: no slot (an index, which a boolean mask would read the device
    to count); `draft_block` computes the drafted slots' logits itself."""
    none = torch.zeros(0, dtype=torch.long, device=device)
    return none, none


def drafted_slots(drafter: DSparkDraftModel, backbone_output, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The final states (R, slots, d) of the `slots` drafted block slots and their base logits, one LM-head product
    over those rows only. Draft k comes from block slot first + k: slot 0 itself, or slot 1 when slot j predicts
    anchor + j."""
    first = drafter.config.first_draft_slot
    # Contiguous: the LM head over a strided slice of the block ran slower than over the whole block.
    hidden = backbone_output.last_hidden_state[:, first : first + slots].contiguous()
    return hidden, drafter.compute_logits(hidden)


def draft_block(drafter: DSparkDraftModel, backbone_output, anchor: torch.LongTensor, slots: int, sampling,
                generator: torch.Generator | None = None) -> tuple[torch.LongTensor, torch.Tensor | None,
                                                                     torch.Tensor | None]:
    """Draft `slots` tokens for every row after the backbone pass.

    Args:
        backbone_output: the drafter's output on `[anchor, MASK x (block_size - 1)]` (the final hidden states of
            every block slot, (R, block_size, d); its logits are not read: pass `logits_mask=drafting_pass(device)`).
        anchor: (R,) the newest committed token of each row (x_{-1} for the sequential head).
        slots: how many tokens to draft (at most `config.num_draft_slots`).
        sampling: a `ProcessorSampling` or `RowSampling` (the processors and the token choice).

    Returns:
        (tokens (R, slots), probs (R, slots, V) or None, confidences (R, slots) or None).
    """
    hidden, base_logits = drafted_slots(drafter, backbone_output, slots)
    head = drafter.sequential_head
    state = head.initial_state(anchor.shape[0], hidden) if head is not None else None
    tokens, probs, embeddings = [], [], []
    previous = anchor = anchor.to(hidden.device)  # the drafter sits by the target's LM head (`attach_target`)
    drafted = anchor[:, None][:, :0]
    for slot in range(slots):
        logits, embedding, state = drafter.slot_logits(hidden[:, slot], base_logits[:, slot], previous, state)
        processed = sampling.process(drafter.to_target_vocab(logits.float()), drafted)
        token, distribution = sampling.choose(processed, generator)
        tokens.append(token)
        if distribution is not None:
            probs.append(distribution)
        if embedding is not None:
            embeddings.append(embedding)
        previous = token
        if slot + 1 < slots and not getattr(sampling, "context_free", True):
            drafted = torch.stack(tokens, dim=1)  # only processors that read the context need it
    if not tokens:
        return anchor[:, None][:, :0], None, None
    # Every slot's confidence in one call, now that every x_{k-1} is known (c_k never reads x_k).
    confidences = drafter.slot_confidences(hidden, torch.stack(embeddings, dim=1) if embeddings else None)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, confidences


def one_hot_probs(tokens: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """(R, k) tokens proposed without a model (suffix matches) as point-mass draft distributions (R, k, V):
    sampling then accepts token x with probability min(1, p(x))."""
    probs = torch.zeros(*tokens.shape, vocab_size, device=tokens.device)
    return probs.scatter_(-1, tokens[..., None], 1.0)


def context_pass(drafter: Eagle3DraftModel, tokens: torch.LongTensor, features: torch.Tensor,
                 cache: DraftContextCache, positions: torch.LongTensor | None = None,
                 mask: torch.BoolTensor | None = None,
                 newest: torch.LongTensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append context rows (`features` (R, M, F) with `tokens` (R, M), the token after each) to `cache`; returns
    the logits (R, V) and output state (R, 1, H) of each row's newest context row: column `newest` (R,), or the
    last row when None (batch 1). `positions` and `mask` None: right after the cached rows, causal."""
    if newest is None:
        out = drafter(input_ids=tokens, target_hidden_states=features, cache=cache)
        return out.logits[:, -1], out.hidden_states[:, -1:]
    # Only the newest rows' logits, picked by index: a boolean mask would read the device to count its rows.
    newest = newest.to(features.device)  # the drafter's (`attach_target`)
    picked = (torch.arange(newest.shape[0], device=newest.device), newest)
    out = drafter(input_ids=tokens, target_hidden_states=features, position_ids=positions, attention_mask=mask,
                  cache=cache, logits_mask=picked)
    return out.logits, out.hidden_states[picked][:, None]


def draft_chain(drafter: Eagle3DraftModel, logits: torch.Tensor, state: torch.Tensor, slots: int, sampling,
                generator: torch.Generator | None, cache: DraftContextCache,
                positions: torch.LongTensor | None = None,
                context_valid: torch.BoolTensor | None = None) -> tuple[torch.LongTensor, torch.Tensor | None]:
    """Draft `slots` tokens per row from the newest context row's `logits` and `state`: each slot's token goes
    through the user's processors and the choice (`sampling`), then one drafter step reads it with the previous
    state. The drafted rows are removed from `cache` afterwards.

    Args:
        positions: (R,) the position of each row's first step (its anchor's); None: right after the cached rows.
        context_valid: (R, C) the cache's valid columns before the chain (the steps see those and themselves);
            None: every column.

    Returns:
        (tokens (R, slots), the distributions sampled rows drew them from (R, slots, V), or None).
    """
    context_length = cache.get_seq_length()
    num_rows = logits.shape[0]
    tokens, probs = [], []
    drafted = torch.zeros(num_rows, 0, dtype=torch.long, device=logits.device)
    for slot in range(slots):
        processed = sampling.process(drafter.to_target_vocab(logits.float()), drafted)
        token, distribution = sampling.choose(processed, generator)
        tokens.append(token)
        if distribution is not None:
            probs.append(distribution)
        if slot + 1 == slots:
            break
        if not getattr(sampling, "context_free", True):
            drafted = torch.stack(tokens, dim=1)  # only processors that read the context need it
        kwargs = {}
        if positions is not None:
            valid = torch.cat([context_valid, context_valid.new_ones(num_rows, slot + 1)], dim=1)
            kwargs = dict(position_ids=(positions + slot)[:, None], attention_mask=valid[:, None, None, :])
        out = drafter(input_ids=token[:, None], hidden_states=state, cache=cache, **kwargs)
        logits, state = out.logits[:, -1], out.hidden_states
    cache.crop(context_length)  # drafted rows were built on the drafter's own states
    if not tokens:
        return drafted, None
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None
