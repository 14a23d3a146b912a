"""Issue 41 (2): the verification policy where drafting pays, on this CPU, and in a GPU-shaped simulation.

    python benchmarks/policy_regimes.py --output benchmarks/policy-regimes/results.json
    python benchmarks/policy_regimes.py --simulate-only --output benchmarks/policy-regimes/simulation.json
    python benchmarks/policy_regimes.py --simulate-only --simulate-prices profiled --rows 1,4 \
        --output benchmarks/policy-regimes/simulation-profiled.json                 # at this machine's prices
    python benchmarks/policy_regimes.py --rows 1,4 --acceptances 0.7 --forms independent --repeats 1 \
        --max-new-tokens 16 --output /tmp/regimes.json                                      # a smoke run

The shipped drafters alone rarely pay on this CPU, so an acceptance oracle (`oracle.AcceptanceOracle`) on the
embedded SmolLM2 target forces what verification accepts, in three forms: `independent` (each proposed token
accepted with probability A), `confidence` (accepted with probability sigmoid(2 (logit c - m) + logit A) of the
drafter's own confidence c for that slot, m the mean logit of its confidences: the head's ranking says which drafts
survive, on average A) and `miscalibrated` (the same with slope 0.5: the head's spread is twice the truth's). Each
cell (form, A, R) runs R held-out chat prompts (the mix of `batched_user_path.py`) through `target.generate` with
every method, interleaved (the order rotated each repeat), best of `--repeats` tokens/s per method, and beside it the
comparison paired by repeat (the oracle's coins are keyed, `oracle.AcceptanceOracle.coins`, by the repeat's seed and
the position: within a repeat every method meets the same coin at every position of every row), the spread of the
repeats recorded. The oracle's target never ends (`--ends` lets it): every method emits the same tokens, so a run's
rate is its seconds, not where a forced draft happened to end a row.

* `plain`: plain batched `generate` (a plain step has nothing to force: the target's own decoding);
* `all`, `fixed-k`, `threshold`: fixed policies (`dspark_round_planning=False`, `dspark_verification_policy=`
  "all", ("fixed", k), ("threshold", 0.5)): the drafter's block every round, no suffix proposals;
* `defaults`: `generate(..., assistant_model=drafter)` as a user calls it (the policy decides), its state kept
  from cell to cell of one form and acceptance (a workload, served at several batch sizes), after `--warmup-calls`
  untimed calls per cell; the workload's very first call (a fresh state) is reported apart, against plain.

Per cell: defaults / the best other method in hindsight, and defaults / plain. `--simulate` adds the same cells on
a GPU-shaped cost curve (`evaluation.simulation.gpu_like_costs`): the policy's own classes, prices learnt from the
simulated seconds, acceptance drawn as above with confidences from a Beta model. `--simulate-prices profiled` runs the
simulation at this machine's own prices instead: per R, a table profiled here (`hf-dspark profile`'s
`profile_verification_costs` over R rows, with the drafter's pass), so the cells are read on a clock without noise
(this CPU's timings swing by 10-40 % between the repeats of a cell, more than the 5 % the defaults are judged by).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import AcceptanceOracle  # noqa: E402
from serving_common import (add_prompt_arguments, chat_text, command_line, draw_sequences, environment, fmt,  # noqa
                            git_state, load_models, md_table, prompt_pools, write_report)

FORMS = ("independent", "confidence", "miscalibrated")
SLOPES = {"confidence": 2.0, "miscalibrated": 0.5}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--drafter", default="dspark")
parser.add_argument("--rows", default="1,4,16,64")
parser.add_argument("--acceptances", default="0.5,0.7,0.9")
parser.add_argument("--forms", default="independent,confidence")
parser.add_argument("--fixed", default="1,2,3,4,5,6,7", help="the k of the fixed methods")
parser.add_argument("--max-new-tokens", type=int, default=48)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--warmup-calls", type=int, default=2,
                    help="untimed calls of the defaults before each cell's repeats (the state they learn is what a "
                         "user's later calls start from); the first call of each workload is reported apart")
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--ends", action="store_true",
                    help="let rows end at the target's end token (default: the oracle's target never ends, so every "
                         "method emits max_new_tokens per row and a forced early end decides nothing)")
parser.add_argument("--simulate", action="store_true", help="also the GPU-shaped simulation of the same cells")
parser.add_argument("--simulate-only", action="store_true")
parser.add_argument("--simulated-rounds", type=int, default=400)
parser.add_argument("--simulate-prices", default="gpu", choices=["gpu", "profiled"],
                    help="the simulation's prices: a GPU-shaped curve, or tables profiled on this machine per R")
parser.add_argument("--simulated-seeds", type=int, default=1, help="simulated runs per method and cell (mean rate)")
parser.add_argument("--output", default="benchmarks/policy-regimes/results.json")
add_prompt_arguments(parser)
args = parser.parse_args()
rows_list = [int(r) for r in args.rows.split(",")]
acceptances = [float(a) for a in args.acceptances.split(",")]
forms = args.forms.split(",")
if not set(forms) <= set(FORMS):
    raise SystemExit(f"--forms takes {', '.join(FORMS)}")
METHODS = ["plain", "all", *[f"fixed-{k}" for k in args.fixed.split(",")], "threshold", "defaults"]
output = Path(args.output)
SIMULATION_KEY = "simulation" if args.simulate_prices == "gpu" else "simulation_profiled"


def method_settings(method: str) -> dict | None:
    """generate()'s keyword arguments for `method` (None: plain, no drafter)."""
    if method == "plain":
        return None
    if method == "defaults":
        return {}
    fixed = dict(dspark_round_planning=False)
    if method == "all":
        return {**fixed, "dspark_verification_policy": "all"}
    if method == "threshold":
        return {**fixed, "dspark_verification_policy": ("threshold", 0.5)}
    return {**fixed, "dspark_verification_policy": ("fixed", int(method.split("-")[1]))}


