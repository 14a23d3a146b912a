"""Write the model cards of the shipped SmolLM2 drafters from their training summaries and a bench JSON.

    python scripts/write_cards.py --bench benchmarks/results-bench-v4.json --stages /work/runs/v3 /work/runs/v4

v1: one hour per drafter (three concurrent one-thread runs) from the shared target cache. Each later stage
continues the previous stage's drafter (`--init-from`) under a new time budget; list the stages the shipped
drafters went through, in order (the last one is what ships).
"""

import argparse
import json
from pathlib import Path

from transformers import AutoConfig

import hf_dspark  # noqa: F401
from hf_dspark.hub.model_card import KIND_NAMES, render_model_card
from hf_dspark.models.loading import shipped_drafter_path
CACHE_COMMAND = ("hf-dspark cache --output /work/cache/smollm2-v1 --data data/regenerated/smollm2-sharegpt "
                 "--dataset-answers 1200 --max-length 512")
COMMON = ("--cache /work/cache/smollm2-v1 --draft-vocab-size 8192 --block-size 7 --batch-size 4 --num-anchors 64 "
          "--learning-rate 1e-3 --warmup-ratio 0.0002 --max-steps 100000 --save-steps 25 --max-seconds 3600 "
          "--threads 1 --ce-weight 0 --kl-weight 1.0")
SPECIFIC = {
    "dspark": "--kind dspark --num-layers 2 --target-layers 1 8 14 20 27 --init-from-target-layers 28 29 "
              "--markov-rank 256",
    "dflash": "--kind dflash --num-layers 2 --target-layers 1 8 14 20 27 --init-from-target-layers 28 29",
    "eagle3": "--kind eagle3 --num-layers 1 --init-from-target-layers 29",
}
LOSS = {
    "dspark": "0.9 TV + 1.0 soft cross-entropy to the target distribution + 1.0 confidence BCE, slot weights exp(-k/4)",
    "dflash": "1.0 soft cross-entropy to the target distribution (the distillation form of DFlash's CE), slot "
              "weights exp(-k/4)",
    "eagle3": "soft cross-entropy to the target distribution over 7 unrolled training-time-test steps, step "
              "weights 0.8^s",
}

# How each continuation stage shared the 2 cores; every stage gave the three drafters the same budget.
STAGE_LAYOUT = {
    "v3": ("each drafter on a core of its own (one thread; DSpark then DFlash on core 1, Eagle3 on core 0 alongside "
           "DFlash, while the other core ran tests, benchmarks or the other drafter)"),
    "v4": "the three drafters at the same time, one thread each, sharing the 2 cores",
}

parser = argparse.ArgumentParser()
parser.add_argument("--bench", required=True)
parser.add_argument("--runs", default="/work/runs/v1")
parser.add_argument("--stages", nargs="*", default=[], help="continuation run folders, in order (e.g. /work/runs/v3)")
args = parser.parse_args()


def given_seconds(summary: dict) -> int:
    """The `--max-seconds` a run was given: the budget it spent (which overshoots by one step) to the quarter hour."""
    return round(summary["budget_seconds"] / 900) * 900


def continue_command(seconds: float) -> str:
    return ("--cache /work/cache/smollm2-v1 --batch-size 4 --num-anchors 64 --learning-rate 1e-3 "
            f"--warmup-ratio 0.0002 --max-steps 100000 --save-steps 25 --max-seconds {seconds:.0f} --threads 1 "
            "--ce-weight 0 --kl-weight 1.0")


bench = json.loads(Path(args.bench).read_text())


def forward_costs(bench: dict) -> str:
    measured = {dtype: costs["ratio_to_one_token"][-1] for dtype, costs in bench.get("target_forward_cost", {}).items()}
    if not measured:
        return "on this CPU a target forward over 8 tokens costs well over one decode step,"
    return ("on this CPU a target forward over 8 tokens costs " + " and ".join(
        f"{ratio:.1f}x one decode step in {dtype}" for dtype, ratio in measured.items()) + " (same run),")

