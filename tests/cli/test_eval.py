"""`hf-dspark eval`: metrics from hand-built acceptance traces, answer extraction, prompt files, test execution,
and a resumed end-to-end run of two drafters on a tiny random chat target saved to disk (real tokenizer)."""

import json

import pytest

from hf_dspark.evaluation import OutputMismatchError, SettingsMismatchError
from hf_dspark.evaluation.harness import EvalSettings, RecordStore, check_identical
from hf_dspark.evaluation.metrics import acceptance_summary, confidence_samples
from hf_dspark.evaluation.prompts import load_prompt_sets
from hf_dspark.evaluation.quality import (
    extract_boxed_answer,
    extract_code,
    extract_number_answer,
    reference_answer,
    run_tests,
)
from hf_dspark.generation.round.stats import SpeculativeStats
from saved_chat_models import save_chat_target_and_drafters

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def hand_trace() -> SpeculativeStats:
    """Four rounds: (draft length, accepted, conditional confidences)."""
    stats = SpeculativeStats()
    for draft, accepted, confidences in [(4, 2, [0.9, 0.8, 0.3, 0.2]), (4, 4, [0.95, 0.9, 0.7, 0.6]),
                                         (2, 0, [0.75, 0.5]), (3, 1, [0.7, 0.2, 0.9])]:
        stats.record(draft, accepted, confidences)
    return stats


def test_acceptance_metrics_match_hand_values():
    summary = acceptance_summary(hand_trace())
    assert summary["rounds"] == 4
    assert summary["tau"] == pytest.approx((2 + 4 + 0 + 1 + 4) / 4)  # accepted + one target token per round
    assert summary["mean_draft_length"] == pytest.approx(13 / 4)
    # slot 1: all 4 rounds reach it, 3 accept; slot 2: rounds 1, 2, 4 reach it, 2 accept; slot 3: rounds 1, 2.
    assert summary["acceptance_by_slot"] == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0], abs=1e-4)
    assert summary["reached_by_slot"] == [4, 3, 2, 1]


def test_calibration_samples_and_metrics_match_hand_values():
    samples = confidence_samples(hand_trace())
    # Reached slots only: round 1 slots 1-3, round 2 all 4, round 3 slot 1, round 4 slots 1-2.
    assert samples["conditional"].tolist() == [0.9, 0.8, 0.3, 0.95, 0.9, 0.7, 0.6, 0.75, 0.7, 0.2]
    assert samples["accepted"].tolist() == [1, 1, 0, 1, 1, 1, 1, 0, 1, 0]
    # Cumulative products over every drafted slot, against "all slots so far accepted".
    assert samples["cumulative"].numel() == 13
    assert samples["cumulative"][:4].tolist() == pytest.approx([0.9, 0.72, 0.216, 0.0432])
    assert samples["survived"].tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 0, 0]

    calibration = acceptance_summary(hand_trace())["calibration"]
    # Bins of width 0.1: |mean c - rate| * count = 0.25 (0.9x) + 0.2 (0.8) + 0.15 (0.7x) + 0.4 + 0.3 + 0.2, / 10.
    assert calibration["ece"] == pytest.approx(0.15, abs=1e-4)
    # Positives beat the negatives 0.3 and 0.2 always, and 0.75 in 4 of 7 pairs: (7 + 7 + 4) / 21.
    assert calibration["auroc"] == pytest.approx(6 / 7, abs=1e-4)
    expected = (0.15 + 0.17 + 0.145 + 0.4015 + 2 * (0.5 - (0.3591 + 0.375) / 2) + 0.216 + 0.0432 + 0.266) / 13
    assert calibration["ece_cumulative"] == pytest.approx(expected, abs=1e-4)
    assert calibration["samples"] == 10 and calibration["cumulative_samples"] == 13


def test_no_calibration_without_confidences():
    stats = SpeculativeStats()
    stats.record(4, 1)
    stats.record(4, 4)
    summary = acceptance_summary(stats)
    assert "calibration" not in summary and summary["tau"] == pytest.approx(3.5)


