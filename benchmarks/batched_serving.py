"""Batched serving with the DSpark scheduler: real runs on this machine, plus a simulation on a GPU-like cost curve.

    python benchmarks/batched_serving.py --output benchmarks/batched-serving

Real part: the embedded SmolLM2-135M-Instruct target and the shipped DSpark drafter serve R = 1, 2, 4, 8, 16
concurrent requests (held-out math, code and chat prompts, greedy, float32 so every request can be checked against
its own plain greedy output). Per R, side by side: plain batched `generate`, and the batched speculative engine
verifying every draft ("all"), one draft ("fixed-1", like MTP-1), drafts whose cumulative confidence stays above a
threshold, and the DSpark scheduler on a cost table profiled here (SPS(B) for B = 1..16*8 tokens), deciding from
the current round's confidences ("scheduler") or, as in production, taking the budget from those of two rounds
earlier ("scheduler-2ago", which skips drafting in rounds whose budget is already known to be 0).
Reported: aggregate tokens/s, mean per-request tokens/s (a request's tokens over the time it finished), the mean
drafts verified per request per round, tau, and the identity check.

Simulated part (`hf_dspark.evaluation.simulation`): the same policies on a GPU-shaped curve (a forward costs the
same up to ~256 tokens, then grows linearly; drafting costs 15% of a forward over R * gamma tokens) with a
calibrated confidence model giving tau ~4.8 when all 7 drafts are verified, for R = 1 .. 256; per-user speed
against aggregate throughput, i.e. the Pareto frontier of each policy.
"""

import argparse
import json
import time
from pathlib import Path

import torch

import hf_dspark
from hf_dspark.evaluation.prompts import chat_input_ids, load_prompt_sets
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.models.loading import shipped_drafter_path
from hf_dspark.evaluation.profiling import profile_verification_costs
from hf_dspark.policy import DSparkScheduler, VerificationCostTable
from hf_dspark.evaluation.simulation import ConfidenceModel, expected_tau, gpu_like_costs, simulate_policy

parser = argparse.ArgumentParser()
parser.add_argument("--output", default="benchmarks/batched-serving")
parser.add_argument("--requests", type=int, nargs="*", default=[1, 2, 4, 8, 16])
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--threshold", type=float, default=0.25)
parser.add_argument("--threads", type=int, default=None)
parser.add_argument("--cost-table", default=None, help="reuse a profiled table instead of profiling")
parser.add_argument("--skip-real", action="store_true")
parser.add_argument("--sim-rounds", type=int, default=200)
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
output = Path(args.output)
output.mkdir(parents=True, exist_ok=True)
results = {"command": "python benchmarks/batched_serving.py " + " ".join(
    f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
    for k, v in vars(args).items() if v not in (None, False)), "threads": torch.get_num_threads()}


def real_runs() -> dict:
    target, tokenizer = hf_dspark.load_default_target(dtype=torch.float32)
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(shipped_drafter_path("dspark"), dtype=torch.float32).eval()
    prompts = [p for group in zip(*load_prompt_sets(["gsm8k", "humaneval", "mt-bench"], 8).values()) for p in group]
    prompts = [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])[0] for p in prompts]
    max_requests = max(args.requests)
    if args.cost_table:
        costs = VerificationCostTable.load(args.cost_table)
    else:
        started = time.perf_counter()
        costs = profile_verification_costs(target, max_tokens=max_requests * (drafter.config.block_size + 1),
                                           context_length=256, repeats=3, warmup=1, drafter=drafter)
        costs.save(output / "cost-table.json")
        print(f"profiled SPS(B) for B = 1..{costs.max_tokens} in {time.perf_counter() - started:.0f} s", flush=True)
    plain_alone = {}
    for index in range(max_requests):  # each prompt's own plain greedy output, the identity reference
        plain_alone[index] = target.generate(prompts[index][None], max_new_tokens=args.max_new_tokens,
                                             do_sample=False)[0, len(prompts[index]):].tolist()
    policies = {"all": ("all", None), "fixed-1": ("fixed", 1), f"threshold-{args.threshold}": ("threshold", args.threshold),
                "scheduler": ("scheduler", DSparkScheduler(costs))}
    rows = []
    for requests in args.requests:
        batch = prompts[:requests]
        rows.append(plain_batched(target, tokenizer, batch, plain_alone))
        for name, (policy, policy_arg) in policies.items():
            rows.append(engine_run(target, drafter, batch, name, policy, policy_arg, plain_alone))
        for row in rows[-(len(policies) + 1):]:
            print(json.dumps(row), flush=True)
    return {"cost_table": costs.description | {"max_tokens": costs.max_tokens}, "rows": rows}


