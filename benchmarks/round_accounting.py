"""Where the engine's defaults gain or lose against plain continuous batching under arrivals, round by round.

    python benchmarks/round_accounting.py --output benchmarks/round-accounting/results.json
    python benchmarks/round_accounting.py --loads p2 --requests 4 --max-new-tokens 8 --passes 1 --output /tmp/ra.json

What `hf-dspark serve` runs, in process and without HTTP: per pass a fresh `SpeculativeEngine(target, drafter)` with
the shipped DSpark drafter and the profiled cost table (the server's defaults) and a fresh `SpeculativeEngine(target,
None)` (`--drafter none`), each warmed by two requests, then every load of `--loads` on both back to back (the order
rotated load by load and pass by pass), the engines kept from load to load as a server keeps its engine. Loads:
`pN` Poisson arrivals at N requests/s (the same exponential draws at every rate, scaled), `cN` a closed loop of N
clients; `--requests` chat prompts of the mix per load.

Per pass and load: each engine's aggregate tokens/s (new tokens / (last finish - first submission)) and the seconds
of its steps that admitted requests (prefill and that step's round). Then the rounds by rows (under 8, 8 or more) and
source (the defaults' drafter, suffix and none rounds, timed from its plan to its record; the plain engine's steps
that admitted nothing): count, milliseconds and tokens a round, tokens/s. Rows in the same band are comparable;
the totals are not (an engine that finishes requests sooner runs at fewer rows). Greedy outputs of both engines are
compared request by request. Written after every pass (`--output` JSON, a .md beside it); a run
resumes after its last complete pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from serving_common import (add_prompt_arguments, command_line, draw_sequences, environment, git_state, load_models,
                            md_table, prompt_ids, prompt_pools, unit_arrival_times, write_report)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--loads", default="p0.5,p1,p2,p4,c4",
                    help="pN: Poisson at N requests/s; cN: N closed-loop clients")
parser.add_argument("--requests", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=48)
parser.add_argument("--passes", type=int, default=3)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--output", default="benchmarks/round-accounting/results.json")
add_prompt_arguments(parser)
args = parser.parse_args()
LOADS = [load for load in args.loads.split(",") if load]
for load in LOADS:
    if load[:1] not in ("p", "c") or not load[1:].replace(".", "", 1).isdigit() or float(load[1:]) <= 0:
        parser.error(f"--loads: {load!r} is neither pN (Poisson, N requests/s) nor cN (N clients)")


class Recorder:
    """The defaults engine's rounds as its policy saw them: rows, source, width, seconds, tokens."""

    def __init__(self, policy):
        self.rounds, self._plan, self._record = [], policy.plan, policy.record
        policy.plan, policy.record = self.plan, self.record

    def plan(self, *a, **k):
        self._started = time.perf_counter()
        return self._plan(*a, **k)

    def record(self, plan, request_ids, lengths, accepted, width, *a, **k):
        kind = "drafter" if plan.use_drafter else "suffix" if "suffix" in plan.sources else "none"
        self.rounds.append((len(request_ids), kind, width, time.perf_counter() - self._started,
                            len(request_ids) + sum(accepted)))
        return self._record(plan, request_ids, lengths, accepted, width, *a, **k)


