"""The coordinator endpoint registry: named OpenAI-compatible endpoints, one of them active.

A new episode takes `registry.active()` and keeps that `Endpoint` object to its end, so swapping
the active endpoint (PUT /admin/coordinator -> `put`) never changes the model under a running
episode. An `Endpoint` is immutable: changing an endpoint's spec builds a new `Endpoint` (with a
new client and a fresh breaker), and the old one keeps working for the episodes that hold it.
Replaced clients are closed in `aclose()`, not earlier: an episode may still be mid-call on one.

Nothing changes unless the endpoint to be added, changed or activated answers a probe
(GET /models listing its model) with its key; a refused change leaves the registry as it was.

**Runtime state.** What was changed at runtime (the specs put, and the active name) is
`runtime_state()`, a JSON document the gateway persists in its record store (`put(commit=...)`
writes it before the change takes effect) and every replica `adopt()`s from there: a swap reaches
the replicas that share the store and outlives a restart. The configured endpoints stay as they
are unless a runtime spec of the same name replaces them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from core.kit.apikeys import read_api_key
from core.kit.breaker import CircuitBreaker
from core.kit.upstream import EndpointSpec, HttpClientName, UpstreamClient, UpstreamError

log = logging.getLogger("bcstack.coordinator")


class RegistryError(ValueError):
    """A registry operation was refused; `str(exc)` is one line naming the endpoint and the reason."""


class Endpoint:
    """One live endpoint: its spec and the client (with its breaker) every call goes through."""

    def __init__(self, spec: EndpointSpec, client: UpstreamClient, key_source: str | None) -> None:
        self._spec = spec
        self._client = client
        self._key_source = key_source

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def spec(self) -> EndpointSpec:
        return self._spec

    @property
    def client(self) -> UpstreamClient:
        return self._client

    @property
    def breaker(self) -> CircuitBreaker:
        return self._client.breaker

    def view(self) -> dict[str, Any]:
        """What the admin API shows: the spec, where the key comes from (never the key), the breaker."""
        spec = self._spec
        return {
            "name": spec.name,
            "base_url": spec.base_url,
            "model": spec.model,
            "timeout_seconds": spec.timeout_seconds,
            "connect_timeout_seconds": spec.connect_timeout_seconds,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "max_tokens": spec.max_tokens,
            "api_key": self._key_source,
            "breaker": self.breaker.state,
        }

    def describe(self) -> str:
        return f"model {self._spec.model}, {self._spec.base_url}"

    def __repr__(self) -> str:
        return f"Endpoint(name={self.name!r}, model={self._spec.model!r}, base_url={self._spec.base_url!r})"


class EndpointRegistry:
    """The endpoints of one coordinator gateway and which one new episodes use."""

    def __init__(
        self,
        specs: list[EndpointSpec],
        active: str | None,
        *,
        attempts: int,
        backoff_seconds: float,
        backoff_max_seconds: float,
        breaker_failures: int,
        breaker_reset_seconds: float,
        on_retry: Callable[[str, str], None] | None = None,
        on_attempt: Callable[[str, str, float], None] | None = None,
        on_breaker: Callable[[str, str], None] | None = None,
        transport_factory: Callable[[EndpointSpec], httpx.AsyncBaseTransport | None] | None = None,
        http_client: HttpClientName | None = None,
    ) -> None:
        if not specs:
            raise RegistryError("no coordinator endpoint configured: set coordinator_url or endpoints")
        names = [spec.name for spec in specs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise RegistryError(f"endpoint names must be unique; repeated: {', '.join(repeated)}")
        if active is not None and active not in names:
            raise RegistryError(f"unknown endpoint '{active}' (known: {', '.join(names)})")
        self._attempts = attempts
        self._backoff_seconds = backoff_seconds
        self._backoff_max_seconds = backoff_max_seconds
        self._breaker_failures = breaker_failures
        self._breaker_reset_seconds = breaker_reset_seconds
        self._on_retry = on_retry
        self._on_attempt = on_attempt
        self._on_breaker = on_breaker
        self._transport_factory = transport_factory
        self._http_client = http_client
        self._endpoints: dict[str, Endpoint] = {}
        for spec in specs:
            try:
                self._endpoints[spec.name] = self._build(spec)
            except UpstreamError as exc:
                # The clients built so far have opened no connection: nothing to close.
                raise RegistryError(f"endpoint '{spec.name}': {exc.reason}") from None
        self._active = active if active is not None else names[0]
        self._runtime: dict[str, EndpointSpec] = {}  # specs put (or adopted) at runtime, by name
        self._runtime_active: str | None = None  # the active name once changed at runtime
        self._swaps = 0
        self._retired: list[UpstreamClient] = []
        self._lock = asyncio.Lock()
        self._closed = False

    # --- reading ----------------------------------------------------------------------------

    def active(self) -> Endpoint:
        """The endpoint a new episode uses; keep the object for the episode's whole life."""
        return self._endpoints[self._active]

    def get(self, name: str) -> Endpoint:
        try:
            return self._endpoints[name]
        except KeyError:
            raise RegistryError(f"unknown endpoint '{name}' (known: {self._known()})") from None

    def names(self) -> list[str]:
        return list(self._endpoints)

    @property
    def swaps(self) -> int:
        """How often the endpoint new episodes use changed (activation or the active spec replaced)."""
        return self._swaps

    def view(self) -> dict[str, Any]:
        return {
            "active": self._active,
            "endpoints": [endpoint.view() for endpoint in self._endpoints.values()],
            "swaps": self._swaps,
        }

    # --- changing ---------------------------------------------------------------------------

    def runtime_state(self, spec: EndpointSpec | None = None, activate: str | None = None) -> dict[str, Any]:
        """The runtime changes as a JSON document, with `spec` put and `activate` made active."""
        runtime = dict(self._runtime)
        if spec is not None:
            runtime[spec.name] = spec
        active = activate if activate is not None else self._runtime_active
        return {
            "active": active,
            "endpoints": [s.model_dump(mode="json") for s in runtime.values()],
        }

    async def put(
        self,
        spec: EndpointSpec | None = None,
        *,
        activate: str | None = None,
        commit: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """Add or change the endpoint `spec`, and/or make `activate` the active one; returns view().

        What would be added, changed or activated is probed first with its key; on any failure
        RegistryError ("endpoint 'b' refused: connection refused") and nothing changes. `commit`
        (given the new `runtime_state()`) runs after the probes and before anything changes: when
        it raises, nothing changes and its exception propagates.
        """
        if spec is None and activate is None:
            raise RegistryError("nothing to change: give an endpoint spec, an endpoint to activate, or both")
        async with self._lock:
            if self._closed:
                raise RegistryError("the endpoint registry is closed")
            if (
                activate is not None
                and activate not in self._endpoints
                and (spec is None or spec.name != activate)
            ):
                raise RegistryError(f"unknown endpoint '{activate}' (known: {self._known()})")

            candidate: Endpoint | None = None  # a new Endpoint for `spec`, installed only after its probe
            to_probe: list[Endpoint] = []
            if spec is not None:
                current = self._endpoints.get(spec.name)
                if current is not None and current.spec == spec:
                    to_probe.append(current)  # unchanged: keep its client and breaker
                else:
                    try:
                        candidate = self._build(spec)
                    except UpstreamError as exc:
                        raise RegistryError(f"endpoint '{spec.name}' refused: {exc.reason}") from None
                    to_probe.append(candidate)
            if activate is not None and (spec is None or activate != spec.name):
                to_probe.append(self._endpoints[activate])

            for endpoint in to_probe:
                try:
                    await endpoint.client.probe()
                except UpstreamError as exc:
                    if candidate is not None:
                        await candidate.client.aclose()
                    raise RegistryError(f"endpoint '{endpoint.name}' refused: {exc.reason}") from None
            if commit is not None:
                try:
                    await commit(self.runtime_state(spec, activate))
                except BaseException:
                    if candidate is not None:
                        await candidate.client.aclose()
                    raise
            if spec is not None:
                self._runtime[spec.name] = spec
            if activate is not None:
                self._runtime_active = activate
            return self._install(candidate, activate)

    async def adopt(self, state: dict[str, Any]) -> bool:
        """Take on runtime changes another replica made (or this one, before a restart): the specs
        in `state` replace or join the endpoints, its active name becomes active. Not probed (the
        replica that made the change probed it; the breaker guards each call). Whether the active
        endpoint changed. RegistryError when `state` is malformed or names an unknown endpoint."""
        try:
            specs = [EndpointSpec.model_validate(item) for item in state.get("endpoints", [])]
        except (ValueError, TypeError, AttributeError) as exc:
            raise RegistryError(f"the stored endpoint state is malformed: {exc}") from None
        activate = state.get("active")
        async with self._lock:
            if self._closed:
                raise RegistryError("the endpoint registry is closed")
            names = set(self._endpoints) | {spec.name for spec in specs}
            if activate is not None and activate not in names:
                raise RegistryError(f"the stored endpoint state activates unknown endpoint '{activate}'")
            built: list[Endpoint] = []
            for spec in specs:
                current = self._endpoints.get(spec.name)
                if current is not None and current.spec == spec:
                    continue
                try:
                    built.append(self._build(spec))
                except UpstreamError as exc:
                    for endpoint in built:
                        await endpoint.client.aclose()
                    raise RegistryError(f"stored endpoint '{spec.name}': {exc.reason}") from None
            before = self.active()
            for endpoint in built:
                self._install(endpoint, None, count=False)
            self._runtime = {spec.name: spec for spec in specs}
            self._runtime_active = activate
            if activate is not None:
                self._install(None, activate, count=False)
            swapped = self.active() is not before
            if swapped:
                self._swaps += 1
            return swapped

    def _install(
        self, candidate: Endpoint | None, activate: str | None, *, count: bool = True
    ) -> dict[str, Any]:
        """Put `candidate` in place and make `activate` active (both checked); returns view()."""
        swapped = False
        if candidate is not None:
            replaced = self._endpoints.get(candidate.name)
            self._endpoints[candidate.name] = candidate
            if replaced is None:
                log.info("coordinator endpoint '%s' added (%s)", candidate.name, candidate.describe())
            else:
                self._retired.append(replaced.client)
                swapped = candidate.name == self._active
                log.info("coordinator endpoint '%s' changed (%s)", candidate.name, candidate.describe())
        if activate is not None and activate != self._active:
            self._active = activate
            swapped = True
            log.info("coordinator endpoint '%s' activated (%s)", activate, self.active().describe())
        if swapped and count:
            self._swaps += 1
        return self.view()

    async def probe_active(self) -> None:
        """Probe the active endpoint; RegistryError with the reason when it does not answer."""
        endpoint = self.active()
        try:
            await endpoint.client.probe()
        except UpstreamError as exc:
            raise RegistryError(f"endpoint '{endpoint.name}' is not reachable: {exc.reason}") from None

    async def aclose(self) -> None:
        """Close every client, the replaced ones included (call when no episode runs any more)."""
        self._closed = True
        clients = [endpoint.client for endpoint in self._endpoints.values()] + self._retired
        self._retired = []
        for client in clients:
            await client.aclose()

    # --- internals --------------------------------------------------------------------------

    def _build(self, spec: EndpointSpec) -> Endpoint:
        key, source = read_api_key(spec)  # UpstreamError(no_api_key) names the env var or file
        name = spec.name
        on_retry, on_attempt, on_breaker = self._on_retry, self._on_attempt, self._on_breaker

        def breaker_changed(state: str) -> None:
            if state == "open":
                log.warning(
                    "coordinator endpoint '%s': circuit breaker open; new chats fail fast for %g s",
                    name,
                    self._breaker_reset_seconds,
                )
            else:
                log.info("coordinator endpoint '%s': circuit breaker %s", name, state.replace("_", "-"))
            if on_breaker is not None:
                on_breaker(name, state)

        client = UpstreamClient(
            spec,
            key,
            attempts=self._attempts,
            backoff_seconds=self._backoff_seconds,
            backoff_max_seconds=self._backoff_max_seconds,
            breaker=CircuitBreaker(
                self._breaker_failures, self._breaker_reset_seconds, on_change=breaker_changed
            ),
            on_retry=(lambda kind: on_retry(name, kind)) if on_retry is not None else None,
            on_attempt=(lambda outcome, seconds: on_attempt(name, outcome, seconds))
            if on_attempt is not None
            else None,
            transport=self._transport_factory(spec) if self._transport_factory is not None else None,
            http_client=self._http_client,
        )
        return Endpoint(spec, client, source)

    def _known(self) -> str:
        return ", ".join(self._endpoints) or "none"
