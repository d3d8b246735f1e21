"""The gRPC edge every service shares (grpc.aio): servicers, health, reflection, metrics,
message-size limits and graceful shutdown; plus client channels with the same limits.

    server = GrpcServer("judge", settings, registry)
    server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, JudgeServicer(...))
    await server.serve()            # until SIGTERM/SIGINT, then a graceful stop

Health (`grpc.health.v1.Health`): the overall status ("") and each added service report
SERVING once the server has started and NOT_SERVING from the moment shutdown begins, so load
balancers drain the instance while in-flight calls finish within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from core.kit.metrics import GrpcMetricsInterceptor, new_registry
from core.kit.settings import ServiceSettings

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def message_size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


KEEPALIVE_SECONDS = 30.0  # how often clients ping an idle connection (channel_options)


def server_keepalive_options(client_keepalive_seconds: float = KEEPALIVE_SECONDS) -> list[tuple[str, Any]]:
    """Server options that accept the clients' keepalive pings. gRPC's server defaults allow one
    ping per 5 minutes without data and none without a call in flight: our clients' 30 s pings
    counted as abuse and the server answered GOAWAY too_many_pings after two, dropping the
    connection (and with it any long, quiet call on it, e.g. a worker episode). Pings are
    accepted at a third of the clients' interval. (gRPC's doc/keepalive.md: the server-side
    GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS and GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS.)"""
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(client_keepalive_seconds * 1000 / 3)),
    ]


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *, keepalive_seconds: float = KEEPALIVE_SECONDS
) -> list[tuple[str, Any]]:
    """Client options: message limits matching the servers, and keepalive pings so a dead peer
    behind a load balancer is noticed within keepalive_seconds + 10 s instead of hanging an episode."""
    return [
        *message_size_options(max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def aio_channel(
    target: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `target` ("host:port", "dns:///name:port") with sane options."""
    return grpc.aio.insecure_channel(
        target,
        options=[*channel_options(max_message_bytes), *options],
        interceptors=list(interceptors) or None,
    )


def sync_channel(
    target: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A blocking channel with the same options, for CLI tools and scripts."""
    return grpc.insecure_channel(target, options=[*channel_options(max_message_bytes), *options])


def service_full_name(add_fn: Callable[..., Any]) -> str:
    """`bcstack.v1.JudgeService` from the generated `add_JudgeServiceServicer_to_server`.

    Reads the service descriptor of the *_pb2 module beside the *_pb2_grpc module that defines
    `add_fn`, so the name always matches the .proto package.
    """
    name = add_fn.__name__
    if not (name.startswith("add_") and name.endswith("Servicer_to_server")):
        raise ValueError(f"{name} is not a generated add_<Service>Servicer_to_server function")
    short = name[len("add_") : -len("Servicer_to_server")]
    module = add_fn.__module__
    if not module.endswith("_pb2_grpc"):
        raise ValueError(f"{name} is not from a *_pb2_grpc module; pass the service name explicitly")
    pb2 = importlib.import_module(module.removesuffix("_grpc"))
    try:
        return pb2.DESCRIPTOR.services_by_name[short].full_name
    except KeyError:
        raise ValueError(f"{pb2.__name__} declares no service {short!r}") from None


class _Undecodable:
    """What the request deserializer hands on when the bytes are no valid request message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


# Status details travel as a percent-encoded trailer (gRPC's HTTP/2 protocol: every byte outside
# printable ASCII, and `%`, as `%XX`); a client warns over 8 KiB of metadata and may then drop the
# stream as RESOURCE_EXHAUSTED ("metadata size exceeds soft limit") instead of the real error. A
# cut by characters was not enough: 1,000 characters of non-ASCII text encoded to 11,713 bytes
# (bench/fuzz_grpc.py, WorkerService.RunEpisodes). So the budget is of encoded bytes.
MAX_STATUS_DETAILS_BYTES = 2000


def _encoded_size(char: str) -> int:
    return 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "surrogatepass"))


def cut_details(details: str, limit: int = MAX_STATUS_DETAILS_BYTES) -> str:
    """`details` shortened to at most `limit` bytes once percent-encoded, saying how much was cut."""
    size = 0
    for end, char in enumerate(details):
        size += _encoded_size(char)
        if size > limit:
            return f"{details[:end]}... ({len(details) - end} more characters cut)"
    return details