def test_answer_extraction():
    assert extract_number_answer("She sells 9 eggs, so 9 * $2 = $18.") == "18"
    assert extract_number_answer("Total: 1,250.00 dollars") == "1250"
    assert extract_number_answer("so the answer is \\boxed{72} (checked 3 times)") == "72"
    assert extract_number_answer("no digits here") is None
    assert extract_boxed_answer("first \\boxed{1} then \\boxed{\\dfrac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed_answer("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}") == "(3,\\frac{\\pi}{2})"
    assert extract_boxed_answer("\\boxed{ 033 }") == "033" and extract_boxed_answer("\\boxed{12.0}") == "12"
    assert extract_boxed_answer("unfinished \\boxed{\\frac{1}{2") is None
    assert reference_answer("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", "number") == "18"
    # A bare LaTeX reference is normalised like a boxed model answer, so the two compare equal.
    assert reference_answer("\\left( 3, \\frac{\\pi}{2} \\right)", "boxed") == "(3,\\frac{\\pi}{2})"
    assert reference_answer("\\dfrac{1}{2}.", "boxed") == extract_boxed_answer("\\boxed{\\frac12}")
    # A list stays a list (no `3, 5, 7` == 357), while currency, percent, unit words and `\\frac{270}7` normalise.
    assert reference_answer("3, 5, 7", "boxed") != extract_boxed_answer("\\boxed{357}")
    assert reference_answer("-2,1", "boxed") != extract_boxed_answer("\\boxed{-21}")
    assert reference_answer("1,000", "boxed") == extract_boxed_answer("\\boxed{1000}")
    for reference, answer in (("\\$36", "36"), ("10\\%", "10"), ("5.4 \\text{ cents}", "5.4"),
                              ("864 \\mbox{ inches}^2", "864"), ("\\frac{270}7", "\\frac{270}{7}"), ("\\text{(C)}", "C")):
        assert reference_answer(reference, "boxed") == extract_boxed_answer(f"\\boxed{{{answer}}}"), reference
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nUse f().") == "def f():\n    return 1\n"


def test_prompt_files_of_every_kind(tmp_path):
    (tmp_path / "math.jsonl").write_text(json.dumps({"turns": ["1+1?"], "answer": 2}) + "\n"
                                         + json.dumps({"turns": ["a", "b"], "test_list": ["assert f() == 1"],
                                                       "test_imports": ["import math"]}) + "\n")
    (tmp_path / "list.json").write_text(json.dumps(["hello", {"prompt": "bye"}]))
    (tmp_path / "plain.txt").write_text("first prompt\n\nsecond prompt\n")
    sets = load_prompt_sets([str(tmp_path / n) for n in ("math.jsonl", "list.json", "plain.txt")] + ["mt-bench"],
                            max_prompts=2)
    assert list(sets) == ["math", "list", "plain", "mt-bench"]
    assert sets["math"][0].reference == "2" and sets["math"][1].tests == ["import math", "assert f() == 1"]
    assert [p.turns for p in sets["list"]] == [["hello"], ["bye"]]
    assert [p.turns for p in sets["plain"]] == [["first prompt"], ["second prompt"]]
    assert len(sets["mt-bench"]) == 2 and len(sets["mt-bench"][0].turns) == 2
    with pytest.raises(FileNotFoundError, match="neither a shipped benchmark"):
        load_prompt_sets(["no-such-set"])


# Code that must pass gets a hang guard, not run_tests' 10 s default: a loaded machine may take longer to start
# Python, and a verdict must not depend on that (code that must fail fails either way).
PASSING_CODE_GUARD = 300.0


def test_code_execution_passes_fails_and_times_out():
    solution = "```python\ndef add(a, b):\n    return a + b\n```"
    assert run_tests(solution, ["assert add(2, 3) == 5"], timeout=PASSING_CODE_GUARD)
    assert not run_tests(solution, ["assert add(2, 3) == 6"])
    humaneval_style = ["def check(candidate):\n    assert candidate(1, 1) == 2"]
    assert run_tests(solution, humaneval_style, entry_point="add", timeout=PASSING_CODE_GUARD)
    assert not run_tests("def add(a, b):\n    while True: pass", ["add(1, 2)"], timeout=1.0)