def plain_batched(target, tokenizer, batch, plain_alone) -> dict:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    started = time.perf_counter()
    out = target.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - started
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokens, identical = [], 0
    for row in range(len(batch)):
        new = out[row, width:].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        tokens.append(cut)
        identical += new[:cut] == plain_alone[row]
    return summary("plain", len(batch), sum(tokens), seconds, [n / seconds for n in tokens], 0.0, 1.0, identical)


def engine_run(target, drafter, batch, name, policy, policy_arg, plain_alone) -> dict:
    engine = SpeculativeEngine(target, drafter, policy, policy_arg, keep_stats=True)
    ids = [engine.submit(prompt, args.max_new_tokens) for prompt in batch]
    finished_at, outputs = {}, {}
    started = time.perf_counter()
    while engine.num_waiting or engine.num_running:
        for request_id, sequence in engine.step().items():
            finished_at[request_id] = time.perf_counter() - started
            outputs[request_id] = sequence
    seconds = time.perf_counter() - started
    tokens = [len(outputs[r]) - len(batch[i]) for i, r in enumerate(ids)]
    per_request = [tokens[i] / finished_at[r] for i, r in enumerate(ids)]
    stats = [engine.stats[r] for r in ids]
    rounds = sum(len(s.draft_lengths) for s in stats)
    verified = sum(sum(s.draft_lengths) for s in stats) / max(rounds, 1)
    tau = sum(sum(s.accepted) + len(s.accepted) for s in stats) / max(rounds, 1)
    identical = sum(outputs[r][len(batch[i]):].tolist() == plain_alone[i] for i, r in enumerate(ids))
    return summary(name, len(batch), sum(tokens), seconds, per_request, verified, tau, identical)


def summary(policy, requests, tokens, seconds, per_request, verified, tau, identical) -> dict:
    return {"policy": policy, "requests": requests, "tokens": tokens, "seconds": round(seconds, 3),
            "aggregate_tokens_per_s": round(tokens / seconds, 2),
            "per_request_tokens_per_s": round(sum(per_request) / len(per_request), 2),
            "mean_verified_drafts": round(verified, 3), "tau": round(tau, 3), "identical": f"{identical}/{requests}"}


def simulation() -> dict:
    model = ConfidenceModel([0.90, 0.87, 0.84, 0.81, 0.78, 0.75, 0.72], concentration=4.0)
    table, draft_seconds = gpu_like_costs()
    policies = {"plain": ("plain", None), "all": ("all", None), "fixed-1": ("fixed", 1),
                "threshold-0.5": ("threshold", 0.5), "scheduler": ("scheduler", None)}
    rows = []
    for requests in [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]:
        for name, (policy, policy_arg) in policies.items():
            if policy == "scheduler":  # the scheduler sees this load's drafting cost in its SPS(B)
                policy_arg = DSparkScheduler(VerificationCostTable(table.seconds, draft_seconds(requests, model.draft_length)))
            result = simulate_policy(policy, policy_arg, requests=requests, rounds=args.sim_rounds,
                                     confidence_model=model, costs=table, draft_seconds=draft_seconds)
            rows.append({"policy": name, "requests": requests,
                         "aggregate_tokens_per_s": round(result.aggregate_tokens_per_second, 1),
                         "per_user_tokens_per_s": round(result.per_user_tokens_per_second, 2),
                         "mean_verified_drafts": round(result.verified_drafts, 3),
                         "tau": round(result.tokens / (result.rounds * requests), 3)})
    return {"confidence_means": model.means, "concentration": model.concentration,
            "expected_tau_all": round(expected_tau(model.means), 3), "cost_curve": table.description,
            "draft_fraction": 0.15, "rounds": args.sim_rounds, "rows": rows}


