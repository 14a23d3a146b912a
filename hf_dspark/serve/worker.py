"""The engine thread: one thread owns the `SpeculativeEngine`, admits the queued sequences, steps it, and hands each
sequence's new tokens to whoever waits for them, never waiting for them itself.

The HTTP side (an asyncio event loop) only ever calls `submit()` and `cancel()`, which take a short lock and return
at once; the engine thread takes what they posted before each step: cancellations first (a request whose client
left is out of the engine before the next step), then new sequences while fewer than `max_running` run. Each
sequence's `deliver` callback is called on the engine thread with an `Update` after every step that gave it tokens,
and once more when it ends; the server's callback hands the update to the event loop (`call_soon_threadsafe`).

Seeds: a sampled sequence with a seed draws from a `torch.Generator` of its own, so its text depends on nothing else
that runs. An engine with a drafter takes no per-request generators today (its sampled requests share the engine's
generator), so seeded sampled sequences then run on a second, plain engine over the same target (lossless too: the
target's own distribution), stepped by the same thread. Unseeded sampled sequences share the main engine's
generator, which the server seeds from the OS: never torch's global generator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..generation.engine.speculative_engine import SpeculativeEngine

logger = logging.getLogger("hf_dspark.serve")


class QueueFull(Exception):
    """More sequences than `max_queued` would wait: the client should retry later (HTTP 429)."""


class NotServing(Exception):
    """The server is shutting down, or its engine thread died (HTTP 503)."""


@dataclass
class Update:
    """What a sequence got from one step: its new token ids, and when it ended, why (`"eos"`, `"length"`,
    `"cancelled"` or `"error"`, with `error` the message). `drafted` / `accepted`: its draft tokens verified and
    accepted so far."""

    index: int
    token_ids: list[int]
    finish: str | None = None
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    status: int = 500


@dataclass(eq=False)
class Sequence:
    """One choice of one request, from its prompt ids to its end; the fields after `deliver` are the engine
    thread's."""

    prompt: list[int]
    max_new_tokens: int
    deliver: Callable[[Update], None]
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    index: int = 0
    arrival: float = field(default_factory=time.monotonic)
    engine: SpeculativeEngine | None = None
    request_id: int | None = None
    stepped: bool = False  # took part in a step that returned (a failing step is blamed on newcomers first)
    sent: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    first_token: float | None = None
    last_token: float | None = None
    cancel_asked_at_step: int | None = None
    done: bool = False


def request_tokens(engine: SpeculativeEngine, request_id: int) -> list[int]:
    """The prompt and new tokens of a request still running (`SpeculativeEngine.tokens_so_far`)."""
    return engine.tokens_so_far(request_id)


def takes_own_generators(engine: SpeculativeEngine, device) -> bool:
    """Whether `engine.submit` takes a request's own `generator=` (a refused submit leaves the engine unchanged; an
    accepted probe asks for no tokens and is cancelled at once)."""
    try:
        probe = engine.submit(torch.tensor([0]), 0, do_sample=True, generator=torch.Generator(device=device))
    except ValueError:
        return False
    engine.cancel(probe)
    return True


