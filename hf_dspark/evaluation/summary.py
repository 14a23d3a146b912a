"""Summaries of evaluation records, per method, per benchmark and overall.

Only prompts that every method finished are summarised, so each speed-up, agreement and accuracy compares methods
on identical prompts; a prompt an interruption left half-done is counted as incomplete until a rerun finishes it.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass

import torch

from ..generation.round.stats import SpeculativeStats
from .metrics import acceptance_summary
from .quality import EXTRACTORS, answer_format, reference_answer, run_tests
from .speed import PLAIN

CODE_BENCHMARKS = ("humaneval", "mbpp", "livecodebench")


@dataclass
class Outcome:
    """What one method did on one prompt."""

    tokens: int
    seconds: float
    stats: SpeculativeStats | None = None
    identical: bool | None = None
    extracted: bool | None = None
    """A final answer was found (None: no extractor for this set); agreement on "no answer" is cheap."""
    agrees: bool | None = None
    """Extracted final answer equal to plain decoding's (None: no extractor for this set, or this is plain)."""
    correct: bool | None = None
    passed: bool | None = None


def describe_hardware() -> str:
    """Where the numbers were measured, for reports and model cards."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def _stats(record: dict) -> SpeculativeStats | None:
    s = record.get("stats")
    if s is None:
        return None
    # Records written before rounds named their proposer (the eval runs before v4, in git history): a round that drafted
    # was the drafter's.
    sources = s.get("sources") or ["drafter" if d > 0 else "none" for d in s["draft_lengths"]]
    return SpeculativeStats(s["draft_lengths"], s["accepted"], s["confidences"], sources, dict(s["seconds"]))


def _rate(hits: list[bool]) -> dict:
    return {"count": sum(hits), "total": len(hits), "rate": round(sum(hits) / len(hits), 4)}


def aggregate(outcomes: list[Outcome], plain: list[Outcome], is_plain: bool) -> dict:
    """Every number of one method over a set of prompts; `plain` holds plain decoding's outcomes on the same."""
    tokens, seconds = sum(o.tokens for o in outcomes), sum(o.seconds for o in outcomes)
    rate = tokens / seconds if seconds else None
    out = {"prompts": len(outcomes), "tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": None if rate is None else round(rate, 2)}
    if not is_plain:
        plain_seconds = sum(o.seconds for o in plain)
        plain_rate = sum(o.tokens for o in plain) / plain_seconds if plain_seconds else None
        out["speedup"] = round(rate / plain_rate, 3) if rate and plain_rate else None
        stats = SpeculativeStats()
        for o in outcomes:
            stats = stats.merge(o.stats)
        out.update(acceptance_summary(stats))
        identical = [o.identical for o in outcomes if o.identical is not None]
        if identical:
            out["identical_to_plain"] = _rate(identical)
        agrees = [o.agrees for o in outcomes if o.agrees is not None]
        if agrees:
            out["answer_agreement"] = _rate(agrees)
    for key, field in (("answers_extracted", "extracted"), ("accuracy", "correct"), ("pass_at_1", "passed")):
        hits = [getattr(o, field) for o in outcomes if getattr(o, field) is not None]
        if hits:
            out[key] = _rate(hits)
    return out


class _TestRunner:
    """Runs each distinct (code, tests) once: identical greedy outputs need not execute twice."""

    def __init__(self, timeout: float):
        self.timeout, self.cache = timeout, {}

    def __call__(self, text: str, task: dict) -> bool:
        key = (text, tuple(task["tests"]), task.get("entry_point"))
        if key not in self.cache:
            self.cache[key] = run_tests(text, task["tests"], task.get("entry_point"), self.timeout)
        return self.cache[key]


def _benchmark_info(benchmark: str, groups: list[dict], execute_code: bool) -> dict:
    tasks = [next(iter(g.values())).get("task") or {} for g in groups]
    references = sum(t.get("reference") is not None for t in tasks)
    tests = sum(bool(t.get("tests")) for t in tasks)
    info = {"prompts": len(groups), "answer_format": answer_format(benchmark, references > 0),
            "references": references, "tests": tests}
    if tests:
        info["code_execution"] = ("executed" if execute_code
                                  else "tests available; not run (pass --execute-code to run them)")
    elif execute_code or benchmark.startswith(CODE_BENCHMARKS):
        info["code_execution"] = "no tests in this prompt set: pass@1 not computed"
    return info


def summarize(records: list[dict], settings, methods: list[str], *, execute_code: bool = False,
              exec_timeout: float = 10.0) -> dict:
    """results.json's content: settings, per-benchmark facts, and per method the overall and per-benchmark
    `aggregate`s."""
    by_prompt: dict[tuple[str, int], dict[str, dict]] = {}
    for record in records:
        by_prompt.setdefault((record["benchmark"], record["index"]), {})[record["method"]] = record
    complete = {key: group for key, group in by_prompt.items() if all(m in group for m in methods)}
    benchmarks: dict[str, list[dict]] = {}  # in the order the records were made, prompts by index
    for (benchmark, _), group in sorted(complete.items(), key=lambda item: item[0][1]):
        benchmarks.setdefault(benchmark, []).append(group)
    order = list(dict.fromkeys(benchmark for benchmark, _ in by_prompt))
    benchmarks = {b: benchmarks[b] for b in order if b in benchmarks}

    runner = _TestRunner(exec_timeout)
    infos, outcomes = {}, {m: {} for m in methods}
    for benchmark, groups in benchmarks.items():
        infos[benchmark] = info = _benchmark_info(benchmark, groups, execute_code)
        kind = info["answer_format"]
        if execute_code and info["tests"]:
            print(f"running the tests of {benchmark} ({len(groups)} prompts x {len(methods)} methods)...",
                  file=sys.stderr, flush=True)
        for method in methods:
            outcomes[method][benchmark] = []
            for group in groups:
                record, plain = group[method], group[PLAIN]
                first_turn, task = record["turns"][0]["text"], record.get("task") or {}
                outcome = Outcome(tokens=sum(len(t["ids"]) for t in record["turns"]),
                                  seconds=sum(t["seconds"] for t in record["turns"]), stats=_stats(record),
                                  identical=record.get("identical"))
                if kind is not None:
                    answer = EXTRACTORS[kind](first_turn)
                    outcome.extracted = answer is not None
                    if method != PLAIN:
                        outcome.agrees = answer == EXTRACTORS[kind](plain["turns"][0]["text"])
                    if task.get("reference") is not None:
                        outcome.correct = answer == reference_answer(task["reference"], kind)
                if execute_code and task.get("tests"):
                    outcome.passed = runner(first_turn, task)
                outcomes[method][benchmark].append(outcome)

    results = {}
    for method in methods:
        everything = [o for b in benchmarks for o in outcomes[method][b]]
        plain_everything = [o for b in benchmarks for o in outcomes[PLAIN][b]]
        results[method] = {
            "overall": aggregate(everything, plain_everything, method == PLAIN),
            "by_benchmark": {b: aggregate(outcomes[method][b], outcomes[PLAIN][b], method == PLAIN)
                             for b in benchmarks},
        }
    identical = [o.identical for m in methods for b in benchmarks for o in outcomes[m][b] if o.identical is not None]
    return {
        "settings": asdict(settings) | {"greedy": settings.greedy, "hardware": describe_hardware()},
        "methods": methods,
        "benchmarks": infos,
        "incomplete_prompts": len(by_prompt) - len(complete),
        "greedy_outputs_identical": all(identical) if identical else None,
        "results": results,
    }
