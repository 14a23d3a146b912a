"""The batched engine's passes over the running rows: the target forward, prefilling new prompts (or the new tokens
of a conversation continued on its parked cache), the rows a round verifies (`EngineRows`: the
forward over the drafts, committing what was accepted), and plain decoding's step (no drafter: every round verifies
no drafts and emits one token per row).

Nothing here decides what a round does; `speculative_engine.SpeculativeEngine` does, from values it reads on the host."""

from __future__ import annotations

import math

import torch

from ...models.identity import EAGLE3_DRAFTER_TYPE, drafting_core
from ...models.layers import DraftContextCache
from ...models.modeling_dspark import DSparkDraftModel
from ...models.modeling_eagle3 import Eagle3DraftModel
from ...transformers_internals.accessors import supports_logits_to_keep
from ...transformers_internals.attention import mask_taking_attention
from ...transformers_internals.cache_layers import cache_layers, crop_entries, stack_layer_rows
from ...transformers_internals.recurrent_states import has_recurrent_layers, keep_recurrent_states, keep_states_after
from .rows import BatchRows
from ..round.drafting import Drafts, to_device
from .eagle3 import project_queued
from .requests import ParkedCache
from .checks import new_target_cache
from .masks import target_attention_mask

def target_forward(target, rows: BatchRows, tokens, new_valid, positions, layer_indices, keep: int,
                   feature_device=None):
    """Append `tokens` (R, N) to the shared cache; returns (float logits of the last `keep` entries, the features of
    `layer_indices` concatenated, None without layers: plain decoding)."""
    mask = target_attention_mask(target, rows.target_valid, new_valid, positions)
    kwargs = {"logits_to_keep": keep} if supports_logits_to_keep(target) else {}
    with mask_taking_attention(target):  # flash attention cannot take the holes: the same attention as sdpa
        out = target(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=rows.target_cache,
                     use_cache=True, output_hidden_states=layer_indices or False, **kwargs)
    if not layer_indices:
        return out.logits[:, -keep:].float(), None
    # With a device_map the layers' states live on their layers' devices; the drafter sits by the LM head.
    features = torch.cat([out.hidden_states[i].to(feature_device) for i in layer_indices], dim=-1)
    return out.logits[:, -keep:].float(), features


def _empty_rows(request_ids: list[int], target_cache, num_rows: int, device) -> BatchRows:
    """Rows with nothing cached yet and an empty drafter context."""
    empty = torch.zeros(num_rows, 0, dtype=torch.bool, device=device)
    zeros = torch.zeros(num_rows, dtype=torch.long, device=device)
    return BatchRows(
        request=to_device(request_ids, device), request_ids=list(request_ids), anchor=zeros,
        target_cache=target_cache, target_valid=empty, target_length=zeros,
        draft_cache=DraftContextCache(), draft_valid=empty, pending=torch.zeros(num_rows, 0, 0, device=device),
        pending_valid=empty, pending_positions=empty.long(), pending_tokens=empty.long(),
    )


def left_padded(prompts: list[list[int]], device) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Prompts as one left-padded batch (ids, mask), built on the host and copied without waiting."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return input_ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)


def prefill(target, input_ids, prompt_mask, request_ids, layer_indices,
            feature_device) -> tuple[BatchRows, torch.Tensor]:
    """Run left-padded prompts through the target; return their rows' state (the anchor not set yet) and the float
    logits at each prompt's last token (R, 1, V).

    Positions count real tokens only, as `generate` does for left-padded prompts. Left padding becomes the first
    holes of both caches."""
    positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    rows = _empty_rows(request_ids, new_target_cache(target), input_ids.shape[0], input_ids.device)
    logits, features = target_forward(target, rows, input_ids, prompt_mask, positions, layer_indices, keep=1,
                                      feature_device=feature_device)
    rows.target_valid, rows.target_length = prompt_mask, prompt_mask.long().sum(dim=1)
    if features is not None:
        # The token after each prompt entry; the last one's is the first token, not chosen yet (`next_tokens`).
        rows.stage_context(features, prompt_mask, positions, input_ids.roll(-1, dims=1), width=prompt_mask.shape[1])
    return rows, logits


