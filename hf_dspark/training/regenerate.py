"""Target-regenerated training data: the target answers each prompt with its own chat template.

Outputs JSONL shards of `{"id", "prompt", "input_ids", "prompt_length", "finished"}` (token ids of the
templated prompt followed by the answer, EOS included). Interrupted runs resume: finished records are kept,
and a run whose settings differ from the folder's manifest is refused rather than mixed in.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

MANIFEST = "manifest.json"


@dataclass
class RegenerationConfig:
    max_new_tokens: int = 384
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    batch_size: int = 32
    max_prompt_tokens: int = 512
    shard_size: int = 1024
    seed: int = 0


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a user prompt (or a whole conversation of `{"role", "content"}` messages) in the tokenizer's
    chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def completed_ids(output_dir: Path) -> set[int]:
    done = set()
    for shard in sorted(output_dir.glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as handle:
            for line in handle:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    continue  # torn line from an interruption: that prompt is regenerated
    return done


def _check_manifest(output_dir: Path, manifest: dict) -> None:
    path = output_dir / MANIFEST
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != manifest:
            raise ValueError(
                f"{output_dir} holds data regenerated with other settings ({previous}); "
                "use a new output folder or the same settings to resume."
            )
    else:
        path.write_text(json.dumps(manifest, indent=2))


class _ShardWriter:
    def __init__(self, output_dir: Path, shard_size: int):
        self.output_dir, self.shard_size = output_dir, shard_size
        shards = sorted(output_dir.glob("shard-*.jsonl"))
        self.index = len(shards)
        self.handle, self.lines = None, 0

    def write(self, record: dict) -> None:
        if self.handle is None or self.lines >= self.shard_size:
            if self.handle is not None:
                self.handle.close()
            self.handle = open(self.output_dir / f"shard-{self.index:05d}.jsonl", "a", encoding="utf-8")
            self.index += 1
            self.lines = 0
        self.handle.write(json.dumps(record) + "\n")
        self.lines += 1

    def flush(self) -> None:
        if self.handle is not None:
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


@torch.no_grad()
def regenerate(target, tokenizer, prompts: list[str], output_dir: str | Path, config: RegenerationConfig | None = None,
               target_name: str = "", progress: bool = True) -> dict:
    """Answer every prompt with ``target`` and append the results to ``output_dir``; returns run statistics."""
    config = config or RegenerationConfig()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    _check_manifest(output_dir, {"target": target_name, "num_prompts": len(prompts), **asdict(config)})

    done = completed_ids(output_dir)
    encoded = {i: chat_prompt_ids(tokenizer, p) for i, p in enumerate(prompts) if i not in done}
    pending = sorted((i for i, ids in encoded.items() if len(ids) <= config.max_prompt_tokens),
                     key=lambda i: (len(encoded[i]), i))
    skipped = len(encoded) - len(pending)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = target.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids]) - {None}

    writer = _ShardWriter(output_dir, config.shard_size)
    answer_tokens, started = 0, time.perf_counter()
    bar = tqdm(total=len(pending), desc="regenerating", unit="prompt", disable=not progress)
    try:
        for start in range(0, len(pending), config.batch_size):
            batch = pending[start : start + config.batch_size]
            width = max(len(encoded[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, i in enumerate(batch):
                ids = encoded[i]
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention_mask[row, width - len(ids) :] = 1
            torch.manual_seed(config.seed + batch[0])  # reproducible after a resume
            output = target.generate(
                input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
                do_sample=config.temperature > 0, temperature=config.temperature or None,
                top_p=config.top_p, top_k=config.top_k, max_new_tokens=config.max_new_tokens, pad_token_id=pad_id,
            )
            for row, i in enumerate(batch):
                answer, finished = [], False
                for token in output[row, width:].tolist():
                    answer.append(token)
                    if token in eos_ids:
                        finished = True
                        break
                answer_tokens += len(answer)
                writer.write({"id": i, "prompt": prompts[i], "input_ids": encoded[i] + answer,
                              "prompt_length": len(encoded[i]), "finished": finished})
            writer.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_per_s=f"{answer_tokens / (time.perf_counter() - started):.0f}")
    finally:
        writer.close()
        bar.close()
    elapsed = time.perf_counter() - started
    return {"prompts": len(pending), "skipped_long_prompts": skipped, "answer_tokens": answer_tokens,
            "seconds": elapsed, "tokens_per_second": answer_tokens / max(elapsed, 1e-9)}


def iter_regenerated(data_dir: str | Path):
    """Yield `{"input_ids", "loss_mask"}` examples (loss on answer tokens) from regenerated shards."""
    for shard in sorted(Path(data_dir).glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                ids, prompt_length = record["input_ids"], record["prompt_length"]
                yield {"input_ids": ids, "loss_mask": [0] * prompt_length + [1] * (len(ids) - prompt_length)}
