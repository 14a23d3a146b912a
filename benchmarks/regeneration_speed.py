"""Regeneration throughput: `hf_dspark.training.regenerate` on the batched engine (plain continuous batching, later
turns continued on their parked caches) against the loop it replaced (its own continuous batching, loaded from git
at `BASELINE_COMMIT` into a temporary module, never part of the package), same conversations, same settings,
measured side by side in one run: the two alternate (old, new, then new, old, ...) so that the machine's load falls
on both alike.

    OMP_NUM_THREADS=1 python benchmarks/regeneration_speed.py --conversations 32 --batch-size 16 \
        --max-new-tokens 64 --max-turns 2 --greedy-fractions 1.0 0.75 --repeats 2 --threads 1 \
        --output benchmarks/regeneration-speed/results.md

Answer tokens are counted up to and including EOS (what the training data holds). The prompt mix is ShareGPT's
decontaminated conversations with their later user turns. Two comparisons: all greedy (both paths do the same work,
so the ratio is the implementations' alone), and `RegenerationConfig`'s default mix (a quarter sampled: the two
paths draw from other random streams, so their sampled answers, and the batch's tail, differ). Greedy conversations
of the two paths are compared token for token (every turn).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import types
from dataclasses import asdict
from pathlib import Path

import torch

from hf_dspark.targets.default_target import load_default_target
from hf_dspark.training.data import Decontaminator, load_conversations, sharegpt_path
from hf_dspark.training.regenerate import RegenerationConfig, chat_prompt_ids, regenerate

# The last commit whose regeneration loop ran without the engine (a DynamicLayer subclass and a sampler of its own).
BASELINE_COMMIT = "a15d6dc"
REPO = Path(__file__).resolve().parents[1]


def load_baseline(commit: str):
    """`regenerate` as it was at `commit`, loaded from git into a module of its own."""
    source = subprocess.run(["git", "show", f"{commit}:hf_dspark/training/regenerate.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    # Its one import of a module that has since been split; everything else it imports still exists.
    source = source.replace("from ..models.common import UserInputError", "from hf_dspark.models import UserInputError")
    name = "hf_dspark.training._regenerate_baseline"
    module = types.ModuleType(name)
    module.__package__ = "hf_dspark.training"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:hf_dspark/training/regenerate.py", "exec"), module.__dict__)
    return module.regenerate


def run(function, target, tokenizer, conversations, config) -> tuple[dict, dict[int, dict]]:
    with tempfile.TemporaryDirectory() as folder:
        stats = function(target, tokenizer, conversations, folder, config, progress=False)
        records = {}
        for shard in sorted(Path(folder).glob("shard-*.jsonl")):
            for line in shard.open():
                record = json.loads(line)
                records[record["id"]] = record
    return stats, records


def compare(paths, target, tokenizer, conversations, config, repeats: int) -> dict:
    """Run both paths `repeats` times each, alternating; returns their summed figures and the last records."""
    totals = {name: {"answer_tokens": 0, "seconds": 0.0} for name in paths}
    records = {}
    for repeat in range(repeats):
        for name in (("old", "new") if repeat % 2 == 0 else ("new", "old")):
            stats, records[name] = run(paths[name], target, tokenizer, conversations, config)
            totals[name]["answer_tokens"] += stats["answer_tokens"]
            totals[name]["seconds"] += stats["seconds"]
            print(f"greedy_fraction {config.greedy_fraction} {name}: {stats['answer_tokens']} answer tokens in "
                  f"{stats['seconds']:.1f} s", flush=True)
    old, new = records["old"], records["new"]
    greedy = [i for i, record in old.items() if not record["sampled"]]
    sampled = [i for i, record in old.items() if record["sampled"]]
    return {
        "totals": totals,
        "speed": {name: total["answer_tokens"] / total["seconds"] for name, total in totals.items()},
        "greedy": len(greedy),
        "same": sum(i in new and new[i]["input_ids"] == old[i]["input_ids"]
                    and new[i]["answer_spans"] == old[i]["answer_spans"] for i in greedy),
        "sampled": len(sampled),
        "later_turns": sum(len(record["answer_spans"]) - 1 for record in old.values()),
    }


def report(args, count: int, config: RegenerationConfig, results: dict) -> str:
    """The results file: the command, the setting, one table row per path and greedy fraction, the ratios."""
    setting = {k: v for k, v in asdict(config).items() if k in ("temperature", "top_p", "top_k", "refill_every",
                                                                "max_conversation_tokens")}
    fractions = " ".join(str(f) for f in args.greedy_fractions)
    lines = [
        "# Regeneration throughput (SmolLM2-135M-Instruct, float32): old loop vs the batched engine",
        "",
        f"Command: `OMP_NUM_THREADS={args.threads} python benchmarks/regeneration_speed.py --conversations "
        f"{args.conversations} --batch-size {args.batch_size} --max-new-tokens {args.max_new_tokens} --max-turns "
        f"{args.max_turns} --greedy-fractions {fractions} --repeats {args.repeats} --threads {args.threads} "
        "--output benchmarks/regeneration-speed/results.md`",
        "",
        f"{count} decontaminated ShareGPT conversations (from offset {args.skip}), first prompts <= "
        f"{args.max_prompt_tokens} tokens, up to {args.max_turns} user turns answered, answers <= "
        f"{args.max_new_tokens} tokens, batch {args.batch_size}, {args.threads} thread(s), other settings the "
        f"defaults ({setting}). Old = `regenerate` at commit {args.baseline} (its own DynamicLayer subclass, loop "
        f"and sampler); new = `regenerate` on `SpeculativeEngine(target)` (no drafter). Each path ran "
        f"{args.repeats} times per greedy fraction, alternating with the other; the figures are the sums.",
        "",
        "| greedy fraction | path | answer tokens | seconds | answer tokens/s |",
        "|---|---|---|---|---|",
    ]
    for fraction, result in results.items():
        for name, label in (("old", f"old loop ({args.baseline})"), ("new", "batched engine")):
            total = result["totals"][name]
            lines.append(f"| {fraction} | {label} | {total['answer_tokens']} | {total['seconds']:.1f} | "
                         f"{result['speed'][name]:.1f} |")
    lines.append("")
    for fraction, result in results.items():
        lines.append(
            f"Greedy fraction {fraction}: ratio new/old {result['speed']['new'] / result['speed']['old']:.2f}x; "
            f"{result['later_turns']} later turns answered; greedy conversations identical token for token (every "
            f"turn) {result['same']} of {result['greedy']}; {result['sampled']} sampled (other random streams, so "
            "other answers of other lengths).")
    lines += ["", "The old loop against stock batched `generate` (1.56x on 128 first turns) is in this file's git "
                  "history."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--skip", type=int, default=3000, help="take conversations from this offset of ShareGPT")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--greedy-fractions", type=float, nargs="+", default=[1.0, 0.75],
                        help="one comparison per value (1: the same greedy work on both sides; 0.75: the default mix)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path per comparison, alternating")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", default=BASELINE_COMMIT, help="git commit of the old regeneration loop")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_default_target(torch.float32)
    found = Decontaminator.from_benchmarks().filter_conversations(
        load_conversations([sharegpt_path()], args.skip + 8 * args.conversations))[args.skip:]
    conversations = [c for c in found if len(chat_prompt_ids(tokenizer, c[0])) <= args.max_prompt_tokens]
    conversations = conversations[: args.conversations]
    if len(conversations) < args.conversations:
        raise SystemExit(f"only {len(conversations)} conversations after offset {args.skip}; lower --skip")
    paths = {"old": load_baseline(args.baseline), "new": regenerate}
    results = {}
    for fraction in args.greedy_fractions:
        config = RegenerationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                    max_prompt_tokens=args.max_prompt_tokens, max_turns=args.max_turns,
                                    greedy_fraction=fraction)
        results[fraction] = compare(paths, target, tokenizer, conversations, config, args.repeats)

    text = report(args, len(conversations), config, results)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
