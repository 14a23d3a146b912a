"""The recurrent and convolution layers of a hybrid target's cache (Qwen3.5 / Qwen3-Next gated DeltaNet, LFM2 short
convolutions, Nemotron-H Mamba-2), brought back after rejected drafts.

Such a layer holds one state that every token of a forward went into. Speculative decoding needs, after a round
that verified n tokens and accepted a of them, the state after exactly those a. transformers keeps what that takes
(`benchmarks/hybrid-state-restore/results.md` measures it against restoring a snapshot and replaying the accepted
tokens, and against folding that replay into the next verification): with past recording on, a forward keeps the
state after each of its tokens. At batch 1 `cache.crop` then picks the state (`one_prompt.target_runners`); in the
batched engine every row accepted its own count, so `keep_states_after` picks each row's.

What is relied on (transformers 5.25; `state_problems` checks it on a tiny model; on a release without it a hybrid
target is refused with `unkept_states_message`):

* a recurrent layer (`LinearAttentionCacheLayerMixin`) keeps `conv_states` and `recurrent_states`, dicts {state
  index: tensor (batch, ...)}, with `is_conv_states_initialized` / `is_recurrent_states_initialized`, the kernel
  widths `conv_kernel_size` and the token count `cumulative_length_linear` (a tensor);
* after `cache.activate_past_recording(recurrent_states_to_keep=n)` (which sets the layers' `record_past`), a forward
  of q <= n tokens leaves a convolution state as its previous `conv_kernel_size` columns followed by the q new inputs,
  and `recurrent_states_history[i]` as the state before the forward followed by the states after each token but the
  last (the current state is the one after the last); `crop(-k)` (also `crop(0)`) goes back k tokens and trims the
  windows; stock `generate` turns `record_past` off on a cache it returns;
* the model updates a state in place (`copy_`, the one-token convolution kernel), so an undo keeps clones.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import cache_utils

_DummyLayer = getattr(cache_utils, "DummyLayer", None)  # layers without a cache (an MLP-only layer of Nemotron-H)


def is_recurrent_layer(layer) -> bool:
    """Whether a cache layer holds recurrent or convolution states (transformers' `LinearAttentionCacheLayerMixin`,
    read by its fields)."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def is_stateless_layer(layer) -> bool:
    return _DummyLayer is not None and isinstance(layer, _DummyLayer)


def has_recurrent_layers(cache) -> bool:
    """Whether some layer of `cache` holds a recurrent or convolution state (a hybrid target's)."""
    return any(is_recurrent_layer(layer) for layer in getattr(cache, "layers", ()))


def keeps_states_per_position() -> bool:
    """Whether this transformers release can keep the state after each token of a forward
    (`Cache.activate_past_recording(recurrent_states_to_keep=...)`, from 5.25.0 on): what exact speculative decoding
    of a hybrid target needs."""
    return len(inspect.signature(cache_utils.Cache.activate_past_recording).parameters) > 1


def unkept_states_message(cache, target) -> str | None:
    """Why a hybrid target must be refused, before any forward, on a transformers release that cannot keep its
    per-position states (rounds would go on from states that include rejected drafts); None when it can run. The
    caller raises it as a `UserInputError` (this package imports nothing of hf_dspark's)."""
    if has_recurrent_layers(cache) and not keeps_states_per_position():
        return (
            f"Speculative decoding of {type(target).__name__} needs the state of its recurrent or convolution layers "
            f"after each verified token, which transformers keeps from 5.25.0 on "
            f"(Cache.activate_past_recording(recurrent_states_to_keep=...)); this is transformers "
            f"{transformers.__version__}. Upgrade it: pip install 'transformers>=5.25.0'."
        )
    return None


def keep_recurrent_states(cache, count: int) -> None:
    """Make the next forwards (of up to `count` tokens) keep every position's state, so that the cache can go back to
    any of them. Call it when nothing is kept (after a crop, or `keep_states_after`)."""
    cache.activate_past_recording(recurrent_states_to_keep=count)


def stop_keeping_states(cache) -> None:
    """Back to keeping only the newest state, as stock `generate` leaves a cache it returns (after a crop)."""
    for layer in cache.layers:
        if hasattr(layer, "record_past"):
            layer.record_past = False