def confidence_map(form: str, acceptance: float, mean_logit: float):
    if form == "independent":
        return None
    slope, level = SLOPES[form], math.log(acceptance / (1 - acceptance))
    return lambda c: torch.sigmoid(slope * (torch.logit(c.clamp(1e-4, 1 - 1e-4)) - mean_logit) + level)


def wire_stash(oracle_ref: list) -> None:
    """Hand each drafting pass's confidences to the current oracle (both loops' drafting passes)."""
    from hf_dspark.generation.engine import speculative_engine
    from hf_dspark.generation.one_prompt.prompt_rows import OnePromptRows

    def stashing(draft):
        def stashed(*args, **kwargs):
            drafts = draft(*args, **kwargs)
            if oracle_ref[0] is not None:
                oracle_ref[0].stash(drafts.confidences)
            return drafts
        return stashed

    speculative_engine._draft = stashing(speculative_engine._draft)  # the engine's pass over all rows
    OnePromptRows.draft = stashing(OnePromptRows.draft)  # batch 1


def mean_confidence_logit(target, drafter, encodings) -> float:
    """The mean logit of the drafter's confidences on these prompts (every slot drafted, nothing forced)."""
    seen = []
    for enc in encodings[:2]:
        target.generate(**enc, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                        dspark_round_planning=False, dspark_verification_policy="all")
        for stats in (drafter.last_generation_stats if isinstance(drafter.last_generation_stats, list)
                      else [drafter.last_generation_stats]):
            seen += [c for round_ in stats.confidences for c in round_]
    logits = [math.log(min(max(c, 1e-4), 1 - 1e-4) / (1 - min(max(c, 1e-4), 1 - 1e-4))) for c in seen]
    return sum(logits) / max(len(logits), 1)


