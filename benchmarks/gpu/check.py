"""The measurements of the prepared GPU check (`bash benchmarks/gpu/check.sh`; README.md beside this file).

Targets are Qwen3 models with random weights of the published shapes (Qwen3-1.7B and Qwen3-8B, bf16), so no weights
travel; the drafter has DeepSpec's preset shape for its target. Random weights accept nothing, so an oracle forces a
chosen acceptance (`AcceptanceOracle`) and the decoding loop runs its real code with it. Every part writes its
numbers into `results.json` as soon as each is measured (and re-renders `results.md`), so a part stopped by its time
limit still leaves what it measured. Every GPU phase is timed with the device synchronised around the clock.

    python benchmarks/gpu/check.py configs --output .gpu-carry/configs        # the targets' configs (prepare.sh)
    python benchmarks/gpu/check.py environment --results OUT --profile gpu     # versions, device
    python benchmarks/gpu/check.py costs|rounds|train --results OUT --profile gpu --seconds 120
    python benchmarks/gpu/check.py report --results OUT                       # results.md (also after each part)

`--profile cpu-smoke` runs the same code on a tiny Qwen3-shaped target on the CPU (check.sh --cpu-smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import AcceptanceOracle  # noqa: E402  (benchmarks/oracle.py: the same oracle as the CPU benchmarks)

# ---------------------------------------------------------------------------------------------------------------------
# What is measured where
# ---------------------------------------------------------------------------------------------------------------------

QWEN3_COMMON = {
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    # <|endoftext|> pads (as Qwen's tokenizer does); EOS is left unset so that every run emits its full token count.
    "bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": None,
}
# The published shapes (the models' config.json on the Hub); random weights of these shapes cost what the real ones do.
TARGET_SHAPES = {
    "qwen3-8b": {"hub_name": "Qwen/Qwen3-8B", "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False},
    "qwen3-1.7b": {"hub_name": "Qwen/Qwen3-1.7B", "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True},
    # The CPU smoke run: Qwen3's architecture at a size that runs in seconds on two cores.
    "qwen3-tiny": {"hub_name": None, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True,
                   "vocab_size": 512, "max_position_embeddings": 1024, "bos_token_id": 1, "pad_token_id": 0},
}
# DeepSpec's drafter shape (5 layers, block 7, Markov rank 256, confidence head; its Qwen3 mask token). Qwen3-8B has a
# preset in hf_dspark (DSparkDraftConfig.for_target); Qwen3-1.7B gets the same shape with evenly spread target layers.
DEEPSPEC_SHAPE = {"num_hidden_layers": 5, "block_size": 7, "markov_head": "markov", "markov_rank": 256,
                  "confidence_head": True, "mask_token_id": 151669}
TINY_DRAFTER = {"num_hidden_layers": 2, "block_size": 4, "markov_head": "markov", "markov_rank": 16,
                "confidence_head": True}


@dataclass
class Profile:
    device: str
    targets: list[str]
    dtype: str = "bfloat16"
    cost_tokens: int = 16  # verification forwards over 1..cost_tokens new tokens
    cost_rows: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    cost_context: int = 512
    cost_repeats: int = 5
    round_rows: list[int] = field(default_factory=lambda: [1, 8, 64])
    acceptances: list[float] = field(default_factory=lambda: [0.6, 0.9])
    prompt_length: int = 128
    new_tokens: dict = field(default_factory=lambda: {1: 128, 8: 64, 64: 64})
    train_batch: int = 2
    train_length: int = 2048
    train_prompt: int = 128  # tokens per sequence outside the loss (the prompt)
    train_anchors: int = 512  # DeepSpec's anchors per sequence
    train_steps: int = 6  # timed steps
    train_warmup: int = 2  # steps before the timed ones (allocator, kernels)


PROFILES = {
    "gpu": Profile(device="cuda", targets=["qwen3-8b", "qwen3-1.7b"]),
    "cpu-smoke": Profile(device="cpu", targets=["qwen3-tiny"], cost_tokens=4, cost_rows=[1, 2], cost_context=16,
                         cost_repeats=2, round_rows=[1, 2], prompt_length=8, new_tokens={1: 24, 2: 16},
                         train_batch=2, train_length=48, train_prompt=8, train_anchors=8, train_steps=2,
                         train_warmup=1),
}


def target_config(configs: Path, name: str):
    """The target's config as prepare.sh wrote it (`configs` subcommand)."""
    from transformers import Qwen3Config

    path = configs / name / "config.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `bash benchmarks/gpu/prepare.sh` (or `python benchmarks/gpu/check.py "
                         f"configs --output {configs}`) and carry {configs} to the GPU machine.")
    return Qwen3Config.from_json_file(str(path))