def _states(layer, kind: str):
    """(index, tensor) of the layer's initialized `kind` ("conv" or "recurrent") states."""
    initialized = getattr(layer, f"is_{kind}_states_initialized")
    return [(i, state) for i, state in getattr(layer, f"{kind}_states").items() if initialized.get(i)]


# ------------------------------------------------------------------------------------------------------------------
# The batched engine: one state per row
# ------------------------------------------------------------------------------------------------------------------


def keep_states_after(cache, kept: torch.LongTensor, width: int) -> None:
    """After a recorded forward of `width` tokens per row, give each row of every recurrent layer its state after
    its first `kept[r]` tokens (1 <= kept[r] <= width, on the device), then stop recording. The tokens past them
    (rejected drafts, padding) leave no trace in these layers; attention layers keep them as holes."""
    for layer in cache.layers:
        if not is_recurrent_layer(layer) or not getattr(layer, "record_past", False):
            continue
        rows = torch.arange(kept.shape[0], device=kept.device)
        for index, window in _states(layer, "conv"):
            size = layer.conv_kernel_size[index]
            columns = (kept[:, None] + torch.arange(size, device=kept.device))[:, None, :]
            layer.conv_states[index] = window.gather(2, columns.expand(-1, window.shape[1], -1)).contiguous()
        for index, current in _states(layer, "recurrent"):
            history = layer.recurrent_states_history[index]
            every = torch.stack([*history[len(history) - width :], current])  # (width + 1, R, ...): 0..width tokens
            layer.recurrent_states[index] = every[kept, rows].contiguous()
        layer.recurrent_states_history = {index: [] for index in range(layer.number_of_states)}
        layer.record_past = False


def select_state_rows(layer, rows: torch.LongTensor) -> None:
    """Keep the given rows (batch indices, on the device) of a recurrent layer's states."""
    for kind in ("conv", "recurrent"):
        states = getattr(layer, f"{kind}_states")
        for index, state in _states(layer, kind):
            states[index] = state.index_select(0, rows)


def stack_state_rows(layer, others: list) -> None:
    """Append the rows of `others` (recurrent layers of the same kind, all holding only their newest states) to
    `layer`, in order."""
    for kind in ("conv", "recurrent"):
        states, theirs = getattr(layer, f"{kind}_states"), [dict(_states(other, kind)) for other in others]
        for index, state in _states(layer, kind):
            states[index] = torch.cat([state, *(their[index] for their in theirs)], dim=0)


def snapshot_state_fields(layer) -> dict:
    """A recurrent layer's fields for an undo: the states cloned (the model writes into them), the rest copied."""
    fields = dict(vars(layer))
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            fields[name] = value.clone()
        elif isinstance(value, dict):
            fields[name] = {key: item.clone() if isinstance(item, torch.Tensor) else item
                            for key, item in value.items()}
    return fields


# ------------------------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------------------------


def state_problems(target) -> list[str]:
    """What the installed transformers no longer does of what this module relies on, tried on `target` (a tiny
    hybrid model): empty when a recorded forward of 3 tokens, cropped by 2, leaves the states of its first token."""
    cache = cache_utils.DynamicCache(config=target.config)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        target(input_ids=tokens[:, :3], cache=cache, use_cache=True)
        keep_recurrent_states(cache, 3)
        target(input_ids=tokens[:, 3:], cache=cache, use_cache=True)
        cache.crop(-2)
        stop_keeping_states(cache)
        reference = cache_utils.DynamicCache(config=target.config)
        target(input_ids=tokens[:, :4], cache=reference, use_cache=True)
    problems = []
    for index, (layer, expected) in enumerate(zip(cache.layers, reference.layers)):
        if not is_recurrent_layer(layer):
            continue
        for kind in ("conv", "recurrent"):
            found, wanted = dict(_states(layer, kind)), dict(_states(expected, kind))
            if found.keys() != wanted.keys() or not all(
                    found[i].shape == wanted[i].shape and torch.allclose(found[i], wanted[i], atol=1e-5)
                    for i in wanted):
                problems.append(f"layer {index}'s {kind} state after a recorded forward and crop(-2) is not the "
                                "state after the kept tokens")
    return problems
