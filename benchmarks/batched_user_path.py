"""Issue 31 (1): batched speculative decoding through the user path, against plain batched `generate`.

    python benchmarks/batched_user_path.py --output benchmarks/batched-user-path/results.json
    python benchmarks/batched_user_path.py --prompt-set code-edit --output benchmarks/batched-user-path/code-edit.json
    python benchmarks/batched_user_path.py --rows 1,2 --batches 1 --max-new-tokens 8 --threads 1 --output /tmp/up.json

What a user writes: `target.generate(**tok(batch, return_tensors="pt", padding=True), assistant_model=drafter,
max_new_tokens=N)` (left padding, the chat template applied to each prompt, float32, greedy), with the shipped
drafter (`--drafter dspark|dflash|eagle3`, or a drafter folder), against plain batched `target.generate(**enc,
max_new_tokens=N)` on the same encoding. At R = 1 `generate()` takes hf_dspark's batch-1 loop (round planning,
suffix drafting); at R > 1 the batched engine. A drafter the engine refuses (Eagle3 at commit 79f3409) is recorded
with the error, per R.

Methods, every one on every batch, the order rotated batch by batch, best of `--repeats` wall times each:
* `plain`: plain batched `generate`;
* `spec-defaults`: `generate(..., assistant_model=drafter)` with `generate()`'s defaults;
* `spec-cost-table`: the same with `dspark_cost_table=` a table profiled at the start for that batch size
  (`profile_verification_costs(target, rows=R, max_tokens=R * (gamma + 1), drafter=drafter)`: B tokens in total
  over R rows, which is what the batched scheduler prices) or read from `--cost-table PATH` (one table for every R,
  or one per R when PATH contains `{rows}`, e.g. the tables an earlier run saved beside its results).

Batches: `--batches K` sequences of max(R) prompts drawn once (fixed `--seed`) from the mix (`--categories`,
category rotating row by row) or the code-edit set; the batch (R, k) is sequence k's first R prompts, so every R
runs on nested prompt sets. Each speculative row is checked against the batched plain row and against that prompt's
own plain greedy output decoded alone (batch 1, no padding); the plain rows are checked against the latter too
(padding can change float32 logits in rare near-ties).

Per R (printed, and rewritten after each R in `--output` JSON and a .md beside it): geometric mean over batches of
each speculative method's tokens/s over plain's on the same batch, the worst batch, aggregate tokens/s, tau (from
`drafter.last_generation_stats`, which `generate()` sets on every call at no cost), and the identity counts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from serving_common import (OwnPlain, add_prompt_arguments, chat_text, command_line, draw_sequences, environment,
                            eos_ids, error_text, fmt, geomean, git_state, load_models, md_table, merged_stats,
                            prompt_pools, provenance_lines, until_eos, write_report)

METHODS = ("plain", "spec-defaults", "spec-cost-table")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--drafter", default="dspark", help="dspark, dflash, eagle3 (the shipped ones) or a folder")
parser.add_argument("--rows", default="1,2,4,8,16", help="batch sizes R, comma-separated")
parser.add_argument("--batches", type=int, default=6, help="batches per R")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--repeats", type=int, default=2, help="timed runs per method per batch (the best counts)")
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--methods", default=",".join(METHODS), help=f"subset of {', '.join(METHODS)}")
parser.add_argument("--cost-table", default=None,
                    help="a cost table for spec-cost-table instead of profiling ({rows} in the path: one per R)")
parser.add_argument("--profile-repeats", type=int, default=5)
parser.add_argument("--profile-context", type=int, default=256)
parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up call per method and R")
parser.add_argument("--output", default="benchmarks/batched-user-path/results.json")
add_prompt_arguments(parser)
args = parser.parse_args()
rows_list = [int(r) for r in args.rows.split(",")]
methods = args.methods.split(",")
if methods[0] != "plain" or not set(methods) <= set(METHODS):
    raise SystemExit(f"--methods must start with plain and name only {', '.join(METHODS)}")
output = Path(args.output)

target, tokenizer, drafter = load_models(args.drafter, args.threads)
eos = eos_ids(target)
gamma = drafter.config.num_draft_slots
pools = prompt_pools(args, tokenizer)
sequences = draw_sequences(pools, args.batches, max(rows_list), args.seed)
texts = {p: chat_text(tokenizer, p.text) for seq in sequences for p in seq}
results = {
    "command": command_line(), "git": git_state(), "environment": environment(torch.get_num_threads()),
    "settings": {**vars(args), "rows": rows_list, "methods": methods, "gamma": gamma,
                 "drafter_class": type(drafter).__name__, "dtype": "float32", "greedy": True},
    "prompts": [[{"source": p.source, "index": p.index, "category": p.category} for p in seq] for seq in sequences],
    "cost_tables": {}, "per_rows": {},
}


def cost_tables() -> dict[int, object]:
    """One table per R, all made before any timing: read from --cost-table, or profiled and saved beside the
    results (cost-table-R{R}.json, reusable with --cost-table DIR/cost-table-R{rows}.json)."""
    from hf_dspark.evaluation.profiling import profile_verification_costs
    from hf_dspark.policy import VerificationCostTable

    tables = {}
    for rows in rows_list:
        if args.cost_table:
            path = args.cost_table.format(rows=rows)
            tables[rows] = VerificationCostTable.load(path)
            results["cost_tables"][rows] = {"path": path, **tables[rows].description,
                                            "max_tokens": tables[rows].max_tokens}
            continue
        started = time.perf_counter()
        tables[rows] = profile_verification_costs(target, max_tokens=rows * (gamma + 1),
                                                  context_length=args.profile_context, repeats=args.profile_repeats,
                                                  drafter=drafter, rows=rows)
        path = output.parent / f"cost-table-R{rows}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tables[rows].save(path)
        results["cost_tables"][rows] = {"path": str(path), "profile_seconds": round(time.perf_counter() - started, 1),
                                        **tables[rows].description, "max_tokens": tables[rows].max_tokens}
        print(f"profiled R={rows}: B = 1..{tables[rows].max_tokens} in {time.perf_counter() - started:.0f} s "
              f"-> {path}", flush=True)
    return tables


def run(method: str, encoding, tables, rows: int, max_new_tokens: int):
    """(new tokens per row cut at EOS, seconds, stats or None) of one call through the user path."""
    extra = {}
    if method != "plain":
        extra["assistant_model"] = drafter
    if method == "spec-cost-table":
        extra["dspark_cost_table"] = tables[rows]
    started = time.perf_counter()
    out = target.generate(**encoding, max_new_tokens=max_new_tokens, do_sample=False, **extra)
    seconds = time.perf_counter() - started
    width = encoding["input_ids"].shape[1]
    tokens = [until_eos(row[width:].tolist(), eos) for row in out]
    return tokens, seconds, (drafter.last_generation_stats if method != "plain" else None)


def summarise(rows: int, batches: list[dict]) -> dict:
    summary = {"rows": rows, "batches": len(batches), "methods": {}}
    plain_ok = [b for b in batches if "plain" in b["methods"] and "error" not in b["methods"]["plain"]]
    for method in methods:
        done = [b for b in plain_ok if method in b["methods"] and "error" not in b["methods"][method]]
        errors = sorted({b["methods"][method]["error"] for b in batches
                         if method in b["methods"] and "error" in b["methods"][method]})
        entry = {"batches_run": len(done)}
        if errors:
            entry["errors"] = errors
        if done:
            runs = [b["methods"][method] for b in done]
            tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
            entry.update(tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 2),
                         identical_to_own_plain=f"{sum(r['identical_to_own_plain'] for r in runs)}/{rows * len(runs)}")
            if method != "plain":
                ratios = [r["tokens_per_s"] / b["methods"]["plain"]["tokens_per_s"] for r, b in zip(runs, done)]
                entry.update(speedup_geomean=round(geomean(ratios), 3), speedup_worst=round(min(ratios), 3),
                             speedup_best=round(max(ratios), 3),
                             identical_to_batched_plain=f"{sum(r['identical_to_batched_plain'] for r in runs)}/"
                                                        f"{rows * len(runs)}",
                             tau=merged_stats([r["_stats"] for r in runs if r.get("_stats")])["tau"],
                             rounds_by_source=merged_stats([r["_stats"] for r in runs if r.get("_stats")])[
                                 "rounds_by_source"])
            entry["repeat_outputs_differ"] = sum(r["repeat_outputs_differ"] for r in runs)
        summary["methods"][method] = entry
    return summary


def report() -> None:
    lines = [f"# Batched user path: `generate(**tok(batch, padding=True), assistant_model=drafter)` vs plain batched "
             f"`generate`", ""] + provenance_lines(results)
    s = results["settings"]
    lines += [f"Target: embedded SmolLM2-135M-Instruct, float32, greedy, {s['max_new_tokens']} new tokens; drafter: "
              f"{s['drafter']} ({s['drafter_class']}, gamma {s['gamma']}); prompts: {s['prompt_set']}"
              + (f" ({s['categories']})" if s["prompt_set"] == "mix" else "")
              + f", at most {s['max_prompt_tokens']} tokens, seed {s['seed']}; {s['batches']} batches per R, "
                f"methods interleaved (order rotated per batch), best of {s['repeats']} per method per batch.", "",
              "speed-up = a method's tokens/s over plain batched `generate` on the same batch; geomean and worst over "
              "batches. `= own plain`: rows equal to that prompt's plain greedy output decoded alone (batch 1, no "
              "padding); `= batched plain`: rows equal to the plain batched row.", ""]
    table = []
    for rows, summary in results["per_rows"].items():
        for method, entry in summary["methods"].items():
            if "tokens" not in entry:
                table.append([rows, method, "-", "-", "-", "-", "-", "-", "; ".join(entry.get("errors", ["not run"]))])
                continue
            speed = f"{entry['speedup_geomean']:.2f}x / {entry['speedup_worst']:.2f}x" if method != "plain" else "1.00x"
            table.append([rows, method, entry["tokens_per_s"], speed, fmt(entry.get("tau"), 3),
                          entry.get("identical_to_batched_plain", "-"), entry["identical_to_own_plain"],
                          ", ".join(f"{k} {v}" for k, v in entry.get("rounds_by_source", {}).items()) or "-",
                          "; ".join(entry.get("errors", [])) or ""])
    lines += md_table(["R", "method", "tok/s", "speed-up geomean / worst", "tau", "= batched plain", "= own plain",
                       "rounds by source", "errors"], table)
    if results["cost_tables"]:
        lines += ["", "Cost tables (spec-cost-table): " + "; ".join(
            f"R={r}: {t['path']} (B = 1..{t['max_tokens']}, rows {t.get('rows')}, {t.get('threads')} threads)"
            for r, t in results["cost_tables"].items())]
    md = write_report(output, {**results, "per_rows": {r: {**v} for r, v in results["per_rows"].items()}}, lines)
    print("\n".join(md_table(["R", "method", "tok/s", "speed-up geomean / worst", "tau", "= batched plain",
                               "= own plain", "rounds by source", "errors"], table)), f"\n-> {output}, {md}",
          flush=True)


tables = cost_tables() if "spec-cost-table" in methods else {}
own_plain = OwnPlain(target, args.max_new_tokens)
for prompt in tqdm([p for seq in sequences for p in seq], desc="own plain (batch 1)"):
    own_plain(tokenizer(texts[prompt]).input_ids)

all_batches = {}
for rows in rows_list:
    batches, refused = [], {}
    for k, sequence in enumerate(tqdm(sequences, desc=f"R={rows}")):
        prompts = sequence[:rows]
        encoding = tokenizer([texts[p] for p in prompts], return_tensors="pt", padding=True)
        references = [own_plain(tokenizer(texts[p]).input_ids) for p in prompts]
        if k == 0 and not args.no_warmup:  # first forwards of these shapes, kernel choices: outside the timing
            for method in methods:
                try:
                    run(method, encoding, tables, rows, 4)
                except Exception as error:  # noqa: BLE001 - recorded below, when the timed call fails alike
                    refused[method] = error_text(error)
        order = methods[k % len(methods):] + methods[:k % len(methods)]
        batch = {"batch": k, "prompt_tokens": encoding["attention_mask"].sum(1).tolist(), "methods": {}}
        for repeat in range(args.repeats):
            for method in order:
                entry = batch["methods"].setdefault(method, {"times": []})
                if "error" in entry:
                    continue
                if method in refused:
                    entry["error"] = refused[method]
                    continue
                try:
                    tokens, seconds, stats = run(method, encoding, tables, rows, args.max_new_tokens)
                except Exception as error:  # noqa: BLE001 - e.g. Eagle3 in the batched engine: recorded, not fatal
                    entry["error"] = refused[method] = error_text(error)
                    continue
                if not entry["times"] or seconds < min(entry["times"]):
                    entry["_stats"] = stats  # the statistics of the run whose time counts
                entry["times"].append(seconds)
                if repeat == 0:
                    entry["_tokens"] = tokens
                else:
                    differ = entry.get("repeat_outputs_differ", 0) + (tokens != entry["_tokens"])
                    entry["repeat_outputs_differ"] = differ
        plain_tokens = batch["methods"]["plain"].get("_tokens")
        for method, entry in batch["methods"].items():
            if "error" in entry:
                continue
            tokens = entry["_tokens"]
            entry["seconds"] = min(entry["times"])
            entry["times"] = [round(t, 4) for t in entry["times"]]
            entry["tokens"] = sum(map(len, tokens))
            entry["tokens_per_s"] = entry["tokens"] / entry["seconds"]
            entry["identical_to_own_plain"] = sum(t == r for t, r in zip(tokens, references))
            entry["identical_to_batched_plain"] = sum(t == p for t, p in zip(tokens, plain_tokens)) \
                if plain_tokens is not None else None
            entry["repeat_outputs_differ"] = entry.get("repeat_outputs_differ", 0)
            if entry.get("_stats") is not None:
                entry["tau"] = round(entry["_stats"].tau, 3)
        batches.append(batch)
    all_batches[rows] = batches
    results["per_rows"][rows] = summarise(rows, batches)
    results["batches"] = {r: [{**b, "methods": {m: {k: v for k, v in e.items() if not k.startswith("_")}
                                                for m, e in b["methods"].items()}} for b in bs]
                          for r, bs in all_batches.items()}
    report()
