"""OpenAI's response objects (the `openai` package's own types, as `transformers serve` uses them) and their SSE
events, and the streaming response that ends a request as soon as its client leaves."""

from __future__ import annotations

import asyncio
import time
import uuid

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from starlette.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(model) -> str:
    """One server-sent event: a `data:` line of the object's JSON."""
    return f"data: {model.model_dump_json(exclude_unset=True, warnings=False)}\n\n"


class ResponseBuilder:
    """The objects of one request's answer, all with its id, creation time and model name."""

    def __init__(self, prefix: str, model: str):
        self.id, self.created, self.model = new_id(prefix), int(time.time()), model

    # -- chat ---------------------------------------------------------------------------------------------------------

    def chat(self, generation) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=ChatCompletionMessage(role="assistant", content=text.full_text()),
                              finish_reason=finish, logprobs=None)
                   for i, (text, finish) in enumerate(zip(generation.texts, generation.finish))]
        return ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model,
                              choices=choices, usage=CompletionUsage(**generation.usage()))

    def chat_chunk(self, index: int, content: str | None = None, finish: str | None = None,
                   role: str | None = None) -> str:
        delta = ChoiceDelta(role=role, content=content) if role else \
            (ChoiceDelta(content=content) if content is not None else ChoiceDelta())
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish)
        return sse(ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                       model=self.model, choices=[choice]))

    def chat_usage_chunk(self, generation) -> str:
        return sse(ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                       model=self.model, choices=[], usage=CompletionUsage(**generation.usage())))

    # -- completions --------------------------------------------------------------------------------------------------

    def completion(self, generation) -> Completion:
        choices = [CompletionChoice(index=i, text=text.full_text(), finish_reason=finish, logprobs=None)
                   for i, (text, finish) in enumerate(zip(generation.texts, generation.finish))]
        return Completion(id=self.id, object="text_completion", created=self.created, model=self.model,
                          choices=choices, usage=CompletionUsage(**generation.usage()))

    def completion_chunk(self, index: int, text: str, finish: str | None) -> str:
        # A streamed choice has no finish reason until its last chunk, which CompletionChoice's type does not allow.
        choice = CompletionChoice.model_construct(index=index, text=text, finish_reason=finish, logprobs=None)
        return sse(Completion.model_construct(id=self.id, object="text_completion", created=self.created,
                                              model=self.model, choices=[choice]))

    def completion_usage_chunk(self, generation) -> str:
        return sse(Completion.model_construct(id=self.id, object="text_completion", created=self.created,
                                              model=self.model, choices=[],
                                              usage=CompletionUsage(**generation.usage())))


def error_event(error) -> str:
    """An error after the stream began (the status line is sent): as vLLM does, a `data:` event with the error."""
    import json

    return f"data: {json.dumps(error.body())}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator that end, and run `on_close`, as soon as the client leaves: the
    stream waits for the client's disconnect alongside its own events, instead of noticing it at its next write."""

    def __init__(self, events, on_close, headers: dict | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.body_iterator:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def client_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(client_left())]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()
            self.on_close()
        if tasks[0] in done and not tasks[0].cancelled() and tasks[0].exception() is not None:
            error = tasks[0].exception()
            if not isinstance(error, OSError):  # a write to a client that just left
                raise error
