"""OpenAI's Chat Completions wire format, server side: request parsing, responses, stream chunks,
errors, and the token estimate.

Field names and shapes follow openai-python's generated types (`types/chat/chat_completion.py`,
`chat_completion_chunk.py`, `completion_create_params.py`, `types/model.py`) and the API
reference:

- request: `model`, `messages` [{`role`, `content`: string | [{"type": "text", "text"}] | null}],
  `temperature` (0..2), `top_p` (0..1), `max_tokens` / `max_completion_tokens` (the newer name
  wins when both are sent), `stream`, `stream_options.include_usage`, `n`, `stop` (a string or a
  list), `seed`. Other fields (tools, response_format, user, ...) are accepted and ignored: the
  coordinator protocol is plain text either way.
- response: `{"id": "chatcmpl-…", "object": "chat.completion", "created", "model", "choices":
  [{"index": 0, "message": {"role": "assistant", "content", "refusal": null}, "logprobs": null,
  "finish_reason": "stop" | "length"}], "usage": {"prompt_tokens", "completion_tokens",
  "total_tokens"}}`.
- stream: `data: {chat.completion.chunk}` events — the first delta carries the role, then content
  deltas, then an empty delta with the finish reason — and `data: [DONE]`. With
  `stream_options.include_usage` every chunk has `"usage": null` and one more chunk with
  `"choices": []` carries the usage.
- errors: `{"error": {"message", "type", "param", "code"}}`.

Status codes: a body that is not a JSON object, or asks for what this server cannot do (`n` ≠ 1,
`logprobs`, a content part other than text, no messages) is 400; a body that does not match the
request schema (a missing or mistyped field, a value outside its range) is 422, the stack's
convention for schema errors (DESIGN.md §8 services answer 422 for them too; OpenAI itself says
400); both have type `invalid_request_error` and name the field in `param`.

Tokens are *estimated*, not counted with a tokenizer: one token per run of word characters and
one per other non-blank character (`\\w+|[^\\w\\s]`). Prompt tokens are the estimate over every
message's text. `max_tokens` cuts the answer after that many estimated tokens.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge, Interval
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from core.kit.http import JSON_INTEGER, JSON_NUMBER, JsonInt

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
FinishReason = Literal["stop", "length"]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
# A streamed answer is sent one line per chunk (each keeps its newline), so deltas rejoin exactly.
_LINE_RE = re.compile(r"[^\n]*\n|[^\n]+")


class RequestError(ValueError):
    """A request refused in OpenAI's error shape; `str(e)` is the message."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(str(self), type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- tokens --------------------------------------------------------------------------------------


def estimate_tokens(text: str) -> int:
    """Estimated tokens of `text`: word runs and single punctuation/symbol characters."""
    return len(_TOKEN_RE.findall(text))


def truncate_tokens(text: str, max_tokens: int) -> tuple[str, bool]:
    """`text` cut after its first `max_tokens` estimated tokens, and whether it was cut."""
    ends = [m.end() for m in _TOKEN_RE.finditer(text)]
    if len(ends) <= max_tokens:
        return text, False
    return text[: ends[max_tokens - 1]], True


# --- requests ------------------------------------------------------------------------------------


