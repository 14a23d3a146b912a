"""The batched engine's request bookkeeping: what a request asked for and has produced, what a batch returns, the
parked cache a conversation's next turn continues from, the snapshot that undoes a failed step, and the gate that
lets other threads submit and cancel requests while one thread steps the engine."""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...transformers_internals.cache_layers import restore_layers, snapshot_layers
from .rows import BatchRows
from ..round.sampling import SamplingParams
from ..round.stats import SpeculativeStats
from ..round.stopping import HostStoppingRule


@dataclass
class BatchedOutput:
    """What `batched_speculative_generate` returns.

    sequences: per request, its prompt (without padding) followed by the new tokens.
    stats: per request, one `SpeculativeStats` entry per verification round it took part in.
    verified_tokens_per_round: per round, the tokens in the target forward summed over active requests,
        sum(k_r + 1) (padding excluded): the verification batch B the scheduler prices.
    """

    sequences: list[torch.LongTensor]
    stats: list[SpeculativeStats]
    verified_tokens_per_round: list[int] = field(default_factory=list)


@dataclass
class ParkedCache:
    """A finished request's target-cache entries, kept so that a later request continuing its text (the next turn
    of a conversation) runs only its new tokens. `tokens` are the ids the entries cover: the request's prompt and
    output but its last token, which never went through the target."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (1, heads, len(tokens), dim)


@dataclass
class Request:
    """One request's settings and output so far."""

    tokens: list[int]  # prompt, then the new tokens
    max_new_tokens: int
    sampling: SamplingParams
    eos: set[int]
    generator: torch.Generator | None = None  # its own random source (plain decoding), else the engine's
    resume: ParkedCache | None = None  # entries to continue from instead of prefilling the whole prompt
    keep_cache: bool = False  # park its cache when it finishes
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    emitted: int = 0


