"""The state of a running batch: every per-row tensor and both caches, with holes.

Rows accept different numbers of drafts each round, so their sequences drift apart. Instead of cropping each row's
cache separately, both caches keep **holes**: every round appends the same number of entries to every row (its
newest token and drafts, padded to the longest row), and a per-row validity mask marks which entries are real.
Rejected drafts and padding stay in the caches, masked out of every later attention. Positions are explicit per
row (a row's next position is the number of its valid entries), so a hole never shifts a row's rotary phase.
`BatchRows.select` keeps a subset of rows (requests that finished leave), `merge` appends newly admitted rows, each
cache padded with holes to the wider of the two, and `drop_unused_columns` prunes columns no row uses. The target
cache's layers are reached through `transformers_internals` only (a layer keeps its entries in a buffer with spare
columns there, and each of these operations copies a layer once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ...models.layers import DraftContextCache
from ..round.drafting import pad_to, to_device
from ...transformers_internals.cache_layers import (cache_layers, is_prefix_view, merge_layer_rows, row_entries,
                                                   select_layer_entries)


def _cat_rows(blocks: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Stack row blocks along dim 0, padding the narrower ones with holes along `dim`."""
    width = max(block.shape[dim] for block in blocks)
    return torch.cat([pad_to(block, width, dim) for block in blocks], dim=0)


def _columns(used: list[bool], device) -> torch.LongTensor | None:
    """Indices of the columns some row uses (read on the host), or None when every column is used."""
    return None if all(used) else to_device([i for i, u in enumerate(used) if u], device)


def _layer(tensors: list, index: int):
    return tensors[index] if index < len(tensors) else None


def _merge_draft_layer(blocks: list, counts: list[int]) -> torch.Tensor | None:
    """One drafter-cache layer of several row blocks. A block that has not drafted yet (just prefilled) has no
    context rows there: it joins with zero columns, so every column is a hole for it."""
    reference = next((b for b in blocks if b is not None), None)
    if reference is None:
        return None
    return _cat_rows([b if b is not None else reference.new_zeros(count, reference.shape[1], 0, reference.shape[3])
                      for b, count in zip(blocks, counts)], dim=2)


