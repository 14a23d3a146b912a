"""Issue 44, section 3: the defects the probe found, each with the check that failed before its fix.

1. a symlink in a checkpoint folder leading outside it is never read, in any layout (config.json, the weights, index
   shards, generation_config.json), while links inside the folder and a Hub cache's links into blobs/ still load;
2. LiquidAI's LFM2.5 reader allocates nothing by `head_dim` before the weights confirm it;
3. cost tables whose times divide into zeros or infinities are refused when read, inline in a checkpoint too;
5. config.json values of the wrong kind (a list where a string belongs, a null or missing required field, a zero
   divisor) are one error naming the field in every layout, never a raw exception;
6. unreadable safetensors name their file, and a pipe or a folder in place of the weights is named as such;
7. `SpeculativeEngine.submit` refuses what `generate()` refuses, with the same messages;
8. command-line mistakes are one line and exit code 2 before any work; output paths are checked first;
9. GPT-2 and OPT targets get drafters (their MLP widths have other names), decoding exactly;
10. argparse mistakes are one line; Ctrl-C while the command line imports exits quietly with 130; a drafter's saved
   drafting settings are checked when it loads.
(4, the checks a saved DraftingState needs, belongs to the verification policy's rewrite.)"""

import json
import os
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import BloomConfig, GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

import hf_dspark
import test_interop_k3_dspark as k3
import test_interop_lfm2_dspark as lfm2
from factories import hub_snapshot, prompts, tiny_drafter, tiny_target
from hf_dspark.cli.main import main
from hf_dspark.models.drafting_config import MAX_TABLE_SECONDS, MIN_TABLE_SECONDS
from hf_dspark.models.errors import DrafterLoadError, DrafterTargetMismatchError, UserInputError
from hf_dspark.models.loading import load_drafter
from layout_fixtures import write_checkpoint
from cli_checks import refused
from test_interop_specforge import GOLDEN as SPECFORGE_GOLDEN

TEN_LAYOUTS = ("own_dspark", "own_eagle3", "deepspec_dspark", "deepspec_eagle3", "speculators_dspark",
               "speculators_eagle3", "zlab", "specforge", "lfm2", "k3")


@pytest.fixture(scope="module")
def layouts(folders):  # noqa: F811
    """A tiny loadable drafter folder in each of the ten layouts hf_dspark reads."""
    write_checkpoint(folders / "lfm2", lfm2.published_config(), lfm2.published_tensors())
    write_checkpoint(folders / "k3", k3.published_config(), k3.published_tensors())
    shutil.copytree(SPECFORGE_GOLDEN / "vanilla", folders / "specforge",
                    ignore=shutil.ignore_patterns("golden.safetensors"))
    return folders


def copy_of(layouts, layout: str, tmp_path) -> Path:
    return Path(shutil.copytree(layouts / layout, tmp_path / layout))


LOADERS = {"AutoDrafter": hf_dspark.AutoDrafter.from_pretrained, "load_drafter": lambda path: load_drafter(path, None)}


# ---------------------------------------------------------------------------------------------------------------
# 1. A link out of a checkpoint folder is never followed
# ---------------------------------------------------------------------------------------------------------------

_WATCHED: list[str] = []
_OPENED: list[str] = []


def _record_opens(event: str, args) -> None:
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))  # a file opened through a link is the file linked to
        if any(path.startswith(folder) for folder in _WATCHED):
            _OPENED.append(path)


sys.addaudithook(_record_opens)  # hooks cannot be removed: it records only while a test watches a folder


@pytest.fixture
def opened_in():
    """`opened_in(folder)`: from then on, Python's opens of files under `folder` are recorded (the list returned)."""
    def watch(folder) -> list[str]:
        _WATCHED.append(os.path.realpath(folder))
        return _OPENED
    yield watch
    _WATCHED.clear()
    _OPENED.clear()


def linked_out(folder: Path, name: str) -> Path:
    """`folder/name` moved beside the folder (a real copy of the file, so that following the link would load) and
    replaced by a symlink to it; returns the link."""
    outside = folder.parent / "elsewhere" / name
    outside.parent.mkdir(exist_ok=True)
    shutil.move(folder / name, outside)
    (folder / name).symlink_to(outside)
    return folder / name


