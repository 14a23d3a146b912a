"""Target-regenerated training data: the target answers each conversation with its own chat template.

Outputs JSONL shards of `{"id", "prompt", "input_ids", "prompt_length", "answer_spans", "finished", "sampled"}`:
the token ids of the whole templated conversation, where every assistant turn was written by the target (EOS
included), `answer_spans` the `[start, end)` ranges of those answers and `prompt_length` the start of the first.
Multi-turn sources get every later user turn answered too, each after the target's own previous answers.

Decoding runs on the batched engine without a drafter (`SpeculativeEngine(target)`: plain continuous batching),
which keeps the batch full: a row that finishes is replaced by the next waiting conversation (its next turn first)
instead of idling until the longest row of a fixed batch ends, which is what made stock batched `generate` spend
most of its time on finished rows. A conversation's later turn continues on its parked cache, so only the new user
turn is prefilled. Prompts are admitted shortest first, so each admission prefills prompts of similar length.
Interrupted runs resume: finished conversations are kept, and a run whose settings differ from the folder's manifest
is refused rather than mixed in.
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

from ..evaluation.prompts import chat_prompt_ids  # noqa: F401  (prompt building lives in evaluation; re-exported)
from ..generation.engine.speculative_engine import ParkedCache, SpeculativeEngine
from ..generation.engine.requests import eos_ids as target_eos_ids
from ..models.errors import UserInputError

MANIFEST = "manifest.json"
SAMPLER = "batched-engine"
"""Which random streams sampled answers come from: a folder started by another sampler (the loop before the batched
engine wrote none) is not resumed, so one folder never mixes two."""


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
    parked: ParkedCache | None = None  # the target's cache of its text while it waits for its next turn


def _as_turns(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else [t for t in prompt if isinstance(t, str) and t.strip()]


def _waiting_conversations(tokenizer, conversations: list[list[str]], done: set[int], config: RegenerationConfig,
                           device) -> tuple[deque, int]:
    """(the conversations still to answer, in admission order, and how many were skipped for a long prompt).

    They are taken in a fixed shuffled order, `sort_window` at a time, each window shortest prompt first. A sampled
    conversation gets its own generator, seeded from its id, so its answers do not depend on its batch neighbours."""
    waiting = []
    for i, turns in enumerate(conversations):
        if i in done or not turns:
            continue
        messages = [{"role": "user", "content": turns[0]}]
        ids = chat_prompt_ids(tokenizer, messages)
        if len(ids) > config.max_prompt_tokens:
            continue
        sampled = is_sampled(i, config)
        generator = torch.Generator(device).manual_seed(config.seed * 1_000_003 + i) if sampled else None
        waiting.append(_Conversation(i, turns[: config.max_turns], sampled, generator, ids=ids, messages=messages))
    skipped = sum(1 for i, t in enumerate(conversations) if i not in done and t) - len(waiting)
    order = list(range(len(conversations)))
    random.Random(config.seed).shuffle(order)
    rank = {conversation: position for position, conversation in enumerate(order)}
    waiting.sort(key=lambda c: rank[c.id])
    windows = [waiting[i : i + config.sort_window] for i in range(0, len(waiting), config.sort_window)]
    return deque(c for window in windows for c in sorted(window, key=lambda c: (len(c.ids), c.id))), skipped


class _Turns:
    """Closes each answered turn: continues the conversation with its next user turn, or writes it out."""

    def __init__(self, tokenizer, eos_ids: set[int], config: RegenerationConfig, writer: _ShardWriter, bar):
        self.tokenizer, self.eos_ids, self.config, self.writer, self.bar = tokenizer, eos_ids, config, writer, bar
        self.answer_tokens = 0

    def finish(self, row: _Conversation) -> bool:
        """Close the row's current answer; True when the conversation goes on with its next user turn."""
        self.answer_tokens += len(row.answer)
        start = len(row.ids)
        row.ids = row.ids + row.answer
        row.spans.append([start, len(row.ids)])
        ended = bool(row.answer) and row.answer[-1] in self.eos_ids
        row.turn += 1
        if ended and row.turn < len(row.turns):
            following = next_turn_ids(self.tokenizer, row.messages, row.answer, self.eos_ids, row.turns[row.turn])
            if following is not None and (len(row.ids) + len(following[0]) + self.config.max_new_tokens
                                          <= self.config.max_conversation_tokens):
                tail, row.messages = following
                row.ids = row.ids + tail
                row.answer = []
                return True
        self.writer.write({"id": row.id, "prompt": row.turns[0], "input_ids": row.ids,
                           "prompt_length": row.spans[0][0], "answer_spans": row.spans, "finished": ended,
                           "sampled": row.sampled})
        self.bar.update(1)
        return False


def _admit(engine: SpeculativeEngine, queue: deque, running: dict, config: RegenerationConfig, eos: list[int]) -> None:
    """Submit waiting conversations to fill the batch, at most every `refill_every` steps and only when enough rows
    are free (each admission copies the cache), unless the batch is empty or the queue nearly is."""
    free = config.batch_size - engine.num_running
    rounds = len(engine.verified_tokens_per_round)
    if not queue or free <= 0 or (engine.num_running and rounds % config.refill_every):
        return
    if free < max(1, config.batch_size // 8) and engine.num_running and len(queue) >= free:
        return
    for _ in range(min(free, len(queue))):
        row = queue.popleft()
        request = engine.submit(row.ids, config.max_new_tokens, do_sample=row.sampled, temperature=config.temperature,
                                top_p=config.top_p, top_k=config.top_k, eos_token_id=eos, generator=row.generator,
                                resume=row.parked, keep_cache=row.turn + 1 < len(row.turns))
        row.parked = None
        running[request] = row


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
                                 "prompts_sha256": _digest(conversations), **asdict(config), "sampler": SAMPLER})
    queue, skipped = _waiting_conversations(tokenizer, conversations, completed_ids(output_dir), config,
                                            target.device)
    total = len(queue)
    eos_ids = (target_eos_ids(target, None) | {tokenizer.eos_token_id}) - {None}  # the target's and the chat's
    eos_list = sorted(eos_ids)
    engine = SpeculativeEngine(target)  # no drafter: one target token per row per step
    running: dict[int, _Conversation] = {}
    writer = _ShardWriter(output_dir, config.shard_size)
    bar = tqdm(total=total, desc="regenerating", unit="conv", disable=not progress)
    turns = _Turns(tokenizer, eos_ids, config, writer, bar)
    started = time.perf_counter()
    try:
        while queue or engine.num_running:
            _admit(engine, queue, running, config, eos_list)
            continuing = []
            for request, tokens in engine.step().items():
                row = running.pop(request)
                row.answer = tokens[len(row.ids):].tolist()
                parked = engine.take_parked(request) if row.turn + 1 < len(row.turns) else None
                if turns.finish(row):  # it goes on: its next turn runs on this cache
                    row.parked = parked
                    continuing.append(row)
            queue.extendleft(reversed(continuing))  # first: they finish conversations already started
            if len(engine.verified_tokens_per_round) % 8 == 0:
                bar.set_postfix(tok_per_s=f"{turns.answer_tokens / (time.perf_counter() - started):.0f}",
                                rows=engine.num_running)
    finally:
        writer.close()
        bar.close()
    elapsed = time.perf_counter() - started
    return {"prompts": total, "skipped_long_prompts": skipped, "answer_tokens": turns.answer_tokens,
            "seconds": elapsed, "tokens_per_second": turns.answer_tokens / max(elapsed, 1e-9)}


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