def run_cells(results: dict) -> None:
    import hf_dspark

    target, tokenizer, drafter = load_models(args.drafter, args.threads)
    pools = prompt_pools(args, tokenizer)
    (sequence,) = draw_sequences(pools, 1, max(rows_list), args.seed)
    texts = [chat_text(tokenizer, p.text) for p in sequence]
    encodings = {r: tokenizer(texts[:r], return_tensors="pt", padding=True) for r in rows_list}
    oracle_ref = [None]
    wire_stash(oracle_ref)
    mean_logit = mean_confidence_logit(target, drafter, [encodings[min(rows_list)]])
    results["mean_confidence_logit"] = mean_logit
    cells = results.setdefault("cells", {})
    todo = [(f, a, r) for f in forms for a in acceptances for r in rows_list if f"{f}/{a}/{r}" not in cells]
    states, warmed = {}, set()
    for form, acceptance, rows in tqdm(todo, desc="cells"):
        enc = encodings[rows]
        state = states.setdefault((form, acceptance), hf_dspark.DraftingState())
        times = {m: [] for m in METHODS}
        tokens = {m: [] for m in METHODS}
        sources = {}
        mapping = confidence_map(form, acceptance, mean_logit)

        def timed(seed: int, call: dict) -> tuple[int, float]:
            """(tokens emitted, seconds) of one oracle-forced generate() call."""
            with AcceptanceOracle(target, acceptance, seed=seed, confidence_map=mapping,
                                  never_end=not args.ends) as oracle:
                oracle_ref[0] = oracle
                started = time.perf_counter()
                out = target.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, **call)
                seconds = time.perf_counter() - started
                oracle_ref[0] = None
            return int((out[:, enc["input_ids"].shape[1]:] != tokenizer.pad_token_id).sum()), seconds

        first = not state.statistics.drafter.reached  # the workload's first call: a fresh state
        for call in range(args.warmup_calls):
            emitted, seconds = timed(1000 + call, {"assistant_model": drafter, "dspark_state": state})
            if first and call == 0:
                first_rate = emitted / seconds
        # The process's first pass at a row count is a warm-up, untimed (first forwards of each shape).
        for repeat in range(0 if rows in warmed else 1, args.repeats + 1):
            order = METHODS[repeat % len(METHODS):] + METHODS[: repeat % len(METHODS)]
            for method in order:
                settings = method_settings(method)
                call = {} if settings is None else {"assistant_model": drafter, **settings}
                if method == "defaults":
                    call["dspark_state"] = state
                emitted, seconds = timed(repeat, call)
                if repeat:
                    times[method].append(seconds)
                    tokens[method].append(emitted)
                if method == "defaults" and repeat:
                    stats = drafter.last_generation_stats
                    for s in stats if isinstance(stats, list) else [stats]:
                        for source in s.sources:
                            sources[source] = sources.get(source, 0) + 1
        warmed.add(rows)
        rates = {m: [t / s for t, s in zip(tokens[m], times[m])] for m in METHODS}
        best = {m: max(v) for m, v in rates.items()}
        median = {m: statistics.median(v) for m, v in rates.items()}
        median_other = max((m for m in median if m != "defaults"), key=median.get)
        others = {m: v for m, v in best.items() if m != "defaults"}
        hindsight = max(others, key=others.get)
        cells[f"{form}/{acceptance}/{rows}"] = {
            "form": form, "acceptance": acceptance, "rows": rows, "tokens_per_second": rates,
            "best": best, "best_other": hindsight, "defaults_vs_best_other": best["defaults"] / others[hindsight],
            "defaults_vs_plain": best["defaults"] / best["plain"],
            "median_best_other": median_other, "median_defaults_vs_best_other": median["defaults"] / median[median_other],
            "spread": {m: (max(v) - min(v)) / max(v) for m, v in rates.items()}, "defaults_sources": sources,
            **({"first_call_vs_plain": first_rate / best["plain"]} if first and args.warmup_calls else {})}
        write_report(output, results, report_lines(results))


_MODELS: list = []  # (target, tokenizer, drafter), loaded once for profiling


def profiled_prices(results: dict, rows: int):
    """(table, draft_seconds) profiled on this machine for `rows` rows (kept in the results: a resumed run reuses it)."""
    from hf_dspark.evaluation.profiling import profile_verification_costs
    from hf_dspark.models.cost_table import VerificationCostTable

    tables = results.setdefault("profiled_tables", {})
    if str(rows) not in tables:
        if not _MODELS:
            _MODELS.extend(load_models(args.drafter, args.threads))
        target, _, drafter = _MODELS
        table = profile_verification_costs(target, max_tokens=8 * rows, rows=rows, drafter=drafter,
                                           repeats=5 if rows < 8 else 3)
        tables[str(rows)] = {"seconds": table.seconds, "draft_seconds": table.draft_seconds}
    table = VerificationCostTable(tables[str(rows)]["seconds"])
    return table, lambda requests, draft_length, d=tables[str(rows)]["draft_seconds"]: d


