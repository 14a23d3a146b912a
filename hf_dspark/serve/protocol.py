"""The OpenAI request fields the server takes, checked with pydantic, and its errors in OpenAI's shape.

A field the server cannot honour is refused with a 400 naming it, never ignored: fields of OpenAI's API that this
server does not build (tools, logprobs, penalties, response formats, ...) pass only with their neutral value (what
sending nothing means), and a field OpenAI's API does not have is refused as unrecognized.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 16
MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered as OpenAI answers it: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _neutral(*values):
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


# OpenAI fields this server does not build, each with the values that ask for nothing (accepted and dropped).
_COMMON_UNSUPPORTED = {
    "frequency_penalty": _neutral(0, 0.0),
    "presence_penalty": _neutral(0, 0.0),
    "logit_bias": _neutral({}),
}
CHAT_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "logprobs": _neutral(False),
    "top_logprobs": _neutral(0),
    "tools": _neutral([]),
    "tool_choice": _neutral("none"),
    "parallel_tool_calls": lambda value: True,  # meaningless without tools
    "functions": _neutral([]),
    "function_call": _neutral("none"),
    "response_format": lambda value: value is None or value == {"type": "text"},
    "store": _neutral(False),
    "metadata": _neutral({}),
    "modalities": lambda value: value is None or value == ["text"],
    "audio": _neutral(),
    "prediction": _neutral(),
    "reasoning_effort": _neutral(),
    "web_search_options": _neutral(),
    "service_tier": _neutral("auto", "default"),
    "verbosity": _neutral(),
}
COMPLETION_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "logprobs": _neutral(0),
    "suffix": _neutral(""),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part of type {kind!r} is not supported: this server takes text "
                                     "parts ({\"type\": \"text\", \"text\": ...}) only")
        return value

    def as_template_message(self) -> dict:
        """`{"role", "content"}` as chat templates read it: text parts joined, `developer` read as `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if (isinstance(value, str) and not value) or (isinstance(value, list) and (
                not value or any(isinstance(p, (str, list)) and not p for p in value))):
            raise ValueError("the prompt is empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"


# Responses API fields this server does not build: only their neutral values pass. Nothing is stored, so `store`
# must be false (OpenAI's default is true: a client that relies on it is told) and no earlier response can be named.
RESPONSES_UNSUPPORTED = {
    "store": _neutral(False),
    "previous_response_id": _neutral(),
    "conversation": _neutral(),
    "background": _neutral(False),
    "include": _neutral([]),
    "tools": _neutral([]),
    "tool_choice": _neutral("none", "auto"),
    "parallel_tool_calls": lambda value: True,  # meaningless without tools
    "max_tool_calls": _neutral(),
    "text": lambda value: value is None or value == {"format": {"type": "text"}},
    "reasoning": _neutral(),
    "top_logprobs": _neutral(0),
    "truncation": _neutral("disabled"),
    "metadata": _neutral({}),
    "prompt": _neutral(),
    "service_tier": _neutral("auto", "default"),
}
_INPUT_TEXT_PARTS = ("input_text", "output_text", "text")


def _input_message(item: dict, where: str) -> dict:
    """One Responses input message as chat templates read it (`{"role", "content"}`), its text parts joined."""
    role, content = item.get("role"), item.get("content", "")
    if item.get("type", "message") != "message":
        raise ValueError(f"{where} is a {item.get('type')!r} item; this server takes messages only")
    if role not in ("system", "developer", "user", "assistant"):
        raise ValueError(f"{where} has role {role!r}; one of system, developer, user, assistant")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _INPUT_TEXT_PARTS or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where} has a content part of type {kind!r}; this server takes text parts "
                                 '({"type": "input_text", "text": ...}) only')
        content = "".join(part["text"] for part in content)
    elif not isinstance(content, str):
        raise ValueError(f"{where}'s content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


class ResponsesRequest(_Strict):
    """`/v1/responses`: one answer (no `n`, no stop strings in this API) to `input` after `instructions`."""

    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # as in chat: vLLM's extension
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _messages_only(cls, value):
        if isinstance(value, str):
            if not value:
                raise ValueError("the input is empty")
            return value
        if not value:
            raise ValueError("the input is empty")
        if "role" not in value[0]:  # a flat list of content parts: one user message
            _input_message({"role": "user", "content": value}, "input")
        else:
            for i, item in enumerate(value):
                _input_message(item, f"input[{i}]")
        return value

    def messages(self) -> list[dict]:
        """The chat messages this request means: `instructions` as a system message first."""
        value = self.input
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif "role" not in value[0]:
            messages = [_input_message({"role": "user", "content": value}, "input")]
        else:
            messages = [_input_message(item, f"input[{i}]") for i, item in enumerate(value)]
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        return messages

    @property
    def n(self) -> int:  # what the shared generation path reads (not a field of this API)
        return 1

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_output_tokens"

    @property
    def stop_strings(self) -> list[str]:
        return []


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise APIError(400, f"We could not parse the JSON body of your request: {error}. Send a JSON object.",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}.",
                       code="invalid_json")
    return body


def parse_request(body: dict, schema: type[_Strict], unsupported: dict) -> _Strict:
    """`body` checked against `schema`, the neutral values of unsupported fields dropped; an APIError naming the
    first field at fault otherwise."""
    body = dict(body)
    for name, neutral in unsupported.items():
        if name in body:
            if not neutral(body[name]):
                raise APIError(400, f"'{name}' is not supported by this server (hf-dspark serve); remove it from the "
                                    "request.", param=name, code="unsupported_parameter")
            del body[name]
    try:
        request = schema.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                           code="unknown_parameter") from None
        if first["type"] == "missing":
            raise APIError(400, f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter") from None
        raise APIError(400, f"Invalid value for '{param}': {first['msg']}.", param=param,
                       code="invalid_value") from None
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != request.n:
        raise APIError(400, "'best_of' other than n is not supported by this server (it returns every choice it "
                            "generates).", param="best_of", code="unsupported_parameter")
    return request
