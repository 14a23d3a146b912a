"""Anchor sampling and block construction for parallel-drafter training.

For an anchor at position a, the block is `[x_a, MASK x (B-1)]` at positions a..a+B-1; slot k is supervised with
the token at a+k+1 (`first_slot` 0, DeepSpec's and ours) or at a+k for k >= 1 (`first_slot` 1, slot 0 unused: the
`sample_from_anchor: false` convention) while that token, and every earlier label of the block, lies in the answer.
The block's queries see context rows strictly before the anchor and every slot of their own block, which is
exactly what the drafter sees at inference (the anchor's own target state does not exist yet then). A drafter with
block-causal or sliding-window layers narrows this mask per layer by position (`DSparkDraftModel.layer_masks`, the
one rule inference uses too): `position_ids` are the slots' true positions and context row i is at position i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Up to ``num_anchors`` distinct random anchors per row among positions a with loss_mask[a] and
    loss_mask[a+1]; returns sorted (anchors (B, n), valid (B, n)) padded with invalid zeros."""
    eligible = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    rows = eligible.shape[0]
    anchors = torch.zeros(rows, num_anchors, dtype=torch.long)
    valid = torch.zeros(rows, num_anchors, dtype=torch.bool)
    for row in range(rows):
        candidates = eligible[row].nonzero().squeeze(-1).cpu()
        if candidates.numel() == 0:
            continue
        order = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        chosen = candidates[order].sort().values
        anchors[row, : chosen.numel()] = chosen
        valid[row, : chosen.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


@dataclass
class Blocks:
    """Packed blocks, each tensor of shape (B, n * gamma) unless noted."""

    input_ids: torch.LongTensor  # [x_a, MASK, ...]
    position_ids: torch.LongTensor  # a + k
    previous_token_ids: torch.LongTensor  # the token before slot k's label (the anchor for the first draft)
    labels: torch.LongTensor  # x_{a+k+1} (x_{a+k} when slot 0 is unused)
    target_rows: torch.LongTensor  # label position - 1: the target row whose next-token distribution is the label's
    slot_valid: torch.BoolTensor  # supervised slots
    slot_index: torch.LongTensor  # the draft index: k - first_slot
    attention_mask: torch.BoolTensor  # (B, 1, n * gamma, L + n * gamma)


def build_blocks(
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    anchors: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    block_size: int,
    mask_token_id: int,
    first_slot: int = 0,
) -> Blocks:
    batch, length = input_ids.shape
    num_blocks = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    slot_positions = anchors[..., None] + offsets  # (B, n, G)
    label_positions = slot_positions + 1 - first_slot
    in_range = label_positions < length
    flat = lambda t: t.reshape(batch, num_blocks * block_size)  # noqa: E731
    gather = lambda source, pos: source.gather(1, flat(pos.clamp(min=0, max=length - 1))).reshape(pos.shape)  # noqa: E731

    labels = gather(input_ids, label_positions)
    drafting = offsets >= first_slot  # an unused slot 0 is never supervised, and does not end the block's prefix
    label_in_answer = ((gather(loss_mask, label_positions) > 0) & in_range) | ~drafting
    slot_valid = label_in_answer.long().cumprod(dim=-1).bool() & drafting & anchor_valid[..., None]
    previous = gather(input_ids, label_positions - 1)
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[..., 0] = input_ids.gather(1, anchors)

    context_visible = torch.arange(length, device=input_ids.device)[None, None, :] < anchors[..., None]  # (B, n, L)
    context_visible = context_visible[:, :, None, :].expand(batch, num_blocks, block_size, length)
    block_of_query = torch.arange(num_blocks, device=input_ids.device).repeat_interleave(block_size)
    same_block = block_of_query[:, None] == block_of_query[None, :]
    mask = torch.cat(
        [context_visible.reshape(batch, num_blocks * block_size, length), same_block[None].expand(batch, -1, -1)],
        dim=-1,
    )
    return Blocks(
        input_ids=flat(block_ids),
        position_ids=flat(slot_positions),
        previous_token_ids=flat(previous),
        labels=flat(labels),
        target_rows=flat(label_positions - 1),
        slot_valid=flat(slot_valid),
        slot_index=flat((offsets - first_slot).expand(batch, num_blocks, block_size)),
        attention_mask=mask[:, None],
    )
