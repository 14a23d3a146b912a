"""Issue 25: mistakes a user can fix printed a traceback with exit code 1. Each is now one line on stderr naming the
problem and the fix, with exit code 2, and loses nothing already written; a real bug keeps its traceback. Each case
builds its situation in `tmp` and returns (argv, words the one line must hold, a check that nothing was lost)."""

import json
from types import SimpleNamespace

import pytest

from hf_dspark.cli.main import main
from hf_dspark.training.regenerate import _ShardWriter
from cli_checks import refused
from training_helpers import files_in, write_regenerated_shard


def _prompts_file(tmp, count=4):
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"Name {i} colours of apples."]}) + "\n" for i in range(count)))
    return path


def _unwritable(disk):
    """A folder nobody may write: a read-only tmpfs (root ignores permissions), else a folder without write bits."""
    if disk.mounted:
        disk.remount("ro")
    else:
        disk.folder.chmod(0o555)
    return disk.folder / "out"


def _unchanged(folder, may_add=False):
    """Every file in `folder` stays as it is (and, unless `may_add`, nothing is added: no half-written leftover)."""
    before = files_in(folder)
    return lambda: ({k: v for k, v in files_in(folder).items() if k in before} if may_add else files_in(folder)) == before


def _regenerated_then_cut(env, disk_folder):
    """A regeneration interrupted after two of four records: what a rerun must keep byte for byte."""
    argv = ["regenerate", "--prompts", str(_prompts_file(env.tmp)), "--target", env.target, "--output",
            str(disk_folder / "regen"), "--max-new-tokens", "3", "--batch-size", "2"]
    assert main(argv) == 0
    (shard,) = (disk_folder / "regen").glob("shard-*.jsonl")
    shard.write_text("".join(shard.read_text().splitlines(keepends=True)[:2]))
    return argv, disk_folder / "regen"


def _full_regenerate(env):
    disk = env.small_disk("disk", 1 << 20)
    argv, folder = _regenerated_then_cut(env, disk.folder)
    kept = _unchanged(folder, may_add=True)  # the failed append may leave a torn shard, which a rerun skips
    if disk.mounted:
        disk.fill()
    else:
        env.monkeypatch.setattr(_ShardWriter, "write", _raise_enospc)
    return argv, ["--output", str(folder), "no space left", "rerun"], kept


def _raise_enospc(*args, **kwargs):
    raise OSError(28, "No space left on device")


def _cache_argv(env, output, data_seed=0):
    data = write_regenerated_shard(env.tmp / f"data-{data_seed}", seed=data_seed)
    return ["cache", "--target", env.target, "--output", str(output), "--data", str(data), "--max-length", "64"]


def _full_cache(env, during_write):
    disk = env.small_disk("disk", 1 << 20)
    argv = _cache_argv(env, disk.folder / "cache")
    assert main(argv) == 0
    (disk.folder / "cache" / "shard-00000.safetensors").unlink()  # as if stopped before its one shard
    kept = _unchanged(disk.folder / "cache")
    if disk.mounted:
        disk.fill()
    if during_write:  # the up-front estimate sees room; the disk fills while the shard is written
        env.monkeypatch.setattr("hf_dspark.training.target_cache.shutil.disk_usage", lambda path: _free(1 << 40))
        if not disk.mounted:
            env.monkeypatch.setattr("hf_dspark.training.target_cache.save_file", _raise_enospc)
    elif not disk.mounted:
        env.monkeypatch.setattr("hf_dspark.training.target_cache.shutil.disk_usage", lambda path: _free(1000))
    return argv, [str(disk.folder / "cache"), "no space left" if during_write else "GiB free"], kept


def _free(size):
    return type("Usage", (), {"free": size})()


def _cache_other_data(env):
    output = env.tmp / "cache"
    assert main(_cache_argv(env, output)) == 0
    return _cache_argv(env, output, data_seed=1), ["other data", "new folder"], _unchanged(output)


def _regenerate_other_settings(env):
    argv, folder = _regenerated_then_cut(env, env.tmp)
    kept = _unchanged(folder)
    return argv[:-1] + ["3"], ["other settings", "new output folder"], kept


def _push(env, needles, *extra, drafter=None, dry_run=True):
    """A push (a dry run into `tmp/staged` unless told otherwise) that must leave no staged folder behind."""
    staged = env.tmp / "staged"
    env.monkeypatch.setenv("HF_HOME", str(env.tmp / "hf-home"))  # no cached token
    env.monkeypatch.delenv("HF_TOKEN", raising=False)
    argv = ["push", drafter or env.drafter, "org/tiny-drafter", *extra]
    argv += ["--dry-run", str(staged)] if dry_run else []
    return argv, needles, lambda: not staged.exists() and sorted(p.name for p in env.tmp.iterdir()) == env.before


