"""Write the model cards of the shipped SmolLM2 drafters from their recorded training stages and a bench JSON.

    python scripts/write_cards.py --bench benchmarks/bench/fp32.json

Each shipped folder's `training_stages.json` (written by `scripts/ship_drafter.py`) lists the stages the drafter
went through, in order: the first trained it from scratch, each later one continued the previous stage's drafter
(`--init-from`) under a new time budget. Every stage gave the three drafters the same budget, so the card says so.
"""

import argparse
import json
from pathlib import Path

from transformers import AutoConfig

import hf_dspark  # noqa: F401
from hf_dspark.hub.model_card import KIND_NAMES, render_model_card
from hf_dspark.models.loading import shipped_drafter_path

parser = argparse.ArgumentParser()
parser.add_argument("--bench", required=True, help="a bench JSON with the shipped drafters' rows")
args = parser.parse_args()
bench = json.loads(Path(args.bench).read_text())


def forward_costs(bench: dict) -> str:
    measured = {dtype: costs["ratio_to_one_token"][-1] for dtype, costs in bench.get("target_forward_cost", {}).items()}
    if not measured:
        return "a target forward over 8 tokens costs well over one decode step on this CPU."
    return ("on this CPU a target forward over 8 tokens costs " + " and ".join(
        f"{ratio:.1f}x one decode step in {dtype}" for dtype, ratio in measured.items()) + " (same run).")


def measured_section(kind: str) -> str:
    rows = ["| setting | method | tokens/s | speed-up vs plain | tau | per-slot acceptance | identical to plain greedy |",
            "|---|---|---|---|---|---|---|"]
    labels = {kind: "drafter alone", f"{kind}+suffix": "with suffix drafting",
              f"{kind}+schedule": "`generate` defaults (suffix drafting, round planning)"}
    for setting, methods in bench["results"].items():
        for label, description in labels.items():
            m = methods.get(label)
            if m is None:
                continue
            slots = ", ".join("-" if x is None else f"{x:.2f}" for x in m.get("acceptance_by_slot", []))
            rows.append(f"| {setting} | {description} | {m['tokens_per_s']} | {m['speedup']}x | {m.get('tau')} | "
                        f"{slots} | {m.get('identical_to_plain', '-')} |")
    return (f"`{bench['command']}` (held-out eval prompts, batch 1, 2 CPU cores; the full report is "
            f"`{Path(args.bench).with_suffix('.md').as_posix()}`):\n\n" + "\n".join(rows) + "\n\n"
            "Exactness is checked in float32, where every greedy output is identical to plain greedy. In bfloat16 "
            "the target is not reproducible across forward shapes on this CPU (a forward over n tokens rounds "
            "differently from n one-token forwards), so its own argmax sometimes flips between plain decoding and "
            "any multi-token verification and the outputs diverge from there. A round pays only when it accepts "
            "more than it costs: " + forward_costs(bench))


def training_section(kind: str, stages: list[dict]) -> tuple[list[str], str]:
    commands = []
    for stage in stages:
        if stage["cache_command"] not in commands:
            commands.append(stage["cache_command"])
        commands.append(stage["command"])
    commands.append(f"python scripts/ship_drafter.py <last stage's --output> "
                    f"hf_dspark/checkpoints/{kind}-smollm2-135m-instruct --stage {stages[-1]['stage']} ...")
    lines = []
    for index, stage in enumerate(stages):
        start = "from scratch" if index == 0 else f"continuing {stages[index - 1]['stage']}"
        lines.append(f"* ({stage['stage']}, {start}) {stage['budget_seconds']} s of training steps "
                     f"({stage['steps']} steps of 4 sequences x 64 anchors), {stage['layout']}. Data: {stage['data']}. "
                     f"Loss: {stage['loss']}. Learning rate {stage['learning_rate']}.")
    lines.append("* Every stage gave the three drafters (DSpark, DFlash, Eagle3) the same budget from the same data.")
    lines.append("* Training log: `training_log.jsonl` of the last stage (loss, per-slot acceptance proxy 1 - TV, "
                 f"top-1 agreement{', confidence MAE' if kind == 'dspark' else ''}); every stage is recorded in "
                 "`training_stages.json`.")
    return commands, "\n".join(lines)


for kind, name in KIND_NAMES.items():
    folder = shipped_drafter_path(kind)
    stages = json.loads((folder / "training_stages.json").read_text())
    commands, training = training_section(kind, stages)
    hours = sum(stage["budget_seconds"] for stage in stages) / 3600
    card = render_model_card(
        kind=kind, base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        title=f"{name} drafter for SmolLM2-135M-Instruct ({stages[-1]['stage']}: {hours:.1f} hours of training on "
              "2 CPU cores)",
        summary=(f"A {name} drafter for the embedded default target of hf_dspark, trained on 2 CPU cores under the "
                 "same data and budget as its DSpark/DFlash/Eagle3 siblings. It is far from converged (see "
                 "Measured)."),
        config=AutoConfig.from_pretrained(folder), commands=commands, training=training,
        measured=measured_section(kind), datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"])
    (folder / "README.md").write_text(card)
    print(f"wrote {folder / 'README.md'}")
