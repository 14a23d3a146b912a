"""What hf_dspark relies on of transformers' private API, pinned against the installed transformers (CI runs this on
the oldest supported release, `scripts/test_transformers_range.sh` on any other): the cache internals
(`hf_dspark/transformers_internals/cache_layers.py`), the private attributes read (`accessors.py`) and the Trainer's
private methods (`trainer_hooks.py`); a transformers release that changes one of them fails here first, with the
module to update. The checks themselves are tested on stand-ins, and the engine's growing cache layer against
transformers' own `DynamicLayer`. Last, that no hf_dspark module outside `hf_dspark/transformers_internals/` uses
transformers' private API (a walk over the source)."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_dspark.transformers_internals as transformers_internals_package
from hf_dspark.transformers_internals import MODEL_DECLARATIONS, PRIVATE_NAMES
from hf_dspark.transformers_internals import attention
from hf_dspark.transformers_internals import cache_layers as internals
from hf_dspark.transformers_internals.attention import mask_taking_attention
from hf_dspark.transformers_internals.accessors import accessor_problems
from hf_dspark.transformers_internals.cache_layers import GrowingLayer
from hf_dspark.transformers_internals.trainer_hooks import trainer_problems
from factories import prompts, tiny_target


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
    assert "transformers_internals/cache_layers.py" in message and internals.SUPPORTED in message


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


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_growing_layers_append_in_place_under_inference_mode_too(mode):
    """A server's engine thread runs under `torch.inference_mode()`, where views record no `_base`: the layer must
    still see its keys as a view of its buffer and write the next entries in place (it copied the whole cache at
    every step when it asked `_base`)."""
    layer = GrowingLayer()
    with mode():
        layer.update(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
        buffer, values = layer.key_buffer, layer.value_buffer
        for step in range(GrowingLayer.spare - 1):
            keys, _ = layer.update(torch.full((2, 3, 1, 4), float(step)), torch.zeros(2, 3, 1, 4))
            assert layer.key_buffer is buffer and layer.value_buffer is values
        assert keys.shape[2] == 5 + GrowingLayer.spare - 1 and torch.equal(keys[:, :, -1], buffer[:, :, keys.shape[2] - 1])
        layer.crop(-2)  # transformers' own method slices: still a view of the buffer
        layer.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
        assert layer.key_buffer is buffer
        layer.keys = layer.keys.clone()  # replaced by another tensor: the next update takes a new buffer
        layer.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
        assert layer.key_buffer is not buffer


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


def test_installed_transformers_keeps_what_the_grouped_attention_relies_on():
    assert attention.attention_problems() == []

    def transposed(module, query, key, value, attention_mask, **kwargs):  # a release that returns (B, H, Q, D)
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return output.transpose(1, 2), None

    def renamed(module, query, key, value, mask, dropout=0.0, scale=None):  # a release that renamed its arguments
        raise AssertionError("unreachable")

    assert "differs" in attention.attention_problems(reference=transposed)[0]
    assert "no longer works as called" in attention.attention_problems(reference=renamed)[0]


def test_the_engines_attention_computes_transformers_sdpa_without_copying_key_value_heads(monkeypatch):
    """A verification forward (several queries per row, holes in the cache) under `mask_taking_attention` gives
    exactly the logits of transformers' sdpa, without `repeat_kv` (the copy it exists to avoid)."""
    import transformers.integrations.sdpa_attention as transformers_sdpa

    target = tiny_target("llama")
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    ids = prompts(3, length=9)
    batch = torch.cat([p[:, :9] for p in ids])
    valid = torch.ones(3, 9, dtype=torch.long)
    valid[0, 2] = valid[1, 5] = valid[2, :3] = 0  # holes and left padding, as the engine's caches have
    positions = (valid.cumsum(dim=1) - 1).clamp_min(0)
    with torch.no_grad():
        expected = target(batch, attention_mask=valid, position_ids=positions).logits
        copies = []
        repeat_kv = transformers_sdpa.repeat_kv
        monkeypatch.setattr(transformers_sdpa, "repeat_kv", lambda *args: copies.append(1) or repeat_kv(*args))
        with mask_taking_attention(target):
            logits = target(batch, attention_mask=valid, position_ids=positions).logits
    assert copies == []
    real = valid.bool()
    assert torch.equal(logits[real], expected[real])
    assert target.config._attn_implementation == "sdpa"