class EngineWorker:
    """Owns `engine` on a thread of its own (`start()`); see the module docstring.

    Args:
        engine: the main engine (with or without a drafter).
        max_running: sequences in the engines at once; more wait here, in arrival order.
        max_queued: sequences that may wait beyond the free running places; `submit` raises `QueueFull` past it.
        plain_engine: builds the plain engine that runs seeded sampled sequences when `engine` takes no generators.
        metrics: a `ServerMetrics` (or None).
    """

    def __init__(self, engine: SpeculativeEngine, *, max_running: int, max_queued: int,
                 plain_engine: Callable[[], SpeculativeEngine] | None = None, metrics=None):
        self.engine, self.max_running, self.max_queued = engine, max_running, max_queued
        self.metrics = metrics
        self._device = engine.device
        self._own_generators = takes_own_generators(engine, self._device)
        self._plain_factory, self._plain = plain_engine, None
        self._lock = threading.Condition()
        self._queued: deque[Sequence] = deque()
        self._cancels: list[tuple[Sequence, str]] = []
        self._running: list[Sequence] = []
        self._accepting, self._stopping = True, False
        self.steps = 0
        self.max_cancel_lag_steps = 0  # steps between a cancel() and the engine dropping the sequence
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hf-dspark-engine", daemon=True)

    # -- called from other threads ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._queued)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue the sequences of one request, all or none."""
        with self._lock:
            if not (self._accepting and self.alive):
                raise NotServing("the server is shutting down" if self.failure is None else
                                 f"the engine stopped: {self.failure}")
            room = self.max_queued + max(0, self.max_running - len(self._running))
            if len(self._queued) + len(sequences) > room:
                raise QueueFull(f"{len(self._queued)} sequences are already waiting (--max-queued "
                                f"{self.max_queued}, --max-running {self.max_running})")
            self._queued.extend(sequences)
            self._lock.notify()

    def cancel(self, sequence: Sequence, reason: str = "abort") -> None:
        """Take `sequence` out before the next step (a no-op once it ended). `reason` is what the metrics count it
        as: `"abort"` (the client left) or `"stop"` (a stop string ended it)."""
        with self._lock:
            if not sequence.done:
                sequence.cancel_asked_at_step = self.steps
                self._cancels.append((sequence, reason))
                self._lock.notify()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop after the running step; every sequence still queued or running ends as cancelled."""
        with self._lock:
            self._accepting, self._stopping = False, True
            self._lock.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._next_round():
                    pass
        except BaseException as error:  # a bug here: say so to every waiting client, and report unhealthy
            logger.exception("the engine thread stopped")
            self.failure = error
        finally:
            self._end_all()

    def _next_round(self) -> bool:
        """Wait for work, apply cancellations, admit, step. Returns False once shutdown() was called."""
        with self._lock:
            while not (self._stopping or self._cancels or self._running or
                       (self._queued and len(self._running) < self.max_running)):
                self._lock.wait()
            if self._stopping:
                return False
            cancels, self._cancels = self._cancels, []
            admitted = []
            while self._queued and len(self._running) + len(admitted) < self.max_running:
                admitted.append(self._queued.popleft())
        for sequence, reason in cancels:
            self._cancel(sequence, reason)
        for sequence in admitted:
            self._admit(sequence)
        if self._running:
            self._step()
        return True

    def _engine_for(self, sequence: Sequence) -> tuple[SpeculativeEngine, torch.Generator | None]:
        if sequence.seed is None or not sequence.do_sample:
            return self.engine, None
        generator = torch.Generator(device=self._device).manual_seed(sequence.seed)
        if self._own_generators or self._plain_factory is None:
            return self.engine, generator
        if self._plain is None:
            self._plain = self._plain_factory()
        return self._plain, generator

    def _admit(self, sequence: Sequence) -> None:
        if sequence.done:  # cancelled while queued
            return
        engine, generator = self._engine_for(sequence)
        extra = {"generator": generator} if generator is not None else {}
        try:
            sequence.request_id = engine.submit(torch.tensor(sequence.prompt), sequence.max_new_tokens,
                                                do_sample=sequence.do_sample, temperature=sequence.temperature,
                                                top_p=sequence.top_p, top_k=sequence.top_k, **extra)
        except ValueError as error:  # refused before it could share a round: nothing else is touched
            self._end(sequence, [], "error", error=str(error), status=400)
            return
        sequence.engine = engine
        self._running.append(sequence)
        if self.metrics is not None:
            self.metrics.admitted(sequence, time.monotonic())

    def _cancel(self, sequence: Sequence, reason: str) -> None:
        if sequence.done:
            return
        if sequence.engine is None:  # still queued
            with self._lock:
                if sequence in self._queued:
                    self._queued.remove(sequence)
            self._end(sequence, [], "cancelled", metrics_reason=reason)
            return
        output = sequence.engine.cancel(sequence.request_id)
        self.max_cancel_lag_steps = max(self.max_cancel_lag_steps, self.steps - sequence.cancel_asked_at_step)
        self._running.remove(sequence)
        stats = sequence.engine.returned_stats.get(sequence.request_id)
        self._progress(sequence, output.tolist(), stats, time.monotonic(), "cancelled", metrics_reason=reason)

    def _step(self) -> None:
        engines = [self.engine] + ([self._plain] if self._plain is not None else [])
        for engine in engines:
            members = [s for s in self._running if s.engine is engine]
            if not members:
                continue
            try:
                finished = engine.step()
            except Exception as error:  # the engine undid the step: drop whom it may be blamed on, go on
                self._step_failed(members, error)
                continue
            now = time.monotonic()
            returned = engine.returned_stats
            for sequence in members:
                sequence.stepped = True
                if sequence.request_id in finished:
                    self._running.remove(sequence)
                    tokens = finished[sequence.request_id].tolist()
                    self._progress(sequence, tokens, returned.get(sequence.request_id), now,
                                   self._finish_reason(sequence, tokens))
                else:
                    self._progress(sequence, request_tokens(engine, sequence.request_id),
                                   engine.stats.get(sequence.request_id), now, None)
        self.steps += 1

    def _finish_reason(self, sequence: Sequence, tokens: list[int]) -> str:
        return "length" if len(tokens) - len(sequence.prompt) >= sequence.max_new_tokens else "eos"

    def _step_failed(self, members: list[Sequence], error: Exception) -> None:
        """A step raised (and was undone). The sequences that joined in it are dropped with the error; when none
        did, every sequence of that engine is (the failure is not one request's)."""
        logger.error("an engine step failed: %s", error)
        blamed = [s for s in members if not s.stepped] or members
        for sequence in blamed:
            sequence.engine.cancel(sequence.request_id)
            self._running.remove(sequence)
            self._end(sequence, [], "error", error=f"the engine failed on this request: {error}", status=500)

    def _progress(self, sequence: Sequence, tokens: list[int], stats, now: float, finish: str | None,
                  metrics_reason: str | None = None) -> None:
        """Deliver the sequence's tokens since the last update and account for its new rounds."""
        new = tokens[len(sequence.prompt) + sequence.sent:]
        if stats is not None:
            lengths, accepted = stats.draft_lengths[sequence.rounds:], stats.accepted[sequence.rounds:]
            sequence.rounds += len(lengths)
            sequence.drafted += sum(lengths)
            sequence.accepted += sum(min(a, d) for a, d in zip(accepted, lengths))
            if self.metrics is not None:
                self.metrics.rounds(lengths, accepted)
        if new and self.metrics is not None:
            self.metrics.tokens(sequence, len(new), now)
        if new:
            sequence.first_token = sequence.first_token or now
            sequence.last_token = now
            sequence.sent += len(new)
        if finish is not None:
            self._end(sequence, new, finish, metrics_reason=metrics_reason)
        elif new:
            self._deliver(sequence, Update(sequence.index, new, None, sequence.drafted, sequence.accepted))

    def _end(self, sequence: Sequence, new: list[int], finish: str, *, error: str | None = None, status: int = 500,
             metrics_reason: str | None = None) -> None:
        sequence.done = True
        if self.metrics is not None:
            self.metrics.finished(sequence, metrics_reason or {"eos": "stop", "cancelled": "abort"}.get(finish, finish),
                                  time.monotonic())
        self._deliver(sequence, Update(sequence.index, new, finish, sequence.drafted, sequence.accepted, error, status))

    @staticmethod
    def _deliver(sequence: Sequence, update: Update) -> None:
        try:
            sequence.deliver(update)
        except Exception:  # the receiving side is gone (its event loop closed): nobody to tell
            logger.debug("dropped an update for a closed receiver", exc_info=True)

    def _end_all(self) -> None:
        """Shutdown or failure: every sequence still here ends as cancelled (with the failure, if any)."""
        with self._lock:
            self._accepting = False
            leftover = list(self._queued) + list(self._running)
            self._queued.clear()
        message = "the server is shutting down" if self.failure is None else f"the engine stopped: {self.failure}"
        for sequence in leftover:
            if sequence.engine is not None and sequence in self._running:
                try:
                    sequence.engine.cancel(sequence.request_id)
                except Exception:
                    logger.debug("cancel at shutdown failed", exc_info=True)
                self._running.remove(sequence)
            if not sequence.done:
                self._end(sequence, [], "cancelled", error=message, status=503)