def _push_into_used_folder(env):
    (env.tmp / "staged").mkdir()
    (env.tmp / "staged" / "mine.txt").write_text("mine")
    argv, needles, _ = _push(env, [str(env.tmp / "staged"), "not empty"], "--base-model", "org/t")
    return argv, needles, lambda: files_in(env.tmp / "staged") == {"mine.txt": b"mine"}


def _closed_port() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _hub_refusing_tokens(env):
    """A Hub server that answers every request 401, as huggingface.co does without a (write) token."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Unauthorized(BaseHTTPRequestHandler):
        def answer(self):
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_PUT = answer

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Unauthorized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env.closers.append(server.shutdown)
    return f"http://127.0.0.1:{server.server_port}"


def _with_endpoint(env, endpoint, needles):
    env.monkeypatch.setenv("HF_ENDPOINT", endpoint)
    return _push(env, needles, "--base-model", "org/tiny-target", dry_run=False)


def _file(env, name, text):
    (env.tmp / name).write_text(text)
    return str(env.tmp / name)


MISTAKES = {
    "cost table missing": lambda env: (env.generate + ["--cost-table", str(env.tmp / "none.json")],
                                       ["--cost-table", "none.json", "hf-dspark profile"], None),
    "cost table not JSON": lambda env: (env.generate + ["--cost-table", _file(env, "t.json", "{oops")],
                                        ["t.json", "not valid JSON", "hf-dspark profile"], None),
    "cost table not a table": lambda env: (env.generate + ["--cost-table", _file(env, "t.json", "[1, 2]")],
                                           ["t.json", "is not a cost table", "hf-dspark profile"], None),
    "cost table impossible times": lambda env: (env.generate + ["--cost-table",
                                                                _file(env, "t.json", '{"seconds": [-1]}')],
                                                ["t.json", "seconds from"], None),
    "prompt not UTF-8": lambda env: (["generate", "caf\udce9 au lait"] + env.generate[2:],
                                     ["prompt", "UTF-8", "position 3"], None),
    "regenerate into a read-only folder": lambda env: (
        ["regenerate", "--prompts", "x.jsonl", "--output", str(_unwritable(env.small_disk("ro", 1 << 20)))],
        ["--output", "cannot write"], None),
    "regenerate into a file": lambda env: (["regenerate", "--prompts", "x.jsonl", "--output", _file(env, "f", "")],
                                           ["--output", "a file is in the way"], None),
    "regenerate --cache into a file": lambda env: (
        ["regenerate", "--prompts", "x.jsonl", "--output", str(env.tmp / "o"), "--cache", _file(env, "f", "") + "/c"],
        ["--cache", "a file is in the way"], None),
    "regenerate without its prompt file": lambda env: (
        ["regenerate", "--prompts", str(env.tmp / "none.jsonl"), "--output", str(env.tmp / "new" / "out")],
        ["none.jsonl", "no such file"], lambda: not (env.tmp / "new").exists()),  # and no empty folder made
    "regenerate on a full disk": _full_regenerate,
    "regenerate rerun with other settings": _regenerate_other_settings,
    "cache into a read-only folder": lambda env: (
        _cache_argv(env, _unwritable(env.small_disk("ro", 1 << 20))), ["--output", "cannot write"], None),
    "cache on a disk too small": lambda env: _full_cache(env, during_write=False),
    "cache on a disk that fills": lambda env: _full_cache(env, during_write=True),
    "cache rerun with other data": _cache_other_data,
    "train into a read-only folder": lambda env: (
        ["train", "--target", env.target, "--output", str(_unwritable(env.small_disk("ro", 1 << 20))), "--data",
         str(write_regenerated_shard(env.tmp / "data"))], ["--output", "cannot write"], None),
    "eval into a read-only folder": lambda env: (
        ["eval", "--output", str(_unwritable(env.small_disk("ro", 1 << 20)))], ["--output", "cannot write"], None),
    "profile into a read-only folder": lambda env: (
        ["profile", "--output", str(_unwritable(env.small_disk("ro", 1 << 20)) / "costs.json")],
        ["--output", "cannot write"], None),
    "push a missing folder": lambda env: _push(env, ["no drafter at", "no such folder"], drafter=str(env.tmp / "x")),
    "push the target as the drafter": lambda env: _push(env, ["a target folder goes to --target"], drafter=env.target),
    "push --eval not JSON": lambda env: _push(env, ["--eval", "r.json", "not valid JSON", "hf-dspark eval"],
                                              "--eval", _file(env, "r.json", "oops")),
    "push --eval missing": lambda env: _push(env, ["--eval", "r.json", "no such file"], "--eval",
                                             str(env.tmp / "r.json")),
    "push --eval not results": lambda env: _push(env, ["--eval", "not an `hf-dspark eval` results.json"], "--eval",
                                                 _file(env, "r.json", "[]")),
    "push --card missing": lambda env: _push(env, ["--card", "card.md", "no such file"], "--card",
                                             str(env.tmp / "card.md")),
    "push without a card or --base-model": lambda env: _push(env, ["--base-model", "--card"]),
    "push into a folder with files": _push_into_used_folder,
    "push without network": lambda env: _with_endpoint(env, _closed_port(), ["could not reach", "HF_ENDPOINT"]),
    "push without a token": lambda env: _with_endpoint(env, _hub_refusing_tokens(env), ["401", "HF_TOKEN"]),
    "push to an invalid repo id": lambda env: (["push", env.drafter, "not a repo id!", "--base-model", "org/t"],
                                               ["repo id", "not a repo id!"], None),
    "bench --drafters without a label": lambda env: (["bench", "--drafters", env.drafter],
                                                     ["--drafters", "LABEL=PATH"], None),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_user_mistakes_are_one_line_and_lose_nothing(mistake, saved_pair, tmp_path, capsys, monkeypatch,
                                                     small_disk):
    target, drafter = str(saved_pair / "target"), str(saved_pair / "drafter")
    env = SimpleNamespace(tmp=tmp_path, target=target, drafter=drafter, monkeypatch=monkeypatch, closers=[],
                          small_disk=small_disk, generate=["generate", "hi", "--target", target, "--drafter", drafter])
    try:
        argv, needles, nothing_lost = MISTAKES[mistake](env)
        env.before = sorted(p.name for p in tmp_path.iterdir())
        capsys.readouterr()
        refused(capsys, argv, *needles)
        assert nothing_lost is None or nothing_lost()
    finally:
        for close in env.closers:
            close()


def test_regenerate_resumes_exactly_once_the_full_disk_has_room(saved_pair, tmp_path, capsys, small_disk,
                                                                 monkeypatch):
    """After `regenerate` met a full disk, the same command finishes the run and keeps the records it had."""
    env = SimpleNamespace(tmp=tmp_path, target=str(saved_pair / "target"), small_disk=small_disk)
    disk = small_disk("disk", 1 << 20)
    argv, folder = _regenerated_then_cut(env, disk.folder)
    (shard,) = folder.glob("shard-*.jsonl")
    kept = shard.read_text()
    with monkeypatch.context() as patches:
        if disk.mounted:
            filler = disk.fill()
        else:
            patches.setattr(_ShardWriter, "write", _raise_enospc)
        assert main(argv) == 2
        if disk.mounted:
            filler.unlink()
    assert main(argv) == 0
    records = [json.loads(line) for path in sorted(folder.glob("shard-*.jsonl")) for line in path.open()]
    assert sorted(r["id"] for r in records) == [0, 1, 2, 3] and shard.read_text() == kept


@pytest.mark.parametrize("where", ["regenerate", "target_cache", "push"])
def test_a_bug_while_writing_keeps_its_traceback(where, saved_pair, tmp_path, monkeypatch):
    """Only a folder's own faults become one line: a bug inside the same code still raises with its traceback."""
    import hf_dspark.hub.push
    import hf_dspark.training.target_cache

    def bug(*args, **kwargs):
        raise AssertionError("a bug, not a mistake of the user")

    owner, name = {"regenerate": (_ShardWriter, "write"), "target_cache": (hf_dspark.training.target_cache,
                   "_cache_shard"), "push": (hf_dspark.hub.push, "stage_drafter")}[where]
    monkeypatch.setattr(owner, name, bug)
    env = SimpleNamespace(tmp=tmp_path, target=str(saved_pair / "target"))
    argv = {"regenerate": ["regenerate", "--prompts", str(_prompts_file(tmp_path)), "--target", env.target,
                           "--output", str(tmp_path / "regen"), "--max-new-tokens", "3"],
            "target_cache": _cache_argv(env, tmp_path / "cache"),
            "push": ["push", str(saved_pair / "drafter"), "org/x", "--base-model", "org/t", "--dry-run",
                     str(tmp_path / "staged")]}[where]
    with pytest.raises(AssertionError, match="a bug"):
        main(argv)
