"""`hf-dspark eval`: drafters against plain decoding on prompt sets, with acceptance, calibration, speed and
task-quality numbers written to an output folder (resumable)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import torch


def parse_drafters(items: list[str]) -> dict[str, str]:
    """`LABEL=PATH` or `PATH` (labelled by its folder name) -> {label: path}; labels must be unique."""
    named = {}
    for item in items:
        label, path = item.split("=", 1) if "=" in item and not Path(item).exists() else (Path(item).name, item)
        if label in named:
            raise ValueError(f"two drafters are labelled {label!r}; use LABEL=PATH")
        named[label] = path
    return named


def parse_benchmarks(items: list[str]) -> list[str]:
    """`gsm8k,humaneval mt-bench` -> ["gsm8k", "humaneval", "mt-bench"]."""
    return [name for item in items for name in item.split(",") if name]


def cmd_eval(args) -> int:
    from hf_dspark.cli.generate import load_drafters
    from hf_dspark.evaluation import OutputMismatchError, SettingsMismatchError, evaluate
    from hf_dspark.evaluation.harness import DEFAULT_TARGET_NAME, location
    from hf_dspark.evaluation.prompts import load_prompt_sets
    from hf_dspark.models.loading import shipped_drafter_path
    from hf_dspark.targets.loading import load_target
    from hf_dspark.training.output_folder import check_writable

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is not None and not args.drafter:
        print("hf-dspark eval: a custom --target needs its --drafter", file=sys.stderr)
        return 2
    check_writable(args.output, "--output")  # before minutes of loading and decoding
    try:
        named = parse_drafters(args.drafter) if args.drafter else {"dspark": str(shipped_drafter_path("dspark"))}
        benchmarks = parse_benchmarks(args.benchmarks)
        load_prompt_sets(benchmarks, max_prompts=0)  # a misspelt set fails now, not after loading the models
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-dspark eval: {error}", file=sys.stderr)
        return 2
    target, tokenizer = load_target(args.target, args.dtype, device=args.device)
    drafters = load_drafters(named, target, args.schedule, args.target or "smollm2-135m-instruct")
    command = None
    if sys.argv[1:2] == ["eval"]:  # run from the shell (not through main([...]) in Python)
        command = "hf-dspark eval " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    try:
        evaluate(
            benchmarks, output_dir=args.output, target=target, tokenizer=tokenizer,
            drafters=drafters, max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, multi_turn=args.multi_turn, seed=args.seed,
            execute_code=args.execute_code, exec_timeout=args.exec_timeout, allow_mismatch=args.allow_mismatch,
            progress=not args.no_progress, command=command,
            target_name=location(args.target) if args.target else DEFAULT_TARGET_NAME)
    except (SettingsMismatchError, FileNotFoundError) as error:
        print(f"hf-dspark eval: {error}", file=sys.stderr)
        return 2
    except OutputMismatchError as error:
        print(f"hf-dspark eval: LOSSLESSNESS VIOLATED: {error}", file=sys.stderr)
        return 1
    print((Path(args.output) / "results.md").read_text())
    print(f"written to {args.output}/ (results.json, results.md, records.jsonl, plots)", file=sys.stderr)
    return 0


def add_parser(sub, dtypes) -> None:
    from hf_dspark.cli.generate import add_device_argument

    ev = sub.add_parser("eval", help="evaluate drafters against plain decoding on prompt sets: tau, per-slot "
                                     "acceptance, calibration, speed-up, losslessness and task agreement")
    ev.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    ev.add_argument("--drafter", action="append", default=None,
                    help="drafter PATH or LABEL=PATH; repeat to compare several side by side (default: the shipped "
                         "DSpark drafter)")
    ev.add_argument("--benchmarks", nargs="+", default=["gsm8k,humaneval,mt-bench"],
                    help="comma- or space-separated shipped sets, or prompt files (.jsonl with {\"turns\": [...]} "
                         "per line, .json list, or text with one prompt per line)")
    ev.add_argument("--max-prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against plain)")
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--dtype", default="float32", choices=dtypes)
    add_device_argument(ev)
    ev.add_argument("--output", required=True,
                    help="output folder; rerunning with the same settings resumes from its records.jsonl")
    ev.add_argument("--multi-turn", action="store_true",
                    help="answer every turn, feeding each method its own earlier answers (default: first turn)")
    ev.add_argument("--execute-code", action="store_true",
                    help="run completions against the tests carried by the prompt file (unsandboxed subprocess "
                         "with a timeout) and report pass@1")
    ev.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per test run")
    ev.add_argument("--allow-mismatch", action="store_true",
                    help="report greedy outputs that differ from plain instead of stopping (e.g. bfloat16 noise)")
    ev.add_argument("--schedule", action="store_true",
                    help="also run each confidence-headed drafter with the throughput-scheduled draft length")
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(func=cmd_eval)