for kind, name in KIND_NAMES.items():
    folder = shipped_drafter_path(kind)
    first = json.loads((Path(args.runs) / kind / "training_summary.json").read_text())
    summary = json.loads((folder / "training_summary.json").read_text())
    rows = ["| setting | tokens/s | speed-up vs plain | tau | per-slot acceptance | identical to plain greedy |",
            "|---|---|---|---|---|---|"]
    for setting, methods in bench["results"].items():
        for label in (kind, f"{kind}+schedule"):
            if label in methods:
                m = methods[label]
                slots = ", ".join("-" if x is None else f"{x:.2f}" for x in m.get("acceptance_by_slot", []))
                rows.append(f"| {setting}{' (scheduled)' if label.endswith('schedule') else ''} | "
                            f"{m['tokens_per_s']} | {m['speedup']}x | {m.get('tau')} | {slots} | "
                            f"{m.get('identical_to_plain', '-')} |")
    measured = (f"`{bench['command']}` (held-out eval prompts, batch 1, 2 CPU cores; the full report is "
                f"`benchmarks/{Path(args.bench).with_suffix('.md').name}`):\n\n" + "\n".join(rows) + "\n\n"
                "Exactness is checked in float32, where every greedy output is identical to plain greedy. In bfloat16 "
                "the target is not reproducible across forward shapes on this CPU (a forward over n tokens rounds "
                "differently from n one-token forwards), so its own argmax sometimes flips between plain decoding and "
                "any multi-token verification and the outputs diverge from there; HF prompt lookup shows the same "
                "in that run. Speculative rounds cost more than they gain at this tau: " + forward_costs(bench)
                + " so the scheduled variant mostly declines to draft.")
    stages = [(Path(stage).name, json.loads((Path(stage) / kind / "training_summary.json").read_text()))
              for stage in args.stages]
    budgets = [given_seconds(stage) for _, stage in stages]
    continued = "".join(
        f"; then ({stage_name}) {budget} s more ({stage['steps']} steps, learning rate again 1e-3 annealed over the "
        f"new budget), {STAGE_LAYOUT.get(stage_name, 'one thread each, float32')}"
        for (stage_name, stage), budget in zip(stages, budgets))
    training = (
        f"* Data: {summary['examples']} sequences truncated to 512 tokens, {summary['answer_tokens']:,} answer tokens: "
        "448 answers regenerated by SmolLM2 itself (`data/regenerated/smollm2-sharegpt`, T 0.7, top-p 0.8) plus the "
        "first 1,200 decontaminated ShareGPT conversations' own answers (off-policy contexts, labelled by the "
        "target's distribution), all from the shared bf16 target cache above (run once for all three drafters).\n"
        f"* Loss: {LOSS[kind]}.\n"
        f"* Budget: (v1) {first['budget_seconds']:.0f} s of training steps ({first['steps']} steps of 4 sequences x 64 "
        "anchors), the same for the three drafters, which trained at the same time on 2 AMD EPYC cores "
        f"(one thread each, float32){continued}. Every stage gave the three drafters the same budget.\n"
        "* Training log: `training_log.jsonl` of the last stage (loss, per-slot acceptance proxy 1 - TV, top-1 "
        f"agreement{', confidence MAE' if kind == 'dspark' else ''}).")
    config = AutoConfig.from_pretrained(folder)
    commands = [CACHE_COMMAND, f"hf-dspark train --output {args.runs}/{kind} {SPECIFIC[kind]} {COMMON}"]
    shipped_from = f"{args.runs}/{kind}"
    for budget, folder_name in zip(budgets, args.stages):
        commands.append(f"hf-dspark train --kind {kind} --init-from {shipped_from} --output {folder_name}/{kind} "
                        f"{continue_command(budget)}")
        shipped_from = f"{folder_name}/{kind}"
    hours = (given_seconds(first) + sum(budgets)) / 3600
    version = f"{stages[-1][0] if stages else 'v1'}: {hours:.1f} hours of training on shared CPU cores"
    commands.append(f"python scripts/ship_drafter.py {shipped_from} hf_dspark/checkpoints/{kind}-smollm2-135m-instruct")
    card = render_model_card(
        kind=kind, base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        title=f"{name} drafter for SmolLM2-135M-Instruct ({version})",
        summary=(f"A {name} drafter for the embedded default target of hf_dspark, trained on 2 CPU cores under the "
                 "same data and budget as its DSpark/DFlash/Eagle3 siblings. It is far from converged (see "
                 "Measured)."),
        config=config, commands=commands,
        training=training, measured=measured, datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"])
    (folder / "README.md").write_text(card)
    print(f"wrote {folder / 'README.md'}")
