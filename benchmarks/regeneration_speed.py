"""Regeneration throughput: stock batched `generate` (length-sorted fixed batches, left padding) against
`hf_dspark.training.regenerate` (continuous batching), same prompts, same settings, measured side by side.

    python benchmarks/regeneration_speed.py --prompts 192 --batch-size 64 --max-new-tokens 256 --threads 2 \
        --output benchmarks/regeneration/results.md

Answer tokens are counted up to and including EOS (what the training data holds); stock `generate` also spends
steps on rows that already ended, which is the waste continuous batching removes. Greedy answers of the two
paths are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hf_dspark.models.default_target import load_default_target
from hf_dspark.training.data import Decontaminator, load_conversations, sharegpt_path
from hf_dspark.training.regenerate import RegenerationConfig, chat_prompt_ids, regenerate


def stock_generate(target, tokenizer, prompt_ids: list[list[int]], batch_size: int, max_new_tokens: int, eos: int):
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    answers, started = {}, time.perf_counter()
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompt_ids[i]) for i in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, width - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
            mask[r, width - len(prompt_ids[i]):] = 1
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id)
        for r, i in enumerate(rows):
            answer = out[r, width:].tolist()
            answers[i] = answer[: answer.index(eos) + 1] if eos in answer else answer
    return answers, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--skip", type=int, default=3000, help="take prompts from this offset of ShareGPT")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_default_target(torch.float32)
    conversations = Decontaminator.from_benchmarks().filter_conversations(
        load_conversations([sharegpt_path()], args.skip + 4 * args.prompts))[args.skip:]
    prompts = [c[0] for c in conversations if len(chat_prompt_ids(tokenizer, c[0])) <= args.max_prompt_tokens]
    prompts = prompts[: args.prompts]
    if len(prompts) < args.prompts:
        raise SystemExit(f"only {len(prompts)} prompts after offset {args.skip}; lower --skip")
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in prompts]

    stock, stock_seconds = stock_generate(target, tokenizer, prompt_ids, args.batch_size, args.max_new_tokens,
                                          tokenizer.eos_token_id)
    stock_tokens = sum(len(a) for a in stock.values())
    stock_steps = sum(len(a) for a in stock.values())

    config = RegenerationConfig(max_new_tokens=args.max_new_tokens, greedy_fraction=1.0, batch_size=args.batch_size,
                                max_prompt_tokens=args.max_prompt_tokens, max_turns=1)
    with tempfile.TemporaryDirectory() as folder:
        ours = regenerate(target, tokenizer, prompts, folder, config, progress=False)
        records = [json.loads(line) for shard in sorted(Path(folder).glob("shard-*.jsonl")) for line in open(shard)]
    same = sum(r["input_ids"][r["prompt_length"]:] == stock[r["id"]] for r in records)

    lines = [
        "# Regeneration throughput (SmolLM2-135M-Instruct, float32, greedy)",
        "",
        f"Command: `python benchmarks/regeneration_speed.py --prompts {args.prompts} --batch-size {args.batch_size} "
        f"--max-new-tokens {args.max_new_tokens} --threads {args.threads}`",
        "",
        f"{len(prompts)} decontaminated ShareGPT first turns (from offset {args.skip}), prompts <= "
        f"{args.max_prompt_tokens} tokens, answers <= {args.max_new_tokens} tokens, batch {args.batch_size}, "
        f"{args.threads} threads.",
        "",
        "| path | answer tokens | seconds | answer tokens/s |",
        "|---|---|---|---|",
        f"| stock `generate`, length-sorted fixed batches | {stock_tokens} | {stock_seconds:.1f} | "
        f"{stock_tokens / stock_seconds:.1f} |",
        f"| `hf-dspark regenerate` (continuous batching) | {ours['answer_tokens']} | {ours['seconds']:.1f} | "
        f"{ours['tokens_per_second']:.1f} |",
        "",
        f"Ratio: {ours['tokens_per_second'] / (stock_tokens / stock_seconds):.2f}x. Greedy answers identical to "
        f"stock `generate`: {same} of {len(records)}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
