"""Prompt sets for `hf-dspark eval`: shipped benchmark names, `{"turns": [...]}` JSONL files, JSON lists or text
files of prompts, all read into one `EvalPrompt` shape.

A JSONL line may carry more than its turns: `reference` (or `answer`) enables accuracy, and `test` (or
`test_list`) with an optional `entry_point` / `test_imports` enables pass@1 under `--execute-code`. Of the shipped
sets, gsm8k and math500 carry references and humaneval and mbpp tests (see `data/README.md`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EVAL_DATA_DIR = Path(__file__).parent / "data"
BENCHMARKS = (
    "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2",
)


def benchmark_path(name: str) -> Path:
    path = EVAL_DATA_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"unknown benchmark {name!r}; shipped: {', '.join(BENCHMARKS)}")
    return path


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a user prompt (or a whole conversation of `{"role", "content"}` messages) in the tokenizer's
    chat template, ready for the assistant's answer. Training data (`hf-dspark regenerate`) and evaluation prompts
    are both built with it."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def chat_input_ids(tokenizer, messages: list[dict]) -> torch.LongTensor:
    """The chat-templated (1, L) prompt tensor `generate` takes, built exactly as the training data was."""
    import torch

    return torch.tensor([chat_prompt_ids(tokenizer, messages)])


@dataclass
class EvalPrompt:
    benchmark: str
    index: int
    """Position in its set (0-based): with the benchmark name, the key records are resumed by."""
    turns: list[str]
    reference: str | None = None
    tests: list[str] = field(default_factory=list)
    """Test code run after the completion (asserts, or a `check(candidate)` definition)."""
    entry_point: str | None = None
    """With a HumanEval-style `check(candidate)` test: the function to pass to it."""

    @property
    def fingerprint(self) -> str:
        """Short hash of the turns, so a resumed run can tell that a prompt file changed under the same index."""
        return hashlib.sha1(json.dumps(self.turns).encode()).hexdigest()[:12]


def _from_object(benchmark: str, index: int, item) -> EvalPrompt:
    if isinstance(item, str):
        return EvalPrompt(benchmark, index, [item])
    if not isinstance(item, dict):
        raise ValueError(f"{benchmark} #{index}: expected a string or an object, got {type(item).__name__}")
    turns = item.get("turns")
    if turns is None and isinstance(item.get("prompt"), str):
        turns = [item["prompt"]]
    if not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{benchmark} #{index}: needs a non-empty list of strings under 'turns' (or a 'prompt')")
    reference = item.get("reference", item.get("answer"))
    tests = item.get("test", item.get("test_list")) or []
    if isinstance(tests, str):
        tests = [tests]
    imports = item.get("test_imports") or []
    tests = [*([imports] if isinstance(imports, str) else imports), *tests] if tests else []
    return EvalPrompt(benchmark, index, list(turns), None if reference is None else str(reference), list(tests),
                      item.get("entry_point"))


def read_prompt_file(path: str | Path, benchmark: str | None = None) -> list[EvalPrompt]:
    """`.jsonl`: one object (or string) per line; `.json`: a list of them; anything else: one prompt per line."""
    path = Path(path)
    benchmark = benchmark or path.stem
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        # Split on newlines only: str.splitlines() also breaks at U+2028 / U+0085 inside JSON strings.
        items = [json.loads(line) for line in text.split("\n") if line.strip()]
    elif path.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    return [_from_object(benchmark, i, item) for i, item in enumerate(items)]


def load_prompt_sets(sources: list[str], max_prompts: int | None = None) -> dict[str, list[EvalPrompt]]:
    """{benchmark: its first `max_prompts` prompts}; a source is a shipped benchmark name or a file path (the
    benchmark is then named after the file)."""
    sets: dict[str, list[EvalPrompt]] = {}
    for source in sources:
        if source in BENCHMARKS:
            name, path = source, benchmark_path(source)
        elif Path(source).is_file():
            name, path = Path(source).stem, Path(source)
        else:
            raise FileNotFoundError(f"{source!r} is neither a shipped benchmark ({', '.join(BENCHMARKS)}) nor a file")
        if name in sets:
            raise ValueError(f"two prompt sets are named {name!r}; rename one of the files")
        sets[name] = read_prompt_file(path, name)[:max_prompts]
    return sets
