"""Distil a DSpark drafter for a target with a plain `Trainer`-style script (copy and adapt).

    hf-dspark regenerate --prompts sharegpt --output data/regenerated/smollm2 --max-prompts 2000
    python examples/train_dspark.py --data data/regenerated/smollm2 --output my-dspark-drafter

Multi-GPU: `accelerate launch --config_file examples/accelerate_fsdp.yaml examples/train_dspark.py ...`
(only the drafter is sharded and trained; the frozen target is prepared for evaluation on every rank).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

import hf_dspark
from hf_dspark.targets.default_target import load_default_target
from hf_dspark.training import DSparkTrainer, RegeneratedDataset, most_frequent_tokens
from hf_dspark.training.recipes import answer_token_counts

parser = argparse.ArgumentParser()
parser.add_argument("--target", default=None, help="causal LM path (default: embedded SmolLM2-135M-Instruct)")
parser.add_argument("--data", required=True, help="folder of `hf-dspark regenerate` shards")
parser.add_argument("--output", required=True)
parser.add_argument("--draft-vocab-size", type=int, default=8192)
parser.add_argument("--max-steps", type=int, default=1000)
args = parser.parse_args()

if args.target is None:
    target, tokenizer = load_default_target(dtype=torch.float32)
else:
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.target)

train_data = RegeneratedDataset(args.data, max_length=1024)
config = hf_dspark.DSparkDraftConfig.from_target_config(
    target.config, num_hidden_layers=5, block_size=7, markov_head="markov", markov_rank=256, confidence_head=True,
    draft_vocab_size=args.draft_vocab_size,
)
drafter = hf_dspark.DSparkDraftModel(config)
counts = answer_token_counts(train_data, target.config.vocab_size)
drafter.set_draft_vocab(most_frequent_tokens(counts, args.draft_vocab_size, always=[tokenizer.eos_token_id]))

training_args = TrainingArguments(
    output_dir=f"{args.output}/trainer",
    per_device_train_batch_size=8,
    learning_rate=6e-4,
    warmup_steps=max(1, args.max_steps // 25),
    lr_scheduler_type="cosine",
    max_grad_norm=1.0,
    max_steps=args.max_steps,
    logging_steps=10,
    save_steps=100,
    save_total_limit=2,
    report_to=[],
)
trainer = DSparkTrainer(
    model=drafter, target=target, args=training_args, train_dataset=train_data,
    num_anchors=64,  # blocks per sequence; the loss is 0.1 CE + 0.9 TV + 1.0 BCE, slot weights exp(-k/4)
)
trainer.train(resume_from_checkpoint=None)  # pass True to continue an interrupted run
drafter.save_pretrained(args.output)
