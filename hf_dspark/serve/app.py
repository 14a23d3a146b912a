"""The FastAPI application: OpenAI's `/v1/chat/completions`, `/v1/completions`, `/v1/responses` and `/v1/models`,
plus `/health` and `/metrics`, over one `EngineWorker`."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from openai.types import Model
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .generation import Generation, SamplingSettings
from .metrics import ServerMetrics
from .protocol import (CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, RESPONSES_UNSUPPORTED, APIError, ChatCompletionRequest,
                       CompletionRequest, ResponsesRequest, parse_json, parse_request)
from .responses import DONE, EventStream, ResponseBuilder, error_event
from .responses_api import ResponseAnswer
from .worker import EngineWorker


UNKNOWN_CONTEXT_MAX_TOKENS = 4096
"""A chat request's default limit when the model's config names no context length."""


@dataclass
class ServedModel:
    """What the HTTP side knows of the model: its tokenizer, the name clients ask for, and its limits."""

    tokenizer: object
    name: str
    context_length: int | None
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ServerState:
    worker: EngineWorker
    model: ServedModel
    metrics: ServerMetrics
    api_key: str | None = None
    draining: bool = False


def build_app(state: ServerState) -> FastAPI:
    """The application; its lifespan starts the engine thread and, at shutdown, stops it (every request still in
    it then ends as cancelled)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.worker.alive and state.worker.failure is None:
            state.worker.start()
        try:
            yield
        finally:
            state.draining = True
            await asyncio.get_running_loop().run_in_executor(None, state.worker.shutdown)

    app = FastAPI(title="hf-dspark serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.get("/health")
    async def health():
        if state.draining or not state.worker.alive:
            return JSONResponse({"status": "draining" if state.draining else "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(_openai_router(state))
    return app


def _openai_router(state: ServerState) -> APIRouter:
    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise APIError(401, "Incorrect API key provided: pass the server's --api-key as a bearer token "
                                "(Authorization: Bearer KEY).", code="invalid_api_key")

    router = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @router.get("/models")
    async def models():
        model = state.model
        entry = Model(id=model.name, object="model", created=model.created, owned_by="hf-dspark",
                      max_model_len=model.context_length)
        return {"object": "list", "data": [entry.model_dump()]}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        body = parse_request(parse_json(await request.body()), ChatCompletionRequest, CHAT_UNSUPPORTED)
        _check_model(state, body.model)
        prompt = _chat_prompt(state.model.tokenizer, [message.as_template_message() for message in body.messages],
                              "messages")
        generation = _generation(state, body, [_checked_prompt(state, prompt, "messages")])
        builder = ResponseBuilder("chatcmpl", state.model.name)
        if body.stream:
            return _stream(generation, request, builder, _chat_events(builder, generation, body.include_usage))
        if not await _collect(generation, request):
            return Response(status_code=499)  # the client left: nobody reads this
        return JSONResponse(builder.chat(generation).model_dump(exclude_unset=True),
                            headers=_request_id(request, builder))

    @router.post("/completions")
    async def completions(request: Request):
        body = parse_request(parse_json(await request.body()), CompletionRequest, COMPLETION_UNSUPPORTED)
        _check_model(state, body.model)
        tokenizer = state.model.tokenizer
        prompts, prefixes = [], []
        for prompt in body.prompts:
            ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
            prompts.append(_checked_prompt(state, ids, "prompt"))
            text = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=True)
            prefixes.append(text if body.echo else "")
        generation = _generation(state, body, prompts, prefixes)
        builder = ResponseBuilder("cmpl", state.model.name)
        if body.stream:
            return _stream(generation, request, builder, _completion_events(builder, generation, body.include_usage))
        if not await _collect(generation, request):
            return Response(status_code=499)
        return JSONResponse(builder.completion(generation).model_dump(exclude_unset=True),
                            headers=_request_id(request, builder))

    @router.post("/responses")
    async def responses(request: Request):
        body = parse_request(parse_json(await request.body()), ResponsesRequest, RESPONSES_UNSUPPORTED)
        _check_model(state, body.model)
        prompt = _chat_prompt(state.model.tokenizer, body.messages(), "input")
        generation = _generation(state, body, [_checked_prompt(state, prompt, "input")])
        answer = ResponseAnswer(state.model.name, body)
        if body.stream:
            return _stream(generation, request, answer, answer.events(generation))
        if not await _collect(generation, request):
            return Response(status_code=499)
        return JSONResponse(answer.whole(generation).model_dump(exclude_none=True),
                            headers=_request_id(request, answer))

    return router


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model.name:
        raise APIError(404, f"The model `{name}` does not exist: this server serves `{state.model.name}` "
                            "(see /v1/models).", param="model", code="model_not_found")


def _chat_prompt(tokenizer, messages: list[dict], param: str) -> list[int]:
    """The prompt ids of chat `messages` (`{"role", "content"}`) by the model's chat template; `param` is the
    request field they came from."""
    from ..evaluation.prompts import chat_prompt_ids

    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, f"This model's tokenizer has no chat template, so the server cannot build a prompt from "
                            f"'{param}'; use /v1/completions with the text of the prompt.", param=param,
                       code="no_chat_template")
    try:
        return chat_prompt_ids(tokenizer, messages)
    except Exception as error:  # the template's own refusal (e.g. roles out of order)
        raise APIError(400, f"The chat template cannot render these messages: {error}", param=param,
                       code="invalid_messages") from None


def _checked_prompt(state: ServerState, ids: list[int], param: str) -> list[int]:
    model = state.model
    if not ids:
        raise APIError(400, f"The {param} is empty (no tokens).", param=param, code="invalid_value")
    outside = next((t for t in ids if not (isinstance(t, int) and 0 <= t < model.vocab_size)), None)
    if outside is not None:
        raise APIError(400, f"Token id {outside!r} in '{param}' is outside the model's vocabulary (0.."
                            f"{model.vocab_size - 1}).", param=param, code="invalid_value")
    if model.context_length is not None and len(ids) >= model.context_length:
        raise APIError(400, f"This model's maximum context length is {model.context_length} tokens, and the "
                            f"{param} has {len(ids)} tokens, leaving no room for an answer. Shorten the {param}.",
                       param=param, code="context_length_exceeded")
    return ids


def _generation(state: ServerState, body, prompts: list[list[int]], prefixes: list[str] | None = None):
    limit = state.model.context_length
    longest = max(len(p) for p in prompts)
    max_new_tokens = body.max_new_tokens
    if max_new_tokens is None:  # chat without a limit: up to the context, as vLLM
        max_new_tokens = limit - longest if limit is not None else UNKNOWN_CONTEXT_MAX_TOKENS
    elif limit is not None and longest + max_new_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{longest + max_new_tokens} tokens ({longest} in the prompt, {max_new_tokens} in "
                            f"'{body.max_tokens_field}'). Lower '{body.max_tokens_field}' or shorten the prompt.",
                       param=body.max_tokens_field, code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default: sampling
    sampling = SamplingSettings(max_new_tokens, temperature > 0, temperature if temperature > 0 else 1.0,
                                1.0 if body.top_p is None else body.top_p, max(0, body.top_k or 0), body.seed)
    generation = Generation(state.worker, state.model.tokenizer, prompts, body.n, sampling, body.stop_strings,
                            prefixes)
    if state.draining:
        raise APIError(503, "The server is shutting down.", code="service_unavailable", kind="server_error")
    generation.start()
    return generation


def _request_id(request: Request, builder: ResponseBuilder | ResponseAnswer) -> dict:
    return {"x-request-id": request.headers.get("x-request-id") or builder.id}


async def _collect(generation: Generation, request: Request) -> bool:
    """Wait for every choice (True), or for the client to leave (False: its choices leave the engine)."""

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    finished, watcher = asyncio.ensure_future(generation.run_to_end()), asyncio.ensure_future(client_left())
    try:
        await asyncio.wait([finished, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not finished.done():
            finished.cancel()
        generation.close()
    if finished.cancelled():
        return False
    finished.result()  # an engine error, as an APIError
    return True


def _stream(generation: Generation, request: Request, builder: ResponseBuilder | ResponseAnswer,
            events) -> EventStream:
    return EventStream(events, generation.close, headers=_request_id(request, builder))


async def _chat_events(builder: ResponseBuilder, generation: Generation, include_usage: bool):
    try:
        for index in range(len(generation.sequences)):
            yield builder.chat_chunk(index, content="", role="assistant")
        async for piece in generation.pieces():
            if piece.text:
                yield builder.chat_chunk(piece.index, content=piece.text)
            if piece.finish:
                yield builder.chat_chunk(piece.index, finish=piece.finish)
        if include_usage:
            yield builder.chat_usage_chunk(generation)
    except APIError as error:
        yield error_event(error)
    yield DONE


async def _completion_events(builder: ResponseBuilder, generation: Generation, include_usage: bool):
    try:
        async for piece in generation.pieces():
            yield builder.completion_chunk(piece.index, piece.text, piece.finish)
        if include_usage:
            yield builder.completion_usage_chunk(generation)
    except APIError as error:
        yield error_event(error)
    yield DONE
