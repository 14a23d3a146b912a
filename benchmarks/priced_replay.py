"""Issue 41: the policy's choices compared without this machine's noise. Requests arriving over time (as
`arrivals.py`) are served by `SpeculativeEngine` for real (real tokens, real drafts, real acceptances), but time is
simulated: every pass is priced from one fixed table of this machine's prices, and the policy is given those prices
(a cost model that does not learn), so a method's makespan depends on its choices only.

    python benchmarks/priced_replay.py --output benchmarks/priced-replay/results.json
    python benchmarks/priced_replay.py --rates inf --requests 4 --max-new-tokens 16 --sweeps 1 --output /tmp/pr.json

Prices: F(R, W), a target forward over R rows of W new tokens after a 120-token cache, timed here (median of
`--sweeps` interleaved sweeps over every shape, R = 1..`--requests`, W = 1..gamma + 1); D(R) and O(R), the drafter's
pass and the loop's own work, a least-squares line through what an engine learnt serving the requests all at once.
A plain step is priced F(R, 1) + O(R), a round F(R, W) + O(R) (+ D(R) when the drafter ran), a prefill 50 ms plus
0.4 ms a prompt token (the same for every method). `--prices PATH` reuses a table this script wrote.

Methods: `plain` (`SpeculativeEngine(target, None)`), `tokens` (the defaults with every round valued by its expected
tokens: the policy is not told the rows' tokens left) and `defaults`. Every speculative engine starts from the same
drafting state (what a warm-up engine learnt serving the requests at once); `--seeds` policy seeds per rate. Per rate
and seed: the aggregate tokens/s (all new tokens / (last finish - first arrival)) and the mean per-user tokens/s as
ratios to plain, rounds, and whether every output is plain's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy
import torch
from tqdm import tqdm

from serving_common import (add_prompt_arguments, command_line, draw_sequences, environment, git_state, load_models,
                            md_table, prompt_ids, prompt_pools, provenance_lines, unit_arrival_times, write_report)

METHODS = ("plain", "tokens", "defaults")
CONTEXT = 120

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--drafter", default="dspark")
parser.add_argument("--rates", default="1,2,4,inf", help="arrival rates in requests/s (inf: all at once)")
parser.add_argument("--requests", type=int, default=12)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--seeds", type=int, default=2, help="policy seeds per rate")
parser.add_argument("--sweeps", type=int, default=3, help="interleaved timing sweeps over every shape")
parser.add_argument("--prices", default=None, help="a prices JSON this script wrote (skips the timing)")
parser.add_argument("--output", default="benchmarks/priced-replay/results.json")
add_prompt_arguments(parser)
args = parser.parse_args()
rates = [float(r) for r in args.rates.split(",")]
output = Path(args.output)

target, tokenizer, drafter = load_models(args.drafter, args.threads)
pools = prompt_pools(args, tokenizer)
prompts = draw_sequences(pools, 1, args.requests, args.seed)[0]
ids = [prompt_ids(tokenizer, p.text) for p in prompts]
unit_arrivals = unit_arrival_times(len(ids), args.seed + 1)
widths = drafter.config.num_draft_slots + 1

from hf_dspark import DraftingState, SpeculativeEngine  # noqa: E402
from hf_dspark.generation.engine.checks import engine_plan  # noqa: E402


def engine_with(state: DraftingState) -> SpeculativeEngine:
    plan = engine_plan(drafter, None, None, None, None)
    return SpeculativeEngine(target, drafter, plan=replace(plan, settings=replace(plan.settings, state=state)))


def line_through(points: dict) -> tuple[float, float]:
    rows, seconds = numpy.array(list(points.keys()), float), numpy.array(list(points.values()))
    slope, intercept = numpy.polyfit(rows, seconds, 1) if len(points) > 1 else (0.0, float(seconds.mean()))
    return float(max(intercept, 0.0)), float(max(slope, 0.0))


def measured_prices() -> dict:
    samples = {}
    with torch.inference_mode():
        caches = {r: target(input_ids=torch.randint(0, 1000, (r, CONTEXT)), use_cache=True).past_key_values
                  for r in range(1, args.requests + 1)}
        shapes = [(r, w) for r in range(1, args.requests + 1) for w in range(1, widths + 1)]
        for _ in tqdm(range(args.sweeps), desc="timing shapes"):
            for r, w in shapes:
                for repeat in range(3):
                    started = time.perf_counter()
                    target(input_ids=torch.randint(0, 1000, (r, w)), cache=caches[r], use_cache=True)
                    if repeat:
                        samples.setdefault(f"{r},{w}", []).append(time.perf_counter() - started)
                    caches[r].crop(-w)
    forward = {key: statistics.median(values) for key, values in samples.items()}
    state = DraftingState()  # what an engine learns of D(R) and O(R) serving every request at once
    engine = engine_with(state)
    for i in ids:
        engine.submit(torch.tensor(i), args.max_new_tokens)
    engine.run_until_done()
    costs = engine.round_policy.costs
    return {"forward": forward, "draft": line_through({r: s * costs.load for r, s in costs.drafts.items()}),
            "overhead": line_through({r: s * costs.load for r, s in costs.overheads.items()})}


prices = json.loads(Path(args.prices).read_text()) if args.prices else measured_prices()
if not args.prices:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_name(output.stem + "-prices.json").write_text(json.dumps(prices, indent=1))
F = {tuple(map(int, key.split(","))): seconds for key, seconds in prices["forward"].items()}


def D(rows: int) -> float:
    return prices["draft"][0] + prices["draft"][1] * rows


def O(rows: int) -> float:  # noqa: E743 - the module's name for the loop's own work
    return prices["overhead"][0] + prices["overhead"][1] * rows


def prefill(tokens: int) -> float:
    return 0.05 + 0.0004 * tokens


def make(method: str, snapshot: dict, seed: int, priced: dict):
    if method == "plain":
        return SpeculativeEngine(target, None)
    engine = engine_with(DraftingState.from_dict(snapshot))
    policy, costs = engine.round_policy, engine.round_policy.costs
    costs.forwards.clear(), costs.forwards.update(F)  # the rule after drafting holds the same model
    costs.drafts.clear(), costs.drafts.update({r: D(r) for r in range(1, args.requests + 1)})
    costs.overheads.clear(), costs.overheads.update({r: O(r) for r in range(1, args.requests + 1)})
    costs.load, costs.learn = 1.0, False
    policy.rng.seed(seed)
    if method == "tokens":
        plan = policy.plan
        policy.plan = lambda *a, left=None, **k: plan(*a, **k)
    record = policy.record

    def priced_record(plan, request_ids, lengths, accepted, width, *a, **k):
        rows = len(request_ids)
        priced["round"] = F[rows, width] + O(rows) + (D(rows) if plan.use_drafter else 0.0)
        return record(plan, request_ids, lengths, accepted, width, *a, **k)
    policy.record = priced_record
    return engine


def serve(method: str, arrivals: list[float], snapshot: dict, seed: int) -> dict:
    priced = {}
    engine = make(method, snapshot, seed, priced)
    request_of, finish, outputs = {}, {}, {}
    submitted, now, rounds = 0, 0.0, 0
    while len(finish) < len(ids):
        joining = []
        while submitted < len(ids) and arrivals[submitted] <= now:
            request_of[engine.submit(torch.tensor(ids[submitted]), args.max_new_tokens)] = submitted
            joining.append(submitted)
            submitted += 1
        if not (engine.num_waiting or engine.num_running):
            now = arrivals[submitted]
            continue
        priced["round"] = None
        done = engine.step()
        rows = engine.num_running + len(done)
        now += prefill(sum(len(ids[i]) for i in joining)) if joining else 0.0
        now += priced["round"] if priced["round"] is not None else F[rows, 1] + O(rows)
        rounds += 1
        for request_id, sequence in done.items():
            finish[request_of[request_id]] = now
            outputs[request_of[request_id]] = sequence[len(ids[request_of[request_id]]):].tolist()
    tokens = [len(outputs[i]) for i in range(len(ids))]
    return {"aggregate": sum(tokens) / (max(finish.values()) - min(arrivals)), "rounds": rounds,
            "per_user": sum(n / (finish[i] - arrivals[i]) for i, n in enumerate(tokens)) / len(ids),
            "outputs": outputs}


state = DraftingState()
warm = engine_with(state)
for i in ids:
    warm.submit(torch.tensor(i), args.max_new_tokens)
warm.run_until_done()
warm, snapshot = None, state.to_dict()
results = {"command": command_line(), "git": git_state(), "environment": environment(torch.get_num_threads()),
           "settings": vars(args), "prices": prices, "runs": []}
for rate in rates:
    arrivals = [a / rate for a in unit_arrivals]
    for seed in tqdm(range(args.seeds), desc=f"rate {rate:g}/s"):
        served = {method: serve(method, arrivals, snapshot, seed) for method in METHODS}
        plain = served["plain"]
        results["runs"].append({
            "rate": rate, "seed": seed,
            **{f"{m}_aggregate_vs_plain": round(served[m]["aggregate"] / plain["aggregate"], 4) for m in METHODS[1:]},
            **{f"{m}_per_user_vs_plain": round(served[m]["per_user"] / plain["per_user"], 4) for m in METHODS[1:]},
            **{f"{m}_rounds": served[m]["rounds"] for m in METHODS},
            "identical_to_plain": all(served[m]["outputs"] == plain["outputs"] for m in METHODS[1:])})
        print(results["runs"][-1], flush=True)
table = [[r["rate"], r["seed"], r["tokens_aggregate_vs_plain"], r["defaults_aggregate_vs_plain"],
          r["tokens_per_user_vs_plain"], r["defaults_per_user_vs_plain"], r["plain_rounds"], r["tokens_rounds"],
          r["defaults_rounds"], r["identical_to_plain"]] for r in results["runs"]]
lines = ["# Priced replay: the policy's choices at this machine's prices, without its noise", "",
         *provenance_lines(results), "",
         f"{args.requests} requests x {args.max_new_tokens} new tokens, greedy, float32; simulated time (see the "
         "script's docstring). Ratios to plain served the same way.", "",
         *md_table(["rate", "seed", "tokens: aggregate", "defaults: aggregate", "tokens: per-user",
                    "defaults: per-user", "plain rounds", "tokens rounds", "defaults rounds", "outputs = plain"], table)]
md = write_report(output, results, lines)
print("\n".join(lines[-len(table) - 2:]), f"\n-> {md}")