LINKED_FILES = [(layout, "config.json") for layout in TEN_LAYOUTS] + \
               [(layout, "model.safetensors") for layout in TEN_LAYOUTS] + [("own_dspark", "generation_config.json")]


@pytest.mark.parametrize("layout,name", LINKED_FILES, ids=[f"{layout}-{name}" for layout, name in LINKED_FILES])
def test_a_link_out_of_the_folder_is_refused_before_anything_reads_it(layouts, tmp_path, opened_in, layout, name):
    folder = copy_of(layouts, layout, tmp_path)
    link = linked_out(folder, name)
    opened = opened_in(tmp_path / "elsewhere")
    for loader in LOADERS.values():
        with pytest.raises(UserInputError, match="leads outside the folder") as refusal:
            loader(folder)
        assert str(link) in str(refusal.value) and "copy the file itself into the folder" in str(refusal.value)
    assert opened == []


def test_a_sharded_drafter_with_a_shard_linked_out_is_refused(tmp_path, opened_in):
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    drafter.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    link = linked_out(tmp_path / "sharded", shard.name)
    opened = opened_in(tmp_path / "elsewhere")
    with pytest.raises(UserInputError, match=f"{re.escape(str(link))}.*leads outside the folder"):
        hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "sharded")
    assert opened == []


def test_a_model_card_linked_out_of_the_folder_is_never_uploaded(layouts, tmp_path, opened_in):
    from hf_dspark.hub.push import drafter_card

    folder = copy_of(layouts, "own_dspark", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.txt").write_text("not a model card")
    (folder / "README.md").symlink_to(tmp_path / "elsewhere" / "secret.txt")
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(folder)
    opened = opened_in(tmp_path / "elsewhere")
    with pytest.raises(UserInputError, match=f"{re.escape(str(folder / 'README.md'))} is a link that leads outside"):
        drafter_card(drafter)
    assert opened == []


@pytest.mark.parametrize("layout", ["own_dspark", "lfm2"])
def test_links_inside_the_folder_still_load(layouts, tmp_path, layout):
    folder = copy_of(layouts, layout, tmp_path)
    (folder / "kept").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.move(folder / name, folder / "kept" / name)
        (folder / name).symlink_to(Path("kept") / name)
    loaded = hf_dspark.AutoDrafter.from_pretrained(folder)
    reference = hf_dspark.AutoDrafter.from_pretrained(layouts / layout)
    assert all(torch.equal(tensor, reference.state_dict()[key]) for key, tensor in loaded.state_dict().items())


@pytest.mark.parametrize("layout", ["own_dspark", "lfm2"])
def test_a_hub_snapshot_linking_into_its_blobs_still_loads(layouts, tmp_path, layout):
    hub_snapshot(tmp_path / "hub", f"someone/{layout}", layouts / layout)  # every file a link into blobs/
    loaded = hf_dspark.AutoDrafter.from_pretrained(f"someone/{layout}", cache_dir=tmp_path / "hub",
                                                   local_files_only=True)
    reference = hf_dspark.AutoDrafter.from_pretrained(layouts / layout)
    assert all(torch.equal(tensor, reference.state_dict()[key]) for key, tensor in loaded.state_dict().items())


# ---------------------------------------------------------------------------------------------------------------
# 2. The LFM2.5 reader allocates nothing by head_dim before the weights confirm it
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [200_000_000, 10**12])
def test_an_lfm2_head_dim_the_weights_do_not_have_allocates_nothing(tmp_path, monkeypatch, head_dim):
    """The probe's case: head_dim 200000000 took peak memory from 349 MB to 3.4 GB (the channel order of the
    interleaved-rotary conversion, built before any shape was compared); 10**12 asked for 4 TB."""
    real_arange = torch.arange

    def guarded_arange(*args, **kwargs):
        on_meta = torch.get_default_device().type == "meta" or str(kwargs.get("device")) == "meta"
        if not on_meta and any(isinstance(value, int) and abs(value) > 10**6 for value in args):
            pytest.fail(f"torch.arange{args} was allocated before the config was refused")
        return real_arange(*args, **kwargs)

    folder = write_checkpoint(tmp_path / "lfm2", lfm2.published_config(head_dim=head_dim), lfm2.published_tensors())
    monkeypatch.setattr(torch, "arange", guarded_arange)
    with pytest.raises(DrafterLoadError, match=r"q_proj.weight \(64, 64\) stored, \(\d+, 64\) for the config"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# 3. Cost tables whose times divide into zeros or infinities are refused when read
# ---------------------------------------------------------------------------------------------------------------

IMPOSSIBLE_TABLES = [({"seconds": [1e-300]}, "'seconds'[0]"), ({"seconds": [1.0, 1e-200]}, "'seconds'[1]"),
                     ({"seconds": [1e20]}, "'seconds'[0]"), ({"seconds": [1.0], "draft_seconds": 1e20},
                                                             "'draft_seconds'")]


@pytest.mark.parametrize("table,field", IMPOSSIBLE_TABLES, ids=[field for _, field in IMPOSSIBLE_TABLES])
def test_cost_tables_that_made_every_generate_divide_by_zero_are_refused(layouts, tmp_path, table, field):
    """Such tables passed validation and every generate() then raised ZeroDivisionError in the planner, also with
    the table inline in a checkpoint's generation_config.json."""
    with pytest.raises(UserInputError, match=f"not a cost table: field {re.escape(field)}"):
        hf_dspark.VerificationCostTable.from_dict(table, "the table")
    with pytest.raises(ValueError, match=f"to {MAX_TABLE_SECONDS}"):
        hf_dspark.VerificationCostTable(table["seconds"], table.get("draft_seconds", 0.0))
    folder = copy_of(layouts, "own_dspark", tmp_path)
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(saved | {"dspark_cost_table": table}))
    with pytest.raises(DrafterLoadError, match=f"dspark_cost_table.*{re.escape(field)}"):
        hf_dspark.DSparkDraftModel.from_pretrained(folder)


