"""Settings that cannot work are refused the same way at batch size 1 and in a batch, with a ValueError that names
the setting (issue 16: top_p=0, num_assistant_tokens, a drafter on another device than its target); checkpoints whose
weights are not safetensors files inside their folder are refused before any is read (issue 25)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dspark import DrafterTargetMismatchError, UserInputError
from factories import prompts, tiny_drafter, tiny_target

MAX_NEW = 10


def batch_of(prompt_list):
    width = max(p.shape[1] for p in prompt_list)
    ids = torch.zeros(len(prompt_list), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompt_list):
        ids[row, width - prompt.shape[1]:] = prompt[0]
        mask[row, width - prompt.shape[1]:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target, "markov", block_size=4)


@pytest.mark.parametrize("top_p,match", [(0.0, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
                                         (-0.5, "top_p")])  # a negative one transformers itself refuses
def test_top_p_outside_its_range_is_refused_at_every_batch_size(pair, top_p, match):
    """Stock generate read top_p=0 as top-1 at batch 1 while the batched engine refused it: now both refuse."""
    target, drafter = pair
    prompt_list = prompts(2)
    ids, mask = batch_of(prompt_list)
    calls = {
        "batch 1": lambda: target.generate(prompt_list[0], assistant_model=drafter, do_sample=True, top_p=top_p,
                                           max_new_tokens=MAX_NEW),
        "batch 2": lambda: target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True,
                                           top_p=top_p, max_new_tokens=MAX_NEW),
    }
    messages = set()
    for name, call in calls.items():
        with pytest.raises(ValueError, match=match) as raised:
            call()
        messages.add(str(raised.value))
    assert len(messages) == 1  # one rule, one message


def test_top_p_inside_its_range_still_samples_at_both_batch_sizes(pair):
    target, drafter = pair
    prompt_list = prompts(2)
    ids, mask = batch_of(prompt_list)
    torch.manual_seed(0)
    one = target.generate(prompt_list[0], assistant_model=drafter, do_sample=True, top_p=0.5, max_new_tokens=MAX_NEW)
    two = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True, top_p=0.5,
                          max_new_tokens=MAX_NEW)
    assert one.shape[1] == prompt_list[0].shape[1] + MAX_NEW and two.shape[1] == ids.shape[1] + MAX_NEW


def test_num_assistant_tokens_holds_in_a_batch_as_at_batch_one(pair, monkeypatch):
    target, drafter = pair
    prompt_list = prompts(3)
    ids, mask = batch_of(prompt_list)
    expected = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    # Was a crash at batch 1 and a silent clamp in a batch: now both refuse it, alike, before any forward.
    with monkeypatch.context() as patched:
        patched.setattr(type(target), "forward", lambda *a, **k: pytest.fail("a forward ran"))
        messages = set()
        for batch_ids, batch_mask in ((prompt_list[0], None), (ids, mask)):
            with pytest.raises(ValueError, match=r"num_assistant_tokens must be an int from 1 to the drafter's 4 "
                                                 r"draft slots") as raised:
                target.generate(batch_ids, attention_mask=batch_mask, assistant_model=drafter, do_sample=False,
                                max_new_tokens=MAX_NEW, num_assistant_tokens=6)
            messages.add(str(raised.value))
        assert len(messages) == 1
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW,
                          num_assistant_tokens=2, return_dict_in_generate=True,
                          dspark_round_planning=False)  # every round drafts, whatever this machine's speed
    for row, reference in enumerate(expected):
        sequence = out.sequences[row, int((mask[row] == 0).sum()):]  # no EOS: every row ran MAX_NEW tokens
        assert torch.equal(sequence, reference)
    assert len(out.request_stats) == 3 and max(max(s.draft_lengths) for s in out.request_stats) == 2


def test_a_drafter_on_another_device_is_named_in_attach_target():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov").to("meta")  # stands in for cuda vs cpu: no GPU needed
    with pytest.raises(DrafterTargetMismatchError, match=r"drafter is on meta but the target's input embedding is "
                                                         r"on cpu.*drafter.to\('cpu'\)"):
        drafter.attach_target(target)
    # generate() moves a drafter beside its target (attach_target(follow=True)), but not one never loaded.
    with pytest.raises(DrafterTargetMismatchError, match="meta device, not loaded"):
        target.generate(prompts(1)[0], assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(DrafterTargetMismatchError, match="meta device, not loaded"):
        ids, mask = batch_of(prompts(2))
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cpu_drafter_follows_a_gpu_target():
    target = tiny_target("llama").to("cuda")
    drafter = tiny_drafter(target, "markov")
    with pytest.raises(DrafterTargetMismatchError, match=r"drafter is on cpu but .* cuda:0.*drafter.to\('cuda:0'\)"):
        drafter.attach_target(target)  # training's attach (follow=False) names the mismatch
    out = target.generate(prompts(1)[0].cuda(), assistant_model=drafter, do_sample=False, max_new_tokens=8)
    assert torch.equal(out, target.generate(prompts(1)[0].cuda(), do_sample=False, max_new_tokens=8))
    # generate() drafts with a copy beside the target (`for_target`) and leaves the drafter's own weights alone.
    assert next(drafter.parameters()).device.type == "cpu"
    assert next(drafter.for_target(target).parameters()).device.type == "cuda"


# ---------------------------------------------------------------------------------------------------------------
# Safetensors only, inside the checkpoint folder (issue 25, item 3): a model.safetensors.index.json, or config.json's
# transformers_weights, that names a pickle or a file outside the folder is refused before anything is read
# ---------------------------------------------------------------------------------------------------------------

INDEX = "model.safetensors.index.json"
BAD_ENTRIES = ["weights.bin", "../outside.safetensors", "absolute", "/etc/passwd"]


class _CreatesMarkerWhenUnpickled:
    """Unpickling this calls open(marker, "w"): the marker file appearing proves that pickle was read."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def unpickled(monkeypatch):
    """The files torch.load was asked to read (it then fails): a second proof, beside the marker, that no pickle
    was opened."""
    calls = []

    def refuse(file, *args, **kwargs):
        calls.append(str(file))
        raise AssertionError(f"torch.load({file}) was called")

    monkeypatch.setattr(torch, "load", refuse)
    return calls


