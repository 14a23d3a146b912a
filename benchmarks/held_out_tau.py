"""Measured tau and per-slot acceptance of drafters on held-out eval prompts, side by side (the drafter alone:
no suffix drafting, no schedule, every slot verified; float32 greedy through `target.generate`).

    python benchmarks/held_out_tau.py --output benchmarks/held-out-tau/results.md      # the shipped drafters
    python benchmarks/held_out_tau.py --drafters dspark=/work/runs/v5/dspark ... --output ...

Same prompts, plain outputs and scoring as `benchmarks/recipe_ablation.py` (eval-set first turns from the second
prompt on, so they are neither training prompts nor the bench's). Every output must equal plain greedy.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

import hf_dspark  # noqa: F401
from hf_dspark.targets.default_target import load_default_target
from hf_dspark.models.loading import load_drafter, shipped_drafter_path

sys.path.insert(0, str(Path(__file__).parent))
from recipe_ablation import held_out, measured_tau, plain_outputs  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--drafters", nargs="*", default=None, help="LABEL=PATH (default: the shipped three)")
parser.add_argument("--output", required=True, help="markdown report (a .json beside it)")
parser.add_argument("--benchmarks", nargs="+", default=["gsm8k", "humaneval", "mt-bench", "alpaca"])
parser.add_argument("--prompts-per-benchmark", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
named = (dict(item.split("=", 1) for item in args.drafters) if args.drafters else
         {kind: str(shipped_drafter_path(kind)) for kind in ("dspark", "dflash", "eagle3")})

target, tokenizer = load_default_target(torch.float32)
prompts = held_out(tokenizer, args.benchmarks, args.prompts_per_benchmark)
output = Path(args.output)
plain = plain_outputs(target, prompts, args.max_new_tokens, output.parent / "plain-greedy.pt")
results = {}
for label, path in named.items():
    drafter = load_drafter(path, torch.float32)
    drafter.attach_target(target)
    results[label] = {"path": path, **measured_tau(target, drafter, prompts, plain, args.max_new_tokens)}
    print(label, json.dumps(results[label]), flush=True)

command = "python benchmarks/held_out_tau.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
lines = ["# Held-out tau, the drafter alone (float32 greedy, every slot verified)", "", f"Command: `{command}`", "",
         f"{len(prompts)} held-out prompts ({', '.join(args.benchmarks)}), {args.max_new_tokens} new tokens.", "",
         "| drafter | tau | identical to plain | " + " | ".join(f"slot {k + 1}" for k in range(7)) + " |",
         "|---|---|---|" + "---|" * 7]
for label, r in results.items():
    slots = [("-" if a is None else f"{a:.2f}") for a in r["acceptance_by_slot"]] + ["-"] * 7
    lines.append(f"| {label} | {r['tau']:.3f} | {r['identical']} | " + " | ".join(slots[:7]) + " |")
base = results.get("dspark")
if base:
    lines += [""] + [f"DSpark / {label}: tau {base['tau'] / r['tau']:.3f}x" for label, r in results.items()
                     if label != "dspark"]
lines += ["", "Acceptance by slot is conditional: of the rounds that reached slot k, the share that accepted it."]
output.write_text("\n".join(lines) + "\n")
output.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=1))
print("\n".join(lines))
