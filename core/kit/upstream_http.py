"""The two HTTP clients an `UpstreamClient` can send through, behind one small interface.

`HttpxTransport` and `AiohttpTransport` take the same request and give the same `HttpAnswer`, or
raise `NoAnswer` ("timeout" or "connection"), so retries, the breaker and error messages in
`core.kit.upstream` do not care which one runs. Why two: under hundreds of concurrent calls
httpx's connection pool scans every pooled connection on each request and response, and aiohttp's
does not (bench/gateway.py measured 0.26x the gateway's CPU per coordinator turn at 512 episodes);
httpx stays the default where concurrency is low and for its in-process test transports.

aiohttp (and yarl) are imported by the transport that uses them, not with this module: every
`bcstack` command imports this module through the CLI, and aiohttp's import was ~0.1 s of each.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx

if TYPE_CHECKING:
    import aiohttp

HttpClientName = Literal["httpx", "aiohttp"]
HTTP_CLIENTS: tuple[str, ...] = ("httpx", "aiohttp")
DEFAULT_HTTP_CLIENT: HttpClientName = "httpx"
# Many episodes share one endpoint: up to 1,000 connections (the official openai client's cap),
# all kept alive. With the openai client's 100 kept alive, 512 concurrent episodes opened and
# closed a TCP connection for most calls (bench/gateway.py).
MAX_CONNECTIONS = 1000
KEEPALIVE_SECONDS = 5.0  # httpx's default; below the usual server keep-alive, so no reuse races it


@dataclass(frozen=True)
class HttpAnswer:
    """One upstream HTTP answer, read whole; the same shape from either HTTP client."""

    status_code: int
    reason_phrase: str
    headers: Mapping[str, str]  # case-insensitive lookups (httpx.Headers, multidict)
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class NoAnswer(Exception):
    """No HTTP answer: `kind` "timeout" (`detail` says which) or "connection" (`cause` says why)."""

    def __init__(
        self, kind: str, detail: str = "", cause: BaseException | None = None, protocol: bool = False
    ) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.cause, self.protocol = kind, detail, cause, protocol


class HttpxTransport:
    def __init__(self, base_url: str, transport: httpx.AsyncBaseTransport | None) -> None:
        limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS,
            max_keepalive_connections=MAX_CONNECTIONS,
            keepalive_expiry=KEEPALIVE_SECONDS,
        )
        self._client = httpx.AsyncClient(base_url=base_url + "/", transport=transport, limits=limits)

    async def send(
        self, method: str, path: str, headers: dict[str, str], body: bytes | None, connect: float, read: float
    ) -> HttpAnswer:
        timeout = httpx.Timeout(read, connect=connect, pool=read)
        try:
            r = await self._client.request(method, path, headers=headers, content=body, timeout=timeout)
        except httpx.ConnectTimeout:
            raise NoAnswer("timeout", f"no connection within {connect:g} s") from None
        except httpx.TimeoutException:
            raise NoAnswer("timeout", f"no answer within {read:g} s") from None
        except httpx.RequestError as exc:
            raise NoAnswer(
                "connection", cause=exc, protocol=isinstance(exc, httpx.RemoteProtocolError)
            ) from exc
        return HttpAnswer(r.status_code, r.reason_phrase, r.headers, r.content)

    async def aclose(self) -> None:
        await self._client.aclose()


class AiohttpTransport:
    """aiohttp with httpx's behaviour: no redirects followed, cookies kept, proxies from the
    environment (read once, as httpx does). The session belongs to an event loop, so it is made
    on the first request, in the loop that makes it."""

    def __init__(self, base_url: str) -> None:
        self._base = base_url + "/"
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp
        import yarl

        try:
            proxy, proxy_auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(self._base))
        except LookupError:
            proxy, proxy_auth = None, None
        connector = aiohttp.TCPConnector(
            limit=MAX_CONNECTIONS, limit_per_host=0, keepalive_timeout=KEEPALIVE_SECONDS
        )
        return aiohttp.ClientSession(
            self._base,
            connector=connector,
            cookie_jar=aiohttp.CookieJar(unsafe=True),
            proxy=proxy,
            proxy_auth=proxy_auth,
        )

    async def send(
        self, method: str, path: str, headers: dict[str, str], body: bytes | None, connect: float, read: float
    ) -> HttpAnswer:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session, self._loop = self._open(), loop
        timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=read)
        try:
            async with self._session.request(
                method, path, headers=headers, data=body, timeout=timeout, allow_redirects=False
            ) as r:
                return HttpAnswer(r.status, r.reason or "", r.headers, await r.read())
        except aiohttp.ConnectionTimeoutError:
            raise NoAnswer("timeout", f"no connection within {connect:g} s") from None
        except aiohttp.ServerTimeoutError:
            raise NoAnswer("timeout", f"no answer within {read:g} s") from None
        except aiohttp.ClientError as exc:
            protocol = isinstance(
                exc,
                aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError,
            )
            raise NoAnswer("connection", cause=exc, protocol=protocol) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_transport(
    name: HttpClientName, base_url: str, transport: httpx.AsyncBaseTransport | None = None
) -> HttpxTransport | AiohttpTransport:
    """The named client for `base_url`; `transport` (httpx only) swaps its network layer in tests."""
    if name not in HTTP_CLIENTS:
        raise ValueError(f"http_client must be one of {', '.join(HTTP_CLIENTS)}, got {name!r}")
    return HttpxTransport(base_url, transport) if name == "httpx" else AiohttpTransport(base_url)
