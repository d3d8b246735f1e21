"""Prometheus metrics shared by every service.

Each service owns one `CollectorRegistry` (from `new_registry`) and registers its own metrics on
it; nothing goes to prometheus_client's global default registry, so two services in one
process (tests, `bcstack up` in-process) never collide. Names follow REFERENCE.md: the
`bcstack_` prefix, base units (`_seconds`, `_bytes`), counters ending in `_total`, no colons,
and low-cardinality labels (HTTP routes are templates such as `/v1/episodes/{episode_id}`,
never raw paths; gRPC methods are the fixed `/package.Service/Method` names).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import choose_encoder, start_http_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "bcstack_"

# `_created` series double the series count and no dashboard here reads them.
disable_created_metrics()

# Latency buckets in seconds: from a cached search (~ms) up to a whole coordinator episode (minutes).
LATENCY_BUCKETS_SECONDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

UNMATCHED_ROUTE = "<unmatched>"


def new_registry(*, process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry for one service; with `bcstack_process_*` (CPU, memory, fds) by default."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(namespace=PREFIX.rstrip("_"), registry=registry)
    return registry


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The registry in the format the scraper asked for (Prometheus text or OpenMetrics)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def metrics_endpoint(registry: CollectorRegistry) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette/FastAPI endpoint serving `registry` (mount it at GET /metrics)."""

    async def metrics(request: Request) -> Response:
        body, content_type = exposition(registry, request.headers.get("accept"))
        return Response(body, media_type=None, headers={"Content-Type": content_type})

    return metrics


def add_metrics_route(app: Starlette, registry: CollectorRegistry, path: str = "/metrics") -> None:
    """Add GET `path` serving `registry` to a FastAPI/Starlette app (hidden from OpenAPI)."""
    app.add_route(path, metrics_endpoint(registry), methods=["GET"], include_in_schema=False)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, threading.Thread]:
    """Serve `registry` on http://host:port/metrics from a daemon thread (gRPC-only processes).

    Returns (server, thread); `server.shutdown()` stops it and `server.server_port` is the bound port.
    """
    return start_http_server(port, addr=host, registry=registry)


# --- per-registry metric families ------------------------------------------------------------


@dataclass(frozen=True)
class HttpMetrics:
    requests: Counter
    duration: Histogram


@dataclass(frozen=True)
class GrpcMetrics:
    requests: Counter
    duration: Histogram


_families: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _family(registry: CollectorRegistry, key: str, build: Callable[[], Any]) -> Any:
    # A registry rejects a second metric of the same name, so the HTTP middleware and gRPC
    # interceptor families are created once per registry and shared.
    with _families_lock:
        per_registry = _families.setdefault(registry, {})
        if key not in per_registry:
            per_registry[key] = build()
        return per_registry[key]


def http_metrics(registry: CollectorRegistry) -> HttpMetrics:
    return _family(
        registry,
        "http",
        lambda: HttpMetrics(
            requests=Counter(
                "bcstack_http_requests_total",
                "HTTP requests handled, by route template and status code.",
                ["service", "route", "method", "code"],
                registry=registry,
            ),
            duration=Histogram(
                "bcstack_http_request_duration_seconds",
                "HTTP request latency from first byte in to response end, in seconds.",
                ["service", "route", "method"],
                buckets=LATENCY_BUCKETS_SECONDS,
                registry=registry,
            ),
        ),
    )


def grpc_metrics(registry: CollectorRegistry) -> GrpcMetrics:
    return _family(
        registry,
        "grpc",
        lambda: GrpcMetrics(
            requests=Counter(
                "bcstack_grpc_requests_total",
                "gRPC calls handled, by method and status code.",
                ["service", "method", "code"],
                registry=registry,
            ),
            duration=Histogram(
                "bcstack_grpc_request_duration_seconds",
                "gRPC call latency on the server, in seconds.",
                ["service", "method"],
                buckets=LATENCY_BUCKETS_SECONDS,
                registry=registry,
            ),
        ),
    )


# --- HTTP ------------------------------------------------------------------------------------


def route_template(scope: Scope) -> str:
    """The matched route's path template, or `<unmatched>` (404s must not mint label values)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED_ROUTE


class PrometheusMiddleware:
    """Pure ASGI middleware (streaming- and SSE-safe, unlike BaseHTTPMiddleware).

    Records `bcstack_http_requests_total{service,route,method,code}` and
    `bcstack_http_request_duration_seconds{service,route,method}`. For a streamed response the
    duration runs until the last body chunk is sent.
    """

    def __init__(self, app: ASGIApp, service: str, registry: CollectorRegistry) -> None:
        self.app = app
        self.service = service
        self.metrics = http_metrics(registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before starting a response, the server answers 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # The router stored the matched route in the shared scope on the way in.
            route, method = route_template(scope), scope.get("method", "")
            self.metrics.requests.labels(self.service, route, method, str(status)).inc()
            self.metrics.duration.labels(self.service, route, method).observe(time.perf_counter() - start)


# --- gRPC ------------------------------------------------------------------------------------


def _status_name(code: Any) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # the aio context may hand back the raw integer
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    return grpc.StatusCode.UNKNOWN.name


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio server interceptor recording `bcstack_grpc_requests_total{service,method,code}`
    and `bcstack_grpc_request_duration_seconds{service,method}` for every call kind.
    """

    def __init__(self, service: str, registry: CollectorRegistry) -> None:
        self.service = service
        self.metrics = grpc_metrics(registry)

    def _record(self, method: str, code: str, started: float) -> None:
        self.metrics.requests.labels(self.service, method, code).inc()
        self.metrics.duration.labels(self.service, method).observe(time.perf_counter() - started)

    def _final_code(self, context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
        if exc is None or isinstance(exc, grpc.aio.AbortError):
            code = context.code()
            return _status_name(code) if code is not None else grpc.StatusCode.OK.name
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):  # the client went away
            return grpc.StatusCode.CANCELLED.name
        return grpc.StatusCode.UNKNOWN.name

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return handler
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap_unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            exc: BaseException | None = None
            try:
                result = behavior(request_or_iterator, context)
                return await result if inspect.isawaitable(result) else result
            except BaseException as e:
                exc = e
                raise
            finally:
                self._record(method, self._final_code(context, exc), started)

        return wrapper

    def _wrap_stream(self, behavior: Callable[..., Any], method: str) -> Callable[..., AsyncIterator[Any]]:
        async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            exc: BaseException | None = None
            try:
                result = behavior(request_or_iterator, context)
                if hasattr(result, "__aiter__"):  # async generator servicer
                    async for response in result:
                        yield response
                elif inspect.isawaitable(result):  # coroutine servicer writing with context.write
                    await result
                else:  # plain iterator
                    for response in result:
                        yield response
            except BaseException as e:
                exc = e
                raise
            finally:
                self._record(method, self._final_code(context, exc), started)

        return wrapper
