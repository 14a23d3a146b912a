"""`hf-dspark bench`: plain vs prompt lookup vs drafters, side by side in one run, written to a results file."""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch


def cmd_bench(args) -> int:
    from hf_dspark.cli.generate import load_drafters
    from hf_dspark.evaluation.speed import held_out_prompts, markdown_table, run_speed_benchmark
    from hf_dspark.models.errors import UserInputError
    from hf_dspark.models.loading import shipped_drafter_path
    from hf_dspark.targets.loading import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.output:
        from hf_dspark.training.output_folder import check_writable_file

        for path in (Path(args.output), Path(args.output).with_suffix(".json")):  # written after the whole benchmark
            check_writable_file(path, "--output")
    if args.drafters:
        unlabelled = [item for item in args.drafters if "=" not in item]
        if unlabelled:
            raise UserInputError(f"--drafters {unlabelled[0]}: give each drafter as LABEL=PATH (e.g. "
                                 f"mine={unlabelled[0]}).")
        named = dict(item.split("=", 1) for item in args.drafters)
    else:
        named = {kind: str(shipped_drafter_path(kind)) for kind in ("dspark", "dflash", "eagle3")}
    try:
        prompts = held_out_prompts(args.benchmarks, args.prompts_per_benchmark)
    except (ValueError, FileNotFoundError) as error:  # a misspelt set, before any model loads
        raise UserInputError(f"--benchmarks: {error}.") from None
    command = "hf-dspark bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    report = [f"# hf-dspark bench ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
              f"Command: `{command}`", "",
              f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
              f"torch {torch.__version__}. Prompts: {len(prompts)} held-out first turns "
              f"({', '.join(args.benchmarks)}; {args.prompts_per_benchmark} each), batch 1, "
              f"{args.max_new_tokens} new tokens. Methods run interleaved prompt by prompt.", ""]
    raw, forward_costs = {}, {}
    for dtype in args.dtypes:
        target, tokenizer = load_target(args.target, dtype, device=args.device)
        line, forward_costs[dtype] = measure_forward_costs(target, dtype)
        report.append(line)
        print(line, flush=True)
        drafters = load_drafters(named, target, args.schedule, args.target or "smollm2-135m-instruct")
        states = {}  # what each drafter learns carries over from one temperature to the next, as on one server
        for temperature in args.temperatures:
            title = f"{dtype}, {'greedy' if temperature == 0 else f'T={temperature:g}'}"
            print(f"== {title}", file=sys.stderr, flush=True)
            summaries = run_speed_benchmark(target, tokenizer, drafters, prompts, max_new_tokens=args.max_new_tokens,
                                            temperature=temperature, seed=args.seed,
                                            log=lambda line: print(line, file=sys.stderr, flush=True),
                                            states=states)
            raw[title] = summaries
            report.append(markdown_table(summaries, title))
            print(report[-1], flush=True)
    report += ["", "Raw summaries:", "", "```json", json.dumps(raw, indent=1), "```", ""]
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text("\n".join(report))
        raw_json = {"command": command, "results": raw, "target_forward_cost": forward_costs}
        Path(args.output).with_suffix(".json").write_text(json.dumps(raw_json, indent=1))
        print(f"written to {args.output} (and .json)", file=sys.stderr)
    return 0


COST_TOKENS = 8
"""Forward sizes the bench times: 1..8 tokens, a gamma-7 block plus its anchor."""


def measure_forward_costs(target, dtype: str) -> tuple[str, dict]:
    """(report line, data): what a target forward over k tokens costs relative to a one-token decode step on this
    machine. Speculative decoding verifying k tokens per round gains only when tau exceeds that ratio plus the
    drafting time."""
    from hf_dspark.evaluation.profiling import profile_verification_costs

    table = profile_verification_costs(target, max_tokens=COST_TOKENS, context_length=256, repeats=5)
    ratios = [seconds / table.seconds[0] for seconds in table.seconds]
    data = {"ms_by_tokens": [round(1000 * s, 2) for s in table.seconds],
            "ratio_to_one_token": [round(r, 3) for r in ratios]}
    listed = ", ".join(f"{k} tokens {ratios[k - 1]:.2f}x" for k in (2, 4, COST_TOKENS))
    line = (f"{dtype} target forward after a 256-token context: 1 token {1000 * table.seconds[0]:.1f} ms; {listed}. "
            f"Verifying {COST_TOKENS} tokens per round breaks even at tau = {ratios[-1]:.2f} before drafting costs.\n")
    return line, data


def add_parser(sub, dtypes) -> None:
    from hf_dspark.cli.generate import add_device_argument

    bench = sub.add_parser("bench", help="speed benchmark: plain, prompt lookup and drafters side by side")
    bench.add_argument("--drafters", nargs="*", default=None,
                       help="LABEL=PATH drafters (default: the shipped dspark, dflash and eagle3 drafters)")
    bench.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    bench.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=dtypes)
    add_device_argument(bench)
    bench.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    bench.add_argument("--benchmarks", nargs="+", default=["gsm8k", "math500", "humaneval", "mbpp", "mt-bench",
                                                            "alpaca"])
    bench.add_argument("--prompts-per-benchmark", type=int, default=1)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--schedule", action="store_true",
                       help="also run each confidence-headed drafter with the throughput-scheduled draft length")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--output", default=None, help="write the markdown report here (e.g. benchmarks/...md)")
    bench.set_defaults(func=cmd_bench)
