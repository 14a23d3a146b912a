"""`hf-dspark generate` and `hf-dspark bench` on a tiny random chat target saved to disk (real tokenizer)."""

import json

import pytest

from hf_dspark.cli.main import main
from hf_dspark.evaluation.profiling import TIMING, profile_verification_costs
from hf_dspark.policy import VerificationCostTable
from factories import tiny_drafter
from cli_checks import refused


def test_generate_streams_and_compares_with_plain(saved_pair, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))  # the profiled cost table is cached here
    code = main(["generate", "What is 2 + 2?", "--target", str(saved_pair / "target"), "--drafter",
                 str(saved_pair / "drafter"), "--max-new-tokens", "12", "--compare"])
    assert code == 0
    captured = capsys.readouterr()
    assert "tokens/s, tau" in captured.err and "speed-up" in captured.err
    assert "identical to plain greedy: yes" in captured.err
    assert list((tmp_path / "cost-tables").glob("*.json"))  # profiled once for the throughput schedule


def test_a_cost_table_cached_by_older_timing_is_profiled_again(saved_pair, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    command = ["generate", "What is 2 + 2?", "--target", str(saved_pair / "target"), "--drafter",
               str(saved_pair / "drafter"), "--max-new-tokens", "4"]
    assert main(command) == 0
    (path,) = (tmp_path / "cost-tables").glob("*.json")
    current = json.loads(path.read_text())
    assert current["description"]["timing"] == TIMING
    stale = {**current, "seconds": [1.0] * len(current["seconds"]),
             "description": {k: v for k, v in current["description"].items() if k != "timing"}}
    path.write_text(json.dumps(stale))
    assert main(command) == 0
    assert "profiling verification costs once" in capsys.readouterr().err
    again = json.loads(path.read_text())
    assert again["description"]["timing"] == TIMING and again["seconds"] != stale["seconds"]
    marked = {**again, "seconds": [2.0] * len(again["seconds"])}  # a current table is reused as it is
    path.write_text(json.dumps(marked))
    assert main(command) == 0
    assert "profiling" not in capsys.readouterr().err
    assert json.loads(path.read_text())["seconds"] == marked["seconds"]


def test_generate_refuses_a_custom_target_without_drafter(saved_pair, capsys):
    assert main(["generate", "hi", "--target", str(saved_pair / "target")]) == 2
    assert "needs its --drafter" in capsys.readouterr().err


def test_bench_reports_every_method_side_by_side(saved_pair, tmp_path, capsys):
    report = tmp_path / "bench.md"
    code = main(["bench", "--target", str(saved_pair / "target"), "--drafters", f"tiny={saved_pair / 'drafter'}",
                 "--dtypes", "float32", "--temperatures", "0", "1", "--benchmarks", "gsm8k", "mt-bench",
                 "--max-new-tokens", "10", "--output", str(report)])
    assert code == 0
    text = report.read_text()
    for row in ("| plain |", "| prompt-lookup |", "| tiny |"):
        assert text.count(row) == 2  # greedy and T=1 tables
    assert "| 2/2 |" in text  # both greedy outputs identical to plain, for prompt lookup and the drafter
    assert "hf-dspark bench" in text and "float32, greedy" in text and "float32, T=1" in text
    assert "float32 target forward after a 256-token context" in text
    costs = json.loads(report.with_suffix(".json").read_text())["target_forward_cost"]["float32"]
    assert len(costs["ms_by_tokens"]) == 8 and costs["ratio_to_one_token"][0] == 1.0


def test_profiled_cost_table_round_trips(tmp_path):
    from factories import tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    table = profile_verification_costs(target, max_tokens=5, context_length=16, repeats=3, drafter=drafter)
    assert table.max_tokens == 5 and table.draft_seconds > 0
    table.save(tmp_path / "t.json")
    assert VerificationCostTable.load(tmp_path / "t.json") == table
    assert table.round_seconds(7) > table.round_seconds(5) or table.seconds[-1] <= table.seconds[0]
    with pytest.raises(ValueError, match="time from"):
        VerificationCostTable([0.0])


def test_regenerate_can_write_the_target_cache_in_the_same_run(saved_pair, tmp_path):
    from hf_dspark.training.target_cache import TargetCacheDataset

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Name {i} colours of apples."]}) + "\n" for i in range(3)))
    code = main(["regenerate", "--prompts", str(prompts), "--target", str(saved_pair / "target"), "--output",
                 str(tmp_path / "regen"), "--max-new-tokens", "5", "--batch-size", "2", "--cache",
                 str(tmp_path / "cache"), "--cache-layers", "0", "1"])
    assert code == 0
    cached = TargetCacheDataset(tmp_path / "cache")
    assert len(cached) == 3
    example = cached[0]
    assert example["target_features"].shape == (len(example["input_ids"]), 2 * 32)
    assert example["loss_mask"].sum() >= 1


def test_training_reads_several_cache_folders_as_one_dataset(saved_pair, tmp_path, capsys):
    """Data regenerated later is cached in a folder of its own; `--cache A B` trains on both, nothing recached."""
    for part, count in (("a", 2), ("b", 3)):
        prompts = tmp_path / f"prompts-{part}.jsonl"
        prompts.write_text("".join(json.dumps({"turns": [f"Name {i} {part} fruits."]}) + "\n" for i in range(count)))
        assert main(["regenerate", "--prompts", str(prompts), "--target", str(saved_pair / "target"), "--output",
                     str(tmp_path / f"regen-{part}"), "--max-new-tokens", "5", "--batch-size", "2", "--cache",
                     str(tmp_path / f"cache-{part}"), "--cache-layers", "-1", "0"]) == 0
    capsys.readouterr()
    assert main(["train", "--target", str(saved_pair / "target"), "--output", str(tmp_path / "out"), "--cache",
                 str(tmp_path / "cache-a"), str(tmp_path / "cache-b"), "--max-steps", "2", "--block-size", "4",
                 "--num-layers", "1", "--target-layers", "-1", "0", "--draft-vocab-size", "64",
                 "--batch-size", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["examples"] == 5 and summary["steps"] == 2
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_profile_writes_a_cost_table_generate_can_use(saved_pair, tmp_path, capsys):
    table_path = tmp_path / "costs.json"
    assert main(["profile", "--target", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
                 "--max-tokens", "6", "--context-length", "32", "--repeats", "2", "--output", str(table_path)]) == 0
    table = VerificationCostTable.load(table_path)
    assert table.max_tokens == 6 and table.draft_seconds > 0 and "SPS" in capsys.readouterr().out
    assert main(["generate", "Hello", "--target", str(saved_pair / "target"), "--drafter",
                 str(saved_pair / "drafter"), "--max-new-tokens", "6", "--cost-table", str(table_path)]) == 0


# ---------------------------------------------------------------------------------------------------------
# Mistakes a user can fix: one line on stderr naming the problem and the fix, exit code 2, no traceback
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["generate", "hi"],
    ["regenerate", "--prompts", "none.jsonl", "--output", "unused"],
    ["eval", "--output", "unused"],
])
def test_negative_temperature_is_refused_by_every_command(capsys, command):
    """generate and regenerate ran greedy silently (recording -1 in the manifest); eval failed with a traceback."""
    refused(capsys, command + ["--temperature", "-1"], "--temperature must be >= 0", "got -1.0")


def test_impossible_flags_are_refused_before_any_model_loads(capsys, monkeypatch):
    import hf_dspark.targets.loading as loading

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    refused(capsys, ["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1", "got 0")
    refused(capsys, ["generate", "hi", "--temperature", "0.7", "--top-p", "0"], "--top-p must be in (0, 1]")
    refused(capsys, ["bench", "--temperatures", "0", "-0.5"], "--temperatures must all be >= 0", "got 0.0 -0.5")
    refused(capsys, ["regenerate", "--output", "x", "--batch-size", "0"], "--batch-size must be at least 1")


def test_missing_and_wrong_model_folders_are_one_line(saved_pair, capsys, tmp_path):
    target, drafter = str(saved_pair / "target"), str(saved_pair / "drafter")
    missing = str(tmp_path / "no-such-drafter")
    refused(capsys, ["generate", "hi", "--target", target, "--drafter", missing],
            f"no drafter at {missing}: no such folder", "save_pretrained()")
    refused(capsys, ["generate", "hi", "--target", str(tmp_path / "gone"), "--drafter", drafter],
            "no target at", "no such folder")
    refused(capsys, ["generate", "hi", "--target", target, "--drafter", target],  # the target given as the drafter
            "model_type 'llama'", "no drafter layout hf_dspark reads", "--target")
    refused(capsys, ["generate", "hi", "--target", drafter, "--drafter", drafter], "holds an hf_dspark drafter")
    (tmp_path / "empty").mkdir()
    refused(capsys, ["generate", "hi", "--target", target, "--drafter", str(tmp_path / "empty")], "no config.json")
    refused(capsys, ["eval", "--target", target, "--drafter", missing, "--benchmarks", "gsm8k", "--output",
                     str(tmp_path / "out")], "no drafter at")


def test_a_drafter_for_another_target_is_one_line(saved_pair, capsys, tmp_path):
    from factories import tiny_target

    other = tiny_target("llama", vocab_size=600)
    tiny_drafter(other, "markov", block_size=4).save_pretrained(tmp_path / "other-drafter")
    refused(capsys, ["generate", "hi", "--target", str(saved_pair / "target"), "--drafter",
                     str(tmp_path / "other-drafter")], "hidden_size (64) differs", "trained for this target")


def test_train_data_mistakes_are_one_line(saved_pair, capsys, tmp_path):
    base = ["train", "--target", str(saved_pair / "target"), "--output", str(tmp_path / "out"), "--max-steps", "1",
            "--block-size", "4", "--num-layers", "1"]
    refused(capsys, base, "no training data", "--data DIR")
    refused(capsys, base + ["--data", str(tmp_path / "nothing")], "no such folder", "hf-dspark regenerate")
    (tmp_path / "empty").mkdir()
    refused(capsys, base + ["--data", str(tmp_path / "empty")], "no usable regenerated examples")
    refused(capsys, base + ["--cache", str(tmp_path / "empty")], "is not a target cache", "hf-dspark cache")
    refused(capsys, base + ["--init-from", str(tmp_path / "nothing"), "--data", str(tmp_path / "empty")],
            "no drafter at")


def test_real_bugs_keep_their_traceback(saved_pair, monkeypatch):
    import hf_dspark.cli.main as cli

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a mistake of the user")

    monkeypatch.setattr(cli, "load_target", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", "--target", str(saved_pair / "target"), "--output", "unused"])
