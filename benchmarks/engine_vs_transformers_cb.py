"""Issue 31 (3): hf_dspark's engine without a drafter against transformers' own continuous batching, same requests.

    python benchmarks/engine_vs_transformers_cb.py --output benchmarks/engine-vs-transformers-cb/results.json
    python benchmarks/engine_vs_transformers_cb.py --requests 2 --max-new-tokens 8 --threads 1 --output /tmp/cb.json

Both serve the same chat-templated prompts (the mix, `--seed`), greedy, float32, the same `max_new_tokens` and EOS,
all requests submitted at once:

* `engine-plain`: `hf_dspark.SpeculativeEngine(target, None)`, every prompt `submit()`ted, then `run_until_done()`;
* `transformers-cb`: `target.generate_batch(inputs=[ids, ...], generation_config=GenerationConfig(do_sample=False,
  max_new_tokens=N, ...))` (transformers' `ContinuousMixin`, `transformers/generation/continuous_batching/`),
  options from `--cb-*`.

Interleaved: `--repeats` rounds, the order alternating; best wall time per method. Reported: tokens/s of each, the
ratio engine / transformers, whether the two outputs are identical request by request (and each against the
prompt's own plain greedy `generate` output, batch 1). `generate_batch` logs its failures instead of raising, so
the run captures its log records, each result's `error` and any missing result; an exception, an error or a missing
result is recorded verbatim and the engine side still runs.
"""

from __future__ import annotations

import argparse
import logging
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from serving_common import (OwnPlain, add_prompt_arguments, command_line, draw_sequences, environment, eos_ids,
                            error_text, git_state, load_models, md_table, prompt_ids, prompt_pools, provenance_lines,
                            until_eos, write_report)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--requests", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--repeats", type=int, default=2)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--cb-page-size", type=int, default=None, help="ContinuousBatchingConfig.page_size")
parser.add_argument("--cb-num-blocks", type=int, default=None,
                    help="ContinuousBatchingConfig.num_blocks (default: sized to the requests; see "
                         "--cb-memory-default)")
parser.add_argument("--cb-memory-default", action="store_true",
                    help="leave num_blocks to transformers: on a CPU it then sizes the KV cache to 60%% of the RAM "
                         "and allocates it on every generate_batch call (tens of seconds, and that memory)")
parser.add_argument("--cb-max-batch-tokens", type=int, default=None, help="ContinuousBatchingConfig.max_batch_tokens")
parser.add_argument("--cb-no-warmup", action="store_true", help="generate_batch(warmup=False)")
parser.add_argument("--no-identity", action="store_true", help="skip the own-plain reference (batch-1 runs)")
parser.add_argument("--output", default="benchmarks/engine-vs-transformers-cb/results.json")
add_prompt_arguments(parser)
args = parser.parse_args()
output = Path(args.output)

target, tokenizer, _ = load_models(None, args.threads)
eos = eos_ids(target)
prompts = draw_sequences(prompt_pools(args, tokenizer), 1, args.requests, args.seed)[0]
ids = [prompt_ids(tokenizer, p.text) for p in prompts]
results = {
    "command": command_line(), "git": git_state(), "environment": environment(torch.get_num_threads()),
    "settings": {**vars(args), "dtype": "float32", "greedy": True, "attn_implementation":
                 target.config._attn_implementation},
    "prompts": [{"source": p.source, "index": p.index, "category": p.category, "prompt_tokens": len(i)}
                for p, i in zip(prompts, ids)],
    "runs": {"engine-plain": [], "transformers-cb": []}, "transformers_cb_errors": [],
}


class Captured(logging.Handler):
    """Warnings and errors transformers' continuous batching logs (generate_batch catches its own exceptions)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-4000:]
        self.records.append(text)


def cb_options() -> dict:
    """The ContinuousBatchingConfig fields set here. Unless --cb-memory-default, num_blocks is sized to the
    requests (each needs ceil((prompt + new tokens) / page_size) pages, one spare each), as the engine's cache
    grows to what its requests use."""
    page_size = args.cb_page_size or 256
    num_blocks = args.cb_num_blocks
    if num_blocks is None and not args.cb_memory_default:
        num_blocks = sum(-(-(len(i) + args.max_new_tokens) // page_size) + 1 for i in ids)
    return {k: v for k, v in {"page_size": args.cb_page_size, "num_blocks": num_blocks,
                              "max_batch_tokens": args.cb_max_batch_tokens}.items() if v is not None}


def run_engine(max_new_tokens: int):
    from hf_dspark import SpeculativeEngine

    started = time.perf_counter()
    engine = SpeculativeEngine(target, None)
    request_ids = [engine.submit(torch.tensor(i), max_new_tokens) for i in ids]
    outputs = engine.run_until_done()
    seconds = time.perf_counter() - started
    return [until_eos(outputs[r][len(i):].tolist(), eos) for r, i in zip(request_ids, ids)], seconds, []


def run_transformers(max_new_tokens: int):
    """(outputs or None per request, seconds, problems): generate_batch's results and everything it reported."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos),
                              pad_token_id=tokenizer.pad_token_id)
    cb = cb_options()
    handler = Captured()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    problems = []
    started = time.perf_counter()
    try:
        results_by_id = target.generate_batch(inputs=[list(i) for i in ids], generation_config=config,
                                              continuous_batching_config=ContinuousBatchingConfig(**cb),
                                              progress_bar=False, warmup=not args.cb_no_warmup)
    except Exception as error:  # noqa: BLE001 - recorded verbatim
        problems.append(error_text(error) + "\n" + traceback.format_exc()[-4000:])
        results_by_id = {}
    finally:
        seconds = time.perf_counter() - started
        logger.removeHandler(handler)
    problems += handler.records
    # A fresh manager names the requests req_0, req_1, ... in input order; matched by prompt where that fails.
    by_prompt = {tuple(r.prompt_ids): r for r in results_by_id.values()}
    outputs = []
    for index in range(len(ids)):
        result = results_by_id.get(f"req_{index}")
        if result is None or list(result.prompt_ids) != list(ids[index]):
            result = by_prompt.get(tuple(ids[index]))
        if result is None:
            problems.append(f"no result for request {index}")
            outputs.append(None)
        elif result.error is not None:
            problems.append(f"request {index} ({result.request_id}): {result.error}")
            outputs.append(None)
        else:
            outputs.append(until_eos(list(result.generated_tokens), eos))
    return outputs, seconds, problems