def _write_index(folder, entry: str, weights: dict) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 0},
                                            "weight_map": {name: entry for name in weights}}))


def _with_bad_index(folder, entry: str):
    """`folder` (a saved model) with its weights moved where `entry` points and an index naming them there; the
    moved weights are real, so without the check they would load. Returns (index entry, marker file)."""
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    marker = folder.parent / f"{folder.name}-unpickled"
    if entry == "weights.bin":
        torch.save({"payload": _CreatesMarkerWhenUnpickled(marker)}, folder / entry)
    elif entry == "../outside.safetensors":
        save_file(weights, str(folder.parent / "outside.safetensors"), metadata={"format": "pt"})
    elif entry == "absolute":
        (folder.parent / "elsewhere").mkdir(exist_ok=True)
        entry = str(folder.parent / "elsewhere" / "model.safetensors")
        save_file(weights, entry, metadata={"format": "pt"})
    _write_index(folder, entry, weights)
    return entry, marker


def _assert_refused(error, folder, entry, marker, unpickled):
    message = str(error)
    assert isinstance(error, UserInputError), repr(error)
    assert str(folder / INDEX) in message and repr(entry) in message, message
    assert "re-save" in message and "inside the folder" in message, message
    assert not marker.exists() and not unpickled


@pytest.fixture
def bad_drafter(tmp_path, request):
    folder = tmp_path / "drafter"
    tiny_drafter(tiny_target("llama"), "markov").save_pretrained(folder)
    return folder, *_with_bad_index(folder, request.param)


@pytest.mark.parametrize("bad_drafter", BAD_ENTRIES, indirect=True)
@pytest.mark.parametrize("loader", ["class", "AutoModel", "load_drafter"])
def test_a_drafter_index_naming_a_pickle_or_a_file_outside_its_folder_is_refused(bad_drafter, loader, unpickled):
    from transformers import AutoModel

    import hf_dspark
    from hf_dspark.models.loading import load_drafter

    folder, entry, marker = bad_drafter
    load = {"class": hf_dspark.DSparkDraftModel.from_pretrained, "AutoModel": AutoModel.from_pretrained,
            "load_drafter": lambda path: load_drafter(path, torch.float32)}[loader]
    with pytest.raises(Exception) as raised:
        load(folder)
    _assert_refused(raised.value, folder, entry, marker, unpickled)


@pytest.mark.parametrize("entry", ["weights.bin", "../outside.safetensors"])
def test_a_target_index_naming_a_pickle_or_a_file_outside_its_folder_is_refused(tmp_path, entry, unpickled):
    from hf_dspark.targets.loading import load_target

    folder = tmp_path / "target"
    tiny_target("llama").save_pretrained(folder)
    entry, marker = _with_bad_index(folder, entry)
    with pytest.raises(Exception) as raised:
        load_target(str(folder), "float32")
    _assert_refused(raised.value, folder, entry, marker, unpickled)