def eos_ids(target, eos_token_id) -> set[int]:
    """Like `generate`: None falls back to the target's generation config."""
    if eos_token_id is None:
        eos_token_id = getattr(target.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        return set(eos_token_id.flatten().tolist())
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def emit(requests: list[Request], new_tokens: list[list[int]], counts: list[int]) -> list[bool]:
    """Append each row's first `counts[r]` tokens (host ints), stopping after an EOS or at `max_new_tokens` exactly
    as plain decoding would (every row's EOS found at once in the values read). Returns which rows finished."""
    finished = []
    for request, tokens, count in zip(requests, new_tokens, counts):
        # The batch-1 loop's rule, with the request's own limits: its length cap counts its prompt.
        rule = HostStoppingRule(len(request.tokens) - request.emitted + request.max_new_tokens, request.eos)
        appended, done = rule.first_stop(tokens[:count], len(request.tokens))
        request.tokens.extend(tokens[:appended])
        request.emitted += appended
        finished.append(done)
    return finished


def park_finished(rows: BatchRows, done: list[bool], requests: dict[int, Request],
                  parked: dict[int, ParkedCache]) -> None:
    """Keep the cache of the finished `keep_cache` requests (their entries cover all their tokens but the last,
    which never went through the target)."""
    for row, (request_id, finished) in enumerate(zip(rows.request_ids, done)):
        request = requests[request_id]
        if finished and request.keep_cache:
            parked[request_id] = ParkedCache(request.tokens[:-1], rows.target_entries(row))


@dataclass
class EngineSnapshot:
    """The engine's state before a step, by reference: every cache update and row edit replaces tensors, or writes
    cache entries past the lengths kept here, so keeping the old references is enough to undo a step."""

    waiting: list[int]
    rows: BatchRows | None
    row_fields: dict
    target_layers: list[dict]
    draft_layers: tuple[list, list]
    requests: dict[int, tuple[int, int, int]]  # request id -> (tokens, emitted, rounds recorded)
    parked: list[int]
    resumes: dict[int, ParkedCache]  # the parked caches waiting requests continue from (admission lets them go)
    rounds: int

    @classmethod
    def take(cls, waiting: list[int], rows: BatchRows | None, requests: dict[int, Request], parked: dict,
             rounds: int) -> "EngineSnapshot":
        # What a step can change: the waiting and running requests (not those other threads post meanwhile).
        stepped = [*waiting, *(rows.request_ids if rows is not None else [])]
        counts = {r: (len(requests[r].tokens), requests[r].emitted, requests[r].stats.num_rounds) for r in stepped}
        resumes = {r: requests[r].resume for r in waiting if requests[r].resume is not None}
        if rows is None:
            return cls(list(waiting), None, {}, [], ([], []), counts, list(parked), resumes, rounds)
        return cls(list(waiting), rows, dict(vars(rows)), snapshot_layers(rows.target_cache),
                   (list(rows.draft_cache.keys), list(rows.draft_cache.values)), counts, list(parked), resumes,
                   rounds)

    def undo(self, engine, error: BaseException) -> None:
        """Put `engine` back as it was before the step that raised `error`, and say so on the error."""
        engine._waiting, engine._rows, engine._sampling = self.waiting, self.rows, None
        self.restore(engine._requests, engine._parked, engine.verified_tokens_per_round)
        if hasattr(error, "add_note"):
            error.add_note(
                f"SpeculativeEngine: the step that raised this ({len(self.waiting)} waiting requests "
                f"{self.waiting[:8]}, {engine.num_running} running) was undone; the engine is as before it. "
                "Fix the cause or cancel(request_id) the offending request, then step again."
            )

    def restore(self, requests: dict[int, Request], parked: dict, verified_tokens_per_round: list[int]) -> None:
        """Put the rows, requests, parked caches and per-round records back (the caller resets its own fields)."""
        rows = self.rows
        if rows is not None:
            vars(rows).clear()
            vars(rows).update(self.row_fields)
            restore_layers(rows.target_cache, self.target_layers)
            rows.draft_cache.keys, rows.draft_cache.values = (list(k) for k in self.draft_layers)
        for request_id, (length, emitted, rounds) in self.requests.items():
            request = requests[request_id]
            del request.tokens[length:]
            request.emitted = emitted
            for per_round in vars(request.stats).values():  # draft_lengths, accepted, confidences, ...
                if isinstance(per_round, list):
                    del per_round[rounds:]
        for request_id, resume in self.resumes.items():
            requests[request_id].resume = resume
        for request_id in [r for r in parked if r not in self.parked]:
            del parked[request_id]
        del verified_tokens_per_round[self.rounds:]


class _TurnLock:
    """A lock taken in the order it was asked for: a `cancel()` that arrives during a step goes right after it,
    before the stepping thread's next step (a plain lock would let that thread take it again at once)."""

    def __init__(self):
        self._turns = threading.Condition(threading.Lock())
        self._next = self._serving = 0
        self._abandoned: set[int] = set()  # turns whose thread stopped waiting (interrupted)

    def __enter__(self) -> None:
        with self._turns:
            turn, self._next = self._next, self._next + 1
            try:
                while turn != self._serving:
                    self._turns.wait()
            except BaseException:
                if turn == self._serving:
                    self._advance()
                else:
                    self._abandoned.add(turn)
                raise

    def __exit__(self, *error) -> None:
        with self._turns:
            self._advance()

    def _advance(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._turns.notify_all()


class EngineGate:
    """What lets several threads share one `SpeculativeEngine`. `submit()` posts its request under a short lock of
    its own, never waiting for a running step; the next step (or a `cancel()`) takes the posted requests into the
    waiting ones. `step()`, `cancel()`, `take_parked()` and each step of `run_until_done()` hold the engine in
    turn (first come, first served): a cancel arriving during a step waits for it, then returns the request's
    tokens as that step left them, and a step never sees another thread's change."""

    def __init__(self):
        self._turn = _TurnLock()
        self._inbox_lock = threading.Lock()
        self._inbox: list[int] = []
        self._ids = itertools.count()
        self._holder: int | None = None  # the thread holding the engine

    def __len__(self) -> int:
        return len(self._inbox)

    def post(self, request: Request, requests: dict[int, Request], stats: dict) -> int:
        """Register `request` and queue it for the next step; returns its id."""
        with self._inbox_lock:
            request_id = next(self._ids)
            requests[request_id] = request
            stats[request_id] = request.stats
            self._inbox.append(request_id)
        return request_id

    def admit(self, waiting: list[int]) -> None:
        """Move the ids posted since the last call to the end of `waiting`."""
        with self._inbox_lock:
            waiting.extend(self._inbox)
            self._inbox.clear()

    @contextmanager
    def exclusive(self):
        """Hold the engine, after the threads that asked before."""
        if self._holder == threading.get_ident():
            raise RuntimeError("SpeculativeEngine: step(), cancel(), run_until_done() and take_parked() cannot be "
                               "called from inside a step (from code the step runs); call them once it returns.")
        with self._turn:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None
