"""The HTTP edge every service shares: a FastAPI app with /health, /metrics, request metrics,
JSON errors and a request body limit, and the uvicorn runner.

    app = create_app("judge", settings, registry)
    @app.post("/v1/grade")
    async def grade(body: GradeRequest) -> GradeResponse: ...
    serve_http(app, settings)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, BeforeValidator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core import __version__
from core.kit.metrics import PrometheusMiddleware, add_metrics_route, new_registry
from core.kit.settings import ServiceSettings

log = logging.getLogger(__name__)

HealthCheck = Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]]


def create_app(
    service_name: str,
    settings: ServiceSettings,
    registry: CollectorRegistry | None = None,
    *,
    version: str = __version__,
    health_check: HealthCheck | None = None,
    **fastapi_kwargs: Any,
) -> FastAPI:
    """A FastAPI app for `service_name` with the shared routes, middleware and error handling.

    - GET /health -> {"status": "ok", "service", "version"}, merged with what `health_check`
      returns; a `status` other than "ok" from it answers 503 (a readiness probe then fails).
    - GET /metrics -> `registry` (a new one when None; kept on `app.state.registry`).
    - Request bodies above `settings.max_request_bytes` get 413.
    - Validation errors get 422 `{"detail": [{"loc", "msg", "type"}]}`, without echoing input.
    - A method the path does not serve gets 405 with `Allow` naming every method it does serve.
    - `app.state` holds service_name, settings, registry and admin_token (for `require_admin`).
    Extra keyword arguments (lifespan, title, ...) go to FastAPI.
    """
    registry = registry if registry is not None else new_registry()
    fastapi_kwargs.setdefault("title", f"bcstack {service_name}")
    app = FastAPI(version=version, **fastapi_kwargs)
    app.state.service_name = service_name
    app.state.settings = settings
    app.state.registry = registry
    app.state.admin_token = settings.admin_token

    # Added last = outermost: metrics also count the 413s answered by the size check.
    app.add_middleware(BodySizeLimit, max_body_size=settings.max_request_bytes)
    app.add_middleware(PrometheusMiddleware, service=service_name, registry=registry)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(405, _method_not_allowed)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health", include_in_schema=False)
    async def health() -> JSONResponse:
        body: dict[str, Any] = {"status": "ok", "service": service_name, "version": version}
        if health_check is not None:
            extra = health_check()
            if inspect.isawaitable(extra):
                extra = await extra
            body.update(extra)
        return JSONResponse(body, status_code=200 if body.get("status") == "ok" else 503)

    add_metrics_route(app, registry)
    _document_kit_responses(app)
    return app


_KIT_ERROR = {
    "content": {
        "application/json": {
            "schema": {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}
        }
    }
}
# What the kit answers before a route runs: documented on every operation it can happen to.
_BODY_RESPONSES = {
    "400": {"description": "the request body cannot be parsed (not JSON, not UTF-8)", **_KIT_ERROR},
    "413": {"description": "the request body is over max_request_bytes", **_KIT_ERROR},
}
_ADMIN_RESPONSES = {
    "401": {"description": "no admin token sent (Authorization: Bearer)", **_KIT_ERROR},
    "403": {"description": "a wrong admin token, or admin disabled (no BCSTACK_ADMIN_TOKEN)", **_KIT_ERROR},
}


def _document_kit_responses(app: FastAPI) -> None:
    """Add the kit's own answers (400/413 for a body, 401/403 for an admin operation) to the
    OpenAPI document where a route did not describe them itself."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    extra = {**(_BODY_RESPONSES if "requestBody" in operation else {})}
                    extra |= _ADMIN_RESPONSES if operation.get("security") else {}
                    for status, response in extra.items():
                        responses.setdefault(status, response)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _json_integer(value: Any) -> Any:
    if isinstance(value, bool | str | bytes):
        raise ValueError("must be an integer")
    return value


def _json_number(value: Any) -> Any:
    if isinstance(value, bool | str | bytes):
        raise ValueError("must be a number")
    return value


