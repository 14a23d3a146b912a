"""A drafter folder (and a target's generation_config.json) is data from the Hub: it may carry a cost table inline or
name one inside itself, never make `from_pretrained` or `generate()` read a file elsewhere; every file read is a
bounded read of a regular file; cost tables and saved DraftingStates are checked field by field (issue 30)."""

import json
import os
import re
import resource
import stat
import time
import tracemalloc
from dataclasses import asdict

import pytest

import hf_dspark
from hf_dspark import DraftingState
from hf_dspark.cli.main import main
from hf_dspark.generation import DraftingSettings
from hf_dspark.models.errors import DrafterLoadError, UserInputError
from hf_dspark.models.json_files import SMALL_JSON_BYTES, read_json
from hf_dspark.policy import VerificationCostTable
from hf_dspark.policy.acceptance import SlotAcceptance
from factories import hub_snapshot, prompts, tiny_drafter, tiny_target

TABLE = VerificationCostTable([1.0, 1.5, 2.0], draft_seconds=0.25, description={"device": "folder"})
ELSEWHERE = VerificationCostTable([9.0, 9.0], description={"device": "working directory"})


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    return target, tiny_drafter(target, "markov")


@pytest.fixture
def folder(models, tmp_path):
    """A saved tiny drafter."""
    models[1].save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


def name_table(folder, value):
    """Write `value` as the folder's generation_config.dspark_cost_table (as a malicious checkpoint would)."""
    path = folder / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"dspark_cost_table": value}))
    return path


def refused_at_load(folder, *needles, **options):
    """The one-line DrafterLoadError `from_pretrained` raises, checked to name the field, the file and `needles`,
    and never to suggest profiling into the path the checkpoint named."""
    with pytest.raises(DrafterLoadError) as raised:
        hf_dspark.DSparkDraftModel.from_pretrained(folder, **options)
    message = str(raised.value)
    assert "dspark_cost_table" in message and "generation_config.json" in message, message
    assert "\n" not in message and "my-costs.json" in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def outside_file(folder, name):
    (folder.parent / name).write_text(json.dumps(asdict(ELSEWHERE)))
    return str(folder.parent / name)


@pytest.mark.parametrize("name, needle", [
    ("/etc/passwd", "absolute path"),
    ("../../../../etc/hostname", "outside the drafter folder"),
    ("/dev/stdin", "absolute path"),
    ("/dev/zero", "absolute path"),
    ("tables/../../outside.json", "outside the drafter folder"),
    ("missing.json", "not in the drafter folder"),
    (3, "neither the cost table's fields"),
    (["seconds"], "neither the cost table's fields"),
])
def test_a_folder_naming_a_file_outside_itself_is_refused_at_from_pretrained(folder, name, needle):
    outside_file(folder, "outside.json")
    name_table(folder, name)
    message = refused_at_load(folder, needle)
    assert f"--output {name}" not in message


@pytest.mark.parametrize("kind", ["link out", "link to /dev/zero", "fifo", "folder", "too large"])
def test_a_named_file_inside_the_folder_must_be_a_small_regular_file_that_stays_inside(folder, kind):
    path = folder / "costs.json"
    if kind == "link out":
        path.symlink_to(outside_file(folder, "outside.json"))
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    elif kind == "folder":
        path.mkdir()
    else:
        with open(path, "wb") as sparse:
            sparse.truncate(SMALL_JSON_BYTES + 1)
    name_table(folder, "costs.json")
    start = time.perf_counter()
    refused_at_load(folder, "costs.json", {"link out": "leads outside", "link to /dev/zero": "leads outside",
                                           "fifo": "not a regular file", "folder": "not a regular file",
                                           "too large": "larger than"}[kind])
    assert time.perf_counter() - start < 30


