"""The target's attention masks in the batched engine.

The engine's target cache keeps holes (rejected drafts, padding) and a row's real tokens at explicit positions, so a
cache *slot* is not a position. For full attention that does not matter: transformers' causal mask by slot, with the
(R, W) validity as padding mask, sees exactly a row's earlier real tokens. A sliding window, though, counts slots, holes
included: it would see fewer real tokens than the target's own decoding. So for a target with sliding-window layers
every layer keeps every entry (`transformers_internals.cache_layers.growing_cache`) and the engine builds the masks
itself, by position, and passes them ready-made (transformers then builds none):

    key j is visible to query i of a row  iff  j is a real entry of the row and pos[j] <= pos[i]
                                               (and pos[i] - pos[j] < window on a sliding layer)

as transformers' `sliding_window_causal_mask_function` (`kv_idx > q_idx - sliding_window`) does on a hole-free cache,
where slots are positions. A query always sees its own entry: a query that is itself a hole (left padding, a padded
draft) might otherwise see nothing, and sdpa turns a fully masked row into NaN on some backends, which a later layer
would read (with weight 0, but 0 * NaN is NaN). A hole's output is never used.

The masks are 4D, (R, 1, Q, K): bool (True = attend) for sdpa, additive float (0 or the dtype's minimum) for eager, as
transformers' `sdpa_mask`/`eager_mask` make them. A target whose attention layers are all of one kind gets the one
mask (its decoder returns a 4D mask as given); a target mixing full and sliding layers gets the mapping {layer type:
mask} its decoder takes instead of building its own (`generate` passes the same). A target with full attention only
gets the (R, W) padding mask (transformers' causal mask by slot is right for it; a hybrid's recurrent layers zero
their padding from it), but in one-token forwards of a non-hybrid one the (R, 1, 1, W) mask of the real entries:
from a padding mask transformers would first read on the host whether it may skip the mask, a device read per step."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ...transformers_internals.accessors import attention_implementation
from ...transformers_internals.cache_layers import attention_layer_types, takes_mask_mapping

FULL, SLIDING = "full_attention", "sliding_attention"
# Layers without attention entries of their own: a hybrid target's recurrent / convolution layers keep one state per
# row (their padding is zeroed by the model from the 2D mask, `recurrent_states`); "dummy" ones keep no cache (an
# MLP-only layer, or Gemma 4's KV-shared layers, which attend over an earlier layer's entries, holes and all, with
# the mask of their own attention kind).
RECURRENT_KINDS = frozenset({"linear_attention", "conv"})
STATE_KINDS = RECURRENT_KINDS | {"dummy"}


@dataclass(frozen=True)
class MaskKinds:
    """The attention kinds of a target's layers, as the engine masks them."""

    kinds: frozenset[str]  # a subset of {FULL, SLIDING}: the attention layers' kinds
    window: int | None  # the sliding layers' window (None without any)
    recurrent: bool = False  # recurrent or convolution layers beside the attention ones (a hybrid target)


_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> (its config, MaskKinds)


def mask_kinds(target) -> MaskKinds:
    """The target's layer kinds; refuses (ValueError) those the engine cannot mask. Read once per target and config
    (every forward asks)."""
    try:
        config, kinds = _KINDS.get(target, (None, None))
    except TypeError:  # a stand-in that takes no weak reference: read every time
        return _read_kinds(target)
    if config is not target.config:
        kinds = _read_kinds(target)
        _KINDS[target] = (target.config, kinds)
    return kinds


def _read_kinds(target) -> MaskKinds:
    every = frozenset(attention_layer_types(target.config))
    kinds = every - STATE_KINDS
    others = sorted(kinds - {FULL, SLIDING})
    if others:
        raise ValueError(
            f"Batched decoding runs targets with full and sliding-window attention layers (and recurrent or "
            f"convolution layers beside full attention); this target also has {', '.join(map(repr, others))} layers "
            "(chunked layers cannot keep the engine's holes); decode it per prompt with "
            "target.generate(..., assistant_model=drafter)."
        )
    if SLIDING in kinds and every & RECURRENT_KINDS:
        raise ValueError(
            "Batched decoding runs hybrid targets (recurrent or convolution layers) whose attention layers are all "
            "full attention; this one also has sliding-window layers, whose masks by position the engine cannot "
            "pass beside the recurrent layers' padding mask. Decode it per prompt with "
            "target.generate(..., assistant_model=drafter)."
        )
    text = target.config.get_text_config(decoder=True)
    if SLIDING not in kinds:
        return MaskKinds(kinds, None, bool(every & RECURRENT_KINDS))
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"This target has sliding-window layers but no usable sliding_window ({window!r}).")
    if getattr(text, "use_bidirectional_attention", False) or not getattr(text, "is_causal", True):
        raise ValueError("Batched decoding needs causal attention; this target's sliding layers are bidirectional.")
    if kinds == {FULL, SLIDING} and not takes_mask_mapping(target):
        raise ValueError(
            f"This target mixes full and sliding-window layers, but its decoder ({type(target.base_model).__name__}) "
            "does not take a ready attention-mask mapping per layer type, which batched decoding needs; decode it "
            "per prompt."
        )
    return MaskKinds(kinds, window)


def target_attention_mask(target, cached_valid: torch.BoolTensor, new_valid: torch.BoolTensor,
                          positions: torch.LongTensor):
    """The `attention_mask` of a target forward appending entries at `positions` (R, Q), real where `new_valid`, to
    a cache whose real entries are `cached_valid` (R, W): the (R, W + Q) padding mask for full-attention
    targets (transformers makes the causal mask), but for one-token forwards of non-hybrid ones, else the masks by
    position (module docstring)."""
    valid = torch.cat([cached_valid, new_valid], dim=1)
    kinds = mask_kinds(target)
    eager = attention_implementation(target.config) == "eager"
    if kinds.kinds <= frozenset({FULL}):
        if kinds.recurrent or positions.shape[1] > 1:
            return valid.long()  # transformers' causal mask by slot is right for full attention
        if not eager:
            # One token per row (a plain step): it sees every real entry and itself. Built here because from a
            # padding mask transformers would first read on the host whether it may skip the mask.
            valid[:, -1] = True
            return valid[:, None, None, :]
    # A real entry's position is the number of real entries before it in its row.
    key_positions = torch.cat([cached_valid.long().cumsum(dim=1) - 1, positions], dim=1)
    masks = {kind: _by_position(valid, key_positions, positions, kinds.window if kind == SLIDING else None,
                                target.dtype if eager else None)
             for kind in kinds.kinds}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _by_position(valid, key_positions, query_positions, window: int | None, additive_dtype) -> torch.Tensor:
    """(R, 1, Q, K) mask: real keys at positions up to the query's (within `window` of it), and the query itself."""
    queries, keys = query_positions.shape[1], valid.shape[1]
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # (R, Q, K)
    see = valid[:, None, :] & (distance >= 0)
    if window is not None:
        see &= distance < window
    own = torch.arange(queries, device=valid.device)
    see[:, own, keys - queries + own] = True
    see = see[:, None]
    if additive_dtype is None:
        return see
    return torch.where(see, torch.zeros((), dtype=additive_dtype, device=see.device),
                       torch.finfo(additive_dtype).min)