# A forward's fixed cost in prompt tokens (launches, per-layer host work): what splitting a prefill into one more
# forward must save in padding. Measured on a 2-core CPU with SmolLM2-135M: a forward costs about 40 tokens' worth
# beyond its tokens; an accelerator runs a few hundred tokens in the time it takes to launch one forward's kernels.
CPU_FORWARD_OVERHEAD_TOKENS = 64
ACCELERATOR_FORWARD_OVERHEAD_TOKENS = 1024


def prefill_groups(lengths: list[int], overhead_tokens: int) -> list[list[int]]:
    """The prompts (indices into `lengths`) split into left-padded forwards so that the token slots computed, padding
    included, plus `overhead_tokens` per forward are least. Prompts of one batch often differ several-fold in length
    (a padded batch of chat prompts is a third real tokens): one padded forward computes the rest for nothing.
    The best split takes runs of the length-sorted order (dynamic programming over where each run starts)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, start_of = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        width = lengths[order[end - 1]]  # the longest prompt of any run that ends here
        for start in range(end):
            cost = best[start] + (end - start) * width + overhead_tokens
            if cost < best[end]:
                best[end], start_of[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[start_of[end] : end])
        end = start_of[end]
    return groups[::-1]


def prefill_grouped(target, prompts: list[list[int]], request_ids: list[int], layer_indices, feature_device,
                    device) -> tuple[BatchRows, torch.Tensor]:
    """`prefill` for prompts of any lengths: one left-padded forward per group of similar lengths
    (`prefill_groups`), the groups' rows merged into one block (each cache padded with holes to the widest group,
    which later rounds mask like any hole). Returns the rows, in the groups' order (`rows.request_ids`), and their
    logits."""
    cpu = torch.device(device).type == "cpu"
    overhead = CPU_FORWARD_OVERHEAD_TOKENS if cpu else ACCELERATOR_FORWARD_OVERHEAD_TOKENS
    blocks, logits = [], []
    for group in prefill_groups([len(prompt) for prompt in prompts], overhead):
        input_ids, mask = left_padded([prompts[i] for i in group], device)
        rows, group_logits = prefill(target, input_ids, mask, [request_ids[i] for i in group], layer_indices,
                                     feature_device)
        blocks.append(rows)
        logits.append(group_logits)
    blocks[0].merge(*blocks[1:])  # one copy of each cache layer for all groups
    return blocks[0], torch.cat(logits)


def prefill_resumed(target, parked: list[ParkedCache], new_tokens: list[list[int]], request_ids,
                    device) -> tuple[BatchRows, torch.Tensor]:
    """`prefill` for conversations continued on their parked caches: each row's parked entries (holes after the
    shorter ones), then only its new tokens, left-padded, in one forward (plain decoding only)."""
    num_rows = len(parked)
    cache = new_target_cache(target)
    for index, layer in enumerate(cache_layers(cache)):
        stack_layer_rows(layer, [entries.layers[index] for entries in parked])
    lengths = [len(entries.tokens) for entries in parked]
    rows = _empty_rows(request_ids, cache, num_rows, device)
    rows.target_length = to_device(lengths, device)
    rows.target_valid = torch.arange(max(lengths), device=device)[None, :] < rows.target_length[:, None]
    tokens, new_valid = left_padded(new_tokens, device)
    positions = rows.target_length[:, None] + (new_valid.long().cumsum(dim=1) - 1).clamp_min(0)
    logits, _ = target_forward(target, rows, tokens, new_valid, positions, (), keep=1)
    rows.target_valid = torch.cat([rows.target_valid, new_valid], dim=1)
    rows.target_length = rows.target_length + new_valid.long().sum(dim=1)
    return rows, logits


def project_context(drafter: DSparkDraftModel | Eagle3DraftModel, rows: BatchRows) -> None:
    """Move the queued context into the drafter's cache now (`DSparkDraftModel.cache_context`: no block drafted).

    A context row's keys and values depend only on its target features and position, not on the block, so this
    is what the next round would compute. Newcomers do it before joining: their prompt context then shares the
    running rows' cache columns (the merged width is the larger of the two) instead of being appended after them.
    An Eagle3 drafter keeps each row's newest entry queued (`eagle3.project_queued`).
    """
    if rows.pending.shape[1] == 0:
        return
    if drafting_core(drafter) == EAGLE3_DRAFTER_TYPE:
        return project_queued(drafter, rows)
    drafter.cache_context(rows.pending, rows.pending_positions, rows.draft_cache)
    rows.draft_valid = torch.cat([rows.draft_valid, rows.pending_valid], dim=1)
    rows.take_context()


class EngineRows:
    """The running rows as a round sees them (`round.skeleton.RoundRows`): caches with holes, explicit positions.

    `draft_pass` is the drafter kind's pass over all rows (`speculative_engine._draft`, `eagle3.draft_rows`); the
    verification's features and positions wait here for `commit`."""

    def __init__(self, target, drafter, rows: BatchRows, draft_pass, layer_indices, feature_device):
        self.target, self.drafter, self.rows, self.draft_pass = target, drafter, rows, draft_pass
        self.layer_indices, self.feature_device = layer_indices, feature_device
        self._verified = None

    @property
    def anchor(self) -> torch.LongTensor:
        return self.rows.anchor

    def queued_context(self) -> int:
        return self.rows.pending.shape[1]

    def draft(self, budget, slots, rule, sampling, generator) -> Drafts:
        return self.draft_pass(self.drafter, self.rows, budget, slots, rule, sampling, generator)

    def verify_forward(self, tokens: torch.LongTensor, drafts: Drafts, width: int) -> torch.Tensor:
        """Every row's anchor and drafts in one target forward of `width` entries per row (the longest row's drafts
        + 1); a row's entries past its own drafts are padding, masked and never kept."""
        rows = self.rows
        offsets = torch.arange(width, device=rows.anchor.device)
        new_valid = offsets[None, :] < drafts.lengths[:, None].to(offsets.device) + 1
        positions = rows.target_length[:, None] + offsets  # padded entries get the same arithmetic; they are masked
        if width > 1 and has_recurrent_layers(rows.target_cache):
            keep_recurrent_states(rows.target_cache, width)  # each row keeps its own count (`commit`)
        logits, features = target_forward(self.target, rows, tokens, new_valid, positions, self.layer_indices,
                                          keep=width, feature_device=self.feature_device)
        self._verified = features, positions
        return logits

    def commit(self, num_accepted: torch.LongTensor, accepted: list[int], width: int,
               new_tokens: torch.LongTensor) -> None:
        """The newest token and the accepted drafts become valid; rejected drafts and padding stay as holes, except
        the trailing columns that no row kept: cropping those is a free slice and bounds the cache's growth. A
        recurrent layer keeps no holes: each row takes its state after its kept entries. `accepted` is
        `num_accepted` as read on the host; `new_tokens` holds the token after each kept entry."""
        rows, (features, positions) = self.rows, self._verified
        used = max(accepted) + 1
        keep_states_after(rows.target_cache, num_accepted + 1, width)
        if used < width:
            crop_entries(rows.target_cache, width - used)
        kept = torch.arange(used, device=rows.anchor.device)[None, :] < num_accepted[:, None] + 1
        rows.target_valid = torch.cat([rows.target_valid, kept], dim=1)
        rows.target_length = rows.target_length + num_accepted + 1
        rows.stage_context(features, kept, positions, new_tokens, width=used)
        self._verified = None


def plain_step(target, rows: BatchRows) -> torch.Tensor:
    """Plain decoding's round: every row's anchor through the target (it becomes valid); returns the float logits
    after it (R, V)."""
    new_valid = rows.target_valid.new_ones(len(rows), 1)
    logits, _ = target_forward(target, rows, rows.anchor[:, None], new_valid, rows.target_length[:, None], (), keep=1)
    rows.target_valid = torch.cat([rows.target_valid, new_valid], dim=1)
    rows.target_length = rows.target_length + 1
    return logits[:, -1]
