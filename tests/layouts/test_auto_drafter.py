"""`hf_dspark.AutoDrafter.from_pretrained` and the classes' own `from_pretrained` load every layout directly (no
convert step), naming the layout found; a drafter checkpoint loaded by a stock class is refused by `generate()`
with the loader that works; the command line takes every layout with `--drafter`."""

import json
import logging

import pytest
import torch
from dflash import DFlashDraftModel
from transformers import AutoModel, Qwen3Config

import hf_dspark
from hf_dspark.cli.main import main
from hf_dspark.models.errors import DrafterLoadError, UserInputError
from factories import tiny_drafter, tiny_target

VOCAB = 96


def _zlab_folder(folder):
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         num_target_layers=4, architectures=["DFlashDraftModel"],
                         dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2], "block_size": 4})
    DFlashDraftModel(config).eval().save_pretrained(folder)  # z-lab's own class and save
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def zlab(tmp_path_factory):
    return _zlab_folder(tmp_path_factory.mktemp("zlab"))


def test_auto_drafter_loads_our_own_layout_as_the_class_it_names(tmp_path, target):
    tiny_drafter(target, "markov").save_pretrained(tmp_path / "dspark")
    tiny_drafter(target, "eagle3").save_pretrained(tmp_path / "eagle3")
    assert type(hf_dspark.AutoDrafter.from_pretrained(tmp_path / "dspark")) is hf_dspark.DSparkDraftModel
    eagle = hf_dspark.AutoDrafter.from_pretrained(str(tmp_path / "eagle3"), dtype=torch.bfloat16)
    assert type(eagle) is hf_dspark.Eagle3DraftModel and eagle.dtype == torch.bfloat16


def test_another_projects_layout_loads_directly_and_says_which(zlab, target, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dspark.models.formats"):
        drafter = hf_dspark.AutoDrafter.from_pretrained(zlab)
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_dspark.models.formats"]
    assert len(lines) == 1 and "zlab_dflash (DFlashDraftModel)" in lines[0], lines
    assert type(drafter) is hf_dspark.DSparkDraftModel and not drafter.config.sample_from_anchor
    same = hf_dspark.DSparkDraftModel.from_pretrained(zlab)  # the class's own loader converts too
    for (name, mine), (_, theirs) in zip(drafter.state_dict().items(), same.state_dict().items()):
        assert torch.equal(mine, theirs), name
    ids = torch.tensor([[5, 17, 33, 2, 60, 41]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16), expected)


def test_the_wrong_class_or_a_model_that_is_no_drafter_is_refused_naming_the_loader(zlab, tmp_path, target):
    with pytest.raises(DrafterLoadError, match=r"AutoDrafter\.from_pretrained"):
        hf_dspark.Eagle3DraftModel.from_pretrained(zlab)
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(DrafterLoadError, match="no drafter layout hf_dspark reads"):
        hf_dspark.AutoDrafter.from_pretrained(tmp_path / "target")
    with pytest.raises(UserInputError, match="do not apply to it: \\['attn_implementation'\\]"):
        hf_dspark.AutoDrafter.from_pretrained(zlab, attn_implementation="eager")


def test_a_drafter_loaded_by_a_stock_class_is_refused_by_generate_naming_the_loader(zlab, target):
    """AutoModel reads z-lab's folder (`model_type: qwen3`) as a plain Qwen3Model without the drafter's fusion:
    stock assisted decoding would run it as a small language model. Refused before any token."""
    stock = AutoModel.from_pretrained(zlab)
    assert type(stock).__name__ == "Qwen3Model"
    ids = torch.tensor([[5, 17, 33]])
    for call in (lambda: target.generate(ids, assistant_model=stock, max_new_tokens=4),
                 lambda: hf_dspark.custom_generate_for(stock)):
        with pytest.raises(UserInputError) as refusal:
            call()
        message = str(refusal.value)
        assert "zlab_dflash" in message and f"hf_dspark.AutoDrafter.from_pretrained({str(zlab)!r})" in message


@pytest.mark.slow  # the real SmolLM2 target
def test_the_command_line_takes_every_layout(tmp_path, capsys):
    """`hf-dspark generate --drafter` with a z-lab DFlash drafter (z-lab's own class, SmolLM2's shapes, one layer)
    on the embedded SmolLM2 target: it loads with no convert step and the output is identical to plain greedy."""
    import json as json_module

    from hf_dspark.targets.default_target import default_target_dir, load_default_target

    load_default_target()  # the cached copy the CLI reads
    shapes = json_module.loads((default_target_dir() / "config.json").read_text())
    torch.manual_seed(4)
    config = Qwen3Config(**{k: shapes[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                   "num_attention_heads", "num_key_value_heads", "rope_parameters",
                                                   "max_position_embeddings")},
                         head_dim=shapes["hidden_size"] // shapes["num_attention_heads"], num_hidden_layers=1,
                         num_target_layers=shapes["num_hidden_layers"], architectures=["DFlashDraftModel"],
                         dflash_config={"mask_token_id": 2, "target_layer_ids": [14], "block_size": 4})
    DFlashDraftModel(config).eval().save_pretrained(tmp_path / "zlab-smollm2")
    code = main(["generate", "Name three colours.", "--drafter", str(tmp_path / "zlab-smollm2"),
                 "--max-new-tokens", "8", "--compare", "--no-schedule", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "identical to plain greedy: yes" in captured.out + captured.err


def test_config_fields_nobody_understands_are_refused_not_ignored(zlab, tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    config = json.loads((zlab / "config.json").read_text())
    config["dflash_config"]["draft_temperature"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(zlab / "model.safetensors")
    with pytest.raises(UserInputError, match="draft_temperature"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


@pytest.mark.parametrize("name", ["dspark_vanilla", "dflash"])
def test_deepspecs_own_checkpoint_loaded_by_automodel_is_refused_by_generate(name):
    """The issue's report: AutoModel maps DeepSpec's `model_type: qwen3` to a plain Qwen3Model (the drafter weights
    dropped). Passed as assistant_model it is refused with the loader that works, which loads it whole."""
    from pathlib import Path

    folder = Path(__file__).parents[1] / "data" / "deepspec_golden" / name
    stock = AutoModel.from_pretrained(folder)
    assert type(stock).__name__ == "Qwen3Model"
    target = tiny_target("qwen3", vocab_size=stock.config.vocab_size)
    with pytest.raises(UserInputError, match=r"deepspec \(Qwen3DSparkModel\).*hf_dspark\.AutoDrafter\.from_pretrained"):
        target.generate(torch.tensor([[5, 17, 33]]), assistant_model=stock, max_new_tokens=4)
    assert type(hf_dspark.AutoDrafter.from_pretrained(folder)) is hf_dspark.DSparkDraftModel
