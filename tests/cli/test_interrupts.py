"""Defect 11: Ctrl-C in a long command printed a KeyboardInterrupt traceback (in `regenerate` ending with the engine's
"cancel(request_id) the offending request", which means nothing on the command line). Each command now ends with one
line on stderr saying what was kept and how to resume, and exit code 130; the rerun resumes from what the line
names. In-process, the interrupt is raised where Ctrl-C lands (mid-decoding, mid-training, mid-write); `regenerate`
also gets a real SIGINT in a child process that waits for it inside an engine step."""

import json
from pathlib import Path

import pytest

from hf_dspark.cli.main import main
from hf_dspark.training.regenerate import completed_ids, shard_paths
from training_helpers import write_regenerated_shard


def interrupted(capsys, argv: list[str], *needles: str) -> str:
    """Run `argv`, which Ctrl-C stops: exit code 130, one line on stderr holding `needles`, no traceback."""
    assert main(argv) == 130
    return one_interrupt_line(capsys.readouterr().err, argv[0], *needles)


def one_interrupt_line(err: str, command: str, *needles: str) -> str:
    for noise in ("Traceback", "KeyboardInterrupt", "cancel(request_id)"):
        assert noise not in err, err[-3000:]
    lines = [text for text in err.splitlines() if text.startswith("hf-dspark ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"hf-dspark {command}: interrupted (Ctrl-C); "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _prompts(tmp_path, count=6):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"Name {i} colours of apples."]}) + "\n" for i in range(count)))
    return path


def _regenerate_argv(saved_pair, tmp_path, output):  # noqa: F811
    return ["regenerate", "--prompts", str(_prompts(tmp_path)), "--target", str(saved_pair / "target"), "--output",
            str(output), "--max-new-tokens", "4", "--batch-size", "2", "--max-turns", "1"]


def _records(folder) -> dict[int, dict]:
    records = {}
    for shard in shard_paths(folder):
        for line in shard.read_text().splitlines():
            record = json.loads(line)
            records[record["id"]] = record
    return records


def test_ctrl_c_in_regenerate_says_how_many_conversations_are_saved_and_the_rerun_resumes(saved_pair, tmp_path,
                                                                                          capsys, monkeypatch):
    from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine

    output = tmp_path / "regen"
    argv = _regenerate_argv(saved_pair, tmp_path, output)
    plain_round = SpeculativeEngine._plain_round

    def round_after_two_saved(self):  # inside an engine step (where Ctrl-C lands), once two conversations are saved
        if len(completed_ids(output)) >= 2:
            raise KeyboardInterrupt
        return plain_round(self)

    with monkeypatch.context() as patched:
        patched.setattr(SpeculativeEngine, "_plain_round", round_after_two_saved)
        line = interrupted(capsys, argv, f"saved in {output}", "rerun the same command to resume")
    saved = len(completed_ids(output))
    assert saved >= 2 and f"{saved} conversations are saved" in line, line
    kept = {shard.name: shard.read_bytes() for shard in shard_paths(output)}
    assert main(argv) == 0
    assert {shard.name: shard.read_bytes() for shard in shard_paths(output) if shard.name in kept} == kept
    uninterrupted = tmp_path / "whole"
    assert main(_regenerate_argv(saved_pair, tmp_path, uninterrupted)) == 0
    assert _records(output) == _records(uninterrupted)  # the rerun answered exactly the rest, exactly alike


REGENERATE_DRIVER = """
from pathlib import Path
from hf_dspark.cli.main import main
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.training.regenerate import completed_ids
from training_helpers import announce_and_wait_for_sigint

marker, output = Path(sys.argv[2]), Path(sys.argv[3])
plain_round = SpeculativeEngine._plain_round

def round_that_waits(self):  # inside an engine step, once two conversations are saved: where Ctrl-C usually lands
    if len(completed_ids(output)) >= 2:
        announce_and_wait_for_sigint(marker, "two saved")
    return plain_round(self)

SpeculativeEngine._plain_round = round_that_waits
sys.exit(main(sys.argv[4:]))
"""


def test_a_real_sigint_to_regenerate_is_one_line_and_exit_code_130(saved_pair, tmp_path, interruptible_child):
    output, marker = tmp_path / "regen", tmp_path / "started"
    argv = _regenerate_argv(saved_pair, tmp_path, output)
    interruptible_child.start(REGENERATE_DRIVER, marker, str(marker), str(output), *argv)
    assert interruptible_child.interrupt() == 130, interruptible_child.output()
    saved = len(completed_ids(output))
    one_interrupt_line(interruptible_child.output(), "regenerate", f"{saved} conversations are saved in {output}",
                       "rerun the same command to resume")
    assert main(argv) == 0 and len(completed_ids(output)) == 6


def test_ctrl_c_in_generate_keeps_the_streamed_answer_and_says_nothing_was_saved(saved_pair, capsys, monkeypatch):
    from transformers import TextStreamer

    import hf_dspark.cli.generate as generate

    class StoppedStreamer(TextStreamer):  # Ctrl-C while the answer streams, inside the decoding loop
        calls = 0

        def put(self, value):
            StoppedStreamer.calls += 1
            if StoppedStreamer.calls == 4:
                raise KeyboardInterrupt
            super().put(value)

    monkeypatch.setattr(generate, "TextStreamer", StoppedStreamer)
    base = ["generate", "--target", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
            "--max-new-tokens", "12", "--no-schedule"]
    interrupted(capsys, base + ["What is 2 + 2?"], "nothing was saved", "the answer so far is what was printed")
    assert StoppedStreamer.calls == 4

    def ctrl_c_at_the_prompt(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c_at_the_prompt)
    interrupted(capsys, base + ["--chat"], "the chat ended; nothing was saved")


def test_ctrl_c_in_train_names_the_checkpoint_the_rerun_resumes_from(saved_pair, tmp_path, capsys, monkeypatch):
    from hf_dspark.training.trainer import DSparkTrainer

    output = tmp_path / "out"
    argv = ["train", "--target", str(saved_pair / "target"), "--output", str(output), "--data",
            str(write_regenerated_shard(tmp_path / "data")), "--max-steps", "4", "--save-steps", "2",
            "--block-size", "4", "--num-layers", "1", "--markov-rank", "16", "--batch-size", "2", "--num-anchors", "4",
            "--max-length", "64", "--threads", "1"]
    compute_loss = DSparkTrainer.compute_loss

    def loss_of_step_3_interrupted(self, *args, **kwargs):  # checkpoint-2 is saved by now
        if self.state.global_step == 2:
            raise KeyboardInterrupt
        return compute_loss(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(DSparkTrainer, "compute_loss", loss_of_step_3_interrupted)
        interrupted(capsys, argv, f"the newest complete checkpoint is {output / 'trainer' / 'checkpoint-2'} (step 2)",
                    "rerun the same command to resume from it")
    assert main(argv) == 0
    assert f"resuming from {output / 'trainer' / 'checkpoint-2'}" in capsys.readouterr().err


def test_ctrl_c_in_cache_says_how_many_shards_are_kept_and_the_rerun_resumes(saved_pair, tmp_path, capsys,
                                                                            monkeypatch):
    output = tmp_path / "cache"
    argv = ["cache", "--target", str(saved_pair / "target"), "--output", str(output), "--data",
            str(write_regenerated_shard(tmp_path / "data")), "--max-length", "64"]

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr("hf_dspark.training.target_cache._cache_shard", stopped)
        interrupted(capsys, argv, f"0 of 1 target-cache shards are saved in {output}", "rerun the same command")
    assert main(argv) == 0 and (output / "shard-00000.safetensors").is_file()


def test_ctrl_c_while_a_cache_shard_is_written_leaves_no_half_file(saved_pair, tmp_path, capsys, monkeypatch):
    output = tmp_path / "cache"
    argv = ["cache", "--target", str(saved_pair / "target"), "--output", str(output), "--data",
            str(write_regenerated_shard(tmp_path / "data")), "--max-length", "64"]

    def half_written(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a shard")
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr("hf_dspark.training.target_cache.save_file", half_written)
        interrupted(capsys, argv, f"0 of 1 target-cache shards are saved in {output}", "rerun the same command")
    assert list(output.glob("*.tmp")) == []
    assert main(argv) == 0 and (output / "shard-00000.safetensors").is_file()


def test_ctrl_c_in_eval_says_how_many_answers_are_saved(saved_pair, tmp_path, capsys, monkeypatch):
    import hf_dspark.evaluation.harness as harness

    output = tmp_path / "eval"
    generate_record, records = harness.generate_record, output / "records.jsonl"

    def answer_after_two_saved(*args, **kwargs):  # Ctrl-C while the third answer is decoded
        if records.is_file() and len(records.read_text().splitlines()) == 2:
            raise KeyboardInterrupt
        return generate_record(*args, **kwargs)

    monkeypatch.setattr(harness, "generate_record", answer_after_two_saved)
    interrupted(capsys, ["eval", "--target", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
                         "--benchmarks", "gsm8k", "--max-prompts", "2", "--max-new-tokens", "4", "--no-progress",
                         "--output", str(output)],
                f"2 answers (one per method and prompt) are saved in {records}",
                "rerun the same command to resume")


@pytest.mark.parametrize("command", ["bench", "profile", "convert"])
def test_ctrl_c_in_commands_that_write_at_the_end_says_nothing_was_written(saved_pair, tmp_path, capsys, monkeypatch,
                                                                            command):
    target, drafter, output = str(saved_pair / "target"), str(saved_pair / "drafter"), tmp_path / "out"

    def stopped(*args, **kwargs):
        if command == "convert":  # a half-written folder, then Ctrl-C
            output.mkdir()
            (output / "config.json").write_text("{}")
        raise KeyboardInterrupt

    if command == "bench":
        monkeypatch.setattr("hf_dspark.cli.bench.measure_forward_costs", stopped)
        argv = ["bench", "--target", target, "--drafters", f"tiny={drafter}", "--dtypes", "float32", "--output",
                str(output / "bench.md")]
    elif command == "profile":
        monkeypatch.setattr("hf_dspark.evaluation.profiling.profile_verification_costs", stopped)
        argv = ["profile", "--target", target, "--output", str(output / "costs.json")]
    else:
        monkeypatch.setattr("hf_dspark.hub.convert.convert_drafter", stopped)
        argv = ["convert", drafter, str(output)]
    interrupted(capsys, argv, "nothing was written to")
    assert not output.exists()  # convert removed its half-written folder; the others wrote nothing
