"""Issue 31 (2): requests arriving over time (Poisson) into `hf_dspark.SpeculativeEngine`, on real wall-clock time.

    python benchmarks/arrivals.py --output benchmarks/arrivals/results.json
    python benchmarks/arrivals.py --rates 0.5,1 --requests 4 --max-new-tokens 8 --threads 1 --output /tmp/arr.json
    python benchmarks/arrivals.py --rates inf --methods plain,defaults --no-sim --output /tmp/together.json

For each arrival rate (`--rates`, requests per second) one fixed set of requests (`--requests` prompts drawn from
the mix, `--seed`) gets Poisson arrival times: the same exponential draws at every rate, scaled by 1 / rate (`inf`:
every request is submitted at once, before the first step, the load where a scheduler must brake hardest). Each
method serves them in real time: a request is submitted once its arrival time has passed, the engine steps while
anything waits or runs, and otherwise the loop sleeps until the next arrival. Methods (order rotated rate by rate):

* `plain`: plain continuous batching, `SpeculativeEngine(target, None)`;
* `verify-1`: `SpeculativeEngine(target, drafter, policy="fixed", policy_arg=1)` (like MTP-1);
* `verify-all`: `SpeculativeEngine(target, drafter, policy="all")`;
* `defaults`: `SpeculativeEngine(target, drafter)`, whatever the engine plans by default from the drafter's
  `generation_config` (what it resolved to is recorded; `--default-cost-table PATH` first puts a profiled table in
  that config, as `hf-dspark generate` does, so the defaults then include the table's scheduling).

Per method and rate: per-user tokens/s (a request's new tokens / (its finish - its arrival); mean and p50), the
aggregate tokens/s (all new tokens / (last finish - first arrival)), latency, tau, rounds by source, and each
request's output against its own plain greedy output decoded alone. Written after every rate: `--output` JSON, a
.md beside it and a Pareto plot (`.png`: per-user against aggregate, one line per method across the rates).

Beside it, a "GPU-shaped" simulation from `hf_dspark.evaluation.simulation` (its `simulate_policy`,
`ConfidenceModel`, `gpu_like_costs`): the same four methods, on a GPU-like cost curve. `simulate_policy` models R
always-busy requests (closed loop, fixed R), not arrivals, so that part sweeps R instead of the arrival rate (see
the .md). The confidence model's per-slot means are the conditional acceptance by slot measured here by
`verify-all` (else `defaults`), and, for comparison, the paper-like means `benchmarks/batched_serving.py` uses.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from serving_common import (OwnPlain, add_prompt_arguments, command_line, draw_sequences, environment, error_text,
                            fmt, git_state, load_models, md_table, merged_stats, percentile, prompt_ids,
                            prompt_pools, provenance_lines, unit_arrival_times, write_report)

METHODS = ("plain", "verify-1", "verify-all", "defaults")
PAPER_MEANS = [0.90, 0.87, 0.84, 0.81, 0.78, 0.75, 0.72]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--drafter", default="dspark", help="dspark, dflash, eagle3 (the shipped ones) or a folder")
parser.add_argument("--rates", default="0.25,0.5,1,2,4", help="arrival rates in requests/s, comma-separated")
parser.add_argument("--requests", type=int, default=24, help="requests per rate and method")
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--repeats", type=int, default=1,
                    help="runs per method and rate, interleaved with the other methods; the best aggregate counts")
parser.add_argument("--methods", default=",".join(METHODS), help=f"subset of {', '.join(METHODS)}")
parser.add_argument("--default-cost-table", default=None,
                    help="put this cost table in the drafter's generation_config before building the engines")
parser.add_argument("--fixed-policies-planning", default="off", choices=["off", "drafter"],
                    help="verify-1 / verify-all: off = built with dspark_round_planning=False (the policy alone, "
                         "every round; an engine without a round planner ignores it), drafter = the drafter's own "
                         "generation_config (an engine round planner then caps, not fixes, the drafts)")
parser.add_argument("--no-identity", action="store_true", help="skip the own-plain reference (batch-1 runs)")
parser.add_argument("--no-warmup", action="store_true")
parser.add_argument("--sim-rows", default="1,2,4,8,16,32,64,128,256", help="R values of the simulation")
parser.add_argument("--sim-rounds", type=int, default=200)
parser.add_argument("--no-sim", action="store_true")
parser.add_argument("--output", default="benchmarks/arrivals/results.json")
add_prompt_arguments(parser)
args = parser.parse_args()
try:
    rates = [float(r) for r in args.rates.split(",")]
except ValueError:
    raise SystemExit(f"--rates must be numbers (requests/s) or inf, comma-separated; got {args.rates!r}") from None
if not all(rate > 0 for rate in rates):
    raise SystemExit(f"--rates must all be above 0 (inf: every request at once); got {args.rates!r}")
methods = args.methods.split(",")
if not set(methods) <= set(METHODS):
    raise SystemExit(f"--methods must name only {', '.join(METHODS)}")
output = Path(args.output)

target, tokenizer, drafter = load_models(args.drafter, args.threads)
if args.default_cost_table:
    from hf_dspark.policy import VerificationCostTable

    drafter.generation_config.dspark_cost_table = VerificationCostTable.load(args.default_cost_table)
pools = prompt_pools(args, tokenizer)
prompts = draw_sequences(pools, 1, args.requests, args.seed)[0]
ids = [prompt_ids(tokenizer, p.text) for p in prompts]
unit_arrivals = unit_arrival_times(len(ids), args.seed + 1)  # / rate: arrivals at that rate

results = {
    "command": command_line(), "git": git_state(), "environment": environment(torch.get_num_threads()),
    "settings": {**vars(args), "rates": rates, "methods": methods, "drafter_class": type(drafter).__name__,
                 "dtype": "float32", "greedy": True},
    "prompts": [{"source": p.source, "index": p.index, "category": p.category, "prompt_tokens": len(i)}
                for p, i in zip(prompts, ids)],
    "unit_arrivals": [round(a, 4) for a in unit_arrivals], "engines": {}, "runs": [], "every_repeat": [],
    "simulation": None,
}


def make_engine(method: str):
    from hf_dspark import SpeculativeEngine

    if method == "plain":
        return SpeculativeEngine(target, None, keep_stats=True)
    if method == "defaults":
        return SpeculativeEngine(target, drafter, keep_stats=True)
    policy = {"verify-1": ("fixed", 1), "verify-all": ("all", None)}[method]
    if args.fixed_policies_planning == "drafter":
        return SpeculativeEngine(target, drafter, policy=policy[0], policy_arg=policy[1], keep_stats=True)
    # The engine reads the drafter's generation_config when it is built: switch its round planning off for that.
    config = drafter.generation_config
    missing = object()
    saved = getattr(config, "dspark_round_planning", missing)
    config.dspark_round_planning = False
    try:
        return SpeculativeEngine(target, drafter, policy=policy[0], policy_arg=policy[1], keep_stats=True)
    finally:
        if saved is missing:
            del config.dspark_round_planning
        else:
            config.dspark_round_planning = saved


def describe(engine) -> dict:
    """What the engine resolved (its policy, and a round planner where the engine has one)."""
    planning = getattr(engine, "planning", None)
    policy_arg = engine.policy_arg
    return {"policy": engine.policy,
            "policy_arg": policy_arg if isinstance(policy_arg, (int, float, type(None))) else type(policy_arg).__name__,
            "draft_slots": getattr(engine, "draft_length", None),
            "round_planning": None if planning is None else
            {"class": type(planning).__name__, **{k: v for k, v in vars(planning).items()
                                                   if isinstance(v, (bool, int, float, str))}}}


def serve(method: str, arrivals: list[float]) -> dict:
    """Serve every request at its arrival time; returns per-request finish times and outputs."""
    engine = make_engine(method)
    results["engines"].setdefault(method, describe(engine))
    request_of, finish, outputs = {}, {}, {}
    submitted, steps = 0, 0
    start = time.perf_counter()
    while len(finish) < len(ids):
        now = time.perf_counter() - start
        while submitted < len(ids) and arrivals[submitted] <= now:
            request_of[engine.submit(torch.tensor(ids[submitted]), args.max_new_tokens)] = submitted
            submitted += 1
        if engine.num_waiting or engine.num_running:
            for request_id, sequence in engine.step().items():
                finish[request_of[request_id]] = time.perf_counter() - start
                outputs[request_of[request_id]] = sequence[len(ids[request_of[request_id]]):].tolist()
            steps += 1
        elif submitted < len(ids):
            time.sleep(max(0.0, arrivals[submitted] - (time.perf_counter() - start)))
    stats = [engine.stats[r] for r in request_of] if not engine.plain else []
    return {"finish": finish, "outputs": outputs, "steps": steps, "stats": stats,
            "batch_sizes": list(engine.verified_tokens_per_round)}


def summarise(method: str, rate: float, arrivals: list[float], served: dict, references) -> dict:
    tokens = [len(served["outputs"][i]) for i in range(len(ids))]
    latency = [served["finish"][i] - arrivals[i] for i in range(len(ids))]
    per_user = [n / t for n, t in zip(tokens, latency)]
    makespan = max(served["finish"].values()) - min(arrivals)
    stats = merged_stats(served["stats"]) if served["stats"] else {}
    row = {"method": method, "rate": rate, "requests": len(ids), "tokens": sum(tokens),
           "makespan_s": round(makespan, 3), "aggregate_tokens_per_s": round(sum(tokens) / makespan, 3),
           "per_user_tokens_per_s_mean": round(sum(per_user) / len(per_user), 3),
           "per_user_tokens_per_s_p50": round(percentile(per_user, 0.5), 3),
           "latency_s_mean": round(sum(latency) / len(latency), 3), "latency_s_p90": round(percentile(latency, 0.9), 3),
           "steps": served["steps"], "tau": stats.get("tau"), "rounds_by_source": stats.get("rounds_by_source", {}),
           "identical_to_own_plain": None if references is None else
           f"{sum(served['outputs'][i] == references[i] for i in range(len(ids)))}/{len(ids)}"}
    if served["stats"]:  # per draft slot: rounds that reached it (earlier drafts accepted) and that accepted it
        slots = max((d for s in served["stats"] for d in s.draft_lengths), default=0)
        reached, accepted = [0] * slots, [0] * slots
        for s in served["stats"]:
            for a, d in zip(s.accepted, s.draft_lengths):
                for j in range(min(d, a + 1)):
                    reached[j] += 1
                    accepted[j] += a > j
        row.update(slot_reached=reached, slot_accepted=accepted,
                   acceptance_by_slot=[round(k / n, 4) if n else None for k, n in zip(accepted, reached)])
    return row


def measured_means(gamma: int) -> tuple[str, list[float]] | None:
    """Conditional acceptance per slot pooled over every rate of `verify-all` (else `defaults`): the simulation's
    confidence means. Slots never reached take the last measured rate."""
    for method in ("verify-all", "defaults"):
        runs = [r for r in results["runs"] if r["method"] == method and r.get("slot_reached")]
        if not runs:
            continue
        reached = [sum(r["slot_reached"][j] for r in runs if j < len(r["slot_reached"])) for j in range(gamma)]
        accepted = [sum(r["slot_accepted"][j] for r in runs if j < len(r["slot_accepted"])) for j in range(gamma)]
        means, last = [], 0.01
        for k, n in zip(accepted, reached):
            last = k / n if n else last
            means.append(min(max(last, 1e-3), 1 - 1e-3))
        return method, means
    return None


def simulation() -> dict:
    """The same methods on a GPU-shaped cost curve (`hf_dspark.evaluation.simulation`), R always-busy requests."""
    from hf_dspark import DSparkScheduler, VerificationCostTable
    from hf_dspark.evaluation.simulation import ConfidenceModel, expected_tau, gpu_like_costs, simulate_policy

    gamma = drafter.config.num_draft_slots
    models = {"paper-like": PAPER_MEANS[:gamma] + PAPER_MEANS[-1:] * (gamma - len(PAPER_MEANS))}
    measured = measured_means(gamma)
    if measured:
        models = {f"measured ({measured[0]})": measured[1], **models}
    table, draft_seconds = gpu_like_costs()
    out = {"cost_curve": table.description, "draft_fraction": 0.15, "rounds": args.sim_rounds, "models": {}}
    for label, means in models.items():
        model = ConfidenceModel(means, concentration=4.0)
        rows = []
        for requests in [int(r) for r in args.sim_rows.split(",")]:
            for method in methods:
                policy, policy_arg, note = sim_policy(method, requests, model, table, draft_seconds)
                if policy is None:
                    rows.append({"method": method, "requests": requests, "note": note})
                    continue
                if policy == "scheduler":
                    policy_arg = DSparkScheduler(VerificationCostTable(table.seconds, draft_seconds(requests, gamma)))
                result = simulate_policy(policy, policy_arg, requests=requests, rounds=args.sim_rounds,
                                         confidence_model=model, costs=table, draft_seconds=draft_seconds)
                rows.append({"method": method, "requests": requests, "policy": policy, "note": note,
                             "aggregate_tokens_per_s": round(result.aggregate_tokens_per_second, 1),
                             "per_user_tokens_per_s": round(result.per_user_tokens_per_second, 2),
                             "mean_verified_drafts": round(result.verified_drafts, 3),
                             "tau": round(result.tokens / (result.rounds * requests), 3)})
        out["models"][label] = {"means": [round(m, 4) for m in means], "concentration": 4.0,
                                "expected_tau_all": round(expected_tau(means), 3), "rows": rows}
    return out


def sim_policy(method, requests, model, table, draft_seconds):
    """(policy, policy_arg, note) of `simulate_policy` for a method; policy None when it cannot express it."""
    if method == "plain":
        return "plain", None, ""
    if method == "verify-1":
        return "fixed", 1, ""
    if method == "verify-all":
        return "all", None, ""
    engine = results["engines"].get("defaults")
    if engine is None:
        return None, None, "the engine's defaults were not resolved (method not run)"
    planning = engine.get("round_planning")
    if planning and planning.get("planning", True):  # an engine with a round planner that is switched on
        return None, None, ("the engine's defaults include its round planner (per-row drafter / suffix / plain "
                            "choices from learnt costs), which simulate_policy does not model")
    if engine["policy"] == "scheduler":
        return "scheduler", None, "DSparkScheduler on the simulated curve"
    if engine["policy"] in ("all", "fixed", "threshold"):
        return engine["policy"], engine["policy_arg"], f"resolved to {engine['policy']}"
    return None, None, f"the engine resolved policy {engine['policy']!r}, which simulate_policy does not take"


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = results.get("simulation") or {"models": {}}
    panels = 1 + len(sim["models"])
    figure, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5), squeeze=False)
    axis = axes[0][0]
    for method in methods:
        points = sorted((r for r in results["runs"] if r["method"] == method and "error" not in r),
                        key=lambda r: r["rate"])
        if not points:
            continue
        axis.plot([p["aggregate_tokens_per_s"] for p in points], [p["per_user_tokens_per_s_mean"] for p in points],
                  marker="o", label=method)
        for p in points:
            axis.annotate(f"{p['rate']:g}/s", (p["aggregate_tokens_per_s"], p["per_user_tokens_per_s_mean"]),
                          fontsize=7, textcoords="offset points", xytext=(3, 3))
    axis.set_xlabel("aggregate tokens/s")
    axis.set_ylabel("per-user tokens/s (mean)")
    axis.set_title("Real: Poisson arrivals on this CPU (label: rate)")
    for panel, (label, model) in enumerate(sim["models"].items(), start=1):
        axis = axes[0][panel]
        for method in methods:
            points = [r for r in model["rows"] if r["method"] == method and "aggregate_tokens_per_s" in r]
            if points:
                axis.plot([p["aggregate_tokens_per_s"] for p in points], [p["per_user_tokens_per_s"] for p in points],
                          marker="o", label=method)
                for p in points:
                    if p["requests"] in (1, 16, 64, 256):
                        axis.annotate(f"R={p['requests']}", (p["aggregate_tokens_per_s"], p["per_user_tokens_per_s"]),
                                      fontsize=7, textcoords="offset points", xytext=(3, 3))
        axis.set_xscale("log")
        axis.set_xlabel("aggregate tokens/s")
        axis.set_ylabel("per-user tokens/s")
        axis.set_title(f"Simulated GPU-like, {label} confidences (tau all {model['expected_tau_all']})")
    for axis in axes[0]:
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def rate_label(rate: float) -> str:
    return "inf (all at once)" if rate == float("inf") else fmt(rate)


def report() -> None:
    s = results["settings"]
    lines = ["# Poisson arrivals into `SpeculativeEngine`", ""] + provenance_lines(results)
    lines += [f"Target: embedded SmolLM2-135M-Instruct, float32, greedy, {s['max_new_tokens']} new tokens per request; "
              f"drafter {s['drafter']} ({s['drafter_class']}); {s['requests']} requests ({s['prompt_set']}"
              + (f": {s['categories']}" if s["prompt_set"] == "mix" else "")
              + f", seed {s['seed']}); the same Exp(1) gaps at every rate, scaled by 1/rate; methods in rotated "
                f"order per rate, {s.get('repeats', 1)} run(s) each interleaved, the best aggregate shown. "
                "Per-user = a request's new tokens / (finish - arrival); aggregate = all new tokens / (last finish "
                "- first arrival). Plot: "
              f"`{output.with_suffix('.png').name}`.", "", "What each engine resolved:", ""]
    lines += [f"* `{m}`: {e}" for m, e in results["engines"].items()]
    planned = [m for m, e in results["engines"].items() if m in ("verify-1", "verify-all")
               and e.get("round_planning") and e["round_planning"].get("planning", True)]
    if planned:
        lines += ["", f"Note: {', '.join(planned)} ran with the engine's round planner switched on "
                      "(`--fixed-policies-planning drafter`), so their policy caps what a row verifies rather than "
                      "fixing it; the simulation below runs them as fixed policies."]
    lines.append("")
    table = []
    for r in sorted(results["runs"], key=lambda r: (r["rate"], methods.index(r["method"]))):
        if "error" in r:
            table.append([rate_label(r["rate"]), r["method"]] + ["-"] * 9 + [r["error"]])
            continue
        table.append([rate_label(r["rate"]), r["method"], r["per_user_tokens_per_s_mean"],
                      r["per_user_tokens_per_s_p50"],
                      r["aggregate_tokens_per_s"], r["latency_s_mean"], r["latency_s_p90"], fmt(r["tau"], 3),
                      ", ".join(f"{k} {v}" for k, v in r["rounds_by_source"].items()) or "-",
                      r["identical_to_own_plain"] or "-",
                      ", ".join(str(a) for a in r.get("aggregate_every_repeat", [])) or "-", ""])
    lines += md_table(["rate (req/s)", "method", "per-user tok/s mean", "p50", "aggregate tok/s", "latency mean (s)",
                       "latency p90 (s)", "tau", "rounds by source", "= own plain", "aggregate, every repeat",
                       "error"], table)
    sim = results.get("simulation")
    if sim:
        lines += ["", "## GPU-shaped simulation (`hf_dspark.evaluation.simulation`)", "",
                  "`simulate_policy` replays rounds of R always-busy requests (a closed loop at fixed R): it has no "
                  "arrival process, no request lengths and no queueing, so it cannot replay the Poisson arrivals "
                  "above. The same methods are swept over R instead (per-user = aggregate / R). Cost curve: "
                  f"{sim['cost_curve']}, drafting {sim['draft_fraction']:.0%} of a forward over R x gamma tokens, "
                  f"{sim['rounds']} rounds per point."]
        for label, model in sim["models"].items():
            lines += ["", f"### {label} confidences: per-slot means {model['means']} (tau {model['expected_tau_all']} "
                          "when every slot is verified)", ""]
            lines += md_table(["R", "method", "aggregate tok/s", "per-user tok/s", "drafts verified / request / round",
                               "tau", "note"],
                              [[r["requests"], r["method"], r.get("aggregate_tokens_per_s", "-"),
                                r.get("per_user_tokens_per_s", "-"), r.get("mean_verified_drafts", "-"),
                                r.get("tau", "-"), r.get("note", "")] for r in model["rows"]])
    md = write_report(output, results, lines)
    plot(output.with_suffix(".png"))
    print("\n".join(md_table(["rate", "method", "per-user mean", "p50", "aggregate", "lat mean", "lat p90", "tau",
                              "rounds", "= own plain", "every repeat", "error"], table)), f"\n-> {output}, {md}",
          flush=True)


references = None
if not args.no_identity:
    own_plain = OwnPlain(target, args.max_new_tokens)
    references = [own_plain(i) for i in tqdm(ids, desc="own plain (batch 1)")]
if not args.no_warmup:  # first forwards, kernel choices, the drafter's first pass: outside the timing
    for method in methods:
        try:
            engine = make_engine(method)
            for i in ids[:2]:
                engine.submit(torch.tensor(i), 4)
            engine.run_until_done()
        except Exception:  # noqa: BLE001 - the timed run records the error
            pass
        # A live engine holds its drafter's state (what it measured): the timed engines start from it once it is gone.
        engine = None

for position, rate in enumerate(rates):
    arrivals = [a / rate for a in unit_arrivals]
    order = methods[position % len(methods):] + methods[:position % len(methods)]
    repeats = {method: [] for method in order}
    for repeat, method in tqdm([(k, m) for k in range(args.repeats) for m in order], desc=f"rate {rate:g}/s"):
        try:
            served = serve(method, arrivals)
        except Exception as error:  # noqa: BLE001 - e.g. a drafter the engine refuses: recorded, not fatal
            repeats[method].append({"method": method, "rate": rate, "repeat": repeat, "error": error_text(error)})
            continue
        repeats[method].append({**summarise(method, rate, arrivals, served, references), "repeat": repeat})
    for method, runs in repeats.items():  # the best run of each method (this machine's load only slows a run)
        done = [r for r in runs if "error" not in r]
        best = max(done, key=lambda r: r["aggregate_tokens_per_s"]) if done else runs[0]
        results["runs"].append({**best, "aggregate_every_repeat": [r["aggregate_tokens_per_s"] for r in done]})
        results["every_repeat"].extend(runs)
    if not args.no_sim and position == len(rates) - 1:
        results["simulation"] = simulation()
    report()
