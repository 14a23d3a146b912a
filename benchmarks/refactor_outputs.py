"""fp32 greedy outputs of the shipped drafters on the shipped eval prompts, and the rounds of a deterministic
configuration, written to JSON: run before and after a refactor and compare the two files (`--compare`).

    python benchmarks/refactor_outputs.py --output before.json
    python benchmarks/refactor_outputs.py --output after.json --compare before.json

Two modes per drafter and prompt: the drafter's defaults (round planning on: which proposer a round uses may follow
timings, so only the tokens are compared) and a deterministic one (no round planning, no suffix drafting, no cost
table: every round drafts the same, so the per-round drafted / accepted counts must match too). A batch of the two
prompts of each set goes through the batched engine (DSpark and DFlash).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import hf_dspark
from hf_dspark.evaluation.prompts import chat_prompt_ids

try:
    from hf_dspark.targets.default_target import load_default_target
except ImportError:  # before the GGUF loader left models/
    from hf_dspark.models.default_target import load_default_target

DATA = Path(hf_dspark.__file__).parent / "evaluation" / "data"
KINDS = ("dspark", "dflash", "eagle3")


def prompts(per_set: int) -> list[tuple[str, str]]:
    found = []
    for path in sorted(DATA.glob("*.jsonl")):
        for line in path.read_text().splitlines()[:per_set]:
            found.append((f"{path.stem}/{len(found)}", json.loads(line)["turns"][0]))
    return found


def deterministic(drafter) -> dict:
    """Settings with no timing in them, through whichever API the checkout has."""
    if hasattr(drafter, "round_planning"):  # settings as drafter attributes (before issue 26)
        drafter.round_planning, drafter.suffix_drafting, drafter.verification_costs = False, False, None
        return {}
    return {"dspark_round_planning": False, "dspark_suffix_drafting": False, "dspark_cost_table": None}


def defaults(drafter, saved: dict) -> dict:
    if hasattr(drafter, "round_planning"):
        for name, value in saved.items():
            setattr(drafter, name, value)
    return {}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--compare", default=None, help="an earlier output to compare with (exit 1 on a difference)")
    parser.add_argument("--per-set", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    torch.manual_seed(0)
    target, tokenizer = load_default_target(dtype=torch.float32)
    results = {}
    items = prompts(args.per_set)
    for kind in KINDS:
        drafter = hf_dspark.AutoDrafter.from_pretrained(hf_dspark.shipped_drafter_path(kind), dtype=torch.float32)
        saved = {n: getattr(drafter, n) for n in ("round_planning", "suffix_drafting", "verification_costs")
                 if hasattr(drafter, n)}
        for name, text in tqdm(items, desc=kind):
            ids = torch.tensor([chat_prompt_ids(tokenizer, text)])
            common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
            out = target.generate(ids, assistant_model=drafter, **common, **defaults(drafter, saved))
            results[f"{kind}/default/{name}"] = {"tokens": out.sequences[0].tolist()}
            out = target.generate(ids, assistant_model=drafter, **common, **deterministic(drafter))
            stats = out.speculative_stats
            results[f"{kind}/deterministic/{name}"] = {
                "tokens": out.sequences[0].tolist(),
                "rounds": [[d, a] for d, a in zip(stats.draft_lengths, stats.accepted)],
            }
            defaults(drafter, saved)
        if kind == "eagle3":
            continue
        for start in range(0, len(items), 2):
            texts = [t for _, t in items[start : start + 2]]
            rows = [chat_prompt_ids(tokenizer, t) for t in texts]
            width = max(map(len, rows))
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=args.max_new_tokens,
                                  do_sample=False, return_dict_in_generate=True, **deterministic(drafter))
            results[f"{kind}/batched/{items[start][0]}"] = {"tokens": out.sequences.tolist()}
            defaults(drafter, saved)
    Path(args.output).write_text(json.dumps(results, indent=0))
    print(f"{len(results)} outputs -> {args.output}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = sorted(k for k in before.keys() | results.keys() if before.get(k) != results.get(k))
        print(f"compared with {args.compare}: {len(before)} before, {len(results)} now, {len(differ)} differ")
        for key in differ[:20]:
            print("  differs:", key)
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
