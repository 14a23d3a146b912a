"""Evaluation outputs: `results.json` (every number), `results.md` (tables) and PNG plots.

The plots need matplotlib (the `eval` extra); without it the JSON and Markdown are still written and the report
says the plots were skipped.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .speed import PLAIN

PLOTS = {"acceptance_by_slot.png": "Conditional acceptance by draft slot",
         "tau_by_benchmark.png": "tau by benchmark",
         "calibration.png": "Reliability of the confidence head"}


def _rate(entry: dict | None) -> str:
    return "-" if entry is None else f"{entry['count']}/{entry['total']} ({100 * entry['rate']:.0f}%)"


def _number(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _row(label: list[str], s: dict) -> str:
    slots = ", ".join("-" if x is None else f"{x:.2f}" for x in s.get("acceptance_by_slot", []))
    c = s.get("calibration")
    calibration = (f"{_number(c['ece'], '.3f')} / {_number(c['auroc'], '.3f')} / {_number(c['ece_cumulative'], '.3f')}"
                   if c else "-")
    speedup = f"{s['speedup']:.2f}x" if s.get("speedup") is not None else "-"
    cells = [*label, str(s["prompts"]), _number(s["tokens_per_s"], ".1f"), speedup, _number(s.get("tau"), ".2f"),
             _number(s.get("mean_draft_length"), ".2f"), slots or "-", calibration,
             _rate(s.get("identical_to_plain")), _rate(s.get("answers_extracted")), _rate(s.get("answer_agreement")),
             _rate(s.get("accuracy")),
             _rate(s.get("pass_at_1"))]
    return "| " + " | ".join(cells) + " |"


HEADER = ["prompts", "tokens/s", "speed-up", "tau", "mean draft", "acceptance by slot",
          "ECE / AUROC / cum. ECE", "identical to plain", "answer found", "answer agreement", "accuracy", "pass@1"]


def markdown_report(results: dict, plots: list[str]) -> str:
    settings = results["settings"]
    decoding = "greedy" if settings["greedy"] else f"T={settings['temperature']:g}, top-p {settings['top_p']:g}"
    lines = ["# hf-dspark eval", ""]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    lines += [f"Target: `{settings['target']}` ({settings['dtype']}). Drafters: "
              + ", ".join(f"{label} = `{path}`" for label, path in settings["drafters"].items()) + ".",
              f"Decoding: {decoding}, at most {settings['max_new_tokens']} new tokens, "
              f"{'every turn (own earlier answers fed back)' if settings['multi_turn'] else 'first turn'}, "
              f"seed {settings['seed']}. Methods run interleaved prompt by prompt.", ""]
    if results["greedy_outputs_identical"] is not None:
        lines += ["Greedy outputs identical to plain greedy: "
                  + ("**yes, all**" if results["greedy_outputs_identical"] else "**NO** (see mismatch-*.json)"), ""]
    if results["incomplete_prompts"]:
        lines += [f"{results['incomplete_prompts']} prompt(s) not finished by every method are left out; rerun "
                  "the same command to finish them.", ""]
    lines += ["tau: tokens per target forward (bonus included). Acceptance by slot: conditional on every earlier "
              "slot accepted. ECE / AUROC: conditional confidence vs slot accepted; cum. ECE: product of "
              "confidences vs all slots so far accepted. Answer found / agreement: a final answer was extracted (last "
              "number for gsm8k, last \\boxed{} for math500 and aime25) / it equals plain decoding's.", ""]
    for title, label_header, rows in (
            ("Overall", ["method"], [([m], results["results"][m]["overall"]) for m in results["methods"]]),
            ("By benchmark", ["benchmark", "method"],
             [([b, m], results["results"][m]["by_benchmark"][b]) for b in results["benchmarks"]
              for m in results["methods"]])):
        columns = label_header + HEADER
        lines += [f"## {title}", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
        lines += [_row(label, s) for label, s in rows] + [""]
    lines += ["## Prompt sets", "", "| benchmark | prompts | answer format | references | tests | code execution |",
              "|---|---|---|---|---|---|"]
    for name, info in results["benchmarks"].items():
        lines.append(f"| {name} | {info['prompts']} | {info['answer_format'] or '-'} | {info['references']} | "
                     f"{info['tests']} | {info.get('code_execution', '-')} |")
    lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{PLOTS[p]}]({p})" for p in plots] + [""]
    else:
        lines += ["Plots skipped: matplotlib is not installed (`pip install hf-dspark[eval]`).", ""]
    return "\n".join(lines)


def write_plots(results: dict, folder: Path) -> list[str]:
    """The PNG files written (names in `PLOTS`); empty if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install hf-dspark[eval])", file=sys.stderr)
        return []
    drafters = [m for m in results["methods"] if m != PLAIN]
    benchmarks = list(results["benchmarks"])
    overall = {d: results["results"][d]["overall"] for d in drafters}
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    longest = 1
    for d in drafters:
        rates = overall[d].get("acceptance_by_slot", [])
        longest = max(longest, len(rates))
        ax.plot(range(1, len(rates) + 1), [math.nan if r is None else r for r in rates], marker="o",
                label=f"{d} (tau {_number(overall[d].get('tau'), '.2f')})")
    ax.set_xticks(range(1, longest + 1))
    ax.set(xlabel="draft slot j", ylabel="P(slot j accepted | slots < j accepted)", ylim=(-0.02, 1.02),
           xlim=(0.5, longest + 0.5), title=PLOTS["acceptance_by_slot.png"])
    if drafters:
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "acceptance_by_slot.png", dpi=120)
    plt.close(fig)
    written.append("acceptance_by_slot.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(benchmarks) * max(1, len(drafters)) ** 0.5), 4))
    width = 0.8 / max(1, len(drafters))
    highest = 1.0
    for i, d in enumerate(drafters):
        taus = [results["results"][d]["by_benchmark"][b].get("tau") for b in benchmarks]
        highest = max([highest, *(t for t in taus if t is not None)])
        ax.bar([x + (i - (len(drafters) - 1) / 2) * width for x in range(len(benchmarks))],
               [math.nan if t is None else t for t in taus], width, label=d)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)  # plain decoding: one token per forward
    ax.set_xticks(range(len(benchmarks)), benchmarks, rotation=20)
    ax.set(ylabel="tau (tokens per target forward)", ylim=(0, highest * 1.25), title=PLOTS["tau_by_benchmark.png"])
    if drafters:
        ax.legend(loc="upper right", ncols=min(len(drafters), 3))
    fig.tight_layout()
    fig.savefig(folder / "tau_by_benchmark.png", dpi=120)
    plt.close(fig)
    written.append("tau_by_benchmark.png")

    calibrated = [d for d in drafters if overall[d].get("calibration")]
    if calibrated:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
        for d in calibrated:
            curve = overall[d]["calibration"]["reliability"]
            ax.plot([c for c, _, _ in curve], [r for _, r, _ in curve], marker="o",
                    label=f"{d} (ECE {_number(overall[d]['calibration']['ece'], '.3f')})")
        ax.set(xlabel="confidence c_j", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1),
               title=PLOTS["calibration.png"])
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "calibration.png", dpi=120)
        plt.close(fig)
        written.append("calibration.png")
    return written


def write_report(results: dict, folder: Path) -> None:
    folder = Path(folder)
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = write_plots(results, folder)
    (folder / "results.md").write_text(markdown_report(results, plots))
