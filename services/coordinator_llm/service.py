"""`bcstack serve coordinator-llm`: an OpenAI-compatible chat completions server whose "model" is
a coordinator policy (the toy world's scripted coordinator), answering in the coordinator
protocol. The embedded default for, and the test double of, the production coordinator LLM
(MiniMax-M2.7 behind an OpenAI-compatible endpoint).

    POST /v1/chat/completions   OpenAI request -> chat.completion, or SSE chat.completion.chunk
                                events then `data: [DONE]` with "stream": true
    GET  /v1/models             {"object": "list", "data": [{"id": model_name, "object": "model", ...}]}
    GET  /v1/models/{model}     the model card, or 404 model_not_found
    GET  /health, GET /metrics  the kit's; bcstack_coordinator_llm_* and bcstack_http_*

Auth: with `api_key` set, every /v1 route needs `Authorization: Bearer <key>`; a missing or
wrong key is 401 (`invalid_api_key`). /health and /metrics stay open. The key is compared in
constant time and appears in no response and no log line.

A request naming a model other than `model_name` gets 404 `model_not_found`, as vLLM answers:
a gateway pointed at the wrong name fails loudly instead of being answered by the wrong model.

Fault injection (`fail_rate`, `fail_mode`, `fault_seed`; see `faults`) acts on valid, authorized
chat completions only, after auth and request checks:
- http500: 500 `server_error`;
- http429: 429 `rate_limit_exceeded` with `Retry-After: retry_after_seconds`;
- garbage: 200, a well-formed completion whose content holds no function call;
- hang: the normal answer after `hang_seconds` (so a client timeout below that fires first).

`GET|PUT /admin/faults` (admin bearer token, as every service's admin routes) reads or replaces
the injection at runtime: `{"fail_rate", "fail_mode", "fault_seed"}`, each optional in a PUT (the
current value stays); a PUT restarts the seeded draws. A chaos test turns 500s on and off without
restarting the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, RootModel

from core.kit.auth import bearer_token, require_admin, token_matches
from core.kit.http import KitDetail, ValidationErrorBody, create_app, json_body, json_or_sse_response
from core.kit.metrics import new_registry
from services.coordinator_llm import protocol as proto
from services.coordinator_llm.faults import GARBAGE_CONTENT, FaultInjector
from services.coordinator_llm.metrics import CoordinatorLlmMetrics
from services.coordinator_llm.policies import CoordinatorPolicy, build_policy
from services.coordinator_llm.settings import CoordinatorLlmSettings, FailMode

log = logging.getLogger(__name__)

SERVICE = "coordinator-llm"

MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY = "Incorrect API key provided."


class _Refused(Exception):
    """Raised by a dependency to answer a RequestError before the route runs."""

    def __init__(self, error: proto.RequestError) -> None:
        self.error = error


class FaultSettings(BaseModel):
    """A PUT /admin/faults body: the fields given replace the current ones."""

    model_config = ConfigDict(extra="forbid")

    fail_rate: float | None = Field(None, ge=0.0, le=1.0)
    fail_mode: FailMode | None = None
    fault_seed: int | None = None


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str | None
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


class FaultState(BaseModel):
    fail_rate: float
    fail_mode: FailMode
    fault_seed: int | None


def _openai_error(description: str) -> dict[str, Any]:
    return {"description": description, "model": OpenAIError}


KEYED_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _openai_error("no API key, or a wrong one (api_key set)")
}
CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: json_or_sse_response(
        "a chat.completion; with stream true, chat.completion.chunk events then [DONE]"
    ),
    400: _openai_error("not a JSON object, or an unsupported option (n > 1, logprobs)"),
    404: _openai_error("the request names another model (model_not_found)"),
    422: _openai_error("a field with an invalid value"),
    429: _openai_error("injected fault (fail_mode http429)"),
    500: _openai_error("injected fault (fail_mode http500), or the policy failed"),
    **KEYED_RESPONSES,
}


def _chat_body(model: str) -> dict[str, Any]:
    """The chat completion body as documented: `model` is the one model served (another is 404),
    and the values `parse_chat_request` refuses with a 400 of OpenAI's wording are left out: no
    messages, n other than 1, logprobs."""
    extra = json_body(proto.ChatCompletionRequest)
    schema = extra["requestBody"]["content"]["application/json"]["schema"]
    props = schema["properties"]
    props["model"]["enum"] = [model]
    props["messages"]["minItems"] = 1
    props["n"] = {"anyOf": [{"const": 1}, {"type": "null"}], "default": 1, "description": "one choice only"}
    props["logprobs"] = {"anyOf": [{"const": False}, {"type": "null"}], "default": False}
    props["top_logprobs"] = {"anyOf": [{"const": 0}, {"type": "null"}], "default": None}
    return extra


def _error_response(error: proto.RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def build_app(
    settings: CoordinatorLlmSettings,
    registry: CollectorRegistry | None = None,
    *,
    policy: CoordinatorPolicy | None = None,
) -> FastAPI:
    """The app (what `bcstack serve coordinator-llm` runs); `policy` defaults to `settings.policy`."""
    registry = registry if registry is not None else new_registry()
    policy = policy if policy is not None else build_policy(settings)
    faults = FaultInjector(settings.fail_rate, settings.fail_mode, settings.fault_seed)
    injection = {"faults": faults}  # replaced whole by PUT /admin/faults
    metrics = CoordinatorLlmMetrics(registry)
    model = settings.model_name
    created = proto.now()

    def health() -> dict[str, Any]:
        return {"model": model, "policy": policy.name}

    def announce() -> None:
        faults_note = ""
        if settings.fail_rate > 0:
            faults_note = (
                f"; injecting {settings.fail_mode} on {settings.fail_rate:.0%} of requests "
                f"(seed {settings.fault_seed})"
            )
        log.info(
            "coordinator LLM: %s policy served as model %r (fanout %d, max_rounds %d), API key %s%s",
            policy.name,
            model,
            settings.fanout,
            settings.max_rounds,
            "required" if settings.api_key is not None else "not required",
            faults_note,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Logged at startup, not at build time: `run_service` sets up logging in between.
        announce()
        yield

    app = create_app(SERVICE, settings, registry, health_check=health, lifespan=lifespan)

    @app.exception_handler(_Refused)
    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, _Refused)
        return _error_response(exc.error)

    async def require_api_key(request: Request) -> None:
        expected = settings.api_key
        if expected is None:
            return
        presented = bearer_token(request)
        if presented is not None and token_matches(presented, expected):
            return
        client = request.client.host if request.client else "?"
        reason = "no API key" if presented is None else "a wrong API key"
        log.warning("refused %s %s from %s: %s", request.method, request.url.path, client, reason)
        if request.url.path == "/v1/chat/completions":
            metrics.requests.labels("unauthorized").inc()  # counted, but kept out of the latency
        raise _Refused(
            proto.RequestError(
                MISSING_KEY if presented is None else WRONG_KEY,
                status=401,
                code=None if presented is None else "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        )

    keyed = [Depends(require_api_key)]

    @app.post(
        "/v1/chat/completions",
        dependencies=keyed,
        openapi_extra=_chat_body(model),
        responses=CHAT_RESPONSES,
    )
    async def chat_completions(request: Request) -> Any:
        started = time.perf_counter()

        def finished(outcome: str) -> None:
            metrics.record(outcome, time.perf_counter() - started)

        try:
            req = proto.parse_chat_request(await request.body())
            if req.model != model:
                raise proto.RequestError(
                    f"The model `{req.model}` does not exist. This server serves `{model}`.",
                    status=404,
                    param="model",
                    code="model_not_found",
                )
        except proto.RequestError as e:
            finished("invalid")
            log.debug("refused a chat completion: %d %s", e.status, e)
            return _error_response(e)

        fault = injection["faults"].draw()
        if fault == "http500":
            finished("fault_http500")
            return _error_response(
                proto.RequestError(
                    "The server had an error while processing your request (injected fault).",
                    status=500,
                    type="server_error",
                )
            )
        if fault == "http429":
            finished("fault_http429")
            return _error_response(
                proto.RequestError(
                    "Rate limit reached for requests (injected fault). "
                    f"Please try again in {settings.retry_after_seconds}s.",
                    status=429,
                    type="requests",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(settings.retry_after_seconds)},
                )
            )
        if fault == "hang":
            await asyncio.sleep(settings.hang_seconds)

        try:
            text = GARBAGE_CONTENT if fault == "garbage" else policy.next_turn(list(req.messages))
        except Exception:
            finished("error")
            log.exception("the %s policy failed", policy.name)
            return _error_response(
                proto.RequestError(
                    "The server had an error while processing your request.", status=500, type="server_error"
                )
            )
        answer = proto.shape_answer(text, req)
        outcome = f"fault_{fault}" if fault else ("length" if answer.finish_reason == "length" else "ok")
        completion_id, now = proto.new_completion_id(), proto.now()
        log.debug(
            "chat completion %s: %d message(s) -> %s, %d+%d tokens (estimated)",
            completion_id,
            len(req.messages),
            outcome,
            answer.prompt_tokens,
            answer.completion_tokens,
        )
        metrics.prompt_tokens.inc(answer.prompt_tokens)
        metrics.completion_tokens.inc(answer.completion_tokens)
        if not req.stream:
            finished(outcome)
            return JSONResponse(proto.completion_body(completion_id, now, model, answer))

        async def events() -> AsyncIterator[bytes]:
            try:
                for chunk in proto.completion_chunks(
                    completion_id, now, model, answer, include_usage=req.include_usage
                ):
                    yield proto.sse_event(chunk)
                yield proto.SSE_DONE
            finally:
                finished(outcome)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    admin = [Depends(require_admin)]

    def fault_state() -> dict[str, Any]:
        now = injection["faults"]
        return {"fail_rate": now.rate, "fail_mode": now.mode, "fault_seed": now.seed}

    @app.get("/admin/faults", dependencies=admin, responses={200: {"model": FaultState}})
    async def get_faults() -> dict[str, Any]:
        return fault_state()

    @app.put(
        "/admin/faults",
        dependencies=admin,
        responses={
            200: {"model": FaultState},
            422: {"description": "an invalid setting", "model": RootModel[ValidationErrorBody | KitDetail]},
        },
    )
    async def put_faults(body: FaultSettings) -> dict[str, Any]:
        now = injection["faults"]
        try:
            injection["faults"] = FaultInjector(
                now.rate if body.fail_rate is None else body.fail_rate,
                body.fail_mode or now.mode,
                now.seed if body.fault_seed is None else body.fault_seed,
            )
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from None
        log.warning("fault injection set to %s", fault_state())
        return fault_state()

    @app.get("/v1/models", dependencies=keyed, responses=KEYED_RESPONSES)
    async def list_models() -> Any:
        return {"object": "list", "data": [proto.model_card(model, created)]}

    @app.get(
        "/v1/models/{model_id:path}",
        dependencies=keyed,
        responses={
            404: {
                # A control character in the path matches no route: Starlette's own 404 answers.
                "description": "no such model (model_not_found)",
                "model": RootModel[OpenAIError | KitDetail],
            },
            **KEYED_RESPONSES,
        },
    )
    async def get_model(model_id: str) -> Any:
        if model_id != model:
            return _error_response(
                proto.RequestError(
                    f"The model `{model_id}` does not exist.",
                    status=404,
                    param="model",
                    code="model_not_found",
                )
            )
        return proto.model_card(model, created)

    @app.exception_handler(404)
    async def unknown_route(request: Request, exc: Exception) -> Any:
        # OpenAI's answer to a /v1 route it does not have. A method a route does not take is the
        # kit's 405 with `Allow`, as vLLM's (FastAPI) server answers it.
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, exc)
        return _error_response(
            proto.RequestError(f"Invalid URL ({request.method} {request.url.path})", status=404)
        )

    return app
