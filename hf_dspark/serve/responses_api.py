"""OpenAI's Responses API objects (`/v1/responses`, the `openai` package's own types) for one answer, whole or as
its streamed events (`event:` / `data:` pairs, each with its sequence number, as OpenAI sends them)."""

from __future__ import annotations

import time

from openai.types.responses import (Response, ResponseCompletedEvent, ResponseContentPartAddedEvent,
                                    ResponseContentPartDoneEvent, ResponseCreatedEvent, ResponseErrorEvent,
                                    ResponseFailedEvent, ResponseIncompleteEvent, ResponseInProgressEvent,
                                    ResponseOutputItemAddedEvent, ResponseOutputItemDoneEvent, ResponseOutputMessage,
                                    ResponseOutputText, ResponseTextDeltaEvent, ResponseTextDoneEvent, ResponseUsage)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from .protocol import APIError
from .responses import new_id


def _no_cached_tokens() -> InputTokensDetails:
    """Nothing read from a prompt cache (the field set grew across `openai` releases: each one present is 0)."""
    fields = InputTokensDetails.model_fields
    return InputTokensDetails(**{name: 0 for name in ("cached_tokens", "cache_write_tokens") if name in fields})


class ResponseAnswer:
    """The objects of one `/v1/responses` answer: the response (`whole`) or its events (`events`)."""

    def __init__(self, model: str, request):
        self.id, self.message_id = new_id("resp"), new_id("msg")
        self.created, self.model, self.request = time.time(), model, request
        self.sequence = 0

    def _response(self, status: str, output: list, generation=None, **extra) -> Response:
        usage = None
        if generation is not None:
            counts = generation.usage()
            usage = ResponseUsage(input_tokens=counts["prompt_tokens"], output_tokens=counts["completion_tokens"],
                                  total_tokens=counts["total_tokens"],
                                  input_tokens_details=_no_cached_tokens(),
                                  output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                                  drafted_tokens=counts["drafted_tokens"], accepted_tokens=counts["accepted_tokens"])
        request = self.request
        return Response(id=self.id, object="response", created_at=self.created, model=self.model, status=status,
                        output=output, usage=usage, tools=[], tool_choice="auto", parallel_tool_calls=False,
                        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                        temperature=request.temperature, top_p=request.top_p, **extra)

    def _message(self, text: str, status: str) -> ResponseOutputMessage:
        content = [ResponseOutputText(type="output_text", text=text, annotations=[])] if status != "in_progress" \
            else []
        return ResponseOutputMessage(id=self.message_id, type="message", role="assistant", status=status,
                                     content=content)

    def _ending(self, generation) -> tuple[str, dict]:
        """The response's status and, when cut at the token limit, why."""
        if generation.finish[0] == "length":
            return "incomplete", {"incomplete_details": IncompleteDetails(reason="max_output_tokens")}
        return "completed", {}

    def whole(self, generation) -> Response:
        status, extra = self._ending(generation)
        text = generation.texts[0].full_text()
        return self._response(status, [self._message(text, status)], generation, **extra)

    def _event(self, event_type, **fields) -> str:
        event = event_type(type=event_type.model_fields["type"].annotation.__args__[0], sequence_number=self.sequence,
                           **fields)
        self.sequence += 1
        return f"event: {event.type}\ndata: {event.model_dump_json(exclude_none=True, warnings=False)}\n\n"

    async def events(self, generation):
        """The answer's events as the generation's text comes; an engine failure ends it with `error` and
        `response.failed`."""
        place = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        started = self._response("in_progress", [])
        yield self._event(ResponseCreatedEvent, response=started)
        yield self._event(ResponseInProgressEvent, response=started)
        yield self._event(ResponseOutputItemAddedEvent, output_index=0, item=self._message("", "in_progress"))
        empty = ResponseOutputText(type="output_text", text="", annotations=[])
        yield self._event(ResponseContentPartAddedEvent, part=empty, **place)
        try:
            async for piece in generation.pieces():
                if piece.text:
                    yield self._event(ResponseTextDeltaEvent, delta=piece.text, logprobs=[], **place)
        except APIError as error:
            yield self._event(ResponseErrorEvent, message=error.message, code=error.code, param=error.param)
            yield self._event(ResponseFailedEvent, response=self._response("failed", []))
            return
        status, extra = self._ending(generation)
        text = generation.texts[0].full_text()
        yield self._event(ResponseTextDoneEvent, text=text, logprobs=[], **place)
        yield self._event(ResponseContentPartDoneEvent,
                          part=ResponseOutputText(type="output_text", text=text, annotations=[]), **place)
        message = self._message(text, status)
        yield self._event(ResponseOutputItemDoneEvent, output_index=0, item=message)
        ended = self._response(status, [message], generation, **extra)
        yield self._event(ResponseCompletedEvent if status == "completed" else ResponseIncompleteEvent,
                          response=ended)
