"""Speculative generation with an hf_dspark drafter: greedy and sampled, in a few lines.

    python examples/generate.py                          # embedded SmolLM2 target + shipped DSpark drafter
    python examples/generate.py --target Qwen/Qwen3-8B --drafter org/dspark-qwen3-8b
"""

import argparse
import time

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_dspark  # registers the drafter classes and the generate() integration
from hf_dspark.targets.default_target import load_default_target

parser = argparse.ArgumentParser()
parser.add_argument("--target", default=None, help="causal LM path (default: embedded SmolLM2-135M-Instruct)")
parser.add_argument("--drafter", default=str(hf_dspark.shipped_drafter_path("dspark")),
                    help="drafter folder or Hub id (default: the shipped DSpark drafter)")
parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
parser.add_argument("--max-new-tokens", type=int, default=128)
args = parser.parse_args()

if args.target is None:
    target, tokenizer = load_default_target(dtype=torch.float32)
else:
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
drafter = AutoModel.from_pretrained(args.drafter, dtype=torch.float32).eval()

messages = [{"role": "user", "content": args.prompt}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]

start = time.perf_counter()
plain = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
plain_seconds = time.perf_counter() - start

start = time.perf_counter()
greedy = target.generate(input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False)
spec_seconds = time.perf_counter() - start
stats = drafter.last_generation_stats
print(tokenizer.decode(greedy[0, input_ids.shape[1]:], skip_special_tokens=True))
print(f"\nidentical to plain greedy: {torch.equal(plain, greedy)} | tau {stats.tau:.2f} | "
      f"speed-up {plain_seconds / spec_seconds:.2f}x")

sampled = target.generate(
    input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.7, top_p=0.9
)
print("\nsampled:", tokenizer.decode(sampled[0, input_ids.shape[1]:], skip_special_tokens=True))
