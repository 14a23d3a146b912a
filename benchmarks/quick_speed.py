"""Side-by-side check of a drafter on held-out eval prompts: plain greedy vs speculative greedy, same run.

    python benchmarks/quick_speed.py --drafter hf_dspark/checkpoints/dspark-smollm2-135m-instruct --dtype float32

Prints per-prompt tau and identity, then overall tau, tokens/s and the speed-up ratio (time of plain over time of
speculative on the same prompts, interleaved so machine noise hits both).
"""

import argparse
import json
import time

import torch
from transformers import AutoModel

import hf_dspark  # noqa: F401
from hf_dspark.evaluation import benchmark_path
from hf_dspark.targets.default_target import load_default_target
from hf_dspark.training.regenerate import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("--drafter", required=True)
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--benchmarks", default="gsm8k,humaneval,mt-bench")
parser.add_argument("--prompts-per-benchmark", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=96)
args = parser.parse_args()

dtype = getattr(torch, args.dtype)
target, tokenizer = load_default_target(dtype=dtype)
drafter = AutoModel.from_pretrained(args.drafter, dtype=dtype).eval()
results, plain_time, spec_time, new_tokens, accepted, rounds = [], 0.0, 0.0, 0, 0, 0
for name in args.benchmarks.split(","):
    lines = benchmark_path(name).read_text().splitlines()[: args.prompts_per_benchmark]
    for line in lines:
        ids = torch.tensor([chat_prompt_ids(tokenizer, json.loads(line)["turns"][0])])
        start = time.perf_counter()
        plain = target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
        plain_time += time.perf_counter() - start
        start = time.perf_counter()
        spec = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens)
        spec_time += time.perf_counter() - start
        stats = drafter.last_generation_stats
        new_tokens += spec.shape[1] - ids.shape[1]
        accepted += sum(stats.accepted)
        rounds += stats.num_rounds
        results.append({"benchmark": name, "tau": round(stats.tau, 3), "identical": bool(torch.equal(plain, spec)),
                        "by_slot": [round(x, 3) for x in stats.acceptance_by_slot()]})
        print(json.dumps(results[-1]), flush=True)
summary = {
    "dtype": args.dtype,
    "tau": round((accepted + rounds) / rounds, 3),
    "identical": sum(r["identical"] for r in results),
    "prompts": len(results),
    "plain_tokens_per_s": round(new_tokens / plain_time, 2),
    "speculative_tokens_per_s": round(new_tokens / spec_time, 2),
    "speedup": round(plain_time / spec_time, 3),
}
print(json.dumps(summary))
