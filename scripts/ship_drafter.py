"""Copy a trained drafter into `checkpoints/` in bfloat16, with its training log and summary, and check its size.

    python scripts/ship_drafter.py /work/runs/v1/dspark checkpoints/dspark-smollm2-135m-instruct

The model card (README.md) in the destination is kept; write it by hand with the exact commands.
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModel

import hf_dspark  # noqa: F401

LIMIT_MB = 40

parser = argparse.ArgumentParser()
parser.add_argument("trained")
parser.add_argument("destination")
args = parser.parse_args()

source, destination = Path(args.trained), Path(args.destination)
drafter = AutoModel.from_pretrained(source, dtype=torch.float32)
destination.mkdir(parents=True, exist_ok=True)
for stale in destination.glob("*.safetensors"):
    stale.unlink()
drafter.to(torch.bfloat16).save_pretrained(destination)
for name in ("training_log.jsonl", "training_summary.json"):
    if (source / name).is_file():
        shutil.copy(source / name, destination / name)
size = sum(p.stat().st_size for p in destination.glob("*.safetensors")) / 2**20
print(f"{destination}: {size:.1f} MB of weights")
if size > LIMIT_MB:
    raise SystemExit(f"{destination} is {size:.1f} MB, over the {LIMIT_MB} MB limit")