def table(rows, columns) -> list[str]:
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(fn(r)) for _, fn in columns) + " |" for r in rows]
    return lines


def ratio(rows, requests, policy, baseline="plain", key="aggregate_tokens_per_s"):
    by = {(r["policy"], r["requests"]): r[key] for r in rows}
    return by[(policy, requests)] / by[(baseline, requests)]


def plot(sim: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 5))
    for policy in dict.fromkeys(r["policy"] for r in sim["rows"]):
        points = [r for r in sim["rows"] if r["policy"] == policy]
        axis.plot([p["aggregate_tokens_per_s"] for p in points], [p["per_user_tokens_per_s"] for p in points],
                  marker="o", label=policy)
        for p in points:
            if p["requests"] in (1, 16, 64, 256):
                axis.annotate(f"R={p['requests']}", (p["aggregate_tokens_per_s"], p["per_user_tokens_per_s"]),
                              fontsize=7, textcoords="offset points", xytext=(3, 3))
    axis.set_xlabel("aggregate throughput (tokens/s)")
    axis.set_ylabel("per-user speed (tokens/s)")
    axis.set_title("Simulated GPU-like serving: per-user speed vs throughput (R = 1..256)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if not args.skip_real:
    results["real"] = real_runs()
results["simulation"] = simulation()
(output / "results.json").write_text(json.dumps(results, indent=2))
plot(results["simulation"], output / "pareto.png")

lines = ["# Batched serving with the DSpark scheduler", "", f"Command: `{results['command']}` "
         f"({results['threads']} CPU threads).", ""]
if "real" in results:
    real = results["real"]["rows"]
    lines += ["## Real runs: SmolLM2-135M-Instruct + shipped DSpark drafter, float32 greedy, this CPU", "",
              f"{args.max_new_tokens} new tokens per request; per-request speed = a request's tokens / the time it "
              "finished (all start together). `identical` = requests whose output equals that prompt's own plain "
              "greedy output.", ""]
    lines += table(real, [("R", lambda r: r["requests"]), ("policy", lambda r: r["policy"]),
                          ("aggregate tok/s", lambda r: r["aggregate_tokens_per_s"]),
                          ("vs plain", lambda r: f"{ratio(real, r['requests'], r['policy']):.2f}x"),
                          ("per-request tok/s", lambda r: r["per_request_tokens_per_s"]),
                          ("drafts verified / request / round", lambda r: r["mean_verified_drafts"]),
                          ("tau", lambda r: r["tau"]), ("identical", lambda r: r["identical"])])
    lines.append("")
sim = results["simulation"]
lines += ["## Simulation: GPU-like cost curve, calibrated confidences (tau "
          f"{sim['expected_tau_all']} when all 7 drafts are verified)", "",
          "A forward over B tokens costs 12 ms up to ~256 tokens, then grows linearly; drafting costs 15% of a forward "
          f"over R x 7 tokens. {sim['rounds']} rounds per point, the same confidence draws for every policy. "
          "Plot: `pareto.png` (per-user speed against aggregate throughput).", ""]
lines += table(sim["rows"], [("R", lambda r: r["requests"]), ("policy", lambda r: r["policy"]),
                             ("aggregate tok/s", lambda r: r["aggregate_tokens_per_s"]),
                             ("vs plain", lambda r: f"{ratio(sim['rows'], r['requests'], r['policy']):.2f}x"),
                             ("per-user tok/s", lambda r: r["per_user_tokens_per_s"]),
                             ("drafts verified / request / round", lambda r: r["mean_verified_drafts"]),
                             ("tau", lambda r: r["tau"])])
(output / "README.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