def test_a_relative_name_is_never_resolved_against_the_working_directory(folder, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ELSEWHERE.save(cwd / "costs.json")
    monkeypatch.chdir(cwd)
    name_table(folder, "costs.json")
    refused_at_load(folder, "not in the drafter folder")  # not the working directory's table, used silently
    TABLE.save(folder / "costs.json")
    loaded = hf_dspark.DSparkDraftModel.from_pretrained(folder)
    assert DraftingSettings.resolve(loaded).cost_table == TABLE  # the folder's own, never the cwd's
    assert loaded.generation_config.dspark_cost_table == asdict(TABLE)  # kept inline: nothing is read later


@pytest.mark.parametrize("where", ["inline", "costs.json", "tables/costs.json", "link inside"])
def test_a_table_inline_or_inside_the_folder_is_what_the_plan_uses(folder, tmp_path, monkeypatch, where):
    if where == "inline":
        name_table(folder, asdict(TABLE))
    else:
        (folder / "tables").mkdir()
        TABLE.save(folder / ("tables/costs.json" if where == "link inside" else where))
        if where == "link inside":
            (folder / "costs.json").symlink_to(folder / "tables" / "costs.json")
        name_table(folder, "costs.json" if where == "link inside" else where)
    monkeypatch.chdir(tmp_path)
    loaded = hf_dspark.DSparkDraftModel.from_pretrained(folder)
    assert DraftingSettings.resolve(loaded).cost_table == TABLE


def test_a_hub_repo_may_name_a_table_inside_itself_only(folder, tmp_path):
    """Offline, through the Hub cache: a file of the repo is fetched by cached_file (a link into its blobs/, as
    huggingface_hub stores it); a name outside the repo or missing from it is refused."""
    TABLE.save(folder / "costs.json")
    name_table(folder, "costs.json")
    cache = tmp_path / "hub"
    hub_snapshot(cache, "org/good", folder, linked={"costs.json", "generation_config.json"})
    loaded = hf_dspark.DSparkDraftModel.from_pretrained("org/good", cache_dir=cache, local_files_only=True)
    assert DraftingSettings.resolve(loaded).cost_table == TABLE
    for repo, name in (("org/escape", "../../../../../etc/hostname"), ("org/missing", "other.json")):
        name_table(folder, name)
        hub_snapshot(cache, repo, folder, linked=set())
        refused_at_load(repo, name, cache_dir=cache, local_files_only=True)


@pytest.mark.parametrize("table, field", [
    ({"seconds": [1.0], "bogus": 1}, "'bogus'"),
    ({"seconds": "fast"}, "'seconds'"),
    ({"seconds": []}, "'seconds'"),
    ({"seconds": [1.0, -1.0]}, "'seconds'[1]"),
    ({"seconds": [1.0, float("nan")]}, "'seconds'[1]"),
    ({"seconds": [True]}, "'seconds'[0]"),
    ({"seconds": [1.0], "draft_seconds": -1}, "'draft_seconds'"),
    ({"seconds": [1.0], "draft_seconds": "0.1"}, "'draft_seconds'"),
    ({"seconds": [1.0], "description": "cpu"}, "'description'"),
    ({"seconds": [1.0], "description": {"rows": 0}}, "'description.rows'"),
    ({"draft_seconds": 0.1}, "'seconds'"),
])
def test_a_cost_table_with_a_wrong_field_is_one_error_naming_the_field_and_its_source(folder, tmp_path, models,
                                                                                      table, field):
    name_table(folder, table)
    refused_at_load(folder, field, "is not a cost table")
    (folder / "costs.json").write_text(json.dumps(table))
    name_table(folder, "costs.json")
    refused_at_load(folder, field, str(folder / "costs.json"))
    (tmp_path / "mine.json").write_text(json.dumps(table))
    with pytest.raises(UserInputError, match=f"mine.json is not a cost table: .*{re.escape(field)}"):
        VerificationCostTable.load(tmp_path / "mine.json")
    drafter = models[1]
    with pytest.raises(UserInputError, match=f"^dspark_cost_table is not a cost table: .*{re.escape(field)}"):
        DraftingSettings.resolve(drafter, {"dspark_cost_table": table})
    before = drafter.generation_config.dspark_cost_table
    drafter.generation_config.dspark_cost_table = table
    try:
        with pytest.raises(UserInputError, match="^generation_config.dspark_cost_table is not a cost table: "
                                                 f".*{re.escape(field)}"):
            DraftingSettings.resolve(drafter)
        with pytest.raises(UserInputError, match=re.escape(field)):  # nor saved, to be refused when loaded
            drafter.save_pretrained(tmp_path / "resaved")
    finally:
        drafter.generation_config.dspark_cost_table = before


def _virtual_memory() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


@pytest.mark.parametrize("route", ["load", "generate", "save", "cli", "read_json"])
@pytest.mark.parametrize("path", ["/dev/zero", "/dev/stdin", "sparse"])
def test_a_users_own_path_is_still_a_bounded_read_of_a_regular_file(models, tmp_path, capsys, route, path):
    """The user's path is theirs (resolved against the working directory) but /dev/zero, a pipe or a huge file is
    refused at once, having read at most the limit. Memory is capped while it runs, so an unbounded read fails
    fast with MemoryError instead of taking the machine down."""
    if path == "/dev/stdin" and stat.S_ISREG(os.stat(path).st_mode):
        pytest.skip("stdin is redirected from a regular file here: the user's own file, read as any other")
    if path == "sparse":
        path = str(tmp_path / "huge.json")
        with open(path, "wb") as sparse:
            sparse.truncate(1 << 30)
    target, drafter = models
    (input_ids,) = prompts(1)
    calls = {
        "load": lambda: VerificationCostTable.load(path),
        "generate": lambda: target.generate(input_ids, assistant_model=drafter, max_new_tokens=2, do_sample=False,
                                            dspark_cost_table=path),
        "save": lambda: _save_with_table(drafter, path, tmp_path / "saved"),
        "cli": lambda: main(["generate", "hi", "--cost-table", path]),
        "read_json": lambda: read_json(path, "some results", "fix it"),
    }
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_virtual_memory() + (512 << 20), hard))
    tracemalloc.start()
    start = time.perf_counter()
    try:
        if route == "cli":
            assert calls[route]() == 2
            assert re.search("--cost-table: .*(not a regular file|larger than)", capsys.readouterr().err)
        else:
            with pytest.raises(UserInputError, match="not a regular file|larger than"):
                calls[route]()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert time.perf_counter() - start < 30
    assert peak < 20 * SMALL_JSON_BYTES  # never the whole file: at most the limit (+1 byte) was read