def test_a_changed_greedy_output_fails_loudly_with_the_prompt_id(tmp_path):
    plain = {"method": "plain", "benchmark": "gsm8k", "index": 3, "turns": [{"ids": [1, 2, 3], "text": ""}]}
    lossy = {**plain, "method": "tiny", "turns": [{"ids": [1, 2, 4], "text": ""}]}
    assert check_identical({**plain, "method": "tiny"}, plain, tmp_path, allow_mismatch=False)
    with pytest.raises(OutputMismatchError, match=r"tiny changed the greedy output of gsm8k #3 .*token 2"):
        check_identical(lossy, plain, tmp_path, allow_mismatch=False)
    assert not check_identical(lossy, plain, tmp_path, allow_mismatch=True)
    assert (tmp_path / "mismatch-tiny-gsm8k-3.json").is_file()


def test_record_store_refuses_other_settings_and_drops_a_torn_line(tmp_path):
    settings = EvalSettings("t", "float32", {"a": "p"}, 8, 0.0, 1.0, False, 0)
    store = RecordStore(tmp_path, settings)
    store.add({"method": "plain", "benchmark": "b", "index": 0, "fingerprint": "x", "turns": []})
    with (tmp_path / "records.jsonl").open("a") as handle:
        handle.write('{"method": "a", "bench')  # interrupted mid-write
    assert len(RecordStore(tmp_path, settings).records) == 1
    assert (tmp_path / "records.jsonl").read_text().count("\n") == 1
    with pytest.raises(SettingsMismatchError, match="max_new_tokens: 8 there, 16 now"):
        RecordStore(tmp_path, EvalSettings("t", "float32", {"a": "p"}, 16, 0.0, 1.0, False, 0))


def test_a_run_that_failed_before_its_first_record_does_not_block_the_corrected_rerun(tmp_path):
    """settings.json used to be written before any record, so rerunning a failed run into its folder with the
    fixed setting was refused ("holds records made with different settings") though the folder held none."""
    failed = EvalSettings("t", "float32", {"a": "p"}, 8, -1.0, 1.0, False, 0)
    RecordStore(tmp_path, failed)  # the run dies here (or before its first record)
    assert not (tmp_path / "settings.json").exists()
    (tmp_path / "settings.json").write_text(json.dumps(vars(failed)))  # as an older version left the folder
    (tmp_path / "records.jsonl").write_text('{"method": "plain", "bench')  # torn: nothing was finished
    fixed = EvalSettings("t", "float32", {"a": "p"}, 8, 0.0, 1.0, False, 0)
    store = RecordStore(tmp_path, fixed)
    store.add({"method": "plain", "benchmark": "b", "index": 0, "fingerprint": "x", "turns": []})
    assert json.loads((tmp_path / "settings.json").read_text())["temperature"] == 0.0  # written with the record
    assert len(RecordStore(tmp_path, fixed).records) == 1
    with pytest.raises(SettingsMismatchError, match="temperature: 0.0 there, -1.0 now"):
        RecordStore(tmp_path, failed)  # once a record exists, other settings are refused as before


def test_eval_cli_rerun_after_a_failed_run_into_the_same_folder(saved_models, tmp_path, capsys):
    from hf_dspark.cli.main import main

    out = tmp_path / "out"
    command = ["eval", "--target", str(saved_models / "target"), "--drafter", f"dspark={saved_models / 'markov'}",
               "--benchmarks", "gsm8k", "--max-prompts", "1", "--max-new-tokens", "6", "--no-progress", "--output",
               str(out)]
    assert main(command + ["--benchmarks", str(tmp_path / "missing.jsonl")]) == 2  # fails before any record
    assert main(command + ["--temperature", "-1"]) == 2  # was a traceback after writing settings.json
    with pytest.raises(ValueError, match="temperature must be >= 0"):  # the Python API refuses it too
        from hf_dspark.evaluation import evaluate

        evaluate(["gsm8k"], output_dir=out, target=str(saved_models / "target"), drafters=[], temperature=-1)
    capsys.readouterr()
    assert main(command) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 2  # plain + dspark, one prompt


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, tokenizer):  # noqa: F811
    # With and without a confidence head.
    return save_chat_target_and_drafters(tmp_path_factory.mktemp("eval-models"), tokenizer,
                                         {"markov": "markov", "dflash": "dflash"})


