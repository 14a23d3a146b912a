"""Training levers on this CPU, measured side by side in one run: each variant trains a DSpark drafter for the same
wall-clock budget, then is scored on the same held-out cached examples.

    python benchmarks/training_levers.py --cache /work/cache/smollm2-v1 --seconds 150

Variants (one change each from the baseline: target cache, 8192-token draft vocabulary, layers initialised from
target layers 28-29, cosine-over-time learning rate 1e-3):
  full-vocab     drafts over all 49,152 tokens
  random-init    drafter layers randomly initialised
  constant-lr    no cosine decay
  online-target  runs the target every step instead of reading the cache (feature capture off)
  bigram-init    also starts the Markov head at the training answers' low-rank bigram log-probabilities
  context-init   also starts the fusion layer as "target layer 27's output, normed as layer 28 norms it", so the
                 first drafter layer (a copy of layer 28) initially sees the target's own context keys/values
Reported: blocks/s and the held-out acceptance proxy (1 - TV per slot, teacher-forced) with the expected tau it
implies, each as a ratio to the baseline.
"""

import argparse
import json
import time

import torch
from torch.utils.data import Subset
from transformers import TrainingArguments

import hf_dspark  # noqa: F401
from hf_dspark.targets.default_target import load_default_target
from hf_dspark.training.budget import TimeBudgetCallback
from hf_dspark.training.init import init_context_from_target, init_layers_from_target, init_markov_head_from_bigrams
from hf_dspark.training.recipes import ExampleList, answer_token_counts, build_drafter
from hf_dspark.training.target_cache import TargetCacheDataset
from hf_dspark.training.trainer import DSparkTrainer, most_frequent_tokens

parser = argparse.ArgumentParser()
parser.add_argument("--cache", required=True)
parser.add_argument("--seconds", type=float, default=150)
parser.add_argument("--held-out", type=int, default=48)
parser.add_argument("--variants", nargs="*", default=["baseline", "full-vocab", "random-init", "constant-lr",
                                                      "online-target", "bigram-init", "context-init"])
args = parser.parse_args()

target, tokenizer = load_default_target(dtype=torch.float32)
layers = [1, 8, 14, 20, 27]
cache = TargetCacheDataset(args.cache, layer_ids=layers)
train_ids = list(range(len(cache) - args.held_out))
held_out = Subset(cache, range(len(cache) - args.held_out, len(cache)))
vocab = most_frequent_tokens(answer_token_counts(Subset(cache, train_ids), target.config.vocab_size), 8192,
                             always=[tokenizer.eos_token_id])


def without_cached_outputs(dataset) -> ExampleList:
    """The same examples without their cached target outputs (the trainer then runs the target)."""
    return ExampleList([{"input_ids": example["input_ids"], "loss_mask": example["loss_mask"]}
                        for example in (dataset[i] for i in range(len(dataset)))])


results = {}
for variant in args.variants:
    torch.manual_seed(0)
    drafter = build_drafter("dspark", target, num_layers=2, block_size=7, markov_rank=256,
                            draft_vocab_size=None if variant == "full-vocab" else 8192, target_layer_ids=layers)
    if variant != "full-vocab":
        drafter.set_draft_vocab(vocab)
    if variant != "random-init":
        init_layers_from_target(drafter, target, [28, 29])
    if variant == "context-init":
        init_context_from_target(drafter, target, 28)
    if variant == "bigram-init":
        init_markov_head_from_bigrams(drafter, Subset(cache, train_ids))
    budget = TimeBudgetCallback(args.seconds, warmup_steps=5, min_ratio=1.0 if variant == "constant-lr" else 0.0)
    train = Subset(cache, train_ids)
    trainer = DSparkTrainer(
        model=drafter, target=target, train_dataset=without_cached_outputs(train) if variant == "online-target" else train,
        eval_dataset=held_out, num_anchors=64, ce_weight=0.0, kl_weight=1.0, callbacks=[budget],
        args=TrainingArguments(output_dir=f"/tmp/levers-{variant}", per_device_train_batch_size=4,
                               per_device_eval_batch_size=8, learning_rate=1e-3, lr_scheduler_type="constant",
                               max_steps=100000, logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
                               disable_tqdm=True, seed=0, max_grad_norm=1.0),
    )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    blocks = trainer.state.global_step * 4 * 64
    torch.manual_seed(1)
    scores = trainer.evaluate()
    slots = [scores[f"eval_acceptance_slot{k}"] for k in range(7)]
    expected_tau, survive = 1.0, 1.0
    for a in slots:
        survive *= a
        expected_tau += survive
    results[variant] = {"steps": trainer.state.global_step, "blocks_per_s": round(blocks / seconds, 1),
                        "held_out_acceptance": [round(a, 3) for a in slots],
                        "expected_tau_proxy": round(expected_tau, 3)}
    print(json.dumps({variant: results[variant]}), flush=True)

base = results.get("baseline")
print("\n| variant | blocks/s | ratio | slot-0 acceptance | expected tau proxy | ratio |\n|---|---|---|---|---|---|")
for variant, r in results.items():
    ratio = lambda key: r[key] / base[key] if base else float("nan")  # noqa: E731
    print(f"| {variant} | {r['blocks_per_s']} | {ratio('blocks_per_s'):.2f} | {r['held_out_acceptance'][0]} | "
          f"{r['expected_tau_proxy']} | {ratio('expected_tau_proxy'):.2f} |")
