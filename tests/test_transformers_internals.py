"""What hf_dspark relies on of transformers' cache internals, pinned against the installed transformers
(`hf_dspark/generation/transformers_internals.py` is the one module that touches them): a transformers release that
changes one of them fails here first, with the module to update. The check itself is tested on stand-ins, and the
engine's growing cache layer against transformers' own `DynamicLayer`."""

from types import SimpleNamespace

import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from hf_dspark.generation import transformers_internals as internals
from hf_dspark.generation.transformers_internals import GrowingLayer
from conftest import prompts, tiny_target


def test_installed_transformers_keeps_the_cache_internals_hf_dspark_relies_on():
    problems = internals.internals_problems()
    assert problems == [], internals.incompatibility_message(problems)
    assert transformers.__version__.startswith("5."), f"written for {internals.SUPPORTED}"


class CropsInPlace(DynamicLayer):
    """A release whose crop zeroes the dropped entries in the tensor it keeps."""

    def crop(self, tokens_to_remove: int) -> None:
        self.keys[..., tokens_to_remove:, :] = 0
        super().crop(tokens_to_remove)


class KeepsEntriesElsewhere(DynamicLayer):
    """A release that stores entries under other names."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.stored = (key_states, value_states)
        return key_states, value_states


class RenamedUpdate(DynamicLayer):
    def update(self, keys, values, *args, **kwargs):
        return super().update(keys, values)


class StaticWithoutLength:
    def __init__(self, size: int):
        self.size = size


class GenerationWithoutPreviousLength:
    """Sizes its static caches some other way."""


def test_a_drifted_transformers_is_named_with_what_changed_and_the_fix():
    for layer_class, expected in ((CropsInPlace, "wrote into the tensors"), (KeepsEntriesElsewhere, "instance "
                                  "attributes keys/values"), (RenamedUpdate, "update takes")):
        problems = internals.internals_problems(layer_class=layer_class, cache_class=DynamicCache)
        assert any(expected in problem for problem in problems), (layer_class, problems)
    problems = internals.internals_problems(static_class=StaticWithoutLength,
                                            generation_class=GenerationWithoutPreviousLength)
    assert len(problems) == 2 and "max_cache_len" in problems[0] and "_previous_max_cache_length" in problems[1]
    message = internals.incompatibility_message(problems)
    assert "transformers_internals.py" in message and internals.SUPPORTED in message


def test_growing_layers_give_the_dynamic_caches_logits_and_append_in_place():
    target = tiny_target("llama")
    ids = prompts(2, length=7)
    batch = torch.cat([ids[0], ids[1][:, :7]])
    plain, growing = DynamicCache(config=target.config), internals.growing_cache(target.config)
    assert all(type(layer) is GrowingLayer for layer in growing.layers)
    with torch.no_grad():
        expected = target(batch, cache=plain, use_cache=True).logits
        assert torch.equal(target(batch, cache=growing, use_cache=True).logits, expected)
        buffer = growing.layers[0].key_buffer
        token = batch[:, -1:]
        for step in range(GrowingLayer.spare + 2):  # past the spare columns: one new buffer
            expected = target(token, cache=plain, use_cache=True).logits
            assert torch.equal(target(token, cache=growing, use_cache=True).logits, expected)
            if step < GrowingLayer.spare - 1:
                assert growing.layers[0].key_buffer is buffer  # written in place, no copy of the cache
        assert growing.layers[0].key_buffer is not buffer
        # transformers' own methods replace the tensors; the next update notices and starts a new buffer.
        growing.crop(-3)
        growing.batch_select_indices(torch.tensor([1]))
        plain.crop(-3)
        plain.batch_select_indices(torch.tensor([1]))
        expected = target(token[1:], cache=plain, use_cache=True).logits
        assert torch.equal(target(token[1:], cache=growing, use_cache=True).logits, expected)
    for mine, theirs in zip(growing.layers, plain.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_row_and_column_selection_stacking_and_undo():
    layer = GrowingLayer()
    keys = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).reshape(3, 2, 5, 4)
    layer.update(keys, -keys)
    snapshot = internals.snapshot_layers(SimpleNamespace(layers=[layer]))
    internals.select_layer_entries(layer, torch.tensor([2, 0]), [0, 2, 3])
    assert torch.equal(layer.keys, keys[[2, 0]][:, :, [0, 2, 3]]) and torch.equal(layer.values, -layer.keys)
    extra = torch.ones(1, 2, 6, 4)
    internals.stack_layer_rows(layer, [internals.layer_tensors(layer), (extra, extra)])
    assert layer.keys.shape == (3, 2, 6, 4) and torch.equal(layer.keys[2], extra[0])
    assert torch.equal(layer.keys[:2, :, :3], keys[[2, 0]][:, :, [0, 2, 3]]) and not layer.keys[:2, :, 3:].any()
    layer.update(torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4))
    internals.restore_layers(SimpleNamespace(layers=[layer]), snapshot)
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, -keys)
    row = internals.row_entries(SimpleNamespace(layers=[layer]), 1, torch.tensor([1, 4]))
    assert torch.equal(row[0][0], keys[1:2, :, [1, 4]])


def test_static_layers_are_given_and_generate_is_told_their_length():
    target = tiny_target("llama")
    cache = StaticCache(config=target.config, max_cache_len=16)
    internals.use_static_layers(target, cache, 64)
    assert all(type(layer) is StaticLayer and layer.max_cache_len == 64 for layer in cache.layers)
    assert target._previous_max_cache_length == 64
