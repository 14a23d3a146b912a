"""Train the three shipped drafters one more stage with equal budgets, on the recipe the ablation measured best.

    python scripts/train_stage.py --ablation benchmarks/recipe-ablation/results.jsonl --cache CACHE \\
        --stage v5 --seconds 780 --output /work/runs

Of the ablation's variants that a continued stage can use (the shipped DSpark drafter trained on, differing in
loss, learning rate and whether the fusion is preconditioned), the one with the highest held-out tau gives the
recipe. DSpark, DFlash and Eagle3 then each continue their shipped checkpoint (`--init-from`, q/k norms added) for
the same `--seconds` of training steps, one after the other with the same threads, from the same target cache. Each
drafter keeps its own loss form where the variant's weights do not apply to it (DFlash has no confidence head;
Eagle3 trains with soft cross-entropy per unrolled step). The commands are printed and written to
`OUTPUT/STAGE/commands.json` for the model cards; a finished drafter is skipped on a rerun.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from hf_dspark.models.loading import shipped_drafter_path

parser = argparse.ArgumentParser()
parser.add_argument("--ablation", required=True, help="results.jsonl of benchmarks/recipe_ablation.py")
parser.add_argument("--cache", required=True, nargs="+", help="the target cache folders to train from")
parser.add_argument("--stage", required=True)
parser.add_argument("--seconds", type=float, required=True, help="training budget per drafter")
parser.add_argument("--output", required=True)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--kinds", nargs="+", default=["dspark", "dflash", "eagle3"])
args = parser.parse_args()

rows = [json.loads(line) for line in Path(args.ablation).read_text().splitlines() if line.strip()]
continued = [r for r in rows if r["recipe"].get("init_from")]
if not continued:
    raise SystemExit(f"{args.ablation} has no continued-stage variant (continue-shipped...); run those first")
best = max(continued, key=lambda r: r["tau"])
recipe = best["recipe"]
print(f"recipe: {best['variant']} (held-out tau {best['tau']}; of {[(r['variant'], r['tau']) for r in continued]})")

loss_flags = []
for name, value in recipe["loss_weights"].items():
    loss_flags += [f"--{name.replace('_weight', '')}-weight", f"{value:g}"]
stage_dir = Path(args.output) / args.stage
stage_dir.mkdir(parents=True, exist_ok=True)
commands = {}
for kind in args.kinds:
    shipped = os.path.relpath(shipped_drafter_path(kind))  # as the card shows it, from the repository root
    commands[kind] = ["hf-dspark", "train", "--kind", kind, "--init-from", shipped,
                      "--output", str(stage_dir / kind), "--cache", *args.cache, "--batch-size", "4",
                      "--num-anchors", "64", "--learning-rate", f"{recipe['learning_rate']:g}", "--warmup-ratio",
                      "0.0002", "--max-steps", "100000", "--save-steps", "25", "--max-seconds", f"{args.seconds:g}",
                      "--threads", str(args.threads), *loss_flags,
                      *([] if recipe.get("precondition_fusion", False) else ["--no-precondition-fusion"])]
(stage_dir / "commands.json").write_text(json.dumps(
    {"recipe": best["variant"], "commands": {kind: shlex.join(c) for kind, c in commands.items()}}, indent=2))
for kind, command in commands.items():
    if (stage_dir / kind / "training_summary.json").exists():
        print(f"{kind}: already trained ({stage_dir / kind})")
        continue
    print(shlex.join(command), flush=True)
    subprocess.run(command, check=True, stdout=sys.stdout, stderr=sys.stderr)
