"""One HTTP request's generation on the event loop's side: its choices as `Sequence`s on the engine thread, their
updates arriving through an `asyncio.Queue` (`call_soon_threadsafe`: the loop never waits on a step), their text
(`ChoiceText`: stop strings cut exactly) and its usage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from .protocol import APIError
from .text import ChoiceText
from .worker import EngineWorker, NotServing, QueueFull, Sequence, Update

FINISH_REASONS = {"eos": "stop", "length": "length"}


@dataclass
class Piece:
    """New text of one choice, and its finish reason once it ended ("stop" or "length")."""

    index: int
    text: str
    finish: str | None = None


@dataclass
class SamplingSettings:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


class Generation:
    """The choices of one request: `n` per prompt, choice `i` of prompt `p` at index `p * n + i`. A seeded request's
    choice `i` draws from seed + i."""

    def __init__(self, worker: EngineWorker, tokenizer, prompts: list[list[int]], n: int,
                 sampling: SamplingSettings, stop: list[str], prefixes: list[str] | None = None):
        loop = asyncio.get_running_loop()
        self.worker = worker
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.prompt_tokens = sum(len(p) for p in prompts)

        def deliver(update: Update) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self.queue.put_nowait, update)

        self.sequences = [
            Sequence(prompt, sampling.max_new_tokens, deliver, do_sample=sampling.do_sample,
                     temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                     seed=None if sampling.seed is None else sampling.seed + i, index=p * n + i)
            for p, prompt in enumerate(prompts) for i in range(n)]
        self.texts = [ChoiceText(tokenizer, stop, (prefixes or [""] * len(prompts))[p])
                      for p in range(len(prompts)) for _ in range(n)]
        self.finish: list[str | None] = [None] * len(self.sequences)
        self.drafted = [0] * len(self.sequences)
        self.accepted = [0] * len(self.sequences)

    def start(self) -> None:
        try:
            self.worker.submit(self.sequences)
        except QueueFull as error:
            raise APIError(429, f"The server is at capacity: {error}. Retry after a moment.", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except NotServing as error:
            raise APIError(503, f"The server is not taking requests: {error}.", code="service_unavailable",
                           kind="server_error") from None

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    async def pieces(self) -> AsyncIterator[Piece]:
        """New text as it comes, choice by choice; raises APIError if the engine fails a choice."""
        while not self.done:
            update = await self.queue.get()
            piece = self._apply(update)
            if piece is not None:
                yield piece

    def _apply(self, update: Update) -> Piece | None:
        index, text = update.index, self.texts[update.index]
        if self.finish[index] is not None:  # ended by a stop string: the tokens after it are not answered
            return None
        self.drafted[index], self.accepted[index] = update.drafted, update.accepted
        if update.finish in ("error", "cancelled"):
            self.finish[index] = "error"
            raise APIError(update.status, update.error or "the request was cancelled",
                           kind="server_error" if update.status >= 500 else "invalid_request_error")
        piece = text.feed(update.token_ids)
        if text.stopped:
            self.finish[index] = "stop"
            if update.finish is None:
                self.worker.cancel(self.sequences[index], "stop")
        elif update.finish is not None:
            self.finish[index] = FINISH_REASONS[update.finish]
        if self.finish[index] is not None:
            piece += text.finish()
        return Piece(index, piece, self.finish[index]) if piece or self.finish[index] else None

    async def run_to_end(self) -> None:
        async for _ in self.pieces():
            pass

    def close(self) -> None:
        """The client left or the request failed: the choices still running leave the engine before its next step."""
        for sequence, finish in zip(self.sequences, self.finish):
            if finish is None:
                self.worker.cancel(sequence, "abort")

    def usage(self) -> dict:
        """OpenAI's usage, plus the draft tokens the engine verified and accepted for this request (also as
        `completion_tokens_details`' accepted / rejected prediction tokens)."""
        completion = sum(text.completion_tokens for text in self.texts)
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted},
                "drafted_tokens": drafted, "accepted_tokens": accepted}