# The JSON types as JSON Schema (and so the OpenAPI document) defines them: an integer is 3 or
# 3.0, a number 3 or 0.5, never true or "3", which pydantic's lax int and float take (its strict
# int refuses 3.0). Bounds on an optional one go before the validator, or its schema loses them:
# `Annotated[int, Ge(1), JSON_INTEGER] | None`. A boolean is pydantic's StrictBool.
JSON_INTEGER = BeforeValidator(_json_integer)
JSON_NUMBER = BeforeValidator(_json_number)
JsonInt = Annotated[int, JSON_INTEGER]
JsonFloat = Annotated[float, JSON_NUMBER]


class KitDetail(BaseModel):
    """An error with a one-line reason: `{"detail": "..."}` (FastAPI's HTTPException)."""

    detail: str


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """The kit's 422 for a request that fails validation (`_validation_error`)."""

    detail: list[ValidationIssue]


def json_or_sse_response(description: str) -> dict[str, Any]:
    """An OpenAPI 200 answer that is a JSON object, or server-sent events when the request asks to
    stream (the gateway's episodes, the stand-in LLM's chat completions)."""
    return {
        "description": description,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                }
            },
        },
    }


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` documenting `model` as the JSON request body of a route that reads the body
    itself (to answer in another API's error format). Nested models are inlined, so the document
    needs no extra components."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(
                    {**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}}
                )
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {"required": required, "content": {"application/json": {"schema": inline(schema)}}}
    }


class BodySizeLimit:
    """413 `{"detail": ...}` for a request body over `max_body_size` bytes.

    A declared Content-Length over the limit is refused before routing; a chunked body is
    counted as the app reads it and refused at the chunk that crosses the limit. FastAPI has a
    `max_body_size` of its own, but it answers in plain text from outside every middleware;
    this keeps one JSON error shape and lets the metrics middleware count the 413s.
    """

    def __init__(self, app: ASGIApp, max_body_size: int) -> None:
        self.app = app
        self.max_body_size = max_body_size

    def _too_large(self, size: int | str) -> str:
        return f"request body of {size} bytes is over the {self.max_body_size}-byte limit"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_size:
            await JSONResponse({"detail": self._too_large(declared)}, status_code=413)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_size:
                    # FastAPI re-raises an HTTPException met while reading the body, and the
                    # exception middleware turns it into the JSON 413.
                    raise HTTPException(413, detail=self._too_large(f"at least {received}"))
            return message

        await self.app(scope, counting_receive, send)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # No "input": a request body can be large or hold a secret, and the client has it already.
    detail = [
        {"loc": list(err.get("loc", ())), "msg": err.get("msg", ""), "type": err.get("type", "")}
        for err in exc.errors()
    ]
    return JSONResponse({"detail": detail}, status_code=422)


def allowed_methods(app: Any, scope: Scope) -> set[str]:
    """The methods of every route whose path matches the request's (what a 405's `Allow` lists)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return methods


async def _method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's 405 names the methods of the first route on the path only; a path served by one
    # route per method (GET and POST /flush_cache) must name them all (RFC 9110, 15.5.6).
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else "Method Not Allowed"
    allow = ", ".join(sorted(allowed_methods(request.app, request.scope)))
    return JSONResponse({"detail": detail}, status_code=405, headers={"Allow": allow})


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's ServerErrorMiddleware calls this, then re-raises, so uvicorn still logs the traceback.
    return JSONResponse({"detail": "internal server error"}, status_code=500)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: `runner.serve` owns SIGTERM/SIGINT so that the
    HTTP and gRPC servers of one process stop together, within one grace period."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_server(app: Any, settings: ServiceSettings, **config: Any) -> uvicorn.Server:
    """A uvicorn server for `app` on settings.host:settings.port; run it with `await server.serve()`.

    Logging is left to `setup_logging` (uvicorn's loggers propagate to the root handler and its
    redaction filter). Stop it by setting `server.should_exit = True`.
    """
    config.setdefault("log_config", None)
    config.setdefault("log_level", settings.log_level.lower())
    config.setdefault("timeout_graceful_shutdown", settings.shutdown_grace_seconds)
    config.setdefault("server_header", False)
    config.setdefault("timeout_keep_alive", settings.http_keep_alive_seconds)
    return _Uvicorn(uvicorn.Config(app, host=settings.host, port=settings.port, **config))


def serve_http(app: Any, settings: ServiceSettings) -> None:
    """Run `app` until SIGTERM/SIGINT, then let in-flight requests finish (blocking)."""
    from core.kit.runner import run_service

    run_service(settings, http_app=app)
