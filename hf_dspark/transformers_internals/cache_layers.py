"""Every use hf_dspark's decoding makes of transformers' cache internals, in one place, with the check that they
still hold (`internals_problems`, pinned by tests/coexistence/test_transformers_internals.py). Code outside this package reaches
a cache's layers through `cache_layers`, never `cache.layers` itself.

What is relied on (transformers 5.24):

* a `DynamicLayer` keeps its entries in the instance attributes `keys` and `values`, (batch, heads, length, dim),
  and `is_initialized`; `update(key_states, value_states, *args, **kwargs)` appends and returns them;
* `DynamicLayer.crop` and `batch_select_indices` *replace* those tensors (a slice or a new tensor), never write into
  them, so a reference kept before a step still holds the entries of before the step (the engine's undo);
* `DynamicCache(config=...)` holds one layer object per decoder layer in `cache.layers`, a plain `DynamicLayer` for a
  full-attention layer, which may be swapped for another layer object;
* `StaticLayer(max_cache_len=...)`, and `generate` sizing its next static cache from the model's
  `_previous_max_cache_length`;
* a hybrid target's recurrent and convolution layers: what is relied on is listed in `recurrent_states`, which
  handles them (the engine keeps them as they are beside its `GrowingLayer`s; they have no holes);

`GrowingLayer` is the engine's target-cache layer: a `DynamicLayer` whose keys and values are views of a buffer with
spare columns, so a decoding step writes its entries in place instead of copying the whole cache with `torch.cat`
(which costs more than the step's matmuls at batch 64). It writes only columns past its current length, so the
second point above still holds for it.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from transformers import DynamicCache, LlamaConfig
from transformers import cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer
from transformers.generation.utils import GenerationMixin

from .recurrent_states import (is_recurrent_layer, is_stateless_layer, select_state_rows, snapshot_state_fields,
                               stack_state_rows)

SUPPORTED = "transformers 5.24"


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends in place into spare columns (see the module docstring)."""

    spare = 64  # columns allocated ahead: a new buffer (one copy) every `spare` decoding steps

    def __init__(self):
        super().__init__()
        self.key_buffer = self.value_buffer = None

    def hold(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
        """Copy `keys`/`values` (batch, heads, length, dim) into a new buffer with at least `room` spare columns."""
        batch, heads, length, dim = keys.shape
        width = length + max(room, self.spare)
        self.key_buffer = keys.new_empty(batch, heads, width, dim)
        self.value_buffer = values.new_empty(batch, heads, width, values.shape[-1])
        self.key_buffer[:, :, :length] = keys
        self.value_buffer[:, :, :length] = values
        self.take_buffers(self.key_buffer, self.value_buffer, length)

    def take_buffers(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        """Hold these buffers, whose first `length` columns are the entries."""
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self._view(length)
        self.device, self.is_initialized = key_buffer.device, True

    def hold_selected(self, rows: torch.LongTensor | None, columns: list[int] | None) -> None:
        """Keep the given rows and columns (None: all), copied once into a new buffer: the kept columns are copied
        run by run (a run of adjacent columns is a slice, which needs no copy of its own)."""
        runs = _runs(columns) if columns is not None else [(0, self.keys.shape[2])]
        length = sum(end - start for start, end in runs)
        count = self.keys.shape[0] if rows is None else len(rows)
        self.key_buffer = self.keys.new_empty(count, self.keys.shape[1], length + self.spare, self.keys.shape[3])
        self.value_buffer = self.values.new_empty(count, self.values.shape[1], length + self.spare,
                                                  self.values.shape[3])
        at = 0
        for start, end in runs:
            for source, buffer in ((self.keys, self.key_buffer), (self.values, self.value_buffer)):
                if rows is None:
                    buffer[:, :, at : at + end - start] = source[:, :, start:end]
                else:
                    torch.index_select(source[:, :, start:end], 0, rows, out=buffer[:, :, at : at + end - start])
            at += end - start
        self._view(length)

    def _view(self, length: int) -> None:
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def _in_buffer(self) -> bool:
        """Whether `keys` is still a prefix view of the buffer (a transformers method may have replaced it). Read
        from storage and strides, not `_base`: under `torch.inference_mode()` (a server's engine thread) views
        record no base, and a check on it copied the whole cache at every step (10 % of a server's time)."""
        return all(buffer is not None and is_prefix_view(tensor, buffer, dim=2)
                   for tensor, buffer in ((self.keys, self.key_buffer), (self.values, self.value_buffer)))

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.hold(key_states, value_states)
            return self.keys, self.values
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if not self._in_buffer() or length + new > self.key_buffer.shape[-2]:
            self.hold(self.keys, self.values, room=new + self.spare)
        self.key_buffer[:, :, length : length + new] = key_states
        self.value_buffer[:, :, length : length + new] = value_states
        self._view(length + new)
        return self.keys, self.values


def is_prefix_view(view: torch.Tensor, buffer: torch.Tensor, dim: int) -> bool:
    """Whether `view` is `buffer`'s first columns along `dim` (every other dimension whole), so that appending
    writes the columns after it. Read from storage, offset and strides, never `_base`: views made under
    `torch.inference_mode()` record no base."""
    return (view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() and view.storage_offset() == 0
            and view.stride() == buffer.stride() and view.shape[:dim] == buffer.shape[:dim]
            and view.shape[dim + 1:] == buffer.shape[dim + 1:] and view.shape[dim] <= buffer.shape[dim])


def _runs(columns: list[int]) -> list[tuple[int, int]]:
    """[start, end) ranges of adjacent column indices, in order."""
    runs: list[tuple[int, int]] = []
    for column in columns:
        if runs and runs[-1][1] == column:
            runs[-1] = (runs[-1][0], column + 1)
        else:
            runs.append((column, column + 1))
    return runs


# ------------------------------------------------------------------------------------------------------------------
# Cache layers as the engine uses them
# ------------------------------------------------------------------------------------------------------------------


def growing_cache(config) -> DynamicCache | None:
    """A `DynamicCache` for `config` whose attention layers are `GrowingLayer`s, or None when some layer is of a kind
    the engine cannot keep (one layer holding both attention entries and a recurrent state). A sliding-window layer
    becomes a full-length layer too: its window counts cache slots, holes included, so the engine applies it in its
    own mask instead (`engine.masks`), by position. A hybrid target's recurrent and convolution layers stay as
    transformers made them (one state per row, no holes: `recurrent_states`), and so do layers without a cache
    (Gemma 4's KV-shared layers read their producer's entries)."""
    cache = DynamicCache(config=config)
    attention = [type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers]
    if not all(kept or _is_own_state(layer) for kept, layer in zip(attention, cache.layers)):
        return None
    cache.layers = [GrowingLayer() if kept else layer for kept, layer in zip(attention, cache.layers)]
    return cache


def _is_own_state(layer) -> bool:
    """A recurrent / convolution layer without attention entries, or a layer without a cache."""
    return is_stateless_layer(layer) or (is_recurrent_layer(layer) and not hasattr(layer, "keys"))


def attention_layer_types(config) -> list[str]:
    """Each decoder layer's attention kind ("full_attention", "sliding_attention", ...), as `DynamicCache(config=...)`
    reads it: `layer_types`, else `sliding_window` / `attention_chunk_size` of the decoder's config."""
    text = config.get_text_config(decoder=True)
    read = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    if read is not None:
        return list(read(text)[0])
    types = getattr(text, "layer_types", None)
    if types is not None:
        return list(types)
    if getattr(text, "sliding_window", None) is not None:
        return ["sliding_attention"] * text.num_hidden_layers
    if getattr(text, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * text.num_hidden_layers
    return ["full_attention"] * text.num_hidden_layers


_MASK_MAPPING = re.compile(r"isinstance\(\s*(\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)")


def takes_mask_mapping(target) -> bool:
    """Whether the target's decoder takes `attention_mask` as a ready mapping {layer type: 4D mask} (and then builds
    no mask of its own), as transformers' models with mixed layer types do for `generate`."""
    return _forward_takes_mask_mapping(type(target.base_model))


@functools.lru_cache(maxsize=None)
def _forward_takes_mask_mapping(model_class) -> bool:
    try:
        source = inspect.getsource(model_class.forward)
    except (AttributeError, OSError, TypeError):
        return False
    return _MASK_MAPPING.search(source) is not None


def cache_layers(cache) -> list:
    """The layer objects of a transformers `Cache` (`cache.layers`: one per decoder layer), as the engine and the
    static-cache runner walk them."""
    return cache.layers


def layer_tensors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.keys, layer.values


def select_layer_entries(layer, rows: torch.LongTensor | None = None, columns: list[int] | None = None) -> None:
    """Keep the given rows (batch indices, on the device) and columns (entry indices, host ints) of the engine's
    `layer` (a `GrowingLayer`; a recurrent layer keeps its rows, having no columns); None keeps all."""
    if is_recurrent_layer(layer):
        if rows is not None:
            select_state_rows(layer, rows)
    elif not is_stateless_layer(layer):
        layer.hold_selected(rows, columns)


def crop_entries(cache, count: int) -> None:
    """Drop the last `count` entries of every attention layer (the trailing columns no row kept); recurrent layers
    have none (their states were chosen per row) and layers without a cache nothing."""
    for layer in cache.layers:
        if not (is_recurrent_layer(layer) or is_stateless_layer(layer)):
            layer.crop(-count)


def merge_layer_rows(layer, others: list) -> None:
    """Append the rows of `others` (the same layer of other blocks of rows) to the engine's `layer`, each block's
    entries padded with holes to the widest one."""
    if is_recurrent_layer(layer):
        stack_state_rows(layer, others)
    elif not is_stateless_layer(layer):
        stack_layer_rows(layer, [layer_tensors(layer), *(layer_tensors(other) for other in others)])


def row_entries(cache, row: int, columns: torch.LongTensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One row's entries at `columns` of every layer, as new (1, heads, len(columns), dim) tensors."""
    return [(layer.keys[row : row + 1].index_select(2, columns), layer.values[row : row + 1].index_select(2, columns))
            for layer in cache.layers]


def stack_layer_rows(layer: GrowingLayer, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make the engine's `layer` the rows of `blocks` stacked in order, each padded at the end of its entries with zeros (holes)
    to the widest block: one copy of each block."""
    width = max(keys.shape[2] for keys, _ in blocks)
    first_keys, first_values = blocks[0]
    rows = sum(keys.shape[0] for keys, _ in blocks)
    spare = layer.spare
    key_buffer = first_keys.new_empty(rows, first_keys.shape[1], width + spare, first_keys.shape[3])
    value_buffer = first_values.new_empty(rows, first_values.shape[1], width + spare, first_values.shape[3])
    start = 0
    for keys, values in blocks:
        end = start + keys.shape[0]
        key_buffer[start:end, :, : keys.shape[2]] = keys
        value_buffer[start:end, :, : values.shape[2]] = values
        # Holes are masked, but a masked entry still meets a zero attention weight: it must not be inf or NaN.
        key_buffer[start:end, :, keys.shape[2] : width] = 0
        value_buffer[start:end, :, values.shape[2] : width] = 0
        start = end
    layer.take_buffers(key_buffer, value_buffer, width)


def snapshot_layers(cache) -> list[dict]:
    """Each layer's state by reference (see the module docstring: nothing a step does writes into it), but a
    recurrent layer's, which the model writes into: cloned."""
    return [snapshot_state_fields(layer) if is_recurrent_layer(layer) else dict(vars(layer)) for layer in cache.layers]


def restore_layers(cache, snapshot: list[dict]) -> None:
    for layer, fields in zip(cache.layers, snapshot):
        vars(layer).clear()
        vars(layer).update(fields)


def use_static_layers(target, cache, capacity: int) -> None:
    """Give `cache` full-attention static layers of `capacity` entries, and tell `generate` (as its own static
    caches do) so that its next static cache has this length and the compiled forward its shapes."""
    cache.layers = [StaticLayer(max_cache_len=capacity) for _ in cache.layers]
    target._previous_max_cache_length = max(getattr(target, "_previous_max_cache_length", -1), capacity)


# ------------------------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------------------------


def internals_problems(layer_class=DynamicLayer, static_class=StaticLayer, generation_class=GenerationMixin,
                       cache_class=DynamicCache) -> list[str]:
    """What the installed transformers no longer does of what this module relies on (empty when all holds). The
    classes are parameters so that the check itself can be tested on stand-ins."""
    return (_cache_problems(cache_class) + _layer_problems(layer_class)
            + _static_problems(static_class, generation_class))


def _cache_problems(cache_class) -> list[str]:
    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2)
    try:
        layers = cache_class(config=config).layers
    except (AttributeError, TypeError, ValueError) as error:
        return [f"{cache_class.__name__}(config=...) no longer works: {type(error).__name__}: {error}"]
    if len(layers) != 2 or any(type(layer) is not DynamicLayer for layer in layers):
        return [f"{cache_class.__name__}(config=...) no longer holds one DynamicLayer per full-attention layer in "
                f".layers (found {layers!r})"]
    return []


def _layer_problems(layer_class) -> list[str]:
    name = layer_class.__name__
    update = list(inspect.signature(layer_class.update).parameters)
    if update[:3] != ["self", "key_states", "value_states"]:
        return [f"{name}.update takes {update}, expected (self, key_states, value_states, ...)"]
    layer = layer_class()
    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    try:
        out = layer.update(keys, values)
        found = [vars(layer).get("keys"), vars(layer).get("values")]
        if not (all(isinstance(tensor, torch.Tensor) for tensor in found) and torch.equal(found[0], keys)
                and torch.equal(found[1], values) and out[0] is found[0] and vars(layer).get("is_initialized")):
            return [f"{name} no longer keeps its entries in the instance attributes keys/values/is_initialized that "
                    "update() returns"]
        kept = found[0].clone()
        layer.crop(-1)
        layer.batch_select_indices(torch.tensor([1]))
        layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    except (AttributeError, TypeError, KeyError, RuntimeError) as error:
        return [f"{name} no longer works as relied on: {type(error).__name__}: {error}"]
    problems = []
    if not torch.equal(found[0], kept):
        problems.append(f"{name}.crop/batch_select_indices/update wrote into the tensors they replaced: the engine's "
                        "undo keeps references to them")
    if tuple(vars(layer)["keys"].shape) != (1, 1, 3, 4):
        problems.append(f"{name}.crop(-n)/batch_select_indices no longer drop entries/rows as before")
    return problems


def _static_problems(static_class, generation_class) -> list[str]:
    problems = []
    if "max_cache_len" not in inspect.signature(static_class.__init__).parameters:
        problems.append(f"{static_class.__name__}() no longer takes max_cache_len")
    try:
        source = inspect.getsource(generation_class)
    except (OSError, TypeError):
        source = ""
    if "_previous_max_cache_length" not in source:
        problems.append(f"{generation_class.__name__} no longer sizes static caches from _previous_max_cache_length")
    return problems


def incompatibility_message(problems: list[str]) -> str:
    return (f"hf_dspark's cache handling (hf_dspark/transformers_internals/cache_layers.py) is written for {SUPPORTED}; "
            f"the installed transformers differs: {'; '.join(problems)}. Install {SUPPORTED}, or update that module "
            "and its pin test (tests/coexistence/test_transformers_internals.py).")