def test_a_target_with_only_pickled_weights_is_refused(tmp_path, unpickled):
    """No index at all: transformers would fall back to pytorch_model.bin unless told safetensors only."""
    from hf_dspark.targets.loading import load_target

    folder = tmp_path / "target"
    tiny_target("llama").save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({"payload": _CreatesMarkerWhenUnpickled(tmp_path / "unpickled")}, folder / "pytorch_model.bin")
    with pytest.raises(UserInputError, match=r"pickled weights \(pytorch_model.bin\) and no model.safetensors.*"
                                              r"Re-save it with save_pretrained\(\)"):
        load_target(str(folder), "float32")
    assert not (tmp_path / "unpickled").exists() and not unpickled


@pytest.mark.parametrize("what", ["drafter", "target"])
def test_config_transformers_weights_naming_a_pickle_is_refused(tmp_path, what, unpickled):
    """config.json's `transformers_weights` picks the weights file; transformers accepts adapter_model.bin there."""
    from hf_dspark.models.loading import load_drafter
    from hf_dspark.targets.loading import load_target

    folder = tmp_path / what
    target = tiny_target("llama")
    (tiny_drafter(target, "markov") if what == "drafter" else target).save_pretrained(folder)
    torch.save({"payload": _CreatesMarkerWhenUnpickled(tmp_path / "unpickled")}, folder / "adapter_model.bin")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"transformers_weights": "adapter_model.bin"}))
    with pytest.raises(UserInputError, match=r"transformers_weights.*'adapter_model.bin'.*re-save") as raised:
        load_drafter(folder, torch.float32) if what == "drafter" else load_target(str(folder), "float32")
    assert str(folder / "config.json") in str(raised.value)
    assert not (tmp_path / "unpickled").exists() and not unpickled


def _fake_hub_snapshot(cache, repo_id: str, folder):
    """A Hub cache entry for `repo_id` holding `folder`'s files, as `huggingface_hub` lays it out."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    return snapshot


@pytest.mark.parametrize("bad_drafter", ["weights.bin", "../outside.safetensors"], indirect=True)
def test_a_hub_drafter_whose_cached_index_names_a_pickle_or_escapes_is_refused(bad_drafter, tmp_path, monkeypatch,
                                                                                 unpickled):
    """A Hub id is checked on the index its cache resolved (offline here: nothing downloads), and a sharded drafter
    whose shards are inside its snapshot still loads from the same cache."""
    from huggingface_hub import constants

    import hf_dspark
    from hf_dspark.models.loading import load_drafter

    folder, entry, marker = bad_drafter
    snapshot = _fake_hub_snapshot(tmp_path / "hub", "someone/bad-drafter", folder)
    with pytest.raises(Exception) as raised:
        hf_dspark.DSparkDraftModel.from_pretrained("someone/bad-drafter", cache_dir=tmp_path / "hub",
                                                   local_files_only=True)
    _assert_refused(raised.value, snapshot, entry, marker, unpickled)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(Exception) as raised:
        load_drafter("someone/bad-drafter", torch.float32)  # AutoModel, through the Hub cache
    _assert_refused(raised.value, snapshot, entry, marker, unpickled)
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    drafter.save_pretrained(tmp_path / "good", max_shard_size="20KB")
    assert (tmp_path / "good" / INDEX).is_file()
    _fake_hub_snapshot(tmp_path / "hub", "someone/good-drafter", tmp_path / "good")
    loaded = load_drafter("someone/good-drafter", torch.float32)
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in drafter.state_dict().items())


def test_a_sharded_drafter_with_its_shards_inside_the_folder_loads(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov")
    drafter.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / INDEX).is_file()
    import hf_dspark

    loaded = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "sharded")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_cli_refuses_a_bad_drafter_index_in_one_line(tmp_path, capsys, unpickled):
    from hf_dspark.cli.main import main
    from saved_chat_models import save_chat_target

    target = save_chat_target(tmp_path / "target")
    folder = tmp_path / "drafter"
    tiny_drafter(target, "markov", block_size=4).save_pretrained(folder)
    entry, marker = _with_bad_index(folder, "weights.bin")
    capsys.readouterr()
    assert main(["generate", "hi", "--target", str(tmp_path / "target"), "--drafter", str(folder)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hf-dspark ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hf-dspark generate: ") and f"{folder / INDEX}" in lines[0]
    assert "'weights.bin'" in lines[0]
    assert not marker.exists() and not unpickled