def test_static_layers_are_given_and_generate_is_told_their_length():
    target = tiny_target("llama")
    cache = StaticCache(config=target.config, max_cache_len=16)
    internals.use_static_layers(target, cache, 64)
    assert all(type(layer) is StaticLayer and layer.max_cache_len == 64 for layer in cache.layers)
    assert target._previous_max_cache_length == 64


# ------------------------------------------------------------------------------------------------------------------
# transformers' private API is used in hf_dspark/transformers_internals/ only
# ------------------------------------------------------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "hf_dspark"
INTERNALS = PACKAGE / "transformers_internals"
OUTSIDE = sorted(p for p in PACKAGE.rglob("*.py") if INTERNALS not in p.parents)

# Private names of other libraries that hf_dspark reads outside the package, each with its owner. Not transformers':
# allowed, but listed, so that a new one is a decision.
OTHER_LIBRARIES = {
    "_base": "torch.Tensor (is this tensor a view of that buffer?)",
    "_version": "torch.Tensor (in-place write counter)",
    "_parameters": "torch.nn.Module", "_buffers": "torch.nn.Module", "_non_persistent_buffers_set": "torch.nn.Module",
    "_standard_gamma": "torch",
    "_hf_hook": "accelerate (the offloading hook of a module)",
    "_instances": "tqdm (the open progress bars)",
}
# The config.json key transformers writes for `_name_or_path`: a file-format field that converters drop or copy.
CONFIG_FILE_KEYS = {"_name_or_path"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def transformers_private_names() -> set[str]:
    """The private names transformers defines on the classes hf_dspark works with, the private attributes its
    generation, config, modeling, cache and trainer code sets on any object (`generation_config._pad_token_tensor`),
    and every name the internals package registers."""
    from transformers import (Cache, GenerationConfig, GenerationMixin, LlamaConfig, LlamaForCausalLM,
                              PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments)

    names = set(PRIVATE_NAMES) | set(MODEL_DECLARATIONS)
    for cls in (PreTrainedModel, PreTrainedConfig, GenerationConfig, GenerationMixin, Cache, DynamicCache, StaticCache,
                DynamicLayer, StaticLayer, Trainer, TrainingArguments, PreTrainedTokenizerBase, LlamaForCausalLM,
                LlamaConfig):
        for name in filter(_private, dir(cls)):
            owner = next((k for k in cls.__mro__ if name in vars(k)), None)
            if owner is not None and owner.__module__.startswith("transformers."):
                names.add(name)
    root = Path(transformers.__file__).parent
    for module in ("generation/utils.py", "generation/configuration_utils.py", "configuration_utils.py",
                   "modeling_utils.py", "cache_utils.py", "trainer.py"):
        names |= {"_" + found for found in re.findall(r"\w\._([A-Za-z]\w*)\s*=[^=]", (root / module).read_text())}
    return names - set(dir(torch.Tensor)) - set(dir(torch.nn.Module))


def own_private_names(paths) -> set[str]:
    """The private names hf_dspark's own code defines (outside the internals package): functions, classes, class
    attributes, module globals and `self.<name> = ...` attributes."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
    return set(filter(_private, found))


def private_uses(source: str, foreign: set[str], own: set[str], in_models: bool = False) -> list[str]:
    """Each use of transformers' private API in `source` (a module outside the internals package), as
    "line: what". `foreign`: transformers' private names; `own`: those hf_dspark defines itself."""
    found, read_by_getattr = [], set()

    def attribute(line, receiver, name, how):
        if not _private(name):
            return
        if isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) == "super":
            allowed = (in_models and name in MODEL_DECLARATIONS) or (name in own and name not in foreign)
        elif isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            allowed = name in own and name not in foreign
        else:
            allowed = name not in foreign and (name in own or name in OTHER_LIBRARIES)
        if not allowed:
            found.append(f"{line}: {how}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "transformers" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute):
            if node.attr in ("getsource", "getsourcelines"):
                found.append(f"{node.lineno}: inspect.{node.attr} (reading transformers' source)")
            elif node.attr == "layers" and ast.unparse(node.value).lower().endswith("cache"):
                found.append(f"{node.lineno}: {ast.unparse(node)} (a cache's layers: cache_layers.cache_layers)")
            else:
                attribute(node.lineno, node.value, node.attr, ast.unparse(node))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None)
            if name == "getsource":
                found.append(f"{node.lineno}: getsource (reading transformers' source)")
            if (name in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                attribute(node.lineno, node.args[0], node.args[1].value, ast.unparse(node))
                read_by_getattr.add(id(node.args[1]))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = ([item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                           [t.id for t in getattr(item, "targets", [getattr(item, "target", None)])
                            if isinstance(t, ast.Name)])
                for defined in targets:
                    if defined in foreign and not (in_models and defined in MODEL_DECLARATIONS):
                        found.append(f"{item.lineno}: {node.name}.{defined} overrides transformers' private "
                                     f"{defined}")
        elif (isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES and id(node) not in read_by_getattr
              and node.value not in CONFIG_FILE_KEYS):
            found.append(f"{node.lineno}: the name {node.value!r}")
    return sorted(set(found), key=lambda entry: int(entry.split(":")[0]))


@pytest.fixture(scope="module")
def foreign_and_own():
    return transformers_private_names(), own_private_names(OUTSIDE)


def test_no_private_transformers_api_outside_the_internals_package(foreign_and_own):
    foreign, own = foreign_and_own
    found = {}
    for path in OUTSIDE:
        in_models = PACKAGE / "models" in path.parents
        uses = private_uses(path.read_text(), foreign, own, in_models)
        if uses:
            found[str(path.relative_to(PACKAGE))] = uses
    assert found == {}, ("transformers' private API used outside hf_dspark/transformers_internals/ (add a named "
                         f"function there, with its check): {found}")


def test_the_walk_finds_every_kind_of_private_use(foreign_and_own):
    foreign, own = foreign_and_own
    offending = {
        "config._attn_implementation == 'eager'": "config._attn_implementation",
        "getattr(generation_config, '_pad_token_tensor', None)": "getattr(generation_config",
        "target._supports_logits_to_keep()": "target._supports_logits_to_keep",
        "from transformers.generation.utils import _split_model_outputs": "import _split_model_outputs",
        "import transformers.models._something": "import transformers.models._something",
        "source = inspect.getsource(model.forward)": "inspect.getsource",
        "for layer in rows.target_cache.layers: pass": "rows.target_cache.layers",
        "class T(Trainer):\n    def _save_checkpoint(self, model, trial): pass": "overrides transformers' private",
        "class T(Trainer):\n    def step(self, x):\n        return self._prepare_inputs(x)": "self._prepare_inputs",
        "class T(Trainer):\n    def step(self, trial):\n        return super()._get_output_dir(trial)": "super()._get",
        "WRAPPERS = {'_assisted_decoding': None}": "the name '_assisted_decoding'",
        "model._some_private_of_a_future_release": "model._some_private_of_a_future_release",
    }
    for source, expected in offending.items():
        uses = private_uses(source, foreign, own)
        assert len(uses) == 1 and expected in uses[0], (source, uses)
    allowed = ("self._checkpoint_staging = None", "tensor._version", "torch._standard_gamma(x)",
               "KEYS = ('_name_or_path', 'transformers_version')", "class A:\n    _init_weights = None")
    assert [private_uses(s, foreign, own, in_models=True) for s in allowed] == [[]] * len(allowed)
    assert private_uses("class A(PreTrainedModel):\n    _no_split_modules = []", foreign, own)  # outside models/


def test_every_private_name_the_package_uses_is_registered(foreign_and_own):
    """The package's docstring and `PRIVATE_NAMES` name each private transformers name it uses."""
    foreign, _ = foreign_and_own
    used = set()
    for path in INTERNALS.rglob("*.py"):
        if path.name == "__init__.py":  # the register itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.add(node.value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                used.add(node.name)
    used &= foreign
    assert used - PRIVATE_NAMES == set()
    assert PRIVATE_NAMES - used == set(), "registered but no longer used"
    doc = transformers_internals_package.__doc__
    assert [name for name in sorted(PRIVATE_NAMES | MODEL_DECLARATIONS) if name not in doc] == []


def test_installed_transformers_keeps_the_private_attributes_hf_dspark_reads():
    problems = accessor_problems(tiny_target("llama"))
    assert problems == [], problems


def test_installed_trainer_keeps_the_private_methods_hf_dspark_overrides():
    assert trainer_problems() == []

    class DriftedTrainer:
        def _get_output_dir(self, trial, run=None):
            return ""

        def _save_checkpoint(self, model, trial):
            pass

    problems = trainer_problems(DriftedTrainer)
    assert len(problems) == 2 and "_get_output_dir takes ['self', 'trial', 'run']" in problems[0]
    assert "_prepare_inputs takes None" in problems[1]
