"""Every config field a drafter loader reads is checked before any module is built (issue 30, items 4-8): a bad
value, in every layout hf_dspark reads (its own DSpark / Eagle3, DeepSpec's, speculators', z-lab DFlash's), is one
`DrafterLoadError` naming the file, the field, the value and the fix, never an error from deep inside torch or
transformers; sizes that the weights do not have are refused from the safetensors headers, before any real module
is built (a `vocab_size` of 10**12 beside a tiny checkpoint once asked torch for 64 TB); the config classes refuse
the same values; the command line prints the refusal on one line with exit code 2."""

import json
import shutil
import time

import pytest
import torch

import hf_dspark
from hf_dspark import DSparkDraftConfig, DSparkDraftModel, Eagle3DraftConfig, Eagle3DraftModel
from hf_dspark.models.config_checks import MAX_BLOCK_SIZE
from hf_dspark.models.errors import DrafterLoadError
from factories import tiny_target

LAYOUTS = ("own_dspark", "own_eagle3", "deepspec_dspark", "deepspec_eagle3", "speculators_dspark",
           "speculators_eagle3", "zlab")
BLOCK_LAYOUTS = ("own_dspark", "deepspec_dspark", "speculators_dspark")  # with a vocabulary-sized Markov head
LAYER_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                "rope_parameters"}


def where(layout: str, field: str) -> str:
    """How `field` (hf_dspark's name; "rope_type" for the rope type) is named in `layout`'s config.json."""
    field = "rope_parameters" if field == "rope_type" else field
    if layout.startswith("speculators") and field in LAYER_FIELDS:
        return f"transformer_layer_config.{field}"
    if field == "block_size":
        return {"deepspec_eagle3": "ttt_length", "speculators_eagle3": "speculative_tokens"}.get(layout, field)
    return field


def edited(config: dict, layout: str, field: str, value) -> dict:
    """`config` (a config.json dict of `layout`) with `field` set to `value` where that layout keeps it."""
    if field == "rope_type":
        holder = config["transformer_layer_config"] if layout.startswith("speculators") else config
        holder["rope_parameters"] = {**holder["rope_parameters"], "rope_type": value}
    elif layout.startswith("speculators") and field in LAYER_FIELDS:
        config["transformer_layer_config"][field] = value
    elif layout == "zlab" and field == "block_size":
        config["dflash_config"]["block_size"] = value
    elif field == "block_size" and layout in ("deepspec_eagle3", "speculators_eagle3"):
        if layout == "deepspec_eagle3":
            config["ttt_length"] = value
        else:
            config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = value
    else:
        config[field] = value
    if field == "num_hidden_layers" and "layer_types" in config:
        config.pop("layer_types")  # the depth alone disagrees with the weights (a huge one must not be built)
    if field == "num_hidden_layers" and layout.startswith("speculators"):
        config["transformer_layer_config"].pop("layer_types", None)
    return config