def test_a_table_at_the_edges_of_the_range_still_plans_rounds():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=3)
    expected = target.generate(prompts(1)[0], do_sample=False, max_new_tokens=8)
    for seconds, draft in (([MIN_TABLE_SECONDS] * 4, 0.0), ([MAX_TABLE_SECONDS] * 4, MAX_TABLE_SECONDS)):
        table = hf_dspark.VerificationCostTable(seconds, draft)
        assert hf_dspark.VerificationCostTable.from_dict(asdict(table), "the table") == table
        out = target.generate(prompts(1)[0], assistant_model=drafter, do_sample=False, max_new_tokens=8,
                              dspark_cost_table=table)
        assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------------------
# 5. Config values of the wrong kind are one error naming the field, in every layout
# ---------------------------------------------------------------------------------------------------------------

DELETED = object()
WRONG_KINDS = [  # (layout, the field's path in config.json, the value written there): the probe's raw exceptions
    *[(layout, ("model_type",), [value]) for layout, value in (
        ("own_dspark", "dspark"), ("own_eagle3", "eagle3_draft"), ("deepspec_dspark", "qwen3"),
        ("deepspec_eagle3", "qwen3"), ("zlab", "qwen3"), ("specforge", "qwen3"), ("lfm2", "qwen3"),
        ("k3", "k3_dspark"))],
    ("speculators_dspark", ("transformer_layer_config", "model_type"), ["qwen3"]),
    *[(layout, ("rope_parameters", "rope_type"), ["default"]) for layout in (
        "own_dspark", "own_eagle3", "deepspec_dspark", "deepspec_eagle3", "zlab", "specforge")],
    ("k3", ("rope_parameters", "rope_type"), ["yarn"]),
    *[(layout, ("transformer_layer_config", "rope_parameters", "rope_type"), ["default"])
      for layout in ("speculators_dspark", "speculators_eagle3")],
    ("deepspec_dspark", ("markov_head_type",), ["vanilla"]), ("speculators_dspark", ("markov_head_type",), ["vanilla"]),
    ("own_dspark", ("markov_rank",), DELETED),
    *[(layout, (field,), None) for layout in ("deepspec_dspark", "deepspec_eagle3")
      for field in ("head_dim", "target_layer_ids")],
    ("k3", ("rope_parameters", "original_max_position_embeddings"), 0),
]