class _CutDetails:
    """The servicer's context, with the details of `abort` and `set_details` cut (the details
    an abort recorded cannot be changed afterwards)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        await self._context.abort(code, cut_details(details), trailing_metadata)

    def set_details(self, details: str) -> None:
        self._context.set_details(cut_details(details))


class RequestEdgeInterceptor(grpc.aio.ServerInterceptor):
    """What every servicer would otherwise get wrong on its own, at the edge of every RPC kind:

    - a request whose bytes do not parse as the RPC's request message is INVALID_ARGUMENT with
      the parser's reason (left alone, grpc.aio answers UNKNOWN, "Unexpected DecodeError", the code
      of a servicer bug, and the call never reaches the interceptors that count it); the
      deserializer cannot abort, so it hands a marker to the behaviour, which aborts before the
      servicer runs;
    - the servicer's status details are cut to MAX_STATUS_DETAILS_CHARS, so a message that quotes
      a huge request field still reaches the client with its code.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as exc:
                return _Undecodable(f"the request is not a valid message: {exc}")

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

        def checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async def each() -> Any:
                async for request in requests:
                    await refuse(request, context)
                    yield request

            return each()

        serialize = handler.response_serializer
        if handler.unary_unary or handler.stream_unary:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if handler.unary_unary:
                    await refuse(request, context)
                else:
                    request = checked(request, context)
                result = behavior(request, _CutDetails(context))
                return await result if inspect.isawaitable(result) else result

            make = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.stream_unary_rpc_method_handler
            )
            return make(unary, request_deserializer=deserialize, response_serializer=serialize)
        behavior = handler.unary_stream or handler.stream_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if handler.unary_stream:
                await refuse(request, context)
            else:
                request = checked(request, context)
            result = behavior(request, _CutDetails(context))
            if hasattr(result, "__aiter__"):  # an async generator servicer
                async for response in result:
                    yield response
            elif inspect.isawaitable(result):  # a coroutine servicer writing with context.write
                await result
            else:
                for response in result:
                    yield response

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return make(stream, request_deserializer=deserialize, response_serializer=serialize)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """One grpc.aio server for a service. Add servicers, then `start`/`stop` or `serve`.

    The grpc.aio server is created in `start`, inside the running event loop.
    """

    def __init__(
        self,
        service_name: str,
        settings: ServiceSettings,
        registry: CollectorRegistry | None = None,
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.service_name = service_name
        self.settings = settings
        self.registry = registry if registry is not None else new_registry()
        self.health = health.aio.HealthServicer()
        self._interceptors = [
            GrpcMetricsInterceptor(service_name, self.registry),
            RequestEdgeInterceptor(),
            *interceptors,
        ]
        # gRPC takes the first of repeated channel args: the caller's options come first so they win
        self._options = [
            *options,
            *message_size_options(settings.grpc_max_message_bytes),
            *server_keepalive_options(),
        ]
        self._bindings: list[tuple[Callable[[Any, grpc.aio.Server], None], Any]] = []
        self._service_names: list[str] = []
        self._server: grpc.aio.Server | None = None
        self._port: int | None = None

    def add(
        self, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str | None = None
    ) -> str:
        """Register a servicer with its generated `add_*_to_server`; returns the full service name."""
        if self._server is not None:
            raise RuntimeError("add servicers before start()")
        name = full_name or service_full_name(add_fn)
        self._bindings.append((add_fn, servicer))
        self._service_names.append(name)
        return name

    @property
    def service_names(self) -> list[str]:
        """The application services added (without health and reflection)."""
        return list(self._service_names)

    @property
    def server(self) -> grpc.aio.Server:
        if self._server is None:
            raise RuntimeError("the server is not started")
        return self._server

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def target(self) -> str:
        """Where clients reach it, e.g. "127.0.0.1:50051"."""
        host = self.settings.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return _bind_address(host, self.port)

    async def start(self, port: int | None = None) -> int:
        """Bind host:port (port defaults to settings.grpc_port; 0 = any free port) and start.

        Returns the bound port.
        """
        port = self.settings.grpc_port if port is None else port
        if port is None:
            raise ValueError(f"{self.service_name}: grpc_port is not set")
        server = grpc.aio.server(interceptors=self._interceptors, options=self._options)
        for add_fn, servicer in self._bindings:
            add_fn(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        address = _bind_address(self.settings.host, port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"{self.service_name}: cannot bind gRPC on {address}: {exc}") from None
        await server.start()
        self._server, self._port = server, bound
        for name in ["", *self._service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s: gRPC serving %s on %s", self.service_name, ", ".join(self._service_names), self.target)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls and give in-flight ones `grace` seconds
        (default settings.shutdown_grace_seconds) before cancelling them."""
        if self._server is None:
            return
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        await self.health.enter_graceful_shutdown()
        log.info("%s: gRPC stopping (grace %.1f s)", self.service_name, grace)
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def serve(self, stop_event: asyncio.Event | None = None) -> None:
        """Start, run until SIGTERM/SIGINT (or `stop_event`), then stop gracefully."""
        stop_event = stop_event or asyncio.Event()
        with handle_stop_signals(stop_event):
            await self.start()
            await stop_event.wait()
            await self.stop()

    async def __aenter__(self) -> GrpcServer:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@contextlib.contextmanager
def handle_stop_signals(stop_event: asyncio.Event) -> Iterator[None]:
    """While active, SIGTERM/SIGINT set `stop_event` instead of killing the process.

    A no-op outside the main thread (signals are only delivered there). The previous handlers
    are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s: shutting down", sig.name)
        stop_event.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