def write_configs(output: Path) -> None:
    from transformers import Qwen3Config

    for name, shape in TARGET_SHAPES.items():
        fields = {**QWEN3_COMMON, **{k: v for k, v in shape.items() if k != "hub_name"}}
        config = Qwen3Config(**fields)
        config.architectures = ["Qwen3ForCausalLM"]
        (output / name).mkdir(parents=True, exist_ok=True)
        config.to_json_file(str(output / name / "config.json"))
        print(f"{output / name / 'config.json'}: {shape['hub_name'] or 'smoke-test'} shape, "
              f"{config.num_hidden_layers} layers, hidden {config.hidden_size}")


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_target(configs: Path, name: str, profile: Profile):
    """Random weights of the target's shape, made on the device itself (an 8B model is 16 GB: no CPU round trip)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(profile.device):
        target = AutoModelForCausalLM.from_config(target_config(configs, name), dtype=getattr(torch, profile.dtype),
                                                  attn_implementation="sdpa")
    target.generation_config.eos_token_id = None  # no stop token: every run emits exactly its token count
    target.generation_config.pad_token_id = target.config.pad_token_id
    return target.eval().requires_grad_(False)


def drafter_config(target, name: str):
    import hf_dspark

    if name == "qwen3-tiny":
        return hf_dspark.DSparkDraftConfig.from_target_config(target.config, **TINY_DRAFTER)
    hub_name = TARGET_SHAPES[name]["hub_name"]
    if hub_name in hf_dspark.models.configuration_dspark.DEEPSPEC_PRESETS:
        return hf_dspark.DSparkDraftConfig.for_target(hub_name, target_config=target.config)
    return hf_dspark.DSparkDraftConfig.from_target_config(target.config, **DEEPSPEC_SHAPE)


def build_drafter(target, name: str, profile: Profile, dtype: torch.dtype):
    """A DSpark drafter of DeepSpec's shape for `target`, drafting whole blocks every round: no cost table, no round
    planning, no suffix proposals, no confidence stop, so the measured rounds are the drafter's own."""
    import hf_dspark

    torch.manual_seed(1)
    with torch.device(profile.device), default_dtype(dtype):
        drafter = hf_dspark.DSparkDraftModel(drafter_config(target, name))
    drafter.generation_config.update(dspark_round_planning=False, dspark_suffix_drafting=False,
                                     dspark_cost_table=None, assistant_confidence_threshold=None,
                                     dspark_verification_policy="all")
    return drafter


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# The oracle and the phase clock
# ---------------------------------------------------------------------------------------------------------------------