def test_eval_end_to_end_resumes_and_refuses_other_settings(saved_models, tmp_path, capsys):
    from hf_dspark.cli.main import main

    tasks = tmp_path / "arith.jsonl"
    tasks.write_text("".join(json.dumps({"turns": [f"What is {i} + {i}? Answer in Python."], "reference": str(2 * i),
                                         "test": "assert True"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    command = ["eval", "--target", str(saved_models / "target"), "--drafter", f"dspark={saved_models / 'markov'}",
               "--drafter", f"dflash={saved_models / 'dflash'}", "--benchmarks", "gsm8k,mt-bench", str(tasks),
               "--max-new-tokens", "8", "--multi-turn", "--execute-code", "--no-progress", "--output", str(out)]
    assert main(command + ["--max-prompts", "1"]) == 0
    first = (out / "records.jsonl").read_text()
    assert len(first.splitlines()) == 3 * 3  # (plain + 2 drafters) x 3 sets x 1 prompt

    assert main(command + ["--max-prompts", "2"]) == 0  # resumed: the first prompts are not regenerated
    records = (out / "records.jsonl").read_text()
    assert records.startswith(first) and len(records.splitlines()) == 3 * 3 * 2
    mt_bench = [json.loads(line) for line in records.splitlines() if '"mt-bench"' in line]
    assert all(len(r["turns"]) == 2 for r in mt_bench)  # multi-turn: both turns answered

    results = json.loads((out / "results.json").read_text())
    assert results["greedy_outputs_identical"] is True and results["incomplete_prompts"] == 0
    assert results["methods"] == ["plain", "dspark", "dflash"]
    for drafter in ("dspark", "dflash"):
        summary = results["results"][drafter]
        assert summary["overall"]["prompts"] == 6 and set(summary["by_benchmark"]) == {"gsm8k", "mt-bench", "arith"}
        for scope in [summary["overall"], *summary["by_benchmark"].values()]:
            assert scope["tau"] >= 1 and scope["speedup"] > 0 and len(scope["acceptance_by_slot"]) <= 4
            assert scope["identical_to_plain"]["rate"] == 1.0
        assert summary["by_benchmark"]["gsm8k"]["answer_agreement"]["rate"] == 1.0
        assert summary["by_benchmark"]["arith"]["answer_agreement"]["rate"] == 1.0
    assert "calibration" in results["results"]["dspark"]["overall"]  # confidence head
    assert "calibration" not in results["results"]["dflash"]["overall"]
    arith = {m: results["results"][m]["by_benchmark"]["arith"] for m in results["methods"]}
    assert len({json.dumps(a["accuracy"]) for a in arith.values()}) == 1  # same with and without speculation
    assert len({json.dumps(a["pass_at_1"]) for a in arith.values()}) == 1 and arith["plain"]["pass_at_1"]["total"] == 2
    assert arith["plain"]["answers_extracted"]["total"] == 2
    assert results["benchmarks"]["arith"]["answer_format"] == "auto"
    assert results["benchmarks"]["gsm8k"]["references"] == 2  # the shipped gsm8k carries reference answers
    gsm8k = {m: results["results"][m]["by_benchmark"]["gsm8k"] for m in results["methods"]}
    assert len({json.dumps(a["accuracy"]) for a in gsm8k.values()}) == 1 and gsm8k["plain"]["accuracy"]["total"] == 2

    markdown = (out / "results.md").read_text()
    assert "| dspark |" in markdown and "| gsm8k | dflash |" in markdown and "**yes, all**" in markdown
    for plot in ("acceptance_by_slot.png", "tau_by_benchmark.png", "calibration.png"):
        assert (out / plot).read_bytes()[:8] == PNG_MAGIC
        assert f"]({plot})" in markdown

    capsys.readouterr()
    longer = [("9" if arg == "8" else arg) for arg in command]  # --max-new-tokens 9
    assert main(longer + ["--max-prompts", "1"]) == 2
    assert "different settings" in capsys.readouterr().err


def test_python_api_sampling_run_and_an_edited_prompt_file(saved_models, tmp_path, tokenizer):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from hf_dspark.evaluation import evaluate

    target = AutoModelForCausalLM.from_pretrained(saved_models / "target").eval()
    prompts = tmp_path / "chat.txt"
    prompts.write_text("Say hello.\nName a colour.\n")
    run = dict(output_dir=tmp_path / "out", target=target, tokenizer=tokenizer,
               drafters={"dspark": saved_models / "markov"}, max_new_tokens=6, temperature=1.0, progress=False)
    results = evaluate([str(prompts)], **run)
    summary = results["results"]["dspark"]["by_benchmark"]["chat"]
    assert summary["prompts"] == 2 and summary["tau"] >= 1 and "identical_to_plain" not in summary  # sampled
    assert results["greedy_outputs_identical"] is None and results["settings"]["temperature"] == 1.0

    prompts.write_text("Say goodbye.\nName a colour.\n")
    with pytest.raises(SettingsMismatchError, match="chat #0 .*prompt file changed"):
        evaluate([str(prompts)], **run)


def test_shipped_humaneval_prompts_carry_their_unit_tests():
    """pass@1 on humaneval needs each problem's check(candidate); a right and a wrong solution tell them apart."""
    from hf_dspark.evaluation.prompts import load_prompt_sets
    from hf_dspark.evaluation.quality import run_tests

    problems = load_prompt_sets(["humaneval"])["humaneval"]
    assert len(problems) == 164 and all(p.tests and p.entry_point for p in problems)
    first = problems[0]
    assert first.entry_point == "has_close_elements"
    right = ("```python\ndef has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold "
             "for i, a in enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n```")
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert run_tests(right, first.tests, first.entry_point, timeout=PASSING_CODE_GUARD)
    assert not run_tests(wrong, first.tests, first.entry_point)


def test_shipped_math_sets_carry_reference_answers_and_mbpp_its_tests():
    """Accuracy on gsm8k/math500 and pass@1 on mbpp need references and tests on every shipped line."""
    sets = load_prompt_sets(["gsm8k", "math500", "mbpp"])
    assert [len(sets[n]) for n in ("gsm8k", "math500", "mbpp")] == [1319, 500, 257]
    assert all(p.reference for n in ("gsm8k", "math500") for p in sets[n])
    assert all(reference_answer(p.reference, "number").lstrip("-").replace(".", "").isdigit() for p in sets["gsm8k"])
    gsm8k, math500, mbpp = sets["gsm8k"][0], sets["math500"][0], sets["mbpp"][0]
    assert "Janet" in gsm8k.turns[0] and reference_answer(gsm8k.reference, "number") == "18"
    assert reference_answer(math500.reference, "boxed") == extract_boxed_answer(
        "so $(r, \\theta) = \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.")
    import ast

    asserts = [ast.parse(t).body[0] for p in sets["mbpp"] for t in p.tests]
    # Every test is a plain assert (task 436's original `== -1,-6` asserted with a message; it ships corrected).
    assert asserts and all(isinstance(a, ast.Assert) and a.msg is None for a in asserts)
    right = ("```python\ndef remove_Occ(s, ch):\n    first = s.find(ch)\n    if first < 0:\n        return s\n"
             "    s = s[:first] + s[first + 1:]\n    last = s.rfind(ch)\n    return s if last < 0 else s[:last] + s[last + 1:]\n```")
    assert run_tests(right, mbpp.tests, timeout=PASSING_CODE_GUARD)
    assert not run_tests(right.replace("s[last + 1:]", "s[last:]"), mbpp.tests)


def test_prompt_files_keep_unicode_line_separators_inside_strings(tmp_path):
    """arena-hard-v2 has U+2028 inside prompts; a JSONL line ends only at a newline."""
    from hf_dspark.evaluation.prompts import load_prompt_sets, read_prompt_file

    path = tmp_path / "odd.jsonl"
    path.write_text('{"turns": ["one\\u2028two\\u0085three"]}\n{"turns": ["four"]}\n'.encode().decode("unicode_escape"),
                    encoding="utf-8")
    prompts = read_prompt_file(path)
    assert [p.turns[0] for p in prompts] == ["one\u2028two\u0085three", "four"]
    assert len(load_prompt_sets(["arena-hard-v2"])["arena-hard-v2"]) == 750


def test_records_written_before_rounds_named_their_proposer_still_summarise():
    from hf_dspark.evaluation.summary import _stats

    old = {"stats": {"draft_lengths": [3, 0, 2], "accepted": [1, 0, 2], "confidences": [[], [], []], "seconds": {}}}
    stats = _stats(old)
    assert stats.sources == ["drafter", "none", "drafter"] and stats.count("drafter") == 2
    new = {"stats": dict(old["stats"], sources=["suffix", "none", "drafter"])}
    assert _stats(new).sources == ["suffix", "none", "drafter"]