def serve(engine, load: str, ids: list[list[int]], unit: list[float]) -> dict:
    """Serve the requests at `load` in real time; the aggregate rate, each request's new tokens and each step's rows
    and seconds."""
    kind, value = load[0], float(load[1:])
    submitted, outputs, steps = {}, {}, []
    start = time.perf_counter()
    while len(outputs) < len(ids):
        now = time.perf_counter() - start
        while len(submitted) < len(ids) and (unit[len(submitted)] / value <= now if kind == "p"
                                             else len(submitted) - len(outputs) < value):
            index = len(submitted)
            submitted[engine.submit(torch.tensor(ids[index]), args.max_new_tokens)] = index
        if engine.num_waiting or engine.num_running:
            admitting = engine.num_waiting > 0
            began = time.perf_counter()
            finished = engine.step()
            steps.append((admitting, engine.num_running + len(finished), time.perf_counter() - began))
            outputs.update({submitted[r]: tokens[len(ids[submitted[r]]):].tolist() for r, tokens in finished.items()})
        else:
            time.sleep(max(0.0, unit[len(submitted)] / value - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(map(len, outputs.values())) / seconds,
            "outputs": [outputs[i] for i in range(len(ids))], "steps": steps}


def bands(rounds: list, plain_steps: list) -> dict:
    """Rounds by rows (under 8, 8 or more) and source: count, seconds and tokens; the plain engine's steps that
    admitted no request as source `plain`."""
    table = defaultdict(lambda: [0, 0.0, 0])
    steps = [(rows, "plain", 1, seconds, rows) for admitting, rows, seconds in plain_steps if not admitting]
    for rows, kind, width, seconds, tokens in list(rounds) + steps:
        entry = table[f"R {'< 8' if rows < 8 else '>= 8'}, {kind}"]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + tokens
    return {key: {"rounds": n, "seconds": s, "tokens": t} for key, (n, s, t) in sorted(table.items())}


def report(results: dict) -> list[str]:
    lines = ["# Round accounting: the server's defaults against `--drafter none`, in process", "",
             f"`{results['command']}`", "", f"Environment: {results['environment']}", "",
             "Aggregate tokens/s per pass (defaults / plain) and the seconds of steps that admitted requests:", ""]
    rows = []
    for load in LOADS:
        runs = [p[load] for p in results["passes"] if load in p]
        if not runs:
            continue
        ratios = [r["defaults"]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in runs]
        admit = [(sum(s for a, _, s in r["defaults"]["steps"] if a), sum(s for a, _, s in r["plain"]["steps"] if a))
                 for r in runs]
        rows.append([load, f"{statistics.median(ratios):.2f}x", ", ".join(f"{x:.2f}" for x in ratios),
                     ", ".join(f"{a:.1f} / {b:.1f}" for a, b in admit),
                     f"{sum(r['identical'] for r in runs)}/{sum(len(r['plain']['outputs']) for r in runs)}"])
    lines += md_table(["load", "defaults / plain (median)", "each pass", "admitting steps' s (defaults / plain)",
                       "identical outputs"], rows)
    lines += ["", "Rounds by rows and source, summed over the passes (`plain`: the plain engine's steps that admitted "
              "nothing; the others the defaults' rounds, `none` its steps without a proposal):", ""]
    rows = []
    for load in LOADS:
        total = defaultdict(lambda: [0, 0.0, 0])
        for p in results["passes"]:
            for key, v in p.get(load, {}).get("bands", {}).items():
                total[key] = [total[key][0] + v["rounds"], total[key][1] + v["seconds"], total[key][2] + v["tokens"]]
        rows += [[load, key, n, f"{1e3 * s / n:.0f}", f"{t / n:.1f}", f"{t / s:.1f}"]
                 for key, (n, s, t) in sorted(total.items()) if n]
    return lines + md_table(["load", "rows, source", "rounds", "ms a round", "tokens a round", "tokens/s"], rows)


def main() -> None:
    from hf_dspark import SpeculativeEngine
    from hf_dspark.cli.generate import cost_table_for

    target, tokenizer, drafter = load_models("dspark", args.threads)
    drafter.generation_config.dspark_cost_table = cost_table_for(target, drafter, "smollm2-135m-instruct")
    ids = [prompt_ids(tokenizer, p.text) for p in draw_sequences(prompt_pools(args, tokenizer), 1, args.requests,
                                                                 args.seed)[0]]
    unit = unit_arrival_times(len(ids), args.seed + 1)
    output = Path(args.output)
    results = {"command": command_line(), "git": git_state(), "environment": environment(args.threads),
               "settings": vars(args), "passes": []}
    if output.is_file():  # resume after the last complete pass of the same settings
        earlier = json.loads(output.read_text())
        if earlier.get("settings") == vars(args):
            results["passes"] = earlier["passes"]
    # An engine built on the drafter takes its remembered state while none holds it (`policy.remembered`); this one
    # holds it for the run, so every pass's defaults engine starts from nothing, as a freshly started server does.
    holder = SpeculativeEngine(target, drafter)
    for index in tqdm(range(len(results["passes"]), args.passes), desc="passes"):
        engines = {"defaults": SpeculativeEngine(target, drafter), "plain": SpeculativeEngine(target, None)}
        recorder = Recorder(engines["defaults"].round_policy)
        for engine in engines.values():
            serve(engine, "c1", ids[:2], unit)  # warm-up: first forwards, kernel choices
        outcome = {}
        for position, load in enumerate(LOADS):
            order = list(engines)[(index + position) % 2:] + list(engines)[: (index + position) % 2]
            recorder.rounds.clear()
            runs = {name: serve(engines[name], load, ids, unit) for name in order}
            outcome[load] = {**runs, "bands": bands(recorder.rounds, runs["plain"]["steps"]),
                             "identical": sum(a == b for a, b in zip(runs["defaults"]["outputs"],
                                                                     runs["plain"]["outputs"]))}
        results["passes"].append(outcome)
        write_report(output, results, report(results))
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()