@pytest.mark.parametrize("layout,path,value", WRONG_KINDS,
                         ids=[f"{layout}-{'.'.join(path)}={value if value is not DELETED else 'deleted'}"
                              for layout, path, value in WRONG_KINDS])
@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_value_of_the_wrong_kind_is_one_error_naming_the_field(layouts, tmp_path, loader, layout, path, value):
    folder = copy_of(layouts, layout, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    holder = config
    for key in path[:-1]:
        holder = holder[key]
    if value is DELETED:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError) as refusal:
        LOADERS[loader](folder)
    message = str(refusal.value)
    assert str(folder / "config.json") in message and path[-1] in message and "\n" not in message, message


# ---------------------------------------------------------------------------------------------------------------
# 6. Unreadable weights name their file
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["specforge", "lfm2", "k3", "deepspec_dspark", "speculators_dspark", "zlab",
                                    "own_dspark"])
def test_a_corrupt_safetensors_file_is_named(layouts, tmp_path, layout):
    folder = copy_of(layouts, layout, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted download
    for loader in LOADERS.values():
        with pytest.raises(DrafterLoadError, match="truncated or corrupt") as refusal:
            loader(folder)
        assert str(weights) in str(refusal.value)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
@pytest.mark.parametrize("layout", ["own_dspark", "lfm2"])
def test_a_pipe_or_a_folder_in_place_of_the_weights_is_named(layouts, tmp_path, layout, kind):
    """hf_dspark's own layout said transformers' "no file named model.safetensors"; a pipe is never opened (a read
    would wait for a writer forever)."""
    folder = copy_of(layouts, layout, tmp_path)
    weights = folder / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights) if kind == "fifo" else weights.mkdir()
    for loader in LOADERS.values():
        with pytest.raises(UserInputError, match="is not a regular file") as refusal:
            loader(folder)
        assert str(weights) in str(refusal.value)


# ---------------------------------------------------------------------------------------------------------------
# 7. The engine refuses what generate() refuses, with the same messages
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target, "markov", block_size=4)


REFUSED_BY_GENERATE = [dict(top_k=2.5), dict(top_k="5"), dict(top_k=-1), dict(temperature="0.7"),
                       dict(temperature=0.0), dict(temperature=2), dict(top_p=0.0)]


@pytest.mark.parametrize("setting", REFUSED_BY_GENERATE, ids=[repr(s) for s in REFUSED_BY_GENERATE])
def test_the_engine_refuses_a_sampling_setting_as_generate_does(pair, setting):
    """submit() read top_k=2.5 as 2 and took "5", "0.7" and 2 where generate() refuses them."""
    target, drafter = pair
    ids = prompts(1)[0]
    with pytest.raises(ValueError) as by_generate:
        target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=4, **setting)
    engine = hf_dspark.SpeculativeEngine(target, drafter)
    with pytest.raises(ValueError) as by_engine:
        engine.submit(ids[0], 4, do_sample=True, **setting)
    assert str(by_engine.value) == str(by_generate.value)
    assert engine.num_waiting == 0


ENGINE_MISTAKES = [
    ("max_new_tokens", dict(max_new_tokens=True), "max_new_tokens must be a non-negative int"),
    ("eos True", dict(eos_token_id=True), "eos_token_id must be a token id"),
    ("eos float", dict(eos_token_id=2.5), "eos_token_id must be a token id"),
    ("eos float tensor", dict(eos_token_id=torch.tensor([2.5])), "eos_token_id must be a token id"),
    ("eos text", dict(eos_token_id=[1, "2"]), "eos_token_id must be a token id"),
    ("top_k True", dict(do_sample=True, top_k=True), "`top_k` has to be a strictly positive integer"),
    ("top_p text", dict(do_sample=True, top_p="0.5"), r"top_p must be in \(0, 1\]"),
    ("ids None", dict(input_ids=None), "submit takes one prompt of integer token ids"),
    ("ids text", dict(input_ids="hello"), "submit takes one prompt of integer token ids"),
    ("ids of text", dict(input_ids=["a", "b"]), "submit takes one prompt of integer token ids"),
    ("ids float", dict(input_ids=torch.tensor([3.0, 4.0])), "submit takes integer token ids"),
]