def simulate_cells(results: dict) -> None:
    """The same cells on a GPU-shaped curve (or this machine's profiled prices): `evaluation.simulation.
    simulate_policy`, the policy's own classes at work, prices learnt from the simulated seconds, the head's
    confidences from a Beta model around an even chance."""
    from hf_dspark.evaluation.simulation import ConfidenceModel, gpu_like_costs, simulate_policy

    model = ConfidenceModel([0.5] * 7, concentration=2.0)
    cells = results.setdefault(SIMULATION_KEY, {})
    for form in forms:
        for acceptance in acceptances:
            mapping = confidence_map(form, acceptance, 0.0) or (lambda c, a=acceptance: torch.full_like(c, a))
            for rows in rows_list:
                table, draft_seconds = gpu_like_costs() if args.simulate_prices == "gpu" else profiled_prices(
                    results, rows)
                rates = {}
                for method in METHODS:
                    settings = method_settings(method)
                    if settings is None:
                        policy, arg = "plain", None
                    else:
                        chosen = settings.get("dspark_verification_policy", ("scheduler", None))
                        policy, arg = (chosen, None) if isinstance(chosen, str) else chosen
                    rates[method] = statistics.fmean(
                        simulate_policy(policy, arg, requests=rows, rounds=args.simulated_rounds,
                                        confidence_model=model, costs=table, draft_seconds=draft_seconds,
                                        seed=rows + 1000 * seed, planning=method == "defaults",
                                        acceptance=mapping).aggregate_tokens_per_second
                        for seed in range(args.simulated_seeds))
                others = {m: v for m, v in rates.items() if m != "defaults"}
                hindsight = max(others, key=others.get)
                cells[f"{form}/{acceptance}/{rows}"] = {
                    "form": form, "acceptance": acceptance, "rows": rows, "tokens_per_second": rates,
                    "best_other": hindsight, "defaults_vs_best_other": rates["defaults"] / others[hindsight],
                    "defaults_vs_plain": rates["defaults"] / rates["plain"]}
    write_report(output, results, report_lines(results))


def paired(cell: dict) -> tuple[str, float]:
    """The best other method and the defaults against it, paired by repeat: the geometric mean over the repeats of
    the defaults' rate over the method's in the same repeat (the same oracle stream, so its luck cancels), the method
    the one this is lowest against."""
    rates = cell["tokens_per_second"]
    ratios = {m: math.exp(statistics.fmean(math.log(d / o) for d, o in zip(rates["defaults"], v)))
              for m, v in rates.items() if m != "defaults"}
    method = min(ratios, key=ratios.get)
    return method, ratios[method]


def report_lines(results: dict) -> list[str]:
    lines = ["# Policy regimes: the defaults against the best fixed policy in hindsight", "",
             f"`{results['command']}`", ""]
    for key, title in (("cells", "SmolLM2-135M on this CPU, acceptance oracle (tokens/s, best of the repeats)"),
                       ("simulation", "GPU-shaped simulation (tokens per simulated second)"),
                       ("simulation_profiled", "Simulation at this machine's profiled prices (tokens per simulated "
                                               "second; `profiled_tables` in the JSON)")):
        cells = results.get(key)
        if not cells:
            continue
        lines += [f"## {title}", ""]
        header = ["form", "A", "R", "defaults", "best other", "defaults / best other", "defaults / plain"]
        if key == "cells":
            header += ["paired by repeat: defaults / best other", "first call / plain", "spread (defaults)",
                       "defaults' rounds"]
        body = []
        for cell in cells.values():
            rate = cell.get("best", cell["tokens_per_second"])
            row = [cell["form"], cell["acceptance"], cell["rows"], fmt(rate["defaults"], 1),
                   f"{cell['best_other']} {fmt(rate[cell['best_other']], 1)}",
                   fmt(cell["defaults_vs_best_other"]) + "x", fmt(cell["defaults_vs_plain"]) + "x"]
            if key == "cells":
                method, ratio = paired(cell)
                row += [f"{fmt(ratio)}x ({method})",
                        fmt(cell["first_call_vs_plain"]) + "x" if "first_call_vs_plain" in cell else "",
                        f"{100 * cell['spread']['defaults']:.0f} %",
                        ", ".join(f"{n} {s}" for s, n in sorted(cell["defaults_sources"].items()))]
            body.append(row)
        lines += md_table(header, body) + [""]
    return lines


results = {"command": command_line(), "git": git_state(), "environment": environment(args.threads),
           "settings": {**vars(args), "methods": METHODS}}
if output.exists():  # resume: cells already measured are kept
    import json
    results.update({k: v for k, v in json.loads(output.read_text()).items()
                    if k in ("cells", "simulation", "simulation_profiled", "profiled_tables")})
if not args.simulate_only:
    run_cells(results)
if args.simulate or args.simulate_only:
    simulate_cells(results)
print("\n".join(report_lines(results)))
