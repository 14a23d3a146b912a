"""Recipe ablation: which training recipe gives the highest *measured* tau on held-out prompts.

Every variant trains a DSpark drafter from the same target cache for the same training budget (one change each
from the baseline), then is scored by running `target.generate(ids, assistant_model=drafter)` (float32 greedy,
the drafter alone: no suffix drafting, no schedule) on held-out eval prompts, never training prompts. Training
loss is not the criterion. Plain greedy outputs are computed once and every variant must reproduce them.
Resumable: each finished variant is appended to `results.jsonl` in the output folder and skipped on a rerun; a
variant interrupted mid-training continues from its trainer checkpoint.

    hf-dspark cache --output CACHE --data data/regenerated/smollm2-v2 --threads 1
    python benchmarks/recipe_ablation.py --cache CACHE --seconds 360 --output benchmarks/recipe-ablation

`sharegpt-answers` needs a second cache of ShareGPT's own answers (off-policy text, labelled by the target):
`hf-dspark cache --output CACHE2 --dataset-answers N`, passed as `--sharegpt-cache CACHE2`.

Baseline: DSpark (vanilla Markov head), on-policy data, DeepSpec's loss (0.1 CE + 0.9 TV + 1.0 BCE), 2 layers,
gamma 7, 8192-token draft vocabulary, layers initialised from target layers 28-29, lr 6e-4 (annealed over the
budget), qk_norm on, 4 sequences x 64 anchors per step.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import hf_dspark  # noqa: F401
from hf_dspark.evaluation.prompts import chat_input_ids, load_prompt_sets
from hf_dspark.targets.default_target import load_default_target
from hf_dspark.models.loading import load_drafter
from hf_dspark.training.recipes import train_drafter

SHIPPED_DSPARK = "hf_dspark/checkpoints/dspark-smollm2-135m-instruct"
BASELINE = dict(kind="dspark", num_layers=2, block_size=7, markov_rank=256, draft_vocab_size=8192,
                init_from_target=[28, 29], learning_rate=6e-4, loss_weights={}, on_policy=True,
                init_markov_bigrams=False, init_from=None, precondition_fusion=False)

VARIANTS = {
    "baseline": {},
    "sharegpt-answers": {"on_policy": False},
    "kl-heavy-loss": {"loss_weights": {"ce_weight": 0.1, "tv_weight": 0.0, "kl_weight": 0.9}},
    "1-layer": {"num_layers": 1, "init_from_target": [29]},
    "3-layers": {"num_layers": 3, "init_from_target": [27, 28, 29]},
    "gamma-4": {"block_size": 4},
    "vocab-16k": {"draft_vocab_size": 16384},
    "vocab-32k": {"draft_vocab_size": 32768},
    "random-init": {"init_from_target": None},
    "lr-3e-4": {"learning_rate": 3e-4},
    "lr-1.2e-3": {"learning_rate": 1.2e-3},
    "bigram-markov-init": {"init_markov_bigrams": True},
    # The shipped drafter (2.5 CPU hours, mostly off-policy) trained on for the same budget, q/k norms added:
    # the recipe questions a continued stage can still change (loss, learning rate) are asked from there too.
    "continue-shipped": {"init_from": SHIPPED_DSPARK, "init_from_target": None},
    "continue-shipped-kl-heavy": {"init_from": SHIPPED_DSPARK, "init_from_target": None,
                                  "loss_weights": {"ce_weight": 0.1, "tv_weight": 0.0, "kl_weight": 0.9}},
    "continue-shipped-lr-1.2e-3": {"init_from": SHIPPED_DSPARK, "init_from_target": None, "learning_rate": 1.2e-3},
    # The fused target features trained at one scale (`hf_dspark/training/precondition.py`), against the same
    # recipe without it, from scratch (random layers, bigram Markov head) and continued from the shipped drafter.
    "random-init-bigram": {"init_from_target": None, "init_markov_bigrams": True},
    "random-init-bigram-preconditioned": {"init_from_target": None, "init_markov_bigrams": True,
                                          "precondition_fusion": True},
    "continue-shipped-preconditioned": {"init_from": SHIPPED_DSPARK, "init_from_target": None,
                                        "precondition_fusion": True},
    # The drafter kinds beside DSpark (the baseline) from the same start, data and budget: DFlash (the backbone
    # alone), DFlash 2 (in-block convolutions and the candidate selector) and Eagle3 (one autoregressive layer,
    # started from the target's last layer as the block drafters' second layer is).
    "kind-dflash": {"kind": "dflash"},
    "kind-dflash2": {"kind": "dflash2"},
    "kind-eagle3": {"kind": "eagle3", "num_layers": 1, "init_from_target": [29]},
}


def held_out(tokenizer, benchmarks: list[str], per_benchmark: int) -> list[torch.Tensor]:
    """Eval-set first turns from the second prompt on (the bench uses the first ones)."""
    sets = load_prompt_sets(benchmarks, max_prompts=per_benchmark + 1)
    return [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])
            for prompts in sets.values() for p in prompts[1:]]


def plain_outputs(target, prompts: list[torch.Tensor], max_new_tokens: int, path: Path) -> list[torch.Tensor]:
    """Plain greedy outputs, computed once (they do not depend on the variant) and kept beside the results."""
    if path.exists():
        saved = torch.load(path)
        outputs = saved["outputs"]
        if (saved["max_new_tokens"] == max_new_tokens and len(outputs) == len(prompts)
                and all(torch.equal(o[:, : p.shape[1]], p) for o, p in zip(outputs, prompts))):
            return outputs
    outputs = [target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens) for ids in prompts]
    torch.save({"max_new_tokens": max_new_tokens, "outputs": outputs}, path)
    return outputs


def measured_tau(target, drafter, prompts: list[torch.Tensor], plain: list[torch.Tensor],
                 max_new_tokens: int) -> dict:
    drafter.generation_config.update(dspark_suffix_drafting=False, dspark_round_planning=False,
                                     dspark_verification_policy="all")
    accepted = rounds = 0
    by_slot_hits, by_slot_reached = [0] * drafter.config.block_size, [0] * drafter.config.block_size
    identical = 0
    for ids, expected in zip(prompts, plain):
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
        identical += int(torch.equal(out, expected))
        stats = drafter.last_generation_stats
        accepted += sum(stats.accepted)
        rounds += stats.num_rounds
        for draft, got in zip(stats.draft_lengths, stats.accepted):
            for slot in range(min(draft, got + 1)):
                by_slot_reached[slot] += 1
                by_slot_hits[slot] += int(slot < got)
    return {"tau": round((accepted + rounds) / rounds, 3), "identical": f"{identical}/{len(prompts)}",
            "acceptance_by_slot": [round(h / r, 3) if r else None for h, r in zip(by_slot_hits, by_slot_reached)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", required=True, nargs="+",
                        help="target cache folders of the on-policy data (`hf-dspark cache`), trained as one")
    parser.add_argument("--sharegpt-cache", default=None,
                        help="target cache of ShareGPT's own answers (`hf-dspark cache --dataset-answers N`)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seconds", type=float, default=1200, help="training budget per variant (seconds of steps)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training budget per variant in optimizer steps instead of --seconds: the same data for "
                             "every variant whatever the machine's load (each row still reports its seconds)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--benchmarks", nargs="+", default=["gsm8k", "humaneval", "mt-bench", "alpaca"])
    parser.add_argument("--prompts-per-benchmark", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    if "sharegpt-answers" in args.variants and not args.sharegpt_cache:
        parser.error("the sharegpt-answers variant needs --sharegpt-cache (a cache built with "
                     "`hf-dspark cache --dataset-answers N`), or leave it out of --variants")
    torch.set_num_threads(args.threads)

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    results_path = output / "results.jsonl"
    done = {json.loads(line)["variant"] for line in results_path.open()} if results_path.exists() else set()
    target, tokenizer = load_default_target(torch.float32)
    prompts = held_out(tokenizer, args.benchmarks, args.prompts_per_benchmark)
    plain = plain_outputs(target, prompts, args.max_new_tokens, output / "plain-greedy.pt")
    for name in args.variants:
        if name in done:
            continue
        recipe = {**BASELINE, **VARIANTS[name]}
        started = time.perf_counter()
        summary = train_drafter(
            target, tokenizer, kind=recipe["kind"], output_dir=str(output / name), regenerated=[],
            dataset_answers=0, cache=args.cache if recipe["on_policy"] else args.sharegpt_cache,
            max_seconds=None if args.steps else args.seconds, num_layers=recipe["num_layers"], block_size=recipe["block_size"],
            markov_rank=recipe["markov_rank"], draft_vocab_size=recipe["draft_vocab_size"],
            target_layer_ids=None, init_from_target=recipe["init_from_target"], max_length=768, batch_size=4,
            num_anchors=64, learning_rate=recipe["learning_rate"], max_steps=args.steps or 100_000, save_steps=25,
            warmup_ratio=0.0002, seed=0, resume=True, loss_weights=recipe["loss_weights"], qk_norm=True,
            init_markov_bigrams=recipe["init_markov_bigrams"], init_from=recipe["init_from"],
            precondition_fusion=recipe["precondition_fusion"],
        )
        drafter = load_drafter(output / name, torch.float32)
        drafter.attach_target(target)
        score = measured_tau(target, drafter, prompts, plain, args.max_new_tokens)
        row = {"variant": name, "recipe": recipe, "steps": summary["steps"], "train_seconds": summary["train_seconds"],
               "wall_seconds": round(time.perf_counter() - started, 1), **score}
        with results_path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    rows = [json.loads(line) for line in results_path.open()]
    base = next((r["tau"] for r in rows if r["variant"] == "baseline"), None)
    lines = ["# Recipe ablation (held-out measured tau, float32 greedy, drafter alone)", "",
             f"Command: `python benchmarks/recipe_ablation.py --cache {' '.join(args.cache)} "
             + (f"--steps {args.steps} " if args.steps else f"--seconds {args.seconds:g} ")
             + f"--output {args.output} --threads {args.threads}`" + (f" with `--sharegpt-cache {args.sharegpt_cache}`"
                                                                 if args.sharegpt_cache else ""), "",
             f"{len(prompts)} held-out prompts ({', '.join(args.benchmarks)}), {args.max_new_tokens} new tokens.", "",
             "| variant | steps | train s | tau | vs baseline | identical | acceptance by slot |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["tau"]):
        ratio = f"{r['tau'] / base:.3f}x" if base else "-"
        slots = ", ".join("-" if a is None or math.isnan(a) else f"{a:.2f}" for a in r["acceptance_by_slot"])
        lines.append(f"| {r['variant']} | {r['steps']} | {r['train_seconds']:.0f} | {r['tau']:.3f} | {ratio} | "
                     f"{r['identical']} | {slots} |")
    (output / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