def bad_copy(folders, tmp_path, layout: str, field: str, value):
    folder = tmp_path / f"{layout}-bad"
    shutil.copytree(folders / layout, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edited(config, layout, field, value)))
    return folder


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a drafter is built anywhere but on the meta device (which allocates nothing)."""
    for cls in (DSparkDraftModel, Eagle3DraftModel):
        original = cls.__init__

        def guarded(self, config, *args, _original=original, **kwargs):
            if torch.get_default_device().type != "meta":
                raise AssertionError(f"a {type(self).__name__} was built before the config was refused")
            _original(self, config, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", guarded)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_still_loads(folders, layout):
    drafter = hf_dspark.AutoDrafter.from_pretrained(folders / layout)
    assert isinstance(drafter.config.num_draft_slots, int) and 1 <= drafter.config.num_draft_slots <= 4


BAD_VALUES = [  # items 5, 6 and 7 of the issue
    ("hidden_act", "swish42"), ("dtype", "float7"), ("torch_dtype", "float7"), ("hidden_size", -64),
    ("intermediate_size", -128), ("block_size", 4.5), ("num_attention_heads", 0), ("num_key_value_heads", 0),
    ("head_dim", -16), ("rope_type", "bogus"), ("block_size", "4"), ("hidden_size", "64"), ("block_size", True),
    ("num_attention_heads", True), ("num_key_value_heads", 3), ("block_size", 20000), ("rms_norm_eps", "tiny"),
]


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_bad_field_is_one_error_naming_the_file_the_field_and_the_value(folders, tmp_path, nothing_built, layout,
                                                                          field, value):
    folder = bad_copy(folders, tmp_path, layout, field, value)
    with pytest.raises(DrafterLoadError) as refusal:
        hf_dspark.AutoDrafter.from_pretrained(folder)
    message = str(refusal.value)
    assert str(folder / "config.json") in message, message
    shown = "'bogus'" if field == "rope_type" else f"{where(layout, field)}={value!r}"
    assert where(layout, field) in message and shown in message, message
    assert "; " in message and message.endswith("."), message  # the problem, then the fix


@pytest.mark.parametrize("layout", ["own_dspark", "speculators_dspark"])
def test_a_slot_convention_flag_must_be_a_boolean(folders, tmp_path, nothing_built, layout):
    """`"sample_from_anchor": "no"` was a raw TypeError in hf_dspark's layout and read as True by speculators'
    (bool("no")); DeepSpec's reader keeps its documented reading of "true"/"false"/0/1 (tests/layouts/test_convert.py)."""
    folder = bad_copy(folders, tmp_path, layout, "sample_from_anchor", "no")
    with pytest.raises(DrafterLoadError, match="sample_from_anchor='no', which is a str, not a boolean"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_config_json_that_is_not_an_object_is_refused(folders, tmp_path, layout):
    from hf_dspark.models.loading import load_drafter

    folder = tmp_path / "listed"
    shutil.copytree(folders / layout, folder)
    (folder / "config.json").write_text(json.dumps([json.loads((folder / "config.json").read_text())]))
    for load in (hf_dspark.AutoDrafter.from_pretrained, lambda path: load_drafter(path, None)):
        with pytest.raises(hf_dspark.UserInputError, match=f"{folder / 'config.json'} holds a JSON list"):
            load(folder)


HUGE = [("vocab_size", 10**12), ("hidden_size", 10**9), ("intermediate_size", 10**11), ("num_hidden_layers", 10**9),
        ("num_hidden_layers", 200), ("num_target_layers", 10**9), ("markov_rank", 10**12)]


@pytest.mark.parametrize("field,value", HUGE, ids=[f"{f}={v}" for f, v in HUGE])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sizes_the_weights_do_not_have_are_refused_before_anything_is_built(folders, tmp_path, nothing_built,
                                                                            layout, field, value):
    """Item 4: the shapes come from the safetensors headers and a model built on the meta device; no real module
    (and no tensor of the config's sizes) exists before the refusal, which comes at once."""
    if field == "markov_rank" and layout not in BLOCK_LAYOUTS:
        pytest.skip("no Markov head in this layout")
    if field == "num_target_layers" and not layout.startswith(("deepspec", "zlab")):
        pytest.skip("the layout does not record its target's depth")
    if field == "vocab_size" and layout not in BLOCK_LAYOUTS + ("deepspec_eagle3",):
        pytest.skip("no weight of this drafter is vocabulary-sized (the target check refuses it at generate())")
    folder = bad_copy(folders, tmp_path, layout, field, value)
    start = time.perf_counter()
    with pytest.raises(DrafterLoadError, match=str(folder)):
        hf_dspark.AutoDrafter.from_pretrained(folder)
    assert time.perf_counter() - start < 10


def test_a_deepspec_vocabulary_of_twenty_million_allocates_nothing(folders, tmp_path, nothing_built):
    """The probe's case: 2.8 GB of RSS for a 350 KB checkpoint before the refusal."""
    folder = bad_copy(folders, tmp_path, "deepspec_dspark", "vocab_size", 20_000_000)
    with pytest.raises(DrafterLoadError, match=r"markov_head.markov_w1.weight \(96, 16\) stored, \(20000000, 16\)"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


@pytest.mark.parametrize("layout", ["own_dspark", "deepspec_dspark", "zlab"])
def test_a_block_must_fit_the_position_range(folders, tmp_path, layout):
    """Item 8: the block must fit max_position_embeddings, and there is a documented cap (MAX_BLOCK_SIZE)."""
    folder = bad_copy(folders, tmp_path, layout, "max_position_embeddings", 4)
    with pytest.raises(DrafterLoadError, match="block_size=4, which does not fit max_position_embeddings=4"):
        hf_dspark.AutoDrafter.from_pretrained(folder)
    folder = bad_copy(folders, tmp_path / "big", layout, "block_size", MAX_BLOCK_SIZE + 1)
    with pytest.raises(DrafterLoadError, match=f"at most {MAX_BLOCK_SIZE}.*acceptance decays"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


def test_the_largest_block_allowed_still_builds():
    config = DSparkDraftConfig.from_target_config(tiny_target("qwen3").config, num_hidden_layers=1,
                                                  block_size=MAX_BLOCK_SIZE, markov_rank=4)
    assert DSparkDraftModel(config).config.num_draft_slots == MAX_BLOCK_SIZE


CLASS_VALUES = [*BAD_VALUES, ("rope_scaling", {"type": "bogus"}), ("rope_parameters", {"rope_type": "linear"}),
                ("target_layer_ids", [0, True]), ("draft_vocab_size", 0), ("max_position_embeddings", 0),
                ("num_hidden_layers", 10**9), ("target_num_hidden_layers", 10**9)]


@pytest.mark.parametrize("field,value", CLASS_VALUES, ids=[f"{f}={v!r}" for f, v in CLASS_VALUES])
@pytest.mark.parametrize("config_class", [DSparkDraftConfig, Eagle3DraftConfig])
def test_the_config_classes_refuse_the_same_values(config_class, field, value):
    fields = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}} if field == "rope_type" else {}
    if field == "rope_type":
        field, value = "rope_parameters", {**fields["rope_parameters"], "rope_type": value}
    with pytest.raises(DrafterLoadError, match=f"{config_class.__name__} has {field}="):
        config_class(**{field: value})
    with pytest.raises(DrafterLoadError, match=field):
        config_class.from_dict({field: value})


def test_a_sample_from_anchor_that_is_not_a_boolean_is_refused_by_the_class():
    with pytest.raises(DrafterLoadError, match="sample_from_anchor='no'"):
        DSparkDraftConfig(sample_from_anchor="no")
    with pytest.raises(DrafterLoadError, match="block_size must be at least 2 when sample_from_anchor is false"):
        DSparkDraftConfig(sample_from_anchor=False, block_size=1)


def test_automodel_names_the_file_too(folders, tmp_path):
    from transformers import AutoModel

    folder = bad_copy(folders, tmp_path, "own_dspark", "hidden_act", "swish42")
    with pytest.raises(DrafterLoadError, match=f"{folder / 'config.json'} has hidden_act='swish42'"):
        AutoModel.from_pretrained(folder)


def test_the_command_line_prints_one_line_and_exits_2(folders, tmp_path, capsys):
    """`hf-dspark generate --drafter` with a bad hidden_act: one line naming the file and the field, exit code 2."""
    from hf_dspark.cli.main import main
    from saved_chat_models import save_chat_target

    save_chat_target(tmp_path / "target")
    for layout in ("own_dspark", "deepspec_dspark", "zlab"):
        folder = bad_copy(folders, tmp_path / layout, layout, "hidden_act", "swish42")
        capsys.readouterr()
        code = main(["generate", "hi", "--target", str(tmp_path / "target"), "--drafter", str(folder),
                     "--max-new-tokens", "4", "--device", "cpu"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("hf-dspark ")]
        assert code == 2 and "Traceback" not in err and len(lines) == 1, err
        assert lines[0].startswith("hf-dspark generate: ") and f"{folder / 'config.json'}" in lines[0]
        assert "hidden_act='swish42'" in lines[0]
