"""An OpenAI-compatible chat client (the coordinator LLM, the grader LLM) with retries and a breaker.

    client = UpstreamClient(spec, resolve_api_key(spec), attempts=5, breaker=CircuitBreaker(5, 30.0))
    result = await client.chat(messages)        # ChatResult, or UpstreamError after the retries

The breaker is `core.kit.breaker.CircuitBreaker`; the key comes from `core.kit.apikeys`.

Every failure is an `UpstreamError` whose `kind` says what happened (see `KINDS`) and whose
`str()` is one line naming the endpoint, e.g.
`coordinator endpoint 'a': HTTP 503 after 5 attempts: The server is overloaded`.

Retries (tenacity) cover what a later attempt can fix: 429, 5xx, timeouts, connection errors and
answers of the wrong shape. A 401/403 or another 4xx is the caller's mistake and is raised at
once. Waits are exponential with full jitter (AWS "Exponential Backoff And Jitter"), and never
shorter than the upstream's Retry-After (capped at `backoff_max_seconds`, so one misbehaving
header cannot park an episode for an hour).

The circuit breaker is per endpoint and shared by every episode using it: while it is open,
chats fail fast (`circuit_open`, no HTTP). Client errors (4xx) say nothing about the endpoint's
health and do not count.

The API key is sent only in the Authorization header: it is registered with the log redaction
filter, scrubbed from upstream error messages, and never part of a repr or an exception.

HTTP goes through one of two clients (`http_client`, `core.kit.upstream_http`), with the same
timeouts, errors and answers:
`httpx` (the default here) or `aiohttp` (the coordinator gateway's default,
`upstream_http_client`). Under hundreds of concurrent calls httpx spends most of its time in
its connection pool's bookkeeping, which scans every pooled connection on each request and
response; aiohttp's pool does not, and used a fraction of the gateway's CPU per coordinator turn
(bench/gateway.py, bench/README.md).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_random_exponential

from core.kit.breaker import CircuitBreaker
from core.kit.logging import REDACTED, register_secret
from core.kit.upstream_http import (  # noqa: F401 - HttpClientName and friends are part of this API
    DEFAULT_HTTP_CLIENT,
    HTTP_CLIENTS,
    HttpAnswer,
    HttpClientName,
    NoAnswer,
    make_transport,
)

ENDPOINT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class EndpointSpec(BaseModel):
    """One named OpenAI-compatible chat endpoint (a coordinator LLM, a grader LLM)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="registry name (letters, digits, . _ -)")
    base_url: str = Field(description="OpenAI-compatible base URL, e.g. http://minimax:8000/v1")
    model: str = Field(description="model id sent in each chat completion")
    api_key_env: str | None = Field(None, description="env var holding the API key")
    api_key_file: Path | None = Field(None, description="file holding the API key (a mounted Secret)")
    timeout_seconds: float = Field(300.0, gt=0, description="one chat completion at most")
    connect_timeout_seconds: float = Field(5.0, gt=0, description="TCP connect at most")
    temperature: float | None = Field(1.0, ge=0, description="sampling temperature; null = upstream default")
    top_p: float | None = Field(0.95, gt=0, le=1, description="nucleus sampling; null = upstream default")
    max_tokens: int | None = Field(
        8192, gt=0, description="completion tokens per turn; null = upstream default"
    )

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not ENDPOINT_NAME_RE.match(value):
            raise ValueError("use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("base_url")
    @classmethod
    def _url_shape(cls, value: str) -> str:
        if not re.match(r"^https?://[^\s/]+", value):
            raise ValueError(f"not an http(s) URL: {value!r}")
        return value.rstrip("/")


log = logging.getLogger("bcstack.upstream")

KINDS = (
    "rate_limited",  # 429
    "server_error",  # 5xx
    "timeout",  # connect, read or whole-answer timeout
    "connection",  # refused, reset, DNS, protocol errors
    "bad_response",  # 2xx that is not a chat completion (not JSON, no choices, wrong shape)
    "unauthorized",  # 401 / 403
    "client_error",  # any other 4xx (and redirects, and a probe that does not find the model)
    "circuit_open",  # the breaker refused the attempt; no HTTP request was made
    "no_api_key",  # the endpoint names a key source that holds no key
)
# Kinds a later attempt may fix; each failed attempt of one of these counts against the breaker.
RETRIED_KINDS = frozenset({"rate_limited", "server_error", "timeout", "connection", "bad_response"})

MESSAGE_LIMIT = 300  # characters of an upstream error message kept in ours
PROBE_TIMEOUT_SECONDS = 10.0


class UpstreamError(Exception):
    """A failed call to a coordinator endpoint. `str(exc)` is one line and never holds the API key.

    kind: one of KINDS; status: the HTTP status when there was one; endpoint: the endpoint name;
    retryable: whether trying again later may succeed; attempts: HTTP attempts made;
    retry_after: the upstream's Retry-After in seconds, when it sent one; reason: the text after
    the endpoint name (what a registry or an episode record repeats).
    """

    def __init__(
        self,
        kind: str,
        endpoint: str,
        head: str,
        detail: str | None = None,
        *,
        status: int | None = None,
        retryable: bool | None = None,
        attempts: int = 1,
        retry_after: float | None = None,
        role: str = "coordinator",
    ) -> None:
        self.kind = kind
        self.role = role
        self.endpoint = endpoint
        self.status = status
        self.retryable = (kind in RETRIED_KINDS or kind == "circuit_open") if retryable is None else retryable
        self.attempts = attempts
        self.retry_after = retry_after
        self.head = head
        self.detail = detail
        where = f"{head} after {attempts} attempts" if attempts > 1 else head
        self.reason = _one_line(f"{where}: {detail}" if detail else where, limit=2 * MESSAGE_LIMIT)
        super().__init__(f"{role} endpoint '{endpoint}': {self.reason}")

    def after(self, attempts: int, *, retryable: bool | None = None) -> UpstreamError:
        """This error as the outcome of `attempts` attempts."""
        return UpstreamError(
            self.kind,
            self.endpoint,
            self.head,
            self.detail,
            status=self.status,
            retryable=self.retryable if retryable is None else retryable,
            attempts=attempts,
            retry_after=self.retry_after,
            role=self.role,
        )


@dataclass(frozen=True)
class ChatResult:
    """One chat completion: the first choice's text, token usage (0 when not reported), and cost."""

    content: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    attempts: int  # HTTP attempts made, 1 when the first one answered
    seconds: float  # wall time of the whole call, retry waits included


class UpstreamClient:
    """Chat completions against one endpoint (`spec`), with retries and the endpoint's breaker."""

    def __init__(
        self,
        spec: EndpointSpec,
        api_key: str | None,
        *,
        attempts: int = 5,
        backoff_seconds: float = 0.5,
        backoff_max_seconds: float = 30.0,
        breaker: CircuitBreaker | None = None,
        on_retry: Callable[[str], None] | None = None,
        on_attempt: Callable[[str, float], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        role: str = "coordinator",
        http_client: HttpClientName | None = None,
    ) -> None:
        """`http_client`: "httpx" or "aiohttp" (None: DEFAULT_HTTP_CLIENT); `transport` is httpx's."""
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        http_client = http_client or DEFAULT_HTTP_CLIENT
        if http_client not in HTTP_CLIENTS:
            raise ValueError(f"http_client must be one of {', '.join(HTTP_CLIENTS)}, got {http_client!r}")
        if transport is not None and http_client != "httpx":
            raise ValueError("a transport is an httpx transport: it needs http_client='httpx'")
        self.spec = spec
        self.role = role  # what the endpoint is to us, for messages: "coordinator", "grader"
        self.breaker = breaker if breaker is not None else CircuitBreaker(5, 30.0)
        self.attempts = attempts
        self.backoff_seconds = backoff_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self._on_retry = on_retry
        self._on_attempt = on_attempt
        self._api_key = api_key or None
        register_secret(self._api_key)
        self._headers = {"Accept": "application/json", "User-Agent": f"bcstack-{role}"}
        if self._api_key:
            self._headers["Authorization"] = f"Bearer {self._api_key}"
        self._json_headers = {**self._headers, "Content-Type": "application/json"}
        # One chat completion at most timeout_seconds once connected: a read timeout is per chunk,
        # so a server trickling bytes would otherwise hold an episode forever.
        self._overall_seconds = spec.connect_timeout_seconds + spec.timeout_seconds
        self._jitter = wait_random_exponential(multiplier=backoff_seconds, max=backoff_max_seconds)
        self._last_failure: str | None = None
        self.http_client = http_client
        self._http = make_transport(http_client, spec.base_url, transport)

    def __repr__(self) -> str:
        return (
            f"UpstreamClient(endpoint={self.spec.name!r}, base_url={self.spec.base_url!r}, "
            f"model={self.spec.model!r}, api_key={'set' if self._api_key else 'none'}, "
            f"breaker={self.breaker.state!r})"
        )

    # --- chat completions -------------------------------------------------------------------

    async def chat(self, messages: list[dict[str, str]]) -> ChatResult:
        """The endpoint's next turn for `messages`; UpstreamError when every attempt failed."""
        spec = self.spec
        body: dict[str, Any] = {"model": spec.model, "messages": messages}
        for field in ("temperature", "top_p", "max_tokens"):
            value = getattr(spec, field)
            if value is not None:
                body[field] = value
        body["stream"] = False

        started = time.perf_counter()
        made = 0  # HTTP attempts made (a circuit_open refusal makes none)

        def attempt_made() -> None:
            nonlocal made
            made += 1

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=self._wait,
            retry=retry_if_exception(self._should_retry),
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    content, prompt, completion, finish = await self._chat_once(body, attempt_made)
        except UpstreamError as exc:
            if exc.attempts == made:
                raise
            raise exc.after(made) from None
        return ChatResult(content, prompt, completion, finish, made, time.perf_counter() - started)

    def _should_retry(self, exc: BaseException) -> bool:
        # Once our own failures opened the breaker the next attempt would be refused anyway:
        # stop now instead of sleeping first.
        return isinstance(exc, UpstreamError) and exc.kind in RETRIED_KINDS and self.breaker.state != "open"

    def _wait(self, state: RetryCallState) -> float:
        wait = self._jitter(state)
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, UpstreamError) and exc.retry_after is not None:
            wait = max(wait, min(exc.retry_after, self.backoff_max_seconds))
        return wait

    def _before_sleep(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(exc, UpstreamError):
            return
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.info("%s (attempt %d/%d); retrying in %.2f s", exc, state.attempt_number, self.attempts, wait)
        if self._on_retry is not None:
            self._on_retry(exc.kind)

    async def _chat_once(
        self, body: dict[str, Any], attempt_made: Callable[[], None]
    ) -> tuple[str, int, int, str]:
        if not self.breaker.allow():
            last = f" (last: {self._last_failure})" if self._last_failure else ""
            raise UpstreamError(
                "circuit_open",
                self.spec.name,
                "circuit breaker open",
                f"{self.breaker.consecutive_failures} consecutive failures; "
                f"next trial in {self.breaker.retry_in():.1f} s{last}",
                retryable=True,
                attempts=0,
                role=self.role,
            )
        trial = self.breaker.state == "half_open"
        verdict = False
        attempt_made()
        started = time.perf_counter()
        try:
            try:
                response = await self._request("POST", "chat/completions", body=body)
                answer = self._parse_chat(response)
            except UpstreamError as exc:
                self._attempted(exc.kind, started)
                if exc.kind in RETRIED_KINDS:
                    self._last_failure = exc.reason
                    self.breaker.record_failure()
                    verdict = True
                raise
            self._attempted("ok", started)
            self.breaker.record_success()
            verdict = True
            return answer
        finally:
            if trial and not verdict:
                self.breaker.release()

    def _attempted(self, outcome: str, started: float) -> None:
        if self._on_attempt is not None:
            self._on_attempt(outcome, time.perf_counter() - started)

    def _parse_chat(self, response: HttpAnswer) -> tuple[str, int, int, str]:
        if not response.is_success:
            raise self._status_error(response)
        try:
            data = response.json()
        except ValueError:
            raise self._bad(f"HTTP {response.status_code} body is not JSON: {self._text(response)}") from None
        if not isinstance(data, dict):
            raise self._bad(f"the answer is a JSON {type(data).__name__}, not a chat completion object")
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            error = _error_message(data)
            raise self._bad("no choices in the answer" + (f": {self._short(error)}" if error else ""))
        choice = choices[0]
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            raise self._bad("choices[0] has no message object")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise self._bad(f"choices[0].message.content is a {type(content).__name__}, not a string")
        finish = choice.get("finish_reason")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return (
            content,
            _count(usage.get("prompt_tokens")),
            _count(usage.get("completion_tokens")),
            (finish if isinstance(finish, str) else ""),
        )

    # --- health probe -----------------------------------------------------------------------

    async def probe(self) -> None:
        """One GET {base_url}/models: OK when it lists `spec.model`, else UpstreamError (one line).

        Leaves the breaker alone: a probe runs before an endpoint takes any traffic.
        """
        seconds = min(PROBE_TIMEOUT_SECONDS, self.spec.timeout_seconds)
        connect = min(self.spec.connect_timeout_seconds, seconds)
        response = await self._request("GET", "models", connect=connect, read=seconds)
        if not response.is_success:
            raise self._status_error(response)
        try:
            data = response.json()
        except ValueError:
            raise self._bad(f"HTTP {response.status_code} body is not JSON: {self._text(response)}") from None
        listed = data.get("data") if isinstance(data, dict) else None
        if not isinstance(listed, list):
            raise self._bad("the /models answer has no 'data' list")
        ids = [str(entry["id"]) for entry in listed if isinstance(entry, dict) and "id" in entry]
        if self.spec.model not in ids:
            shown = ", ".join(ids[:20]) + (f", … ({len(ids)} in all)" if len(ids) > 20 else "")
            raise UpstreamError(
                "client_error",
                self.spec.name,
                f"model '{self.spec.model}' is not served here",
                f"listed: {shown or 'none'}",
                status=response.status_code,
                role=self.role,
            )

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- HTTP and errors --------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        connect: float | None = None,
        read: float | None = None,
    ) -> HttpAnswer:
        """One HTTP exchange: connect and read timeouts (the spec's by default), and the whole
        answer within their sum."""
        connect = connect if connect is not None else self.spec.connect_timeout_seconds
        read = read if read is not None else self.spec.timeout_seconds
        content = (
            None if body is None else json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        )
        headers = self._headers if body is None else self._json_headers
        try:
            async with asyncio.timeout(connect + read):
                return await self._http.send(method, path, headers, content, connect, read)
        except NoAnswer as exc:
            if exc.kind == "timeout":
                raise UpstreamError(
                    "timeout", self.spec.name, "timeout", exc.detail, role=self.role
                ) from None
            head, detail = _connection_reason(exc.cause, self.spec.base_url, exc.protocol)
            raise UpstreamError(
                "connection", self.spec.name, head, self._short(detail) if detail else None, role=self.role
            ) from exc.cause
        except TimeoutError:
            detail = f"no complete answer within {connect + read:g} s"
            raise UpstreamError("timeout", self.spec.name, "timeout", detail, role=self.role) from None

    def _status_error(self, response: HttpAnswer) -> UpstreamError:
        status = response.status_code
        message = self._short(_error_message_of(response))
        if status == 429:
            kind = "rate_limited"
        elif status >= 500:
            kind = "server_error"
        elif status in (401, 403):
            kind = "unauthorized"
        elif 300 <= status < 400:
            location = response.headers.get("location")
            kind, message = "client_error", f"redirected to {location}; set base_url to the final URL"
        else:
            kind = "client_error"
        retry_after = _retry_after_seconds(response.headers.get("retry-after"))
        return UpstreamError(
            kind,
            self.spec.name,
            f"HTTP {status}",
            message or response.reason_phrase or None,
            status=status,
            retry_after=retry_after if kind in RETRIED_KINDS else None,
            role=self.role,
        )

    def _bad(self, detail: str) -> UpstreamError:
        return UpstreamError("bad_response", self.spec.name, "bad response", detail, role=self.role)

    def _text(self, response: HttpAnswer) -> str:
        return self._short(response.text) or "(empty)"

    def _short(self, text: str) -> str:
        """`text` on one line, at most MESSAGE_LIMIT characters, without the API key.

        Some upstreams echo the key they were given ("Incorrect API key provided: sk-…"); it is
        removed before shortening, so that no prefix of it survives a cut.
        """
        if self._api_key and text:
            text = text.replace(self._api_key, REDACTED)
        return _one_line(text)


# --- helpers ------------------------------------------------------------------------------------


def _one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _error_message(data: Any) -> str:
    """The human message of an OpenAI-style (or FastAPI-style) error body, or "" (not shortened)."""
    if not isinstance(data, dict):
        return ""
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    for key in ("message", "detail"):
        if isinstance(data.get(key), str):
            return data[key]
    return ""


def _error_message_of(response: HttpAnswer) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text
    return _error_message(data) or json.dumps(data)


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def _connection_reason(exc: BaseException | None, base_url: str, protocol: bool) -> tuple[str, str | None]:
    """(head, detail) of a transport error: the root cause in a few words."""
    cause: BaseException | None = exc
    seen = 0
    while cause is not None and seen < 10:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused", None
        if isinstance(cause, ConnectionResetError):
            return "connection reset", None
        if isinstance(cause, socket.gaierror):
            host = httpx.URL(base_url).host
            return "connection failed", f"cannot resolve host {host!r}"
        cause = cause.__cause__ or cause.__context__
        seen += 1
    if protocol:
        return "connection failed", f"protocol error: {_one_line(str(exc)) or type(exc).__name__}"
    return "connection failed", _one_line(str(exc)) or type(exc).__name__
