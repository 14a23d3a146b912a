"""Side-by-side speed benchmark: plain `generate`, HF prompt-lookup decoding and hf_dspark drafters, interleaved
prompt by prompt in one run so machine noise hits every method alike.

Reported per method: tokens/s, speed-up over plain, tau, mean draft length, per-slot conditional acceptance (the
suffix-decay curve), the share of round time spent in each phase (verification, backbone, sequential head), and,
for greedy decoding, how many outputs are identical to plain greedy.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch

from ..generation.round.stats import SpeculativeStats
from ..policy.state import DraftingState
from .metrics import acceptance_summary
from .prompts import chat_input_ids, load_prompt_sets

PROMPT_LOOKUP = "prompt-lookup"
PLAIN = "plain"


def held_out_prompts(benchmarks: list[str], per_benchmark: int) -> list[tuple[str, str]]:
    """The first `per_benchmark` first turns of each shipped eval set (never used for training)."""
    sets = load_prompt_sets(benchmarks, max_prompts=per_benchmark)
    return [(name, prompt.turns[0]) for name, prompts in sets.items() for prompt in prompts]


@dataclass
class MethodResult:
    tokens: int = 0
    seconds: float = 0.0
    identical: int = 0
    compared: int = 0
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    by_benchmark: dict[str, SpeculativeStats] = field(default_factory=dict)
    prompt_rates: list[float] = field(default_factory=list)

    def summary(self, plain_rate: float | None, plain_prompt_rates: list[float] | None = None) -> dict:
        rate = self.tokens / self.seconds if self.seconds else float("nan")
        out = {"tokens_per_s": round(rate, 2), "speedup": round(rate / plain_rate, 3) if plain_rate else None}
        if plain_prompt_rates:
            # Each prompt against plain decoding of the same prompt, measured beside it.
            ratios = [mine / plain for mine, plain in zip(self.prompt_rates, plain_prompt_rates)]
            out["speedup_by_prompt"] = [round(r, 3) for r in ratios]
            out["speedup_geomean"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
            out["speedup_min"] = round(min(ratios), 3)
        if self.stats.num_rounds:
            out["rounds_by_source"] = {source: self.stats.count(source) for source in ("drafter", "suffix", "none")}
            drafter_only = self.stats.only("drafter")
            if drafter_only.num_rounds:
                out["drafter_round_tau"] = round(drafter_only.tau, 3)
        if self.stats.num_rounds:
            out.update(acceptance_summary(self.stats))
            out["tau_by_benchmark"] = {k: round(v.tau, 3) for k, v in self.by_benchmark.items()}
        if self.compared:
            out["identical_to_plain"] = f"{self.identical}/{self.compared}"
        return out


def run_speed_benchmark(target, tokenizer, drafters: dict, prompts: list[tuple[str, str]], *, max_new_tokens: int,
                        temperature: float, prompt_lookup_tokens: int = 10, seed: int = 0, log=print,
                        states: dict | None = None) -> dict:
    """`drafters` maps a label to a loaded drafter. Returns {method: summary} with plain and prompt lookup first.
    `states` maps a label to the `DraftingState` its rounds learn into (kept by the caller to carry it over to
    another run); by default each drafter gets a new one, shared by the prompts of this run."""
    methods = [PLAIN, PROMPT_LOOKUP, *drafters]
    results = {m: MethodResult() for m in methods}
    states = states if states is not None else {}
    for label in drafters:
        states.setdefault(label, DraftingState())  # each drafter learns across the prompts
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                                "top_p": 1.0, "top_k": 0}
    for index, (benchmark, prompt) in enumerate(prompts):
        input_ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompt}]).to(target.device)
        outputs = {}
        for method in methods:
            kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sampling)
            if method == PROMPT_LOOKUP:
                kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
            elif method != PLAIN:
                kwargs["assistant_model"] = drafters[method]
                kwargs["dspark_state"] = states[method]
            torch.manual_seed(seed + index)
            start = time.perf_counter()
            out = target.generate(input_ids, **kwargs)
            seconds = time.perf_counter() - start
            new = out[0, input_ids.shape[1]:]
            outputs[method] = new
            result = results[method]
            result.tokens += new.numel()
            result.seconds += seconds
            result.prompt_rates.append(new.numel() / seconds)
            if method in drafters:
                stats = drafters[method].last_generation_stats
                result.stats = result.stats.merge(stats)
                result.by_benchmark[benchmark] = result.by_benchmark.get(benchmark, SpeculativeStats()).merge(stats)
            if temperature == 0 and method != PLAIN:
                result.compared += 1
                result.identical += int(torch.equal(new, outputs[PLAIN]))
        log(json.dumps({"prompt": index, "benchmark": benchmark, "tokens": {m: outputs[m].numel() for m in methods},
                        **({"identical": {m: bool(torch.equal(outputs[m], outputs[PLAIN])) for m in methods[1:]}}
                           if temperature == 0 else {})}))
    plain = results[PLAIN]
    plain_rate = plain.tokens / plain.seconds
    return {m: results[m].summary(plain_rate, plain.prompt_rates) for m in methods}


def markdown_table(summaries: dict, title: str) -> str:
    lines = [f"### {title}", "", "| method | tokens/s | speed-up | per prompt: geomean / min | tau | mean draft | "
             "rounds: drafter / suffix / plain | per-slot acceptance | identical to plain | "
             "round time: verify / backbone / seq. head / drafting |", "|---" * 10 + "|"]
    for method, s in summaries.items():
        share = s.get("time_share", {})
        shares = " / ".join(f"{share[k]:.2f}" if k in share else "-"
                            for k in ("verification", "backbone", "sequential_head", "drafting"))
        slots = ", ".join("-" if x is None else f"{x:.2f}" for x in s.get("acceptance_by_slot", []))
        tau, draft = (f"{s['tau']:.3f}", f"{s['mean_draft_length']:.2f}") if "tau" in s else ("-", "-")
        per_prompt = (f"{s['speedup_geomean']:.2f}x / {s['speedup_min']:.2f}x" if method != PLAIN and "speedup_min" in s
                      else "-")
        sources = s.get("rounds_by_source")
        rounds = " / ".join(str(sources[k]) for k in ("drafter", "suffix", "none")) if sources else "-"
        lines.append(f"| {method} | {s['tokens_per_s']:.1f} | {s['speedup']:.2f}x | {per_prompt} | {tau} | {draft} | "
                     f"{rounds} | {slots or '-'} | {s.get('identical_to_plain', '-')} | {shares if share else '-'} |")
    return "\n".join(lines) + "\n"