METHODS = {"engine-plain": run_engine, "transformers-cb": run_transformers}
results["settings"]["continuous_batching_config"] = cb_options()
references = None
if not args.no_identity:
    own_plain = OwnPlain(target, args.max_new_tokens)
    references = [own_plain(i) for i in tqdm(ids, desc="own plain (batch 1)")]

kept = {}
for repeat in tqdm(range(-1, args.repeats), desc="repeats (the first untimed)"):
    order = list(METHODS) if repeat % 2 == 0 else list(METHODS)[::-1]
    for method in order:
        outputs, seconds, problems = METHODS[method](args.max_new_tokens if repeat >= 0 else 4)
        entry = {"repeat": repeat, "seconds": round(seconds, 4), "problems": problems,
                 "tokens": sum(len(o) for o in outputs if o is not None),
                 "completed": sum(o is not None for o in outputs)}
        results["runs"][method].append(entry)
        if problems and method == "transformers-cb":
            results["transformers_cb_errors"] += [f"repeat {repeat}: {p}" for p in problems]
        if repeat >= 0 and (method not in kept or seconds < kept[method][1]):
            kept[method] = (outputs, seconds)


def summary() -> dict:
    rows = {}
    for method, (outputs, seconds) in kept.items():
        done = [o for o in outputs if o is not None]
        rows[method] = {"seconds": round(seconds, 4), "tokens": sum(map(len, done)), "completed": len(done),
                        "tokens_per_s": round(sum(map(len, done)) / seconds, 2) if done else None,
                        "identical_to_own_plain": None if references is None else
                        f"{sum(o == r for o, r in zip(outputs, references))}/{len(ids)}"}
    if "engine-plain" in rows and "transformers-cb" in rows:
        engine, cb = kept["engine-plain"][0], kept["transformers-cb"][0]
        same = sum(a == b for a, b in zip(engine, cb) if b is not None)
        rows["comparison"] = {
            "identical_engine_vs_transformers": f"{same}/{len(ids)}",
            "tokens_per_s_ratio_engine_over_transformers":
                round(rows["engine-plain"]["tokens_per_s"] / rows["transformers-cb"]["tokens_per_s"], 3)
                if rows["transformers-cb"]["tokens_per_s"] and rows["transformers-cb"]["completed"] == len(ids)
                else None,
            "first_difference": next(({"request": i, "engine": a[:48], "transformers": b[:48]}
                                      for i, (a, b) in enumerate(zip(engine, cb)) if b is not None and a != b), None)}
    return rows


results["summary"] = summary()
s = results["settings"]
lines = ["# hf_dspark engine (plain) vs transformers' continuous batching (`generate_batch`)", ""]
lines += provenance_lines(results)
lines += [f"Target: embedded SmolLM2-135M-Instruct, float32 ({s['attn_implementation']}), greedy, "
          f"{s['max_new_tokens']} new tokens; {s['requests']} requests ({s['prompt_set']}"
          + (f": {s['categories']}" if s["prompt_set"] == "mix" else "") + f", seed {s['seed']}), all submitted at "
          f"once; one untimed warm-up round, then {s['repeats']} timed rounds, order alternating; best wall time. "
          f"`generate_batch` options: ContinuousBatchingConfig({s['continuous_batching_config']}), warmup="
          f"{not s['cb_no_warmup']}; each call builds its manager and cache (inside the timing), as the engine "
          "builds its own.", ""]
table = []
for method in METHODS:
    row = results["summary"].get(method, {})
    table.append([method, row.get("tokens_per_s", "-"), row.get("seconds", "-"), f"{row.get('completed', 0)}/"
                  f"{len(ids)}", row.get("identical_to_own_plain") or "-"])
lines += md_table(["method", "tok/s", "best seconds", "completed", "= own plain"], table)
comparison = results["summary"].get("comparison", {})
lines += ["", f"engine / transformers tokens/s: {comparison.get('tokens_per_s_ratio_engine_over_transformers')}; "
              f"identical outputs: {comparison.get('identical_engine_vs_transformers')}"
              + (f"; first difference: {comparison['first_difference']}" if comparison.get("first_difference") else "")]
if results["transformers_cb_errors"]:
    lines += ["", "## What `generate_batch` reported (its warnings and errors, results with an error, missing "
                  "results)", "", "```"]
    lines += [e for e in dict.fromkeys(results["transformers_cb_errors"])][:20] + ["```"]
md = write_report(output, results, lines)
print("\n".join(lines), f"\n-> {output}, {md}", flush=True)