_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_TEXT_PARTS = {"type": "array", "items": _TEXT_PART}
_STRINGS = {"type": "array", "items": {"type": "string"}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: Any = Field(
        None,
        description="text, or text parts (the coordinator reads no other part)",
        json_schema_extra={"anyOf": [{"type": "string"}, _TEXT_PARTS, {"type": "null"}]},
    )

    @field_validator("content")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) for p in value):
            return value
        raise ValueError("content must be a string, a list of content parts or null")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class ChatCompletionRequest(BaseModel):
    """The fields the server reads, with JSON's types (`core.kit.http.JsonInt`: no true for 1)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage]
    temperature: Annotated[float, Interval(ge=0.0, le=2.0), JSON_NUMBER] | None = None
    top_p: Annotated[float, Interval(ge=0.0, le=1.0), JSON_NUMBER] | None = None
    max_tokens: Annotated[int, Ge(1), JSON_INTEGER] | None = None
    max_completion_tokens: Annotated[int, Ge(1), JSON_INTEGER] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: JsonInt | None = 1
    stop: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, _STRINGS, {"type": "null"}]})
    seed: JsonInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: JsonInt | None = None

    @field_validator("stop")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string, a list of strings or null")


@dataclass(frozen=True)
class ChatRequest:
    """One parsed chat completion request: what the server needs, validated."""

    model: str
    messages: tuple[dict[str, str], ...]  # {"role", "content"} with content flattened to text
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_chat_request(raw: bytes) -> ChatRequest:
    """The request in `raw` (a JSON body), or RequestError (400 / 422) naming the problem."""
    if not raw.strip():
        raise RequestError("The request body is empty; send a JSON object.")
    try:
        data = json.loads(raw)
    except ValueError:
        raise RequestError(
            "We could not parse the JSON body of your request. The body must be a JSON object."
        ) from None
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object.")
    try:
        req = ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        param = _param_path(err.get("loc", ()))
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise RequestError(f"Invalid value for '{param}': {message}.", status=422, param=param) from None
    if req.n not in (None, 1):
        raise RequestError(
            f"n={req.n} is not supported: this server returns exactly one choice (n=1).",
            param="n",
            code="unsupported_value",
        )
    if req.logprobs or req.top_logprobs:
        raise RequestError(
            "logprobs are not supported by the scripted coordinator.",
            param="logprobs" if req.logprobs else "top_logprobs",
            code="unsupported_value",
        )
    if not req.messages:
        raise RequestError("'messages' must contain at least one message.", param="messages")
    messages = tuple(
        {"role": m.role, "content": _flatten(m.content, f"messages[{i}].content")}
        for i, m in enumerate(req.messages)
    )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return ChatRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        stop=tuple(s for s in stop if s),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def _param_path(loc: Sequence[Any]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def _flatten(content: Any, param: str) -> str:
    """A message's text: a string as is, text parts joined by newlines (as vLLM does), null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise RequestError(
                f"Content parts of type {kind!r} are not supported: the coordinator reads text only.",
                param=f"{param}[{j}].type",
                code="unsupported_value",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError("A text content part needs a string 'text'.", param=f"{param}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


# --- answers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    content: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def shape_answer(text: str, req: ChatRequest) -> Answer:
    """The policy's text as the client asked for it: cut at the first stop string (which is not
    returned, finish "stop"), then at `max_tokens` estimated tokens (finish "length")."""
    finish: FinishReason = "stop"
    cuts = [i for i in (text.find(s) for s in req.stop) if i >= 0]
    if cuts:
        text = text[: min(cuts)]
    if req.max_tokens is not None:
        text, cut = truncate_tokens(text, req.max_tokens)
        if cut:
            finish = "length"
    prompt_tokens = sum(estimate_tokens(m["content"]) for m in req.messages)
    return Answer(text, finish, prompt_tokens, estimate_tokens(text))


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def completion_body(completion_id: str, created: int, model: str, answer: Answer) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer.content, "refusal": None},
                "logprobs": None,
                "finish_reason": answer.finish_reason,
            }
        ],
        "usage": answer.usage(),
    }


def completion_chunks(
    completion_id: str, created: int, model: str, answer: Answer, *, include_usage: bool = False
) -> Iterator[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a streamed answer, in order (without [DONE])."""

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return body

    yield chunk({"role": "assistant", "content": ""})
    for piece in _LINE_RE.findall(answer.content):
        yield chunk({"content": piece})
    yield chunk({}, answer.finish_reason)
    if include_usage:
        yield {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": answer.usage(),
        }


def sse_event(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "bcstack"}