@pytest.mark.parametrize("name,options,match", ENGINE_MISTAKES, ids=[case[0] for case in ENGINE_MISTAKES])
def test_the_engine_refuses_what_no_request_can_mean_with_the_fix(pair, name, options, match):
    target, drafter = pair
    engine = hf_dspark.SpeculativeEngine(target, drafter)
    options = {"input_ids": prompts(1)[0][0], "max_new_tokens": 4, **options}
    with pytest.raises(ValueError, match=match):
        engine.submit(**options)
    assert engine.num_waiting == 0


def test_a_greedy_request_ignores_its_sampling_settings_as_generate_does(pair):
    target, drafter = pair
    ids = prompts(1)[0]
    expected = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=6, top_k=2.5)
    engine = hf_dspark.SpeculativeEngine(target, drafter)
    request = engine.submit(ids[0], 6, top_k=2.5, temperature="0.7")
    assert torch.equal(engine.run_until_done()[request], expected[0])


# ---------------------------------------------------------------------------------------------------------------
# 8. Command-line mistakes are one line before any work
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command loads a model or starts converting."""
    import hf_dspark.cli.main as cli
    import hf_dspark.hub.convert as convert
    import hf_dspark.targets.loading as loading

    fail = lambda *args, **kwargs: pytest.fail("the command started its work")  # noqa: E731
    for module, name in ((loading, "load_target"), (cli, "load_target"), (convert, "convert_drafter")):
        monkeypatch.setattr(module, name, fail)


def _cli_mistakes(tmp: Path) -> list[tuple[list[str], list[str]]]:
    out, folder = str(tmp / "out.json"), str(tmp)
    return [
        (["generate", "hi", "--threads", "-1"], ["--threads must be at least 1", "got -1"]),
        (["profile", "--output", out, "--threads", "-1"], ["--threads must be at least 1"]),
        (["bench", "--threads", "-1"], ["--threads must be at least 1"]),
        (["eval", "--output", folder, "--threads", "-1"], ["--threads must be at least 1"]),
        (["profile", "--output", out, "--context-length", "-1"], ["--context-length must be at least 1"]),
        (["profile", "--output", out, "--repeats", "0"], ["--repeats must be at least 1"]),
        (["profile", "--output", folder], [f"--output {folder}", "is a folder, not a file"]),
        (["bench", "--benchmarks", "bogus"], ["--benchmarks", "'bogus' is neither a shipped benchmark"]),
        (["bench", "--prompts-per-benchmark", "0"], ["--prompts-per-benchmark must be at least 1"]),
        (["bench", "--prompts-per-benchmark", "-2"], ["--prompts-per-benchmark must be at least 1", "got -2"]),
        (["bench", "--output", folder], [f"--output {folder}", "is a folder, not a file"]),
        (["eval", "--output", folder, "--max-prompts", "-1"], ["--max-prompts must be at least 1"]),
        (["eval", "--output", folder, "--exec-timeout", "-1"], ["--exec-timeout must be above 0"]),
        (["convert", folder, str(tmp / "a_file")], [str(tmp / "a_file"), "a file is in the way"]),
    ]


@pytest.mark.parametrize("case", range(14))
def test_a_command_line_mistake_is_one_line_before_any_work(tmp_path, capsys, no_work, case):
    """Each printed a traceback (exit code 1), failed only after its work (a profile, a whole benchmark run lost to
    an --output that is a folder), or started a full run (--prompts-per-benchmark -2, --max-prompts -1)."""
    (tmp_path / "a_file").write_text("in the way")
    argv, needles = _cli_mistakes(tmp_path)[case]
    refused(capsys, argv, *needles)


# ---------------------------------------------------------------------------------------------------------------
# 9. GPT-2 and OPT targets
# ---------------------------------------------------------------------------------------------------------------

OTHER_FAMILIES = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                                               bos_token_id=1, eos_token_id=2)),
    "opt": lambda: OPTForCausalLM(OPTConfig(vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                            num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=256,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_gpt2_and_opt_targets_get_drafters_that_decode_exactly(family, kind):
    """from_target_config raised AttributeError 'intermediate_size': GPT-2 calls it n_inner (None: 4 x n_embd, as
    its MLP builds it), OPT ffn_dim."""
    torch.manual_seed(0)
    target = OTHER_FAMILIES[family]().eval()
    drafter = tiny_drafter(target, kind, block_size=3)
    assert drafter.config.intermediate_size == {"gpt2": 4 * 64, "opt": 128}[family]
    for ids in prompts(2):
        expected = target.generate(ids, do_sample=False, max_new_tokens=10)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=10), expected)


def test_targets_a_drafter_cannot_share_heads_with_or_size_are_refused_naming_the_family():
    projected = OPTConfig(hidden_size=64, word_embed_proj_dim=32, num_attention_heads=4, ffn_dim=128)
    with pytest.raises(DrafterTargetMismatchError, match="opt target projects .* to word_embed_proj_dim 32"):
        hf_dspark.DSparkDraftConfig.from_target_config(projected)
    with pytest.raises(UserInputError, match="the bloom target's config names no MLP width.*intermediate_size="):
        hf_dspark.DSparkDraftConfig.from_target_config(BloomConfig(hidden_size=64, n_head=4))
    config = hf_dspark.DSparkDraftConfig.from_target_config(BloomConfig(hidden_size=64, n_head=4),
                                                            intermediate_size=256)
    assert config.intermediate_size == 256


# ---------------------------------------------------------------------------------------------------------------
# 10. One-line argparse mistakes, a quiet Ctrl-C while importing, saved drafting settings checked at load
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,line", [
    (["generate", "hi", "--bogus"], "hf-dspark: error: unrecognized arguments: --bogus (see hf-dspark --help)"),
    (["generate", "hi", "--threads", "x"], "hf-dspark generate: error: argument --threads: invalid int value: 'x'"),
    (["frobnicate"], "hf-dspark: error: argument command: invalid choice: 'frobnicate'"),
])
def test_an_argparse_mistake_is_one_line(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_code:
        main(argv)
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(line), err


def test_ctrl_c_while_the_command_line_imports_exits_quietly_with_130(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # the console script's module
    import hf_dspark_launch

    class InterruptedImport:  # what Ctrl-C does to `from hf_dspark.cli.main import main` while torch loads
        def find_spec(self, name, path=None, target=None):
            if name == "hf_dspark.cli.main":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "hf_dspark.cli.main")
    monkeypatch.setattr(sys, "meta_path", [InterruptedImport(), *sys.meta_path])
    assert hf_dspark_launch.main() == 130
    err = capsys.readouterr().err
    assert err == "hf-dspark: interrupted before the command started; nothing was done.\n"


SAVED_SETTINGS = [("num_assistant_tokens", 99), ("num_assistant_tokens", "3"), ("dspark_suffix_drafting", "yes"),
                  ("dspark_round_planning", 1), ("assistant_confidence_threshold", -1),
                  ("dspark_confidence_threshold_rule", "sometimes"), ("dspark_verification_policy", "bogus")]


@pytest.mark.parametrize("field,value", SAVED_SETTINGS, ids=[f"{f}={v!r}" for f, v in SAVED_SETTINGS])
def test_saved_drafting_settings_are_checked_when_the_drafter_loads(layouts, tmp_path, field, value):
    """They were read silently and refused only by the first generate() call."""
    folder = copy_of(layouts, "own_dspark", tmp_path)
    saved = folder / "generation_config.json"
    saved.write_text(json.dumps(json.loads(saved.read_text()) | {field: value}))
    for loader in LOADERS.values():
        with pytest.raises(DrafterLoadError, match=f"^{re.escape(str(saved))}: {field} must be .*delete it to use"):
            loader(folder)


def test_the_drafters_own_settings_still_load_and_round_trip(layouts, tmp_path):
    drafter = hf_dspark.AutoDrafter.from_pretrained(layouts / "own_dspark")
    drafter.generation_config.num_assistant_tokens = 2
    drafter.generation_config.dspark_verification_policy = ("threshold", 0.4)
    drafter.save_pretrained(tmp_path / "resaved")
    loaded = hf_dspark.AutoDrafter.from_pretrained(tmp_path / "resaved")
    assert loaded.generation_config.num_assistant_tokens == 2
    assert tuple(loaded.generation_config.dspark_verification_policy) == ("threshold", 0.4)