def _save_with_table(drafter, path, folder):
    before = drafter.generation_config.dspark_cost_table
    drafter.generation_config.dspark_cost_table = path
    try:
        drafter.save_pretrained(folder)
    finally:
        drafter.generation_config.dspark_cost_table = before


def test_a_users_own_relative_path_is_read_from_the_working_directory(models, tmp_path, monkeypatch):
    TABLE.save(tmp_path / "my.json")
    monkeypatch.chdir(tmp_path)
    assert DraftingSettings.resolve(models[1], {"dspark_cost_table": "my.json"}).cost_table == TABLE


@pytest.mark.parametrize("name", ["/etc/passwd", "costs.json"])
def test_a_targets_generation_config_naming_a_file_is_refused_at_generate(models, tmp_path, monkeypatch, name):
    """transformers hands the target's own generation_config.json to every call: it may not name a file either."""
    from transformers import AutoModelForCausalLM

    target, drafter = models
    target.save_pretrained(tmp_path / "target")
    path = tmp_path / "target" / "generation_config.json"
    saved = json.loads(path.read_text())
    saved.pop("_from_model_config", None)  # else transformers rebuilds it from config.json
    path.write_text(json.dumps(saved | {"dspark_cost_table": name}))
    ELSEWHERE.save(tmp_path / "costs.json")
    monkeypatch.chdir(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    (input_ids,) = prompts(1)
    with pytest.raises(UserInputError, match="generation_config.dspark_cost_table names a file") as raised:
        loaded.generate(input_ids, assistant_model=drafter, max_new_tokens=2, do_sample=False)
    assert f"--output {name}" not in str(raised.value)
    out = loaded.generate(input_ids, assistant_model=drafter, max_new_tokens=2, do_sample=False,
                          return_dict_in_generate=True, dspark_cost_table=TABLE)  # the call's own table wins
    assert out.sequences.shape[1] == input_ids.shape[1] + 2


GOOD_STATE = {"suffix": {"matches": {"2": {"reached": [2.0, 1.0], "accepted": [1.5, 0.5], "decay": 0.98}}},
              "drafter": {"reached": [4.0, 2.0], "accepted": [2.0, 0.5], "decay": 0.98},
              "delivered": {"reached": [5.0, 2.0], "accepted": [2.0, 0.0], "decay": 0.98}}
# What a state saved by an earlier hf_dspark also held (one planner per batch size then): loaded without them.
RETIRED = {"drafter_expected": 2.5, "drafter_tokens": 3.0, "rounds_without_drafter": 1, "probe_interval": 16,
           "forward_seconds": {"1": 0.1, "3": 0.2}, "draft_seconds": 0.05}


@pytest.mark.parametrize("change, field", [
    ({"suffix": [1]}, "suffix"),
    ({"suffix": {"matches": [1]}}, "suffix.matches"),
    ({"suffix": {"matches": {"x": {}}}}, "suffix.matches key"),
    ({"suffix": {"matches": {"2": "many"}}}, "suffix.matches['2']"),
    ({"suffix": {"matches": {"2": {"reached": [1.0], "accepted": [2.0]}}}}, "suffix.matches['2'].accepted[0]"),
    ({"suffix": {"matches": {"2": {"reached": [1.0, 1.0], "accepted": [1.0]}}}}, "suffix.matches['2'].accepted"),
    ({"suffix": {"matches": {"2": {"decay": 1.5}}}}, "suffix.matches['2'].decay"),
    ({"suffix": {"bogus": 1}}, "suffix.bogus"),
    ({"bogus": 1}, "bogus"),
    ({"drafter": {"reached": [1.0], "accepted": [2.0]}}, "drafter.accepted[0]"),
    ({"drafter": {"reached": [1.0, 1.0], "accepted": [1.0]}}, "drafter.accepted"),
    ({"drafter": {"reached": [-1.0], "accepted": [0.0]}}, "drafter.reached[0]"),
    ({"drafter": {"reached": "many", "accepted": []}}, "drafter.reached"),
    ({"drafter": {"decay": 2}}, "drafter.decay"),
    ({"drafter": {"slots": 7}}, "drafter.slots"),
    ({"delivered": {"reached": [1.0], "accepted": [2.0]}}, "delivered.accepted[0]"),
    ({"delivered": {"reached": [1.0, 1.0], "accepted": [1.0]}}, "delivered.accepted"),
    ({"delivered": {"decay": -1}}, "delivered.decay"),
])
def test_a_saved_drafting_state_with_a_wrong_field_is_refused_at_load(tmp_path, change, field):
    saved = json.loads(json.dumps(GOOD_STATE))
    for key, value in change.items():
        nested = key in ("suffix", "drafter", "delivered") and isinstance(value, dict)
        saved[key] = saved[key] | value if nested else value
    (tmp_path / "state.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError) as raised:
        DraftingState.load(tmp_path / "state.json")
    message = str(raised.value)
    assert field in message and str(tmp_path / "state.json") in message and "\n" not in message, message
    (tmp_path / "state.json").write_text(json.dumps(GOOD_STATE))
    state = DraftingState.load(tmp_path / "state.json")
    assert state.statistics.suffix.matches == {2: SlotAcceptance([2.0, 1.0], [1.5, 0.5])}
    assert state.statistics.drafter.reached == [4.0, 2.0] and state.statistics.drafter.accepted == [2.0, 0.5]
    assert state.statistics.delivered.reached == [5.0, 2.0] and state.statistics.delivered.accepted == [2.0, 0.0]
    (tmp_path / "old.json").write_text(json.dumps(RETIRED | GOOD_STATE))
    assert DraftingState.load(tmp_path / "old.json") == state
    # Suffix rates pooled over a proposal's tokens, one per match length (saved before per-token rates): left out.
    pooled = {"prior_accepted": 1.0, "prior_rejected": 3.0, "decay": 0.9, "accepted": {"2": 1.5}, "reached": {"2": 2.0}}
    (tmp_path / "pooled.json").write_text(json.dumps(GOOD_STATE | {"suffix": GOOD_STATE["suffix"] | pooled}))
    assert DraftingState.load(tmp_path / "pooled.json") == state
    state.save(tmp_path / "again.json")
    assert DraftingState.load(tmp_path / "again.json") == state
    assert DraftingState.from_dict({}) == DraftingState()
