"""Target-regenerated training data: the target answers each conversation with its own chat template.

Outputs JSONL shards of `{"id", "prompt", "input_ids", "prompt_length", "answer_spans", "finished", "sampled"}`:
the token ids of the whole templated conversation, where every assistant turn was written by the target (EOS
included), `answer_spans` the `[start, end)` ranges of those answers and `prompt_length` the start of the first.
Multi-turn sources get every later user turn answered too, each after the target's own previous answers.

Decoding keeps the batch full (continuous batching): a row that finishes is replaced by the next waiting
conversation (its next turn first) instead of idling until the longest row of a fixed batch ends, which is what
made stock batched `generate` spend most of its time on finished rows. Prompts are admitted shortest first, so each
admission prefills prompts of similar length. Interrupted runs resume: finished conversations are kept, and a run
whose settings differ from the folder's manifest is refused rather than mixed in.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from ..evaluation.prompts import chat_prompt_ids  # noqa: F401  (prompt building lives in evaluation; re-exported)
from ..models.common import UserInputError

MANIFEST = "manifest.json"


@dataclass
class RegenerationConfig:
    """Settings of a regeneration run (all written to the manifest; a resume must use the same ones).

    Args:
        max_new_tokens: longest answer per turn; an answer cut here ends its conversation.
        greedy_fraction: share of conversations answered greedily; the others are sampled with `temperature`,
            `top_p` and `top_k` (users run both, so the drafter should see both). Which ones is fixed by `seed`.
        batch_size: rows decoded together; finished rows are refilled to keep it full.
        max_prompt_tokens: first prompts longer than this are skipped.
        max_conversation_tokens: later turns are answered only while the conversation fits in this many tokens.
        max_turns: user turns answered per conversation (1 = first turn only).
        refill_every: decoding steps between checks for finished rows to replace (an admission copies the cache,
            so it is batched).
        sort_window: conversations are taken in a fixed shuffled order, `sort_window` at a time, each window
            admitted shortest prompt first: batches of similar lengths, and a run stopped early still covers the
            whole prompt mix.
    """

    max_new_tokens: int = 384
    greedy_fraction: float = 0.75
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    batch_size: int = 64
    max_prompt_tokens: int = 512
    max_conversation_tokens: int = 1536
    max_turns: int = 4
    refill_every: int = 8
    sort_window: int = 2048
    shard_size: int = 1024
    seed: int = 0

    def __post_init__(self):
        if self.temperature <= 0:
            raise UserInputError(f"temperature must be > 0 for the sampled share, got {self.temperature}; "
                                 "use greedy_fraction=1 (--greedy-fraction 1) for greedy answers only.")
        if not 0 <= self.greedy_fraction <= 1:
            raise UserInputError(f"greedy_fraction (--greedy-fraction) must be in [0, 1], got {self.greedy_fraction}.")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_turns < 1:
            raise UserInputError("max_new_tokens, batch_size and max_turns must be at least 1.")


def next_turn_ids(tokenizer, messages: list[dict], answer_ids: list[int], eos_ids: set[int], user_turn: str
                  ) -> tuple[list[int], list[dict]] | None:
    """(ids to append after the target's own answer (`answer_ids`, EOS included) so that the conversation continues
    with `user_turn` and a new assistant prompt, the messages so far with that answer and turn), or None when the
    template cannot be continued token-exactly.

    The answer's tokens are kept as the target wrote them (re-tokenizing its text could split it differently); only
    the template text between the answer and the next assistant prompt is tokenized."""
    answer = [t for t in answer_ids if t not in eos_ids]
    answer_text = tokenizer.decode(answer)
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    following = messages + [{"role": "assistant", "content": answer_text}, {"role": "user", "content": user_turn}]
    full_text = tokenizer.apply_chat_template(following, add_generation_prompt=True, tokenize=False)
    if not full_text.startswith(prompt_text + answer_text):
        return None  # the template rewrote the answer (stripped it, dropped a part): not the target's own text
    tail = full_text[len(prompt_text) + len(answer_text):]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    # The answer's EOS is the template's end-of-turn token: keep the generated one instead of a second copy.
    if answer_ids and answer_ids[-1] in eos_ids and tail_ids and tail_ids[0] == answer_ids[-1]:
        tail_ids = tail_ids[1:]
    elif answer_ids and answer_ids[-1] in eos_ids:
        return None
    return tail_ids, following


def shard_paths(folder: str | Path) -> list[Path]:
    """The folder's shards in order: `shard-NNNNN.jsonl`, or gzipped (`.jsonl.gz`, how finished shards are
    committed); a run resumed on gzipped shards appends plain ones after them."""
    folder = Path(folder)
    return sorted([*folder.glob("shard-*.jsonl"), *folder.glob("shard-*.jsonl.gz")], key=lambda p: p.name)


def _open_shard(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def completed_ids(output_dir: Path) -> set[int]:
    done = set()
    for shard in shard_paths(output_dir):
        with _open_shard(shard) as handle:
            for line in handle:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    continue  # torn line from an interruption: that conversation is regenerated
    return done


def _check_manifest(output_dir: Path, manifest: dict) -> None:
    path = output_dir / MANIFEST
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != manifest:
            changed = sorted(key for key in {*previous, *manifest} if previous.get(key) != manifest.get(key))
            differences = ", ".join(f"{key} {previous.get(key)!r} there, {manifest.get(key)!r} now" for key in changed)
            raise UserInputError(f"{output_dir} holds data regenerated with other settings ({differences}); use a "
                                 "new output folder, or the same settings to resume.")
    else:
        path.write_text(json.dumps(manifest, indent=2))


class _ShardWriter:
    def __init__(self, output_dir: Path, shard_size: int):
        self.output_dir, self.shard_size = output_dir, shard_size
        shards = shard_paths(output_dir)
        self.index = 1 + max((int(p.name.split("-")[1].split(".")[0]) for p in shards), default=-1)
        self.handle, self.lines = None, 0

    def write(self, record: dict) -> None:
        if self.handle is None or self.lines >= self.shard_size:
            if self.handle is not None:
                self.handle.close()
            self.handle = open(self.output_dir / f"shard-{self.index:05d}.jsonl", "a", encoding="utf-8")
            self.index += 1
            self.lines = 0
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()
        self.lines += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def is_sampled(conversation_id: int, config: RegenerationConfig) -> bool:
    """Whether a conversation is sampled (else greedy): a fixed function of its id and the seed."""
    digest = hashlib.sha256(f"{config.seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 >= config.greedy_fraction


@dataclass
class _Conversation:
    id: int
    turns: list[str]
    sampled: bool
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)
    turn: int = 0
    answer: list[int] = field(default_factory=list)
    parked: list | None = None  # cache of ids[:fed] while the conversation waits for its next turn
    fed: int = 0


class _GrowingLayer(DynamicLayer):
    """A cache layer whose keys/values are views of a buffer with spare columns: appending a token writes in place
    instead of copying the whole cache with `torch.cat` every step (which cost more than the step's matmuls at
    batch 64)."""

    spare = 64

    def set(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
        batch, heads, length, dim = keys.shape
        self._keys = keys.new_empty(batch, heads, length + max(room, self.spare), dim)
        self._values = values.new_empty(batch, heads, length + max(room, self.spare), dim)
        self._keys[:, :, :length], self._values[:, :, :length] = keys, values
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.set(key_states, value_states)
            return self.keys, self.values
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if length + new > self._keys.shape[-2]:
            self.set(self.keys, self.values, room=new + self.spare)
        self._keys[:, :, length : length + new] = key_states
        self._values[:, :, length : length + new] = value_states
        self.keys, self.values = self._keys[:, :, : length + new], self._values[:, :, : length + new]
        return self.keys, self.values


def _growing_cache(num_layers: int, tensors: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    cache = DynamicCache()
    Cache.__init__(cache, layers=[_GrowingLayer() for _ in range(num_layers)])
    for layer, (keys, values) in zip(cache.layers, tensors or []):
        layer.set(keys, values)
    return cache


class _Batch:
    """The running rows: a left-padded target cache (no holes inside a row: each row's entries are its last ones),
    its attention mask, and the token each row feeds next."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.rows: list[_Conversation] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.BoolTensor | None = None
        self.next_tokens: torch.LongTensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def row_cache(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One row's real cache entries (its own columns only), to continue the conversation later."""
        used = self.mask[index]
        return [(layer.keys[index : index + 1, :, used].clone(), layer.values[index : index + 1, :, used].clone())
                for layer in self.cache.layers]

    def keep(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.next_tokens = None
            return
        self.mask, self.next_tokens = self.mask[index], self.next_tokens[index]
        used = int(self.mask.any(0).float().argmax())  # first column any kept row still uses
        self.mask = self.mask[:, used:]
        for layer in self.cache.layers:
            layer.set(layer.keys[index, :, used:], layer.values[index, :, used:])

    def merge(self, rows: list[_Conversation], cache: DynamicCache, mask: torch.BoolTensor, next_tokens) -> None:
        if self.cache is None:
            self.rows, self.mask, self.next_tokens = rows, mask, next_tokens
            self.cache = _growing_cache(self.num_layers, [(l.keys, l.values) for l in cache.layers])
            return
        width = max(self.mask.shape[1], mask.shape[1])

        def left_pad(tensor, dim):
            missing = width - tensor.shape[dim]
            if missing == 0:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.set(torch.cat([left_pad(mine.keys, 2), left_pad(theirs.keys, 2)]),
                     torch.cat([left_pad(mine.values, 2), left_pad(theirs.values, 2)]))
        self.mask = torch.cat([left_pad(self.mask, 1), left_pad(mask, 1)])
        self.next_tokens = torch.cat([self.next_tokens, next_tokens])
        self.rows = self.rows + rows


def _choose(logits: torch.Tensor, rows: list[_Conversation], config: RegenerationConfig) -> torch.LongTensor:
    """Greedy rows take the argmax; sampled rows draw from temperature + top-k + top-p (applied in `generate`'s
    order) with their own generator, so a conversation's sample does not depend on its batch neighbours."""
    tokens = logits.argmax(-1)
    sampled = [i for i, row in enumerate(rows) if row.sampled]
    if sampled:
        top = logits[sampled].float().div(config.temperature).topk(min(config.top_k or logits.shape[-1],
                                                                       logits.shape[-1]), dim=-1)
        probs = top.values.softmax(-1)
        # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = probs.cumsum(-1) - probs >= config.top_p
        probs = probs.masked_fill(outside, 0.0)
        for position, i in enumerate(sampled):
            choice = torch.multinomial(probs[position], 1, generator=rows[i].generator)
            tokens[i] = top.indices[position, choice[0]]
    return tokens


def _forward(target, input_ids, mask, positions, cache):
    out = target(input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, cache=cache,
                 use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def _prefill(target, rows: list[_Conversation], pad_id: int):
    """First turns: one left-padded forward over the new prompts."""
    width = max(len(row.ids) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        input_ids[r, width - len(row.ids):] = torch.tensor(row.ids)
        mask[r, width - len(row.ids):] = True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    device = target.device
    logits = _forward(target, input_ids.to(device), mask.to(device), positions.to(device), cache)
    return cache, mask.to(device), logits


def _continue(target, row: _Conversation):
    """A later turn: only the tokens after the parked cache (the answer's EOS and the next user turn) are run."""
    device = target.device
    cache = _growing_cache(len(row.parked), row.parked)
    new = torch.tensor([row.ids[row.fed:]], device=device)
    mask = torch.ones(1, len(row.ids), dtype=torch.bool, device=device)
    positions = torch.arange(row.fed, len(row.ids), device=device)[None]
    logits = _forward(target, new, mask, positions, cache)
    row.parked = None
    return cache, mask, logits


def _eos_ids(target, tokenizer) -> set[int]:
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    eos.add(tokenizer.eos_token_id)
    return eos - {None}


def _as_turns(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else [t for t in prompt if isinstance(t, str) and t.strip()]


@torch.no_grad()
def regenerate(target, tokenizer, prompts: list[str] | list[list[str]], output_dir: str | Path,
               config: RegenerationConfig | None = None, target_name: str = "", progress: bool = True) -> dict:
    """Answer every conversation (a prompt string, or the list of a conversation's user turns) with ``target``
    and append the results to ``output_dir``; returns run statistics (answer tokens per second among them)."""
    config = config or RegenerationConfig()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    conversations = [_as_turns(p) for p in prompts]
    _check_manifest(output_dir, {"target": target_name, "num_prompts": len(conversations),
                                 "prompts_sha256": _digest(conversations), **asdict(config)})

    done = completed_ids(output_dir)
    waiting = []
    for i, turns in enumerate(conversations):
        if i in done or not turns:
            continue
        messages = [{"role": "user", "content": turns[0]}]
        ids = chat_prompt_ids(tokenizer, messages)
        if len(ids) > config.max_prompt_tokens:
            continue
        sampled = is_sampled(i, config)
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + i) if sampled else None
        waiting.append(_Conversation(i, turns[: config.max_turns], sampled, generator, ids=ids, messages=messages))
    skipped = sum(1 for i, t in enumerate(conversations) if i not in done and t) - len(waiting)
    order = list(range(len(conversations)))
    random.Random(config.seed).shuffle(order)
    rank = {conversation: position for position, conversation in enumerate(order)}
    waiting.sort(key=lambda c: rank[c.id])
    windows = [waiting[i : i + config.sort_window] for i in range(0, len(waiting), config.sort_window)]
    queue = deque(c for window in windows for c in sorted(window, key=lambda c: (len(c.ids), c.id)))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = _eos_ids(target, tokenizer)
    eos_tensor = torch.tensor(sorted(eos_ids), device=target.device)
    writer = _ShardWriter(output_dir, config.shard_size)
    batch = _Batch(target.config.get_text_config().num_hidden_layers)
    answer_tokens, steps, started = 0, 0, time.perf_counter()
    bar = tqdm(total=len(waiting), desc="regenerating", unit="conv", disable=not progress)

    def finish_turn(row: _Conversation) -> bool:
        """Close the row's current answer; True when the conversation goes on with its next user turn."""
        nonlocal answer_tokens
        answer_tokens += len(row.answer)
        start = len(row.ids)
        row.ids = row.ids + row.answer
        row.spans.append([start, len(row.ids)])
        ended = bool(row.answer) and row.answer[-1] in eos_ids
        row.turn += 1
        if ended and row.turn < len(row.turns):
            following = next_turn_ids(tokenizer, row.messages, row.answer, eos_ids, row.turns[row.turn])
            if following is not None and (len(row.ids) + len(following[0]) + config.max_new_tokens
                                          <= config.max_conversation_tokens):
                tail, row.messages = following
                row.ids = row.ids + tail
                row.answer = []
                return True
        writer.write({"id": row.id, "prompt": row.turns[0], "input_ids": row.ids, "prompt_length": row.spans[0][0],
                      "answer_spans": row.spans, "finished": ended, "sampled": row.sampled})
        bar.update(1)
        return False

    try:
        while queue or len(batch):
            free = config.batch_size - len(batch)
            if queue and free > 0 and (len(batch) == 0 or steps % config.refill_every == 0):
                if free >= max(1, config.batch_size // 8) or len(batch) == 0 or len(queue) < free:
                    admitted = [queue.popleft() for _ in range(min(free, len(queue)))]
                    fresh = [row for row in admitted if row.parked is None]
                    parts = [_continue(target, row) + ([row],) for row in admitted if row.parked is not None]
                    if fresh:
                        parts.append(_prefill(target, fresh, pad_id) + (fresh,))
                    for cache, mask, logits, rows in parts:
                        tokens = _choose(logits, rows, config)
                        for row, token in zip(rows, tokens.tolist()):
                            row.answer = [token]
                        batch.merge(rows, cache, mask, tokens)
                    _retire(batch, eos_ids, config, finish_turn, queue)
            if not len(batch):
                continue
            mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], dim=1)
            positions = batch.mask.sum(1, keepdim=True)
            logits = _forward(target, batch.next_tokens[:, None], mask, positions, batch.cache)
            batch.mask = mask
            tokens = _choose(logits, batch.rows, config)
            batch.next_tokens = tokens
            for row, token in zip(batch.rows, tokens.tolist()):
                row.answer.append(token)
            steps += 1
            if bool(torch.isin(tokens, eos_tensor).any()) or any(len(r.answer) >= config.max_new_tokens
                                                                   for r in batch.rows):
                _retire(batch, eos_ids, config, finish_turn, queue)
            if steps % 8 == 0:
                bar.set_postfix(tok_per_s=f"{answer_tokens / (time.perf_counter() - started):.0f}", rows=len(batch))
    finally:
        writer.close()
        bar.close()
    elapsed = time.perf_counter() - started
    return {"prompts": len(waiting), "skipped_long_prompts": skipped, "answer_tokens": answer_tokens,
            "seconds": elapsed, "tokens_per_second": answer_tokens / max(elapsed, 1e-9)}


def _retire(batch: _Batch, eos_ids: set[int], config: RegenerationConfig, finish_turn, queue: deque) -> None:
    """Remove rows whose answer ended (EOS or max_new_tokens). Conversations with a next turn go to the front of
    `queue` (they finish conversations already started) with their cache parked, so the next turn runs only its
    new tokens."""
    keep, continuing = [], []
    for index, row in enumerate(batch.rows):
        if row.answer and (row.answer[-1] in eos_ids or len(row.answer) >= config.max_new_tokens):
            fed = len(row.ids) + len(row.answer) - 1  # every token but the newest went through the target
            if finish_turn(row):
                row.parked, row.fed = batch.row_cache(index), fed
                continuing.append(row)
        else:
            keep.append(index)
    if len(keep) < len(batch):
        batch.keep(keep)
    queue.extendleft(reversed(continuing))


def _digest(conversations: list[list[str]]) -> str:
    digest = hashlib.sha256()
    for turns in conversations:
        digest.update(json.dumps(turns).encode())
    return digest.hexdigest()


def iter_regenerated(data_dir: str | Path):
    """Yield `{"input_ids", "loss_mask"}` examples (loss on the target's answer tokens) from regenerated shards."""
    for shard in shard_paths(data_dir):
        with _open_shard(shard) as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                ids = record["input_ids"]
                spans = record.get("answer_spans") or [[record["prompt_length"], len(ids)]]
                loss_mask = [0] * len(ids)
                for start, end in spans:
                    loss_mask[start:end] = [1] * (end - start)
                yield {"input_ids": ids, "loss_mask": loss_mask}
