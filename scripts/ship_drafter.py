"""Copy a trained drafter into the package data (`hf_dspark/checkpoints/`) in bfloat16, with its training log and
summary, record the stage that trained it in `training_stages.json`, and check its size.

    python scripts/ship_drafter.py /work/runs/v5/dspark hf_dspark/checkpoints/dspark-smollm2-135m-instruct \
        --stage v5 --command "hf-dspark train ..." --cache-command "hf-dspark cache ..." --data "..." \
        --layout "..." --loss "..." --learning-rate "..."

`training_stages.json` lists every stage the shipped drafter went through, in order (a stage shipped again under
the same name replaces its entry); `scripts/write_cards.py` renders the model card's Training section from it.

A shipped folder holds config.json, model.safetensors, README.md (the model card), training_log.jsonl and
training_summary.json only: the modeling code and `custom_generate/` that `save_pretrained` adds are written
whenever the drafter is saved or pushed (`hf-dspark push`), so no copy of the package's source is kept here.
The model card in the destination is kept; write it with `scripts/write_cards.py`.
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModel

import hf_dspark  # noqa: F401

LIMIT_MB = 40
SHIPPED_FILES = ("config.json", "model.safetensors", "README.md", "training_log.jsonl", "training_summary.json",
                 "training_stages.json")

parser = argparse.ArgumentParser()
parser.add_argument("trained")
parser.add_argument("destination")
parser.add_argument("--stage", required=True, help="name of the stage that trained it (e.g. v5)")
parser.add_argument("--command", required=True, help="the `hf-dspark train` command of the stage")
parser.add_argument("--cache-command", required=True, help="the `hf-dspark cache` command of its target cache")
parser.add_argument("--data", required=True, help="what the stage trained on, in words")
parser.add_argument("--layout", required=True, help="how the stage's drafters shared the machine")
parser.add_argument("--loss", required=True)
parser.add_argument("--learning-rate", required=True)
args = parser.parse_args()

source, destination = Path(args.trained), Path(args.destination)
drafter = AutoModel.from_pretrained(source, dtype=torch.float32)
destination.mkdir(parents=True, exist_ok=True)
for stale in destination.iterdir():
    if stale.name not in SHIPPED_FILES or stale.name.endswith(".safetensors"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
with tempfile.TemporaryDirectory() as staged:
    drafter.to(torch.bfloat16).save_pretrained(staged)
    config = json.loads((Path(staged) / "config.json").read_text())
    config.pop("auto_map", None)  # the remote code is not shipped here; save_pretrained writes both again
    (destination / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(Path(staged) / "model.safetensors", destination / "model.safetensors")
for name in ("training_log.jsonl", "training_summary.json"):
    if (source / name).is_file():
        shutil.copy(source / name, destination / name)
summary = json.loads((source / "training_summary.json").read_text())
stages_path = destination / "training_stages.json"
stages = [s for s in (json.loads(stages_path.read_text()) if stages_path.exists() else []) if s["stage"] != args.stage]
stages.append({"stage": args.stage, "command": args.command, "cache_command": args.cache_command, "data": args.data,
               "budget_seconds": round(summary["budget_seconds"]), "steps": summary["steps"], "layout": args.layout,
               "loss": args.loss, "learning_rate": args.learning_rate})
stages_path.write_text(json.dumps(stages, indent=2) + "\n")
size = (destination / "model.safetensors").stat().st_size / 2**20
print(f"{destination}: {size:.1f} MB of weights")
if size > LIMIT_MB:
    raise SystemExit(f"{destination} is {size:.1f} MB, over the {LIMIT_MB} MB limit")
