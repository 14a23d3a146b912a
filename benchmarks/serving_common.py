"""Shared pieces of the issue-31 serving benchmarks (`batched_user_path.py`, `arrivals.py`,
`engine_vs_transformers_cb.py`): prompt mixes, the chat template, plain greedy references decoded alone, run
provenance (command line, git commit) and report writing. Not a benchmark itself.
"""

from __future__ import annotations

import json
import math
import random
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
EVAL_DIRS = (Path("/work/shared/data/eval"), REPO / "hf_dspark" / "evaluation" / "data")
# Which eval sets make up each category of the mix. The drafters were never trained on any of them.
CATEGORIES = {
    "math": ("gsm8k", "math500"),
    "code": ("humaneval", "mbpp", "livecodebench"),
    "chat": ("mt-bench", "alpaca", "arena-hard-v2"),
}
# Code-editing prompts: the answer repeats most of the prompt's code (what suffix drafting and a good drafter exploit).
EDITS = (
    "the function renamed to `{name}_v2`",
    "every parameter renamed to a longer, more descriptive name",
    "the type hints removed",
    "the examples removed from the docstring",
    "the docstring turned into `#` comments above the function",
    "a first line added to the body that prints the arguments",
)


# -- provenance -------------------------------------------------------------------------------------------------------

def command_line() -> str:
    return "python " + shlex.join([sys.argv[0], *sys.argv[1:]])


def git_state() -> dict:
    """The commit (`git rev-parse --short HEAD`) and whether the tree differs from it (the files that do)."""

    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    # Porcelain lines are "XY path": the first line's leading space is part of its status, so no strip() here.
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line.strip()]
    # New files inside the package change what runs too (benchmark outputs elsewhere do not).
    changed += [line[3:] for line in git("status", "--porcelain", "--", "hf_dspark").splitlines()
                if line.startswith("??")]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "unknown", "dirty": bool(changed),
            "changed": changed}


def environment(threads: int) -> dict:
    import platform

    import transformers

    import hf_dspark

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "hf_dspark": str(Path(hf_dspark.__file__).parent),
            "threads": threads, "machine": platform.machine(), "processor": platform.processor() or None}


def provenance_lines(results: dict) -> list[str]:
    git = results["git"]
    dirty = f", dirty tree ({', '.join(git['changed'][:8])}{' ...' if len(git['changed']) > 8 else ''})" \
        if git["dirty"] else ", clean tree"
    env = results["environment"]
    where = "" if Path(env["hf_dspark"]).parent == REPO else f" (hf_dspark imported from {env['hf_dspark']})"
    return [f"Command: `{results['command']}`", "",
            f"Commit `{git['commit']}`{dirty}{where}; torch {env['torch']}, transformers {env['transformers']}, "
            f"{env['threads']} CPU threads.", ""]


# -- prompts ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    source: str  # eval set (or "code-edit:humaneval")
    index: int  # line in that set
    category: str
    text: str


def eval_dir(given: str | None) -> Path:
    for path in ([Path(given)] if given else list(EVAL_DIRS)):
        if (path / "gsm8k.jsonl").is_file():
            return path
    raise FileNotFoundError(f"no eval prompt folder found (looked in {given or ', '.join(map(str, EVAL_DIRS))})")


def read_first_turns(path: Path) -> list[str]:
    lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return [json.loads(line)["turns"][0] for line in lines]


def chat_text(tokenizer, text: str) -> str:
    """The prompt in the tokenizer's chat template, as text (what `tok(texts, padding=True)` then tokenizes)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of the chat-templated prompt, tokenized as the batched user path tokenizes it."""
    return tokenizer(chat_text(tokenizer, text)).input_ids


