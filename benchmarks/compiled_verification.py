"""Compiled verification at batch 1, side by side in one run: plain greedy, plain greedy compiled (stock generate with
a static cache), our loop eager (the default dynamic cache) and our loop compiled (`cache_implementation="static"`).

    python benchmarks/compiled_verification.py [--smollm2] [--output benchmarks/compiled-verification/results.txt]

The tiny target is a random 4-layer Llama with a random DSpark drafter (its tau is about 1: what is measured there is
the loop's and the forwards' overhead); `--smollm2` adds the default SmolLM2-135M-Instruct target with the shipped
DSpark drafter as `hf-dspark generate` runs it (cost table, round planning, suffix drafting). Each configuration runs
every prompt once untimed (compiling the shapes it meets; its seconds are reported as `first pass`), then once timed,
the four modes interleaved per prompt so machine noise hits them alike. Every output is checked against plain greedy.

On a CPU stock `generate` compiles only when the compile config says `_compile_all_devices`; this script sets it, with
the compile config otherwise at transformers' defaults (inductor, mode "reduce-overhead", dynamic shapes after the
second shape) unless `--static-shapes`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import hf_dspark
from hf_dspark.generation.one_prompt.target_runners import verification_buckets

MODES = ("plain", "plain compiled", "ours eager", "ours compiled")


def tiny_models(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    target = LlamaForCausalLM(config).eval()
    drafter_config = hf_dspark.DSparkDraftConfig.from_target_config(config, num_hidden_layers=2, block_size=4,
                                                                   markov_head="markov", markov_rank=32)
    drafter = hf_dspark.DSparkDraftModel(drafter_config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(2, config.vocab_size, (1, length), generator=generator) for length in (24, 40, 56)]
    return target, drafter, prompts


def smollm2_models(count: int):
    from hf_dspark.cli.generate import cost_table_for
    from hf_dspark.evaluation import benchmark_path
    from hf_dspark.evaluation.prompts import chat_prompt_ids
    from hf_dspark.targets.default_target import load_default_target
    from hf_dspark.models.loading import load_drafter, shipped_drafter_path

    target, tokenizer = load_default_target(dtype=torch.float32)
    drafter = load_drafter(shipped_drafter_path("dspark"), torch.float32)
    drafter.attach_target(target, follow=True)
    drafter.generation_config.dspark_cost_table = cost_table_for(target, drafter, "smollm2-135m-instruct")
    prompts = []
    for name in ("gsm8k", "humaneval", "mt-bench"):
        for line in benchmark_path(name).read_text().splitlines()[:count]:
            prompts.append(torch.tensor([chat_prompt_ids(tokenizer, json.loads(line)["turns"][0])]))
    return target, drafter, prompts


def run_mode(mode: str, target, drafter, ids, max_new_tokens: int, compile_config):
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens)
    if mode.endswith("compiled"):
        kwargs.update(cache_implementation="static", compile_config=compile_config)
    if mode.startswith("ours"):
        kwargs["assistant_model"] = drafter
    start = time.perf_counter()
    out = target.generate(ids, **kwargs)
    return out, time.perf_counter() - start


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {torch.get_num_threads()} thread(s)"


def compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def bench(name: str, target, drafter, prompts, max_new_tokens: int, compile_config, report):
    report(f"## {name}: {len(prompts)} prompts of {[p.shape[1] for p in prompts]} tokens, {max_new_tokens} new tokens, "
           f"verification buckets {verification_buckets(drafter.config.num_draft_slots, drafter.generation_config.dspark_cost_table)}")
    references = {}
    for mode in MODES:
        graphs, start = compiled_graphs(), time.perf_counter()
        for i, ids in enumerate(prompts):
            out, _ = run_mode(mode, target, drafter, ids, max_new_tokens, compile_config)
            references.setdefault(i, out)
        report(f"first pass  {mode:15s} {time.perf_counter() - start:8.1f} s  ({compiled_graphs() - graphs} graphs "
               "compiled)")
    seconds = dict.fromkeys(MODES, 0.0)
    identical = dict.fromkeys(MODES, 0)
    new_tokens, rounds, accepted = 0, 0, 0
    graphs = compiled_graphs()
    for i, ids in enumerate(prompts):
        for mode in MODES:
            out, took = run_mode(mode, target, drafter, ids, max_new_tokens, compile_config)
            seconds[mode] += took
            identical[mode] += bool(torch.equal(out, references[i]))
            if mode == "ours compiled":
                stats = drafter.last_generation_stats
                rounds, accepted = rounds + stats.num_rounds, accepted + sum(stats.accepted)
        new_tokens += references[i].shape[1] - ids.shape[1]
    tau = (accepted + rounds) / rounds
    report(f"timed pass (graphs compiled during it: {compiled_graphs() - graphs}); tau {tau:.3f}")
    report(f"{'mode':15s} {'tok/s':>8s} {'vs plain':>9s} {'identical':>10s}")
    for mode in MODES:
        report(f"{mode:15s} {new_tokens / seconds[mode]:8.2f} {seconds['plain'] / seconds[mode]:8.2f}x "
               f"{identical[mode]:>5d}/{len(prompts)}")
    report("")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", action="store_true", help="also the default SmolLM2-135M-Instruct target")
    parser.add_argument("--prompts-per-benchmark", type=int, default=2, help="SmolLM2 prompts from each of 3 sets")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: generate's, inductor)")
    parser.add_argument("--static-shapes", action="store_true", help="compile with dynamic=False (one graph a shape)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="also write the report to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compile_config = CompileConfig(backend=args.backend, dynamic=False if args.static_shapes else None)
    compile_config._compile_all_devices = True  # stock generate compiles on a CPU only with this

    lines = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    report(f"# command: python {' '.join(sys.argv)}")
    report(f"# machine: {machine()}, torch "
           f"{torch.__version__}, transformers {__import__('transformers').__version__}, fp32, compile config "
           f"{compile_config.to_dict()}")
    report("")
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256), torch.no_grad():
        bench("tiny Llama (random, 4 layers, hidden 256)", *tiny_models(), args.max_new_tokens, compile_config, report)
        torch._dynamo.reset()
        if args.smollm2:
            target, drafter, prompts = smollm2_models(args.prompts_per_benchmark)
            bench("SmolLM2-135M-Instruct + shipped DSpark drafter (generate's defaults)", target, drafter, prompts,
                  args.max_new_tokens, compile_config, report)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
