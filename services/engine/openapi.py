"""The engine's HTTP API as OpenAPI documents it: request and response shapes per route.

The routes parse their bodies themselves (`protocol.py`), so that a refusal has SGLang's status
and wording; these models only describe what they accept and answer, in the limits the parser
enforces, so that `/openapi.json` (and a fuzzer reading it) tells the truth.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.kit.http import json_body

NonEmpty = Annotated[str, Field(min_length=1)]


class SamplingParamsBody(BaseModel):
    """The sampling parameters the CPU engine implements (SGLang's names and defaults); any other
    name is refused, as SGLang's constructor refuses it."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(
        128, ge=0, description="with the prompt, below the context length (a 400 otherwise)"
    )
    min_new_tokens: int | None = Field(0, ge=0, description="at most max_new_tokens")
    temperature: float | None = Field(1.0, ge=0)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(
        -1,
        ge=-1,
        description="-1 = the whole vocabulary; 0 is refused",
        json_schema_extra={"not": {"const": 0}},
    )
    min_p: float | None = Field(0.0, ge=0, le=1)
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    sampling_seed: int | None = Field(
        None, ge=-(2**53 - 1), le=2**53 - 1, description="a 400 past I-JSON's integers (protocol.py)"
    )
    # Accepted and ignored: they only shape how text is streamed or spaced.
    spaces_between_special_tokens: Any = Field(None, description="accepted and ignored")
    stream_interval: Any = Field(None, description="accepted and ignored")
    # SGLang's, accepted at their neutral value only (`protocol._NEUTRAL_SAMPLING`).
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    repetition_penalty: Literal[1] | None = None
    n: Literal[1] | None = None
    json_schema: None = None
    regex: None = None
    ebnf: None = None
    structural_tag: None = None
    stop_regex: None = None
    logit_bias: None = None
    custom_params: None = None


def _given(name: str, kind: str) -> dict[str, Any]:
    """JSON Schema for "`name` is there and not null" (SGLang reads a null prompt field as absent)."""
    return {"required": [name], "properties": {name: {"type": kind}}}


class GenerateBody(BaseModel):
    """One prompt: `text` or `input_ids` (exactly one; the other absent or null)."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "oneOf": [
                {**_given("text", "string"), "not": _given("input_ids", "array")},
                {**_given("input_ids", "array"), "not": _given("text", "string")},
            ]
        },
    )

    text: str | None = Field(None, min_length=1, description="the prompt")
    input_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="token ids, each >= 0 and below the vocab size"
    )
    sampling_params: SamplingParamsBody | None = None
    return_logprob: bool | None = False
    logprob_start_len: int | None = Field(
        -1, ge=-1, description="with return_logprob: below the prompt length"
    )
    return_text_in_logprobs: bool | None = False
    stream: bool | None = Field(False, description="server-sent events, then `data: [DONE]`")
    rid: str | None = None
    log_metrics: bool | None = True


class AbortBody(BaseModel):
    rid: str | None = None
    abort_all: bool | None = False


class PauseBody(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsBody(BaseModel):
    model_path: str = Field(min_length=1, description="the folder holding the new weights")
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool | None = False
    flush_cache: bool | None = True


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class ErrorMessage(BaseModel):
    message: str


class EngineError(BaseModel):
    """SGLang's error body (`http_server._create_error_response`)."""

    error: ErrorMessage


class UpdateWeightsResult(BaseModel):
    success: bool
    message: str
    num_paused_requests: int


class StatusMessage(BaseModel):
    message: str
    status: str


class HealthGenerate(BaseModel):
    status: Literal["ok", "unhealthy"]
    message: str


def _error(description: str, model: type[BaseModel] = EngineError) -> dict[str, Any]:
    return {"description": description, "model": model}


# One server-sent event as schemathesis reads a stream: its `data` line (JSON text).
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}}
UNAVAILABLE = _error("the engine cannot take work now: still loading, failed, or its queue is full")
REFUSED = _error("a request the engine refuses, with SGLang's message")
TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}

GENERATE = {
    "openapi_extra": json_body(GenerateBody),
    "responses": {
        200: {
            "description": "the generation; with stream true, SSE chunks of the same object",
            "model": GenerateResponse,
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
        400: REFUSED,
        503: UNAVAILABLE,
    },
}
ABORT = {
    "openapi_extra": json_body(AbortBody, required=False),
    "responses": {200: {"description": "done (empty body)", **TEXT}, 400: REFUSED, 503: UNAVAILABLE},
}
FLUSH = {
    "responses": {
        200: {"description": "SGLang's answer text", **TEXT},
        400: {"description": "refused: requests are running or waiting (SGLang's text)", **TEXT},
        503: UNAVAILABLE,
    }
}
PAUSE = {
    "openapi_extra": json_body(PauseBody, required=False),
    "responses": {200: {"model": StatusMessage}, 400: REFUSED, 503: UNAVAILABLE},
}
CONTINUE = {"responses": {200: {"model": StatusMessage}, 503: UNAVAILABLE}}
UPDATE_WEIGHTS = {
    "openapi_extra": json_body(UpdateWeightsBody),
    "responses": {
        200: {"model": UpdateWeightsResult},
        400: _error("refused: nothing was loaded, the old weights keep serving", UpdateWeightsResult),
        503: _error("the engine cannot take work now", UpdateWeightsResult),
    },
}
HEALTH_GENERATE = {
    "responses": {
        200: {"model": HealthGenerate},
        503: {"description": "no token came back in time", "model": HealthGenerate},
    }
}
# SGLang 0.5.19: both weight-version routes are 404 stubs pointing at /model_info.
WEIGHT_VERSION = {
    "deprecated": True,
    "responses": {404: {"description": "deprecated: the version is in GET /model_info"}},
}


def document_model_limits(schema: dict[str, Any], *, vocab_size: int, context_length: int) -> None:
    """Write the loaded model's limits into the `/generate` bodies of `schema` (the OpenAPI
    document), so that it says what `protocol.check_vocab` and `check_length` refuse: token ids
    below the vocab size, a prompt below the context length and, since a prompt has a token at
    least, max_new_tokens at most the context length minus one. Limits on two fields together (the
    prompt with max_new_tokens, logprob_start_len with the prompt) no JSON Schema states."""
    for method in ("post", "put"):
        body = schema["paths"]["/generate"][method]["requestBody"]["content"]["application/json"]["schema"]
        props = body["properties"]
        ids = next(s for s in props["input_ids"]["anyOf"] if s.get("type") == "array")
        ids["items"]["maximum"] = vocab_size - 1
        ids["maxItems"] = context_length - 1
        sampling = next(s for s in props["sampling_params"]["anyOf"] if s.get("type") == "object")
        for name in ("max_new_tokens", "min_new_tokens"):
            integer = next(s for s in sampling["properties"][name]["anyOf"] if s.get("type") == "integer")
            integer["maximum"] = context_length - 1