def category_pools(folder: Path, categories: list[str], tokenizer, max_prompt_tokens: int) -> dict[str, dict]:
    """{category: {set name: [Prompt, ...]}}: every first turn of each set whose chat-templated prompt has at most
    `max_prompt_tokens` tokens."""
    pools = {}
    for category in categories:
        if category not in CATEGORIES:
            raise SystemExit(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")
        pools[category] = {}
        for name in CATEGORIES[category]:
            path = folder / f"{name}.jsonl"
            if not path.is_file():
                continue
            texts = read_first_turns(path)
            lengths = [len(ids) for ids in tokenizer([chat_text(tokenizer, t) for t in texts]).input_ids]
            kept = [Prompt(name, i, category, t) for i, (t, n) in enumerate(zip(texts, lengths))
                    if n <= max_prompt_tokens]
            if kept:
                pools[category][name] = kept
        if not pools[category]:
            raise SystemExit(f"no {category} prompt of at most {max_prompt_tokens} tokens in {folder}")
    return pools


def code_edit_pool(folder: Path, tokenizer, max_prompt_tokens: int) -> dict[str, dict]:
    """Code-editing prompts: "Rewrite this function with X:" + a HumanEval prompt's code block (a signature and a
    docstring; MBPP's prompts hold no code, so they give no snippet). One edit per snippet, chosen by its index."""
    prompts = []
    for index, text in enumerate(read_first_turns(folder / "humaneval.jsonl")):
        match = re.search(r"```python\n(.*?)```", text, re.S)
        if not match:
            continue
        code = match.group(1).strip("\n")
        names = re.findall(r"^def (\w+)\(", code, re.M)
        if not names:
            continue
        edit = EDITS[index % len(EDITS)].format(name=names[-1])
        body = f"Rewrite this function with {edit}:\n```python\n{code}\n```"
        if len(prompt_ids(tokenizer, body)) <= max_prompt_tokens:
            prompts.append(Prompt("code-edit:humaneval", index, "code-edit", body))
    if not prompts:
        raise SystemExit(f"no code-edit prompt of at most {max_prompt_tokens} tokens from {folder}/humaneval.jsonl")
    return {"code-edit": {"humaneval": prompts}}


def draw_sequences(pools: dict[str, dict], count: int, length: int, seed: int) -> list[list[Prompt]]:
    """`count` sequences of `length` distinct prompts (distinct over all sequences while the pools last). Position i
    of sequence k is category (i + k) mod C of the mix, its set chosen uniformly among the category's sets, then a
    prompt of that set; so a prefix of any length mixes the categories, and a run at R rows takes each sequence's
    first R prompts (the batches at every R share prompts)."""
    rng = random.Random(seed)
    categories = list(pools)
    remaining = {c: {name: rng.sample(prompts, len(prompts)) for name, prompts in sets.items()}
                 for c, sets in pools.items()}
    sequences = []
    for k in range(count):
        sequence = []
        for i in range(length):
            category = categories[(i + k) % len(categories)]
            sets = [name for name, left in remaining[category].items() if left]
            if not sets:  # exhausted: start that category's sets over (repeats are then possible)
                remaining[category] = {name: rng.sample(p, len(p)) for name, p in pools[category].items()}
                sets = list(remaining[category])
            sequence.append(remaining[category][rng.choice(sets)].pop())
        sequences.append(sequence)
    return sequences


def prompt_pools(args, tokenizer) -> dict[str, dict]:
    folder = eval_dir(args.eval_dir)
    if args.prompt_set == "code-edit":
        return code_edit_pool(folder, tokenizer, args.max_prompt_tokens)
    return category_pools(folder, args.categories.split(","), tokenizer, args.max_prompt_tokens)


def add_prompt_arguments(parser, max_prompt_tokens: int = 384) -> None:
    parser.add_argument("--prompt-set", default="mix", choices=["mix", "code-edit"],
                        help="mix: held-out eval prompts of --categories; code-edit: 'Rewrite this function with X "
                             "changed:' + a HumanEval code block")
    known = ", ".join(c + "=" + "/".join(sets) for c, sets in CATEGORIES.items())
    parser.add_argument("--categories", default="math,code,chat", help=f"categories of the mix ({known})")
    parser.add_argument("--seed", type=int, default=0, help="prompt draw (and arrival times) seed")
    parser.add_argument("--max-prompt-tokens", type=int, default=max_prompt_tokens,
                        help="leave out prompts longer than this after the chat template")
    parser.add_argument("--eval-dir", default=None, help="folder of the eval JSONL files (default: "
                                                         f"{EVAL_DIRS[0]}, else the package's copy)")


# -- models and references --------------------------------------------------------------------------------------------

def load_models(drafter: str | None, threads: int):
    """(target, tokenizer, drafter): the embedded SmolLM2-135M-Instruct in float32 (sdpa), its tokenizer padding on
    the left, and the shipped drafter of that kind (or a drafter folder) in float32; drafter None: none."""
    import hf_dspark
    from hf_dspark.models.loading import load_drafter

    torch.set_num_threads(threads)
    target, tokenizer = hf_dspark.load_default_target(dtype=torch.float32)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = None
    if drafter is not None:
        path = hf_dspark.shipped_drafter_path(drafter) if drafter in ("dspark", "dflash", "eagle3") else drafter
        model = load_drafter(path, torch.float32)
    return target, tokenizer, model


def eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """New tokens up to and including the first EOS (what a request emits; batched rows are padded after it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


class OwnPlain:
    """Each prompt's own plain greedy output, decoded alone (batch 1, no padding), computed once per prompt: the
    reference every speculative row is checked against."""

    def __init__(self, target, max_new_tokens: int):
        self.target, self.max_new_tokens = target, max_new_tokens
        self.eos = eos_ids(target)
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self._cache:
            input_ids = torch.tensor([ids])
            out = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=self.max_new_tokens)
            self._cache[key] = until_eos(out[0, len(ids):].tolist(), self.eos)
        return self._cache[key]


def unit_arrival_times(count: int, seed: int) -> list[float]:
    """Poisson arrival times at 1 request/s (Exp(1) gaps drawn from `random.Random(seed)`, the first request at 0):
    divide by a rate q for arrivals at q requests/s, the same draws at every rate."""
    draws = random.Random(seed)
    gaps = [draws.expovariate(1.0) for _ in range(count)]
    return [sum(gaps[: i + 1]) - gaps[0] for i in range(count)]


# -- statistics and reports -------------------------------------------------------------------------------------------

def geomean(values: list[float]) -> float:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def merged_stats(stats_list) -> dict:
    """tau and round counts of several `SpeculativeStats` together."""
    accepted = sum(sum(s.accepted) for s in stats_list)
    rounds = sum(s.num_rounds for s in stats_list)
    drafted = sum(sum(s.draft_lengths) for s in stats_list)
    sources = {}
    for s in stats_list:
        for source in s.sources:
            sources[source] = sources.get(source, 0) + 1
    return {"tau": round((accepted + rounds) / rounds, 3) if rounds else None, "rounds": rounds,
            "drafted": drafted, "accepted": accepted, "rounds_by_source": sources}


def fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def md_table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def write_report(json_path: Path, results: dict, md_lines: list[str]) -> Path:
    """results.json and a .md beside it (same stem); returns the .md path."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2, default=str))
    md_path = json_path.with_suffix(".md")
    md_path.write_text("\n".join(md_lines) + "\n")
    return md_path


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