class PhaseTimer:
    """Seconds of each phase of `generate` calls, the device synchronised at every phase boundary.

    prefill: the first target forward of each call; verification: every later target forward; drafting: from the
    drafter's first forward of a round (its backbone pass) to the next target forward, which takes in the sequential
    head, the token choices and the drafter's bookkeeping; oracle: the oracle's logit rewrite. Loop overhead is the
    call's wall time minus all of these (generate's setup, verification rule, cache crops, stopping checks, emitting).
    """

    def __init__(self, target, drafter):
        self.target, self.drafter, self.device = target, drafter, target.device
        self.seconds: dict[str, float] = {}
        self.target_forwards = 0
        self._forward_started: float | None = None
        self._drafting_since: float | None = None
        self._handles: list = []
        self._first_of_call = True

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def new_call(self) -> None:
        self._first_of_call = True

    def __enter__(self) -> "PhaseTimer":
        # prepend: the clock's post-hook runs before the oracle's, so the rewrite is timed apart from the forward.
        self._handles = [
            self.target.register_forward_pre_hook(self._target_starts, prepend=True),
            self.target.register_forward_hook(self._target_ends, prepend=True),
            self.drafter.register_forward_pre_hook(self._drafter_starts),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _target_starts(self, module, args):
        synchronize(self.device)
        now = time.perf_counter()
        if self._drafting_since is not None:
            self.add("drafting", now - self._drafting_since)
            self._drafting_since = None
        self._forward_started = now

    def _target_ends(self, module, args, output):
        synchronize(self.device)
        self.add("prefill" if self._first_of_call else "verification", time.perf_counter() - self._forward_started)
        self._first_of_call = False
        self.target_forwards += 1

    def _drafter_starts(self, module, args):
        if self._drafting_since is None:
            synchronize(self.device)
            self._drafting_since = time.perf_counter()


def timed(device: torch.device, fn):
    """(result, wall seconds) with the device synchronised before and after."""
    synchronize(device)
    started = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - started


def random_prompts(rows: int, length: int, vocab: int, pad: int, device: torch.device, seed: int):
    """Left-padded random prompts of lengths between 3/4 of `length` and `length` (one row: exactly `length`)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((rows, length), pad, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        real = length if rows == 1 else int(torch.randint(3 * length // 4, length + 1, (1,), generator=generator))
        ids[row, length - real :] = torch.randint(0, vocab, (real,), generator=generator)
        mask[row, length - real :] = 1
    return ids.to(device), mask.to(device)


# ---------------------------------------------------------------------------------------------------------------------
# Results: one JSON file, rewritten after every measurement, and its Markdown rendering
# ---------------------------------------------------------------------------------------------------------------------


class Results:
    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / "results.json"
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def section(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def save(self) -> None:
        temporary = self.path.with_suffix(".json.part")
        temporary.write_text(json.dumps(self.data, indent=1, sort_keys=False))
        os.replace(temporary, self.path)
        (self.folder / "results.md").write_text(render_markdown(self.data))


def billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def ms(seconds) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.2f}"


def render_markdown(data: dict) -> str:
    env = data.get("environment", {})
    lines = ["# GPU check of hf_dspark", ""]
    if env:
        lines += [f"- profile `{env.get('profile')}`, {env.get('when')}; device: {env.get('device_name')}",
                  f"- torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')} "
                  f"({env.get('transformers_origin')}), huggingface_hub {env.get('huggingface_hub')}, "
                  f"python {env.get('python')}",
                  f"- command: `{env.get('command')}`", ""]
    parts = data.get("parts", {})
    if parts:
        lines += ["| part | status | seconds | limit |", "|---|---|---|---|"]
        lines += [f"| {name} | {p.get('status')} | {p.get('seconds')} | {p.get('limit')} |" for name, p in parts.items()]
        lines.append("")

    tests = data.get("tests", {})
    if tests:
        lines += ["## Lossless tests on the device (`pytest -k cuda`)", "",
                  f"{tests.get('summary', '')}", ""]
        counts = tests.get("counts", {})
        if counts:
            lines.append(", ".join(f"{k}: {v}" for k, v in counts.items()))
            lines.append("")
        for name in tests.get("failed", [])[:40]:
            lines.append(f"- FAILED `{name}`")
        if tests.get("skip_reasons"):
            lines += [f"- skipped: {reason}" for reason in tests["skip_reasons"][:3]]
        lines.append("")

    for name, costs in data.get("costs", {}).items():
        by_rows = costs.get("rows", {})
        if not by_rows:
            continue
        lines += [f"## Verification cost, {name} ({costs.get('dtype')}, {billions(costs.get('parameters', 0))} "
                  f"parameters, {costs.get('context_length')}-token context)", "",
                  "Target forward milliseconds over n new tokens per row (median of "
                  f"{costs.get('repeats')}), by batch rows; in brackets: relative to n = 1.", ""]
        rows = list(by_rows)
        lines += ["| n | " + " | ".join(f"rows {r}" for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
        longest = max(len(by_rows[r]["seconds"]) for r in rows)
        for n in range(longest):
            cells = []
            for r in rows:
                seconds = by_rows[r]["seconds"]
                cells.append(f"{ms(seconds[n])} ({seconds[n] / seconds[0]:.2f})" if n < len(seconds) else "-")
            lines.append(f"| {n + 1} | " + " | ".join(cells) + " |")
        lines.append("| drafting round | " + " | ".join(ms(by_rows[r].get("draft_seconds")) for r in rows) + " |")
        methods = "; ".join(f"rows {r}: {by_rows[r].get('method', '')}" for r in rows)
        lines += ["", f"Measured with {methods}. The last line is one drafting round of the drafter over the rows.", ""]

    rounds = [r for target in data.get("rounds", {}).values() for r in target.get("runs", [])]
    if rounds:
        lines += ["## Rounds at batch R with a forced acceptance a (greedy)", "",
                  "Per-round milliseconds, device synchronised at each phase boundary (instrumented run); tokens/s "
                  "and speed-up from a second, uninstrumented run against plain `generate` on the same prompts.", "",
                  "| target | R | a | tau | tau forced | rounds | drafting | verification | overhead | oracle | "
                  "prefill (ms, once) | tok/s | plain tok/s | speed-up |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rounds:
            per = r["per_round_seconds"]
            lines.append(
                f"| {r['target']} | {r['rows']} | {r['acceptance']} | {r['tau']:.2f} | {r['tau_forced']:.2f} | "
                f"{r['rounds']} | {ms(per.get('drafting'))} | {ms(per.get('verification'))} | "
                f"{ms(per.get('loop_overhead'))} | {ms(per.get('oracle'))} | {ms(r['seconds'].get('prefill'))} | "
                f"{r['tokens_per_second']:.1f} | {r['plain_tokens_per_second']:.1f} | {r['speedup']:.2f}x |")
        lines.append("")
        for name, target in data.get("rounds", {}).items():
            if target.get("oracle_check"):
                checks = "; ".join(f"{k}: {v}" for k, v in target["oracle_check"].items())
                lines += [f"Oracle check on {name} (a = 0 accepts no draft, a = 1 every one): {checks}.", ""]

    training = data.get("train", {})
    if training:
        lines += ["## Trainer throughput (DSparkTrainer, synthetic data, bf16 autocast, fp32 master weights)", "",
                  "| target | batch x length | anchors/seq | step s (median) | target tokens/s | block slots/s | "
                  "peak GB |", "|---|---|---|---|---|---|---|"]
        for name, t in training.items():
            if "step_seconds" not in t:
                continue
            lines.append(f"| {name} | {t['batch']} x {t['length']} | {t['anchors']} | {t['median_step_seconds']:.3f} | "
                         f"{t['target_tokens_per_second']:.0f} | {t['block_slots_per_second']:.0f} | "
                         f"{t.get('peak_memory_gb', '-')} |")
        lines.append("")

    errors = [(part, e) for part, messages in data.get("errors", {}).items() for e in messages]
    if errors:
        lines += ["## Errors", ""] + [f"- {part}: `{error}`" for part, error in errors] + [""]
    return "\n".join(lines)


class OutOfTime(Exception):
    pass


class Deadline:
    """The part's own time limit, kept a little inside check.sh's hard limit so that it stops between measurements
    rather than being killed in one."""

    def __init__(self, seconds: float | None, margin: float = 10.0):
        self.end = None if seconds is None else time.monotonic() + max(seconds - margin, 1.0)

    def check(self, what: str) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise OutOfTime(f"out of time before {what}")


def record_error(results: Results, part: str, error: BaseException) -> None:
    message = str(error).splitlines()[0][:300] if str(error) else ""
    results.section("errors").setdefault(part, []).append(f"{type(error).__name__}: {message}")
    results.save()


# ---------------------------------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------------------------------


def environment(results: Results, profile_name: str, command: str) -> None:
    import transformers

    import hf_dspark

    env = {
        "profile": profile_name, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "transformers_origin": str(Path(transformers.__file__).parent.parent),
        "huggingface_hub": importlib.metadata.version("huggingface_hub"),
        "hf_dspark": str(Path(hf_dspark.__file__).parent), "cpu_threads": torch.get_num_threads(),
        "device_name": "cpu", "settings": asdict(PROFILES[profile_name]),
    }
    for package in ("accelerate", "peft", "pytest"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        env.update(device_name=properties.name, device_memory_gb=round(properties.total_memory / 2**30, 1),
                   capability=f"{properties.major}.{properties.minor}",
                   multiprocessors=properties.multi_processor_count)
    elif PROFILES[profile_name].device == "cuda":
        env["device_name"] = "NO CUDA DEVICE VISIBLE"
    results.data["environment"] = env
    results.save()
    print(json.dumps(env, indent=1))


def forward_costs(target, rows: int, max_tokens: int, context_length: int, repeats: int, warmup: int = 2) -> list[float]:
    """Median seconds of one target forward of shape (rows, n) after a rows x context_length prefix, n = 1..max_tokens:
    `profile_verification_costs`' measurement, on the shapes a batch of `rows` requests verifies with n - 1 drafts
    each. (`profile_verification_costs(rows=R)` prices n tokens in total over R rows, every total from 1 up; its
    entries at R * n tokens are these forwards, and timing all R * 16 totals at R = 64 would not fit the budget.)"""
    device = target.device
    vocab = target.config.vocab_size
    with torch.no_grad():
        prefix = torch.randint(0, vocab, (rows, context_length), device=device)
        cache = target(input_ids=prefix, use_cache=True, logits_to_keep=1).cache
        seconds = []
        for n in range(1, max_tokens + 1):
            times = []
            for attempt in range(warmup + repeats):
                tokens = torch.randint(0, vocab, (rows, n), device=device)
                _, elapsed = timed(device, lambda: target(input_ids=tokens, cache=cache, use_cache=True))
                cache.crop(-n)
                if attempt >= warmup:
                    times.append(elapsed)
            seconds.append(statistics.median(times))
    return seconds


def measure_costs(results: Results, configs: Path, profile: Profile, deadline: Deadline) -> None:
    from hf_dspark.evaluation.profiling import profile_verification_costs

    for name in profile.targets:
        deadline.check(f"the {name} cost curve")
        target = build_target(configs, name, profile)
        drafter = build_drafter(target, name, profile, target.dtype)
        entry = results.section("costs").setdefault(name, {})
        entry.update(dtype=profile.dtype, parameters=parameter_count(target), context_length=profile.cost_context,
                     repeats=profile.cost_repeats, rows={})
        for rows in profile.cost_rows:
            deadline.check(f"{name} at {rows} rows")
            kwargs = dict(max_tokens=profile.cost_tokens, context_length=profile.cost_context,
                          repeats=profile.cost_repeats)
            if rows == 1:
                table = profile_verification_costs(target, drafter=drafter, **kwargs)
                seconds, method = table.seconds, "profile_verification_costs"
            else:
                seconds = forward_costs(target, rows, profile.cost_tokens, profile.cost_context, profile.cost_repeats)
                method = "forward_costs: (R, n) forwards"
                # The drafter's round over R rows, from the package's profiler (one verification size is enough).
                table = profile_verification_costs(target, drafter=drafter, rows=rows, **dict(kwargs, max_tokens=1))
            entry["rows"][str(rows)] = {"seconds": seconds, "method": method, "draft_seconds": table.draft_seconds}
            results.save()
            print(f"costs {name} rows {rows}: " + " ".join(ms(s) for s in seconds) + " ms", flush=True)
        del target, drafter
        empty_cache(profile)


def measure_rounds(results: Results, configs: Path, profile: Profile, deadline: Deadline) -> None:
    for name in profile.targets:
        deadline.check(f"the {name} rounds")
        target = build_target(configs, name, profile)
        drafter = build_drafter(target, name, profile, target.dtype)
        device = target.device
        gamma = drafter.config.block_size
        entry = results.section("rounds").setdefault(name, {})
        entry.update(runs=[], drafter={"layers": drafter.config.num_hidden_layers, "block_size": gamma,
                              "target_layer_ids": drafter.config.target_layer_ids,
                              "markov_rank": drafter.config.markov_rank, "parameters": parameter_count(drafter)})
        entry["oracle_check"] = check_oracle(target, drafter, profile)
        results.save()
        for rows in profile.round_rows:
            deadline.check(f"{name} at R = {rows}")
            new_tokens = profile.new_tokens[rows]
            ids, mask = random_prompts(rows, profile.prompt_length, target.config.vocab_size,
                                       target.config.pad_token_id, device, seed=rows)
            plain_kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens)
            spec_kwargs = dict(plain_kwargs, assistant_model=drafter)
            with torch.no_grad():
                # Warm-up at the shapes measured (kernel choice, allocator), then plain decoding as the reference.
                target.generate(ids, **dict(plain_kwargs, max_new_tokens=min(8, new_tokens)))
                with AcceptanceOracle(target, profile.acceptances[-1], seed=99):
                    target.generate(ids, **dict(spec_kwargs, max_new_tokens=min(3 * gamma, new_tokens)))
                plain, plain_seconds = timed(device, lambda: target.generate(ids, **plain_kwargs))
            if plain.shape[1] != ids.shape[1] + new_tokens:
                raise RuntimeError(f"plain generate emitted {plain.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
            for acceptance in profile.acceptances:
                deadline.check(f"{name} at R = {rows}, a = {acceptance}")
                run = measure_one_setting(target, drafter, ids, spec_kwargs, acceptance, rows, new_tokens)
                run.update(target=name, plain_seconds=plain_seconds,
                           plain_tokens_per_second=rows * new_tokens / plain_seconds,
                           speedup=plain_seconds / run["uninstrumented_seconds"])
                entry["runs"].append(run)
                results.save()
                print(f"rounds {name} R={rows} a={acceptance}: tau {run['tau']:.2f} (forced {run['tau_forced']:.2f}), "
                      f"{run['tokens_per_second']:.1f} tok/s vs plain {run['plain_tokens_per_second']:.1f}; per round "
                      + ", ".join(f"{k} {ms(v)} ms" for k, v in run["per_round_seconds"].items()), flush=True)
        del target, drafter
        empty_cache(profile)


def check_oracle(target, drafter, profile: Profile) -> dict:
    """Before anything is timed: a = 1 must accept every drafted slot of every round and a = 0 none, at batch 1 and
    in the batched engine, or the forced acceptances of the timed runs would mean nothing."""
    gamma = drafter.config.block_size
    found = {}
    for rows in sorted({1, max(profile.round_rows)}):
        ids, mask = random_prompts(rows, profile.prompt_length, target.config.vocab_size, target.config.pad_token_id,
                                   target.device, seed=7)
        for acceptance in (0.0, 1.0):
            with torch.no_grad(), AcceptanceOracle(target, acceptance, seed=7):
                target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                max_new_tokens=3 * (gamma + 1))
            stats = drafter.last_generation_stats
            wanted = [length if acceptance == 1.0 else 0 for length in stats.draft_lengths]
            if stats.accepted != wanted or not any(stats.draft_lengths):
                raise RuntimeError(f"the acceptance oracle did not force a = {acceptance} at R = {rows}: drafted "
                                   f"{stats.draft_lengths}, accepted {stats.accepted}")
            found[f"R={rows} a={acceptance}"] = f"ok: tau {stats.tau:.2f} over {stats.num_rounds} request-rounds"
    return found


def measure_one_setting(target, drafter, ids, spec_kwargs, acceptance, rows, new_tokens) -> dict:
    device = target.device
    gamma = drafter.config.block_size
    with torch.no_grad(), AcceptanceOracle(target, acceptance, seed=rows) as oracle:
        out, uninstrumented = timed(device, lambda: target.generate(ids, **spec_kwargs))
        stats_uninstrumented = drafter.last_generation_stats
        with PhaseTimer(target, drafter) as clock:
            oracle.clock = clock
            clock.new_call()
            drafter.generation_config.dspark_time_phases = True  # the loop's own phase clocks (batch 1), synchronised on the GPU too
            try:
                out, wall = timed(device, lambda: target.generate(ids, **spec_kwargs))
            finally:
                drafter.generation_config.dspark_time_phases = None  # back to the default: off on accelerators, on on the CPU
        oracle.clock = None
    forced = oracle.counts()
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"speculative generate emitted {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    stats = drafter.last_generation_stats
    verification_rounds = clock.target_forwards - 1  # the first forward is the prefill
    measured = dict(clock.seconds)
    measured["loop_overhead"] = wall - sum(clock.seconds.values())
    per_round = {phase: measured.get(phase, 0.0) / max(verification_rounds, 1)
                 for phase in ("drafting", "verification", "loop_overhead", "oracle")}
    return {
        "rows": rows, "acceptance": acceptance, "new_tokens_per_row": new_tokens,
        "rounds": verification_rounds, "tau": stats.tau, "tau_uninstrumented_run": stats_uninstrumented.tau,
        "tau_forced": 1 + sum(acceptance**j for j in range(1, gamma + 1)),
        "mean_draft_length": stats.mean_draft_length,
        "acceptance_by_slot": [round(x, 4) for x in stats.acceptance_by_slot()],
        "seconds": measured, "wall_seconds": wall, "per_round_seconds": per_round,
        "package_phase_seconds": dict(stats.seconds),  # the loop's own clocks (batch 1, time_phases)
        "oracle_counts": forced,  # both runs  # the loop's own clocks (batch 1; unsynchronised)
        "uninstrumented_seconds": uninstrumented, "tokens_per_second": rows * new_tokens / uninstrumented,
    }


def measure_training(results: Results, configs: Path, profile: Profile, deadline: Deadline) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from hf_dspark.training import DSparkTrainer

    class StepClock(TrainerCallback):
        def __init__(self, device):
            self.device, self.seconds, self._started = device, [], None

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(self.device)
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(self.device)
            self.seconds.append(time.perf_counter() - self._started)

    for name in profile.targets:
        deadline.check(f"training against {name}")
        target = build_target(configs, name, profile)
        # fp32 master weights, bf16 autocast (TrainingArguments.bf16): DeepSpec's recipe.
        drafter = build_drafter(target, name, profile, torch.float32).train()
        generator = torch.Generator().manual_seed(0)
        vocab, length, prompt = target.config.vocab_size, profile.train_length, profile.train_prompt
        examples = [{"input_ids": torch.randint(0, vocab, (length,), generator=generator).tolist(),
                     "loss_mask": [0] * prompt + [1] * (length - prompt)}
                    for _ in range(profile.train_batch * (profile.train_steps + profile.train_warmup))]
        device = target.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        clock = StepClock(device)
        with tempfile.TemporaryDirectory() as scratch:
            args = TrainingArguments(
                output_dir=scratch, per_device_train_batch_size=profile.train_batch,
                max_steps=profile.train_steps + profile.train_warmup, learning_rate=6e-4, lr_scheduler_type="constant",
                weight_decay=0.0, max_grad_norm=1.0, bf16=True, logging_steps=10**6, save_strategy="no", report_to=[],
                use_cpu=device.type == "cpu", disable_tqdm=True, dataloader_num_workers=0, seed=0)
            trainer = DSparkTrainer(model=drafter, target=target, args=args, train_dataset=examples,
                                    num_anchors=profile.train_anchors, callbacks=[clock])
            trainer.train()
        timed_steps = clock.seconds[profile.train_warmup:]
        if not timed_steps:
            raise RuntimeError(f"the trainer ran {len(clock.seconds)} steps, fewer than the warm-up "
                               f"({profile.train_warmup}) plus one")
        median = statistics.median(timed_steps)
        block_slots = profile.train_batch * profile.train_anchors * drafter.config.block_size
        entry = {"batch": profile.train_batch, "length": length, "anchors": profile.train_anchors,
                 "block_size": drafter.config.block_size, "drafter_parameters": parameter_count(drafter),
                 "step_seconds": clock.seconds, "median_step_seconds": median,
                 "target_tokens_per_second": profile.train_batch * length / median,
                 "block_slots_per_second": block_slots / median,
                 "final_loss": next((log["train_loss"] for log in reversed(trainer.state.log_history)
                                     if "train_loss" in log), None)}
        if device.type == "cuda":
            entry["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
        results.section("train")[name] = entry
        results.save()
        print(f"train {name}: median step {median:.3f} s, {entry['target_tokens_per_second']:.0f} target tokens/s, "
              f"{entry['block_slots_per_second']:.0f} block slots/s", flush=True)
        del trainer, target, drafter
        empty_cache(profile)


def empty_cache(profile: Profile) -> None:
    if profile.device == "cuda":
        torch.cuda.empty_cache()


def summarise_tests(results: Results, log: Path, rc: int) -> None:
    """Per-test outcomes from pytest's verbose log (it stays readable when pytest is stopped by its time limit)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    outcomes = {}
    for test, outcome in re.findall(r"(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", text):
        outcomes[test] = outcome
    for outcome, test in re.findall(r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(tests/\S+::\S+)", text):
        outcomes[test] = outcome
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    summary = [line.strip("= ") for line in text.splitlines() if re.match(r"^=+ .*(passed|failed|skipped|error)", line)]
    results.data["tests"] = {
        "returncode": rc, "counts": counts, "summary": summary[-1] if summary else "(no pytest summary line)",
        "failed": sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR")),
        "skip_reasons": sorted(set(re.findall(r"SKIPPED \[\d+\] \S+: (.+)", text))),
    }
    results.save()


def mark_part(results: Results, part: str, rc: int, seconds: float, limit: float | None) -> None:
    status = {0: "ok", 124: "stopped at its time limit", 125: "skipped: the budget was spent",
              137: "killed at its time limit"}.get(rc, f"failed (exit {rc})")
    finished = results.data.get("finished", {}).get(part)
    if rc in (124, 137) and finished:
        status = "ok (everything measured; the limit came as it exited)"
    elif rc == 0 and results.data.get("errors", {}).get(part):
        status = "stopped early (see errors)"
    results.section("parts")[part] = {"status": status, "seconds": round(seconds, 1), "limit": limit}
    results.save()


# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["configs", "environment", "costs", "rounds", "train", "tests-summary",
                                         "mark", "report"])
    parser.add_argument("--results", type=Path, help="folder of results.json / results.md ($OUT on the GPU machine)")
    parser.add_argument("--output", type=Path, help="configs: the folder to write them into")
    parser.add_argument("--configs", type=Path, default=Path(".gpu-carry/configs"))
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("PART_LIMIT") or 0) or None,
                        help="this part's time limit, in which it stops between measurements (default: $PART_LIMIT, "
                             "which check.sh sets)")
    parser.add_argument("--command", default="", help="environment: the command that ran the check")
    parser.add_argument("--part-name", help="mark: the part whose status is recorded")
    parser.add_argument("--limit", type=float, help="mark: the part's time limit")
    parser.add_argument("--rc", type=int, default=0, help="mark / tests-summary: the part's exit status")
    parser.add_argument("--log", type=Path, help="tests-summary: pytest's log")
    args = parser.parse_args(argv)

    if args.part == "configs":
        if args.output is None:
            parser.error("configs needs --output")
        write_configs(args.output)
        return 0
    if args.results is None:
        parser.error(f"{args.part} needs --results")
    args.results.mkdir(parents=True, exist_ok=True)
    results = Results(args.results)
    if args.part == "report":
        results.save()
        print((args.results / "results.md").read_text())
        return 0
    if args.part == "mark":
        mark_part(results, args.part_name, args.rc, args.seconds or 0.0, args.limit)
        return 0
    if args.part == "tests-summary":
        summarise_tests(results, args.log, args.rc)
        return 0

    profile = PROFILES[args.profile]
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if profile.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the gpu profile needs a CUDA device and none is visible; use --profile cpu-smoke here")
    import hf_dspark  # noqa: F401  (registers the drafters and the generate() integration)

    if args.part == "environment":
        environment(results, args.profile, args.command)
        return 0
    # check.sh stops a part with SIGTERM at its hard limit: turn it into an exception so the error is recorded.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(OutOfTime("stopped by check.sh's time limit")))
    measure = {"costs": measure_costs, "rounds": measure_rounds, "train": measure_training}[args.part]
    try:
        measure(results, args.configs, profile, Deadline(args.seconds))
        results.section("finished")[args.part] = True
        results.save()
    except OutOfTime as stop:
        record_error(results, args.part, stop)
        print(f"{args.part}: {stop}", flush=True)
    except Exception as error:
        record_error(results, args.part, error)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