@dataclass
class BatchRows:
    """Everything indexed by active row; `select` keeps a subset of rows, `merge` appends another block of rows."""

    request: torch.LongTensor  # (R,) id of the request each row serves
    request_ids: list[int]  # the same on the host
    anchor: torch.LongTensor  # (R,) newest emitted token: not yet in the target cache
    target_cache: DynamicCache
    target_valid: torch.BoolTensor  # (R, W) real entries of the target cache
    target_length: torch.LongTensor  # (R,) valid entries = position of the anchor
    draft_cache: DraftContextCache
    draft_valid: torch.BoolTensor  # (R, C) real rows of the drafter's context cache
    pending: torch.Tensor  # (R, M, F) target features not yet given to the drafter
    pending_valid: torch.BoolTensor  # (R, M)
    pending_positions: torch.LongTensor  # (R, M)
    # (R, M) the token after each queued entry (Eagle3's context rows pair a feature with it); a row's newest entry
    # is followed by its anchor, which may be unknown when the entry is queued (see `next_tokens`)
    pending_tokens: torch.LongTensor
    # Storage with spare columns that `pending` is a prefix of: rounds that leave the drafter idle append their
    # features in place instead of copying the whole queue (a prompt's features included) every step.
    _pending_storage: torch.Tensor | None = field(default=None, repr=False)

    _PER_ROW = ("request", "anchor", "target_valid", "target_length", "draft_valid", "pending", "pending_valid",
                "pending_positions", "pending_tokens")

    def __len__(self) -> int:
        return self.request.shape[0]

    def select(self, keep: list[int]) -> None:
        """Keep the rows at host indices `keep` and drop the columns no kept row uses (one host read), the target
        cache copied once for both."""
        self.request_ids = [self.request_ids[i] for i in keep]
        index = to_device(keep, self.anchor.device)
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name).index_select(0, index))
        cache = self.draft_cache
        cache.keys = [None if k is None else k.index_select(0, index) for k in cache.keys]
        cache.values = [None if v is None else v.index_select(0, index) for v in cache.values]
        target_columns = self._drop_unused_columns()
        for layer in cache_layers(self.target_cache):
            select_layer_entries(layer, index, target_columns)

    def drop_unused_columns(self) -> None:
        """Remove cache and queued-context columns that are holes in every remaining row (e.g. a retired long
        prompt), so a continuously fed batch does not keep the widths of requests long gone."""
        columns = self._drop_unused_columns()
        if columns is not None:
            for layer in cache_layers(self.target_cache):
                select_layer_entries(layer, None, columns)

    def _drop_unused_columns(self) -> list[int] | None:
        """`drop_unused_columns` but for the target cache's layers: returns the target columns to keep (None: all).
        One host read for the three column families; the engine calls it when rows join or leave, which reads the
        device anyway."""
        families = (self.target_valid, self.draft_valid, self.pending_valid)
        used = torch.cat([valid.any(dim=0) for valid in families]).tolist()
        target_used, rest = used[: families[0].shape[1]], used[families[0].shape[1] :]
        draft_used, pending_used = rest[: families[1].shape[1]], rest[families[1].shape[1] :]
        target_columns = None if all(target_used) else [i for i, u in enumerate(target_used) if u]
        if target_columns is not None:
            self.target_valid = self.target_valid[:, to_device(target_columns, self.anchor.device)]
        columns = _columns(draft_used, self.anchor.device)
        if columns is not None:
            self.draft_valid = self.draft_valid[:, columns]
            cache = self.draft_cache
            cache.keys = [None if k is None else k[:, :, columns] for k in cache.keys]
            cache.values = [None if v is None else v[:, :, columns] for v in cache.values]
        columns = _columns(pending_used, self.anchor.device)
        if columns is not None:
            self.pending, self.pending_valid = self.pending[:, columns], self.pending_valid[:, columns]
            self.pending_positions = self.pending_positions[:, columns]
            self.pending_tokens = self.pending_tokens[:, columns]
        return target_columns

    def merge(self, *others: "BatchRows") -> None:
        """Append the rows of `others`, in order. Each column family (target cache, drafter cache, queued context)
        is padded with holes at the end to the widest block; a row's entries keep their order, which is all the
        causal masks and the explicit positions need. Each cache layer is copied once, however many blocks join."""
        if not others:
            return
        blocks = (self, *others)
        counts = [len(block) for block in blocks]
        self.request_ids = [r for block in blocks for r in block.request_ids]
        for name in ("request", "anchor", "target_length"):
            setattr(self, name, torch.cat([getattr(block, name) for block in blocks]))
        for name in ("target_valid", "draft_valid", "pending_valid", "pending_positions", "pending_tokens",
                     "pending"):
            setattr(self, name, _cat_rows([getattr(block, name) for block in blocks], dim=1))
        for index, mine in enumerate(cache_layers(self.target_cache)):
            merge_layer_rows(mine, [cache_layers(other.target_cache)[index] for other in others])
        caches = [block.draft_cache for block in blocks]
        layers = max(len(cache.keys) for cache in caches)
        self.draft_cache.keys = [_merge_draft_layer([_layer(c.keys, i) for c in caches], counts) for i in range(layers)]
        self.draft_cache.values = [_merge_draft_layer([_layer(c.values, i) for c in caches], counts)
                                   for i in range(layers)]

    def target_entries(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The row's valid target-cache entries, in order, as (1, heads, length, dim) tensors of every layer (one host
        read): what a later turn of its conversation continues from."""
        columns = self.target_valid[row].nonzero().flatten()
        return row_entries(self.target_cache, row, columns)

    def stage_context(self, features: torch.Tensor, valid: torch.BoolTensor, positions: torch.LongTensor,
                      tokens: torch.LongTensor, width: int) -> None:
        """Queue the target features of the entries that just became valid for the next backbone pass, after any
        still queued (rounds that drafted nothing leave the drafter idle): the first `width` columns (the caller
        knows how many some row uses, from values it has read), with `tokens`, the token after each entry. The
        features are zeroed where invalid, so no stray value at a padded position (masked, but multiplied by a zero
        attention weight) can turn into NaN inside attention."""
        valid = valid[:, :width]
        features = torch.where(valid[..., None], features[:, :width], 0.0)
        positions, tokens = positions[:, :width], tokens[:, :width]
        if self.pending.shape[1]:
            features = self._appended_features(features)
            valid = torch.cat([self.pending_valid, valid], dim=1)
            positions = torch.cat([self.pending_positions, positions], dim=1)
            tokens = torch.cat([self.pending_tokens, tokens], dim=1)
        self.pending, self.pending_valid, self.pending_positions = features, valid, positions
        self.pending_tokens = tokens

    def _appended_features(self, features: torch.Tensor) -> torch.Tensor:
        """`pending` with `features` appended along dim 1, written into `_pending_storage` when `pending` is its prefix
        and it has room (else into new storage with spare columns): amortised, each column is copied about once.
        Only columns after `pending` are written, so a tensor `pending` was before keeps its values."""
        queued, storage = self.pending, self._pending_storage
        needed = queued.shape[1] + features.shape[1]
        in_storage = storage is not None and is_prefix_view(queued, storage, dim=1)
        if not (in_storage and storage.shape[1] >= needed and storage.dtype == features.dtype):
            storage = queued.new_empty(queued.shape[0], needed + max(32, needed // 2), *queued.shape[2:])
            storage[:, : queued.shape[1]] = queued
            self._pending_storage = storage
        storage[:, queued.shape[1] : needed] = features
        return storage[:, :needed]

    def newest_entries(self) -> torch.BoolTensor:
        """(R, M) the queued entry of each row right before its anchor. An Eagle3 drafter keeps one per row queued
        (every round queues the entry of the anchor it verified; joining rows keep theirs, `engine.eagle3`)."""
        return self.pending_valid & (self.pending_positions == self.target_length[:, None] - 1)

    def next_tokens(self, newest: torch.BoolTensor) -> torch.LongTensor:
        """(R, M) the token after each queued entry: the staged one, and for each row's newest entry its anchor
        (a prompt's last entry is queued before its first token is chosen)."""
        return torch.where(newest, self.anchor[:, None], self.pending_tokens)

    def take_context(self) -> None:
        """The queued context went into the drafter's cache: nothing is queued any more."""
        self.pending, self.pending_valid = self.pending[:, :0], self.pending_valid[:, :0]
        self.pending_positions, self.pending_tokens = self.pending_positions[:, :0], self.pending_tokens[:, :0]
        self._pending_storage = None  # what was queued may still be read by whoever took it: never overwrite it
