"""Issue 41: the README's main job at batch 1, this code against an earlier commit, interleaved on one machine.

    python benchmarks/batch_one_versions.py --output benchmarks/batch-one-versions/results.json
    python benchmarks/batch_one_versions.py --pairs 1 --threads 1 --loads quiet --output /tmp/versions.json  # smoke

Each run is the README's first command's job, `python -m hf_dspark generate PROMPT --compare --threads T`, in a
fresh process (a fresh policy state: what a user's first call gets), in this tree and in a git worktree of `--old`
(51222a7: the code before the unified planner), the two alternating, the order swapped each pair. `busy` runs a
CPU-bound process (`python -c "while True: pass"`) beside both. Reported per (threads, load): each version's speed-up
over plain `generate` in the same process (its own `--compare` line), and new / old of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import command_line, git_state, md_table  # noqa: E402

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether?")
ROOT = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--old", default="51222a7")
parser.add_argument("--pairs", type=int, default=3)
parser.add_argument("--threads", default="1,2")
parser.add_argument("--loads", default="quiet,busy")
parser.add_argument("--worktree", default="/tmp/hf_dspark-old")
parser.add_argument("--output", default="benchmarks/batch-one-versions/results.json")
args = parser.parse_args()
output = Path(args.output)


def old_tree() -> Path:
    tree = Path(args.worktree)
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.old], check=True,
                       capture_output=True)
    return tree


def run(tree: Path, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "hf_dspark", "generate", PROMPT, "--compare", "--threads",
                           str(threads)], cwd=tree, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    text = done.stderr
    speed_up = re.search(r"speed-up ([0-9.]+)x", text)
    rounds = re.search(r"rounds: ([^\]]*)\]", text)
    identical = re.search(r"identical to plain greedy: (\w+)", text)
    if done.returncode or speed_up is None:
        raise SystemExit(f"{tree}: the run failed (exit {done.returncode}):\n{text[-2000:]}")
    return {"speed_up": float(speed_up.group(1)), "rounds": rounds.group(1) if rounds else "",
            "identical": identical.group(1) if identical else ""}


def main() -> None:
    trees = {"new": ROOT, "old": old_tree()}
    results = {"command": command_line(), "git": git_state(), "old": args.old, "cells": {}}
    if output.exists():
        results["cells"] = json.loads(output.read_text()).get("cells", {})
    todo = [(int(t), load) for t in args.threads.split(",") for load in args.loads.split(",")
            if f"{t}/{load}" not in results["cells"]]
    for threads, load in tqdm(todo, desc="cells"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
        try:
            runs = {"new": [], "old": []}
            for pair in range(args.pairs):
                for version in (("new", "old") if pair % 2 == 0 else ("old", "new")):
                    runs[version].append(run(trees[version], threads))
        finally:
            if busy is not None:
                busy.kill()
        medians = {v: statistics.median(r["speed_up"] for r in runs[v]) for v in runs}
        results["cells"][f"{threads}/{load}"] = {"threads": threads, "load": load, "runs": runs,
                                                  "new_vs_old": medians["new"] / medians["old"]}
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=1))
    lines = ["# The README's main job at batch 1: this code against " + args.old, "", f"`{results['command']}`", "",
             "Speed-up over plain `generate` (each run's own `--compare`), fresh process per run, interleaved.", ""]
    body = []
    for cell in results["cells"].values():
        row = [cell["threads"], cell["load"]]
        for version in ("new", "old"):
            row.append(" / ".join(f"{r['speed_up']:.2f}x" for r in cell["runs"][version]))
        row += [f"{cell['new_vs_old']:.2f}x", cell["runs"]["new"][-1]["rounds"], cell["runs"]["old"][-1]["rounds"],
                "yes" if all(r["identical"] == "yes" for v in cell["runs"].values() for r in v) else "NO"]
        body.append(row)
    lines += md_table(["threads", "load", "new", args.old, "new / old (medians)", "new's rounds (last)",
                       "old's rounds (last)", "identical"], body)
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


main()
