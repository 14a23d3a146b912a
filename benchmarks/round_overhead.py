"""What a speculative round costs beside a plain decoding step, and how often it waits for the device.

With a tiny random target the forwards cost little, so the ratio shows the loop's own overhead (Python around the
drafter's block, the verification, the bookkeeping). Measured side by side in one run: plain steps and rounds are
timed in alternation and the medians compared. Host syncs (`hf_dspark.evaluation.host_syncs`) are counted per
round at batch 1 for every drafter kind, and per engine step for batches of R rows.

    OMP_NUM_THREADS=1 python benchmarks/round_overhead.py --output benchmarks/round-overhead/results.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from factories import prompts, tiny_drafter, tiny_target  # noqa: E402  (the test suite's tiny models)

import hf_dspark  # noqa: E402
from hf_dspark.evaluation.host_syncs import HostSyncCounter  # noqa: E402
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine  # noqa: E402
from hf_dspark.policy import DSparkScheduler, VerificationCostTable  # noqa: E402


KINDS = (("markov", 1), ("markov", 2), ("dflash", 1), ("eagle3", 1))


def drafter_for(target, kind: str, layers: int = 1, block_size: int = 7):
    """A random drafter of `kind` (markov = DSpark with its Markov head and confidence head) with `layers` layers."""
    torch.manual_seed(1)
    if kind == "eagle3":
        return tiny_drafter(target, "eagle3", block_size=block_size)
    if kind == "dflash":
        config = hf_dspark.build_dflash_config(target.config, num_hidden_layers=layers, block_size=block_size)
    else:
        config = hf_dspark.DSparkDraftConfig.from_target_config(
            target.config, num_hidden_layers=layers, block_size=block_size, markov_head=kind, markov_rank=16,
            confidence_head=True)
    return hf_dspark.DSparkDraftModel(config).eval()


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def round_cost(target, drafter, ids, new_tokens: int, repeats: int) -> dict:
    """Median seconds of a plain step and of a speculative round, timed in alternation. Each is the difference of a
    long and a one-token generation (the prefill cancels), divided by its steps / rounds."""
    plain, spec = [], []
    for _ in range(repeats):
        long = _seconds(lambda: target.generate(ids, do_sample=False, max_new_tokens=new_tokens))
        short = _seconds(lambda: target.generate(ids, do_sample=False, max_new_tokens=1))
        plain.append((long - short) / (new_tokens - 1))
        long = _seconds(lambda: target.generate(ids, assistant_model=drafter, do_sample=False,
                                                max_new_tokens=new_tokens))
        rounds = drafter.last_generation_stats.num_rounds
        short = _seconds(lambda: target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=1))
        spec.append((long - short) / rounds)
    step, per_round = statistics.median(plain), statistics.median(spec)
    return {"plain_step_ms": 1e3 * step, "round_ms": 1e3 * per_round, "ratio": per_round / step}


def syncs_per_round(target, drafter, ids, new_tokens: int) -> float:
    """Host reads per round of `generate` at batch 1 (prefill excluded: a one-token call is subtracted)."""
    counts = []
    for tokens in (1, new_tokens):
        with HostSyncCounter() as syncs:
            target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=tokens)
        counts.append((syncs.total, drafter.last_generation_stats.num_rounds))
    return (counts[1][0] - counts[0][0]) / (counts[1][1] - counts[0][1])


def engine_syncs(target, drafter, rows: int, policy: str, policy_arg, new_tokens: int) -> tuple[int, float]:
    """(most, mean) host reads per engine step after admission, R rows decoding together."""
    engine = SpeculativeEngine(target, drafter, policy, policy_arg)
    for prompt in prompts(rows, length=8):
        engine.submit(prompt[0], new_tokens)
    engine.step()  # admission and the first round
    counts = []
    while engine.num_running:
        with HostSyncCounter() as syncs:
            engine.step()
        counts.append(syncs.total)
    return max(counts), sum(counts) / len(counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", help="also write the markdown report here")
    parser.add_argument("--no-engine", action="store_true", help="batch-1 rows only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = tiny_target("llama")
    ids = prompts(1, length=16)[0]
    lines = ["# Round overhead and host syncs (tiny random target)", "",
             f"Command: `OMP_NUM_THREADS=1 python benchmarks/round_overhead.py --new-tokens {args.new_tokens} "
             f"--repeats {args.repeats}`", "",
             f"Target: the test suite's tiny Llama (4 layers, hidden 64), float32, 1 thread; {args.new_tokens} greedy "
             "tokens; random drafters (nothing is accepted: every round drafts and verifies a full block).", "",
             "| drafter | gamma | plain step (ms) | round (ms) | round / plain step | host syncs per round |",
             "|---|---|---|---|---|---|"]
    for kind, layers in KINDS:
        drafter = drafter_for(target, kind, layers)
        cost = round_cost(target, drafter, ids, args.new_tokens, args.repeats)
        syncs = syncs_per_round(target, drafter, ids, args.new_tokens)
        label = {"markov": "DSpark (Markov head)", "dflash": "DFlash", "eagle3": "Eagle3"}[kind]
        label += f", {layers} layer{'s' * (layers > 1)}" if kind != "eagle3" else ""
        lines.append(f"| {label} | 7 | {cost['plain_step_ms']:.2f} | {cost['round_ms']:.2f} | {cost['ratio']:.2f}x "
                     f"| {syncs:.2f} |")
        print(lines[-1], flush=True)
    if args.no_engine:
        return 0
    lines += ["", "Batched engine, host syncs per step (after admission; a step = one round for every row):", "",
              "| rows R | policy | most | mean |", "|---|---|---|---|"]
    drafter = drafter_for(target, "markov")
    costs = VerificationCostTable([1.0 + 0.05 * i for i in range(16)])
    policies = [("all", None, "all"), ("threshold", 0.3, "threshold 0.3"),
                ("scheduler", DSparkScheduler(costs), "scheduler")]
    for rows in (1, 4, 16, 64):
        for policy, arg, label in policies:
            most, mean = engine_syncs(target, drafter, rows, policy, arg, 24)
            lines.append(f"| {rows} | {label} | {most} | {mean:.2f} |")
            print(lines[-1], flush=True)
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
