"""The coordinator gateway's upstream client (retries, timeouts, circuit breaker, API keys) and its
endpoint registry (runtime swaps), against real HTTP servers on loopback ports:

- the stand-in coordinator LLM (`services.coordinator_llm`) with its fault injection, and
- `ScriptedLLM`, a tiny OpenAI-compatible ASGI app that answers a scripted status sequence
  (e.g. 503, 503, 200) and records every request it receives, for exact sequences and counts.

Both run under uvicorn in a thread; nothing in the HTTP clients is mocked. Every test runs once
with each HTTP client the upstream client can use (httpx, aiohttp), which must behave alike. Waits
are kept short (backoff 0.01 s) except where a test measures that a Retry-After of 1 s is honoured.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from conftest import LOOPBACK, find_free_port
from fake_openai import Reply, ScriptedLLM, serving_uvicorn

from core.kit import upstream
from core.kit.apikeys import resolve_api_key
from core.kit.breaker import CircuitBreaker
from core.kit.http import uvicorn_server
from core.kit.settings import load_settings
from core.kit.upstream import ChatResult, EndpointSpec, UpstreamClient, UpstreamError
from services.coordinator.registry import Endpoint, EndpointRegistry, RegistryError
from services.coordinator_llm.service import build_app
from services.coordinator_llm.settings import CoordinatorLlmSettings

T = TypeVar("T")

MODEL = "scripted-coordinator"
OTHER_MODEL = "coord-b"
API_KEY = "sk-upstream-3f9a1c77e02b4d58"
KEY_ENV = "BCSTACK_TEST_COORDINATOR_KEY"
QUESTION = "In which city was the inventor of the Varnel loom born?"
MESSAGES = [
    {"role": "system", "content": "You coordinate research workers. Call branch(description, prompt)."},
    {"role": "user", "content": QUESTION},
]
FAST = {"backoff_seconds": 0.01, "backoff_max_seconds": 0.05}
TEST_TIMEOUT_SECONDS = 20.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_SECONDS))


def spec(base_url: str, name: str = "a", model: str = MODEL, **overrides: Any) -> EndpointSpec:
    return EndpointSpec(name=name, base_url=base_url, model=model, **overrides)


def dead_url() -> str:
    return f"http://{LOOPBACK}:{find_free_port()}/v1"


@pytest.fixture(autouse=True, params=upstream.HTTP_CLIENTS)
def http_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The HTTP client every UpstreamClient of the test uses (the default the test runs under)."""
    monkeypatch.setattr(upstream, "DEFAULT_HTTP_CLIENT", request.param)
    return request.param


# --- servers ------------------------------------------------------------------------------------


@contextmanager
def stand_in(**overrides: Any) -> Iterator[str]:
    """The stand-in coordinator LLM in a thread; yields its OpenAI base URL (…/v1)."""
    port = find_free_port()
    settings = load_settings(CoordinatorLlmSettings, port=port, shutdown_grace_seconds=0.2, **overrides)
    with serving_uvicorn(uvicorn_server(build_app(settings), settings)):
        yield f"http://{LOOPBACK}:{port}/v1"


def seed_for(pattern: list[bool], rate: float = 0.5) -> int:
    """A fault seed whose first draws are exactly `pattern` (True = the fault) at `rate`."""
    for seed in range(10_000):
        rng = random.Random(seed)
        if [rng.random() < rate for _ in pattern] == pattern:
            return seed
    raise AssertionError(f"no seed gives {pattern}")


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedLLM]]:
    """Start a ScriptedLLM: `scripted(503, 503, 200)`; its base_url is set once it serves."""
    with ExitStack() as stack:

        def start(*script: int | Reply, model: str = MODEL) -> ScriptedLLM:
            app = ScriptedLLM(*script, model=model)
            port = find_free_port()
            config = uvicorn.Config(
                app,
                host=LOOPBACK,
                port=port,
                log_level="warning",
                lifespan="off",
                timeout_graceful_shutdown=0.2,
            )
            stack.enter_context(serving_uvicorn(uvicorn.Server(config)))
            app.base_url = f"http://{LOOPBACK}:{port}/v1"
            return app

        yield start


@pytest.fixture(scope="module")
def keyed_llm() -> Iterator[str]:
    """The stand-in with an API key and no faults (shared; tests only read from it)."""
    with stand_in(api_key=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def other_llm() -> Iterator[str]:
    """A second stand-in serving another model name, with no key."""
    with stand_in(model_name=OTHER_MODEL) as url:
        yield url


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, f"  {API_KEY}\n")
    return KEY_ENV


async def chat_once(client: UpstreamClient, messages: list[dict[str, str]] = MESSAGES) -> ChatResult:
    try:
        return await client.chat(messages)
    finally:
        await client.aclose()


# --- chat completions against the stand-in coordinator LLM --------------------------------------


def test_chat_returns_the_coordinator_turn_with_usage(keyed_llm: str) -> None:
    result = run(chat_once(UpstreamClient(spec(keyed_llm), API_KEY, **FAST)))
    assert "<function=branch>" in result.content
    assert result.prompt_tokens > 0 and result.completion_tokens > 0
    assert result.finish_reason == "stop"
    assert result.attempts == 1 and 0 < result.seconds < 5


def test_request_shape_and_auth_header(scripted: Callable[..., ScriptedLLM]) -> None:
    llm = scripted(200, 200)
    run(chat_once(UpstreamClient(spec(llm.base_url, temperature=0.7, top_p=None, max_tokens=512), "k-1")))
    run(chat_once(UpstreamClient(spec(llm.base_url), None)))
    with_key, without_key = llm.chats
    assert with_key["method"] == "POST" and with_key["path"] == "/v1/chat/completions"
    assert with_key["json"] == {
        "model": MODEL,
        "messages": MESSAGES,
        "temperature": 0.7,
        "max_tokens": 512,
        "stream": False,
    }
    assert with_key["headers"]["authorization"] == "Bearer k-1"
    assert "authorization" not in without_key["headers"]


def test_429_waits_at_least_retry_after_then_succeeds() -> None:
    retries: list[str] = []
    with stand_in(
        fail_mode="http429", fail_rate=0.5, fault_seed=seed_for([True, False]), retry_after_seconds=1
    ) as url:
        client = UpstreamClient(
            spec(url), None, backoff_seconds=0.01, backoff_max_seconds=5, on_retry=retries.append
        )
        started = time.monotonic()
        result = run(chat_once(client))
        waited = time.monotonic() - started
    assert result.attempts == 2 and result.content
    assert retries == ["rate_limited"]
    assert waited >= 1.0, f"retried after {waited:.2f} s, before Retry-After: 1"


def test_retry_after_is_capped_by_backoff_max(scripted: Callable[..., ScriptedLLM]) -> None:
    llm = scripted(Reply(429, headers={"Retry-After": "120"}), 200)
    started = time.monotonic()
    result = run(
        chat_once(UpstreamClient(spec(llm.base_url), None, backoff_seconds=0.01, backoff_max_seconds=0.2))
    )
    assert result.attempts == 2
    assert 0.2 <= time.monotonic() - started < 5


def test_retry_after_as_an_http_date_is_honoured(scripted: Callable[..., ScriptedLLM]) -> None:
    when = email.utils.formatdate(time.time() + 2, usegmt=True)  # whole seconds: 1-2 s from now
    llm = scripted(Reply(503, headers={"Retry-After": when}), 200)
    started = time.monotonic()
    result = run(
        chat_once(UpstreamClient(spec(llm.base_url), None, backoff_seconds=0.01, backoff_max_seconds=5))
    )
    assert result.attempts == 2
    assert time.monotonic() - started >= 0.9


def test_500_then_success_is_retried() -> None:
    retries: list[str] = []
    attempts: list[str] = []
    with stand_in(fail_mode="http500", fail_rate=0.5, fault_seed=seed_for([True, False])) as url:
        client = UpstreamClient(
            spec(url),
            None,
            **FAST,
            on_retry=retries.append,
            on_attempt=lambda outcome, s: attempts.append(outcome),
        )
        result = run(chat_once(client))
    assert result.attempts == 2 and "<function=branch>" in result.content
    assert retries == ["server_error"]
    assert attempts == ["server_error", "ok"]


def test_every_attempt_failing_raises_server_error_with_the_count() -> None:
    retries: list[str] = []
    with stand_in(fail_mode="http500", fail_rate=1.0) as url:
        client = UpstreamClient(spec(url), None, attempts=3, **FAST, on_retry=retries.append)
        with pytest.raises(UpstreamError) as caught:
            run(chat_once(client))
    err = caught.value
    assert (err.kind, err.status, err.endpoint, err.retryable, err.attempts) == (
        "server_error",
        500,
        "a",
        True,
        3,
    )
    assert retries == ["server_error", "server_error"]
    message = str(err)
    assert message.startswith("coordinator endpoint 'a': HTTP 500 after 3 attempts: ")
    assert "injected fault" in message and "\n" not in message


def test_hang_is_a_timeout() -> None:
    with stand_in(fail_mode="hang", fail_rate=1.0, hang_seconds=5) as url:
        client = UpstreamClient(spec(url, timeout_seconds=0.5), None, attempts=2, **FAST)
        started = time.monotonic()
        with pytest.raises(UpstreamError) as caught:
            run(chat_once(client))
        took = time.monotonic() - started
    assert caught.value.kind == "timeout" and caught.value.attempts == 2 and caught.value.retryable
    assert "0.5 s" in str(caught.value)
    assert took < 3, f"two 0.5 s attempts took {took:.1f} s"


def test_wrong_key_is_unauthorized_and_not_retried(keyed_llm: str) -> None:
    attempts: list[str] = []
    client = UpstreamClient(spec(keyed_llm), "sk-wrong", **FAST, on_attempt=lambda o, s: attempts.append(o))
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(client))
    err = caught.value
    assert (err.kind, err.status, err.retryable, err.attempts) == ("unauthorized", 401, False, 1)
    assert attempts == ["unauthorized"]
    assert str(err) == "coordinator endpoint 'a': HTTP 401: Incorrect API key provided."


def test_wrong_model_is_a_client_error_that_leaves_the_breaker_closed(keyed_llm: str) -> None:
    client = UpstreamClient(spec(keyed_llm, model="gpt-nope"), API_KEY, **FAST, breaker=CircuitBreaker(1, 60))
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(client))
    assert (caught.value.kind, caught.value.status, caught.value.attempts) == ("client_error", 404, 1)
    assert "gpt-nope" in str(caught.value)
    assert client.breaker.state == "closed"


def test_malformed_answers_are_bad_responses_and_retried(scripted: Callable[..., ScriptedLLM]) -> None:
    retries: list[str] = []
    llm = scripted(
        Reply(200, b"<html>upstream proxy error</html>"),
        Reply(200, {"id": "x", "choices": []}),
        Reply(200, {"choices": [{"message": {"role": "assistant", "content": None}}]}),
    )
    result = run(chat_once(UpstreamClient(spec(llm.base_url), None, **FAST, on_retry=retries.append)))
    assert retries == ["bad_response", "bad_response"]
    # null content is an empty turn, not an error; missing usage and finish_reason are zeros/""
    assert (result.content, result.prompt_tokens, result.completion_tokens, result.finish_reason) == (
        "",
        0,
        0,
        "",
    )
    assert result.attempts == 3

    llm = scripted(Reply(200, b"not json"), Reply(200, b"not json"))
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(UpstreamClient(spec(llm.base_url), None, attempts=2, **FAST)))
    assert caught.value.kind == "bad_response" and "not JSON: not json" in str(caught.value)


def test_dead_port_is_a_connection_error() -> None:
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(UpstreamClient(spec(dead_url()), None, attempts=2, **FAST)))
    assert caught.value.kind == "connection" and caught.value.retryable
    assert str(caught.value) == "coordinator endpoint 'a': connection refused after 2 attempts"


def test_a_redirect_is_not_followed(scripted: Callable[..., ScriptedLLM], http_client: str) -> None:
    elsewhere = "http://127.0.0.9:9/v1/chat/completions"
    llm = scripted(Reply(307, headers={"Location": elsewhere}))
    client = UpstreamClient(spec(llm.base_url), None, **FAST)
    assert client.http_client == http_client
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(client))
    assert (caught.value.kind, caught.value.status, caught.value.attempts) == ("client_error", 307, 1)
    assert f"redirected to {elsewhere}; set base_url to the final URL" in str(caught.value)
    assert len(llm.chats) == 1


def test_upstream_message_is_truncated_to_one_line(scripted: Callable[..., ScriptedLLM]) -> None:
    long = "overloaded\n" + "x" * 1000
    llm = scripted(Reply(400, {"error": {"message": long}}))
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(UpstreamClient(spec(llm.base_url), None, **FAST)))
    message = str(caught.value)
    assert caught.value.kind == "client_error" and len(llm.chats) == 1
    assert "\n" not in message and "overloaded x" in message and len(message) < 400


# --- the circuit breaker ------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_circuit_breaker_states() -> None:
    clock, changes = FakeClock(), []
    breaker = CircuitBreaker(3, 30.0, clock=clock, on_change=changes.append)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    breaker.record_success()  # a success resets the count of consecutive failures
    for _ in range(3):
        assert breaker.state == "closed" and breaker.allow()
        breaker.record_failure()
    assert breaker.state == "open" and changes == ["open"]
    clock.now += 29.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow() and breaker.state == "half_open"  # the one trial
    assert not breaker.allow() and not breaker.allow()  # everyone else waits for its verdict
    breaker.record_failure()
    assert breaker.state == "open"  # a failed trial opens it again, and the timer restarts
    clock.now += 29.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow()
    breaker.release()  # a trial without a verdict (a 4xx, a cancelled call) lets another one through
    assert breaker.allow() and not breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()
    assert changes == ["open", "half_open", "open", "half_open", "closed"]


def test_open_breaker_fails_fast_then_a_trial_closes_it(scripted: Callable[..., ScriptedLLM]) -> None:
    llm = scripted(500, 500, 500)  # then 200s
    changes: list[str] = []
    breaker = CircuitBreaker(2, 0.3, on_change=changes.append)
    client = UpstreamClient(spec(llm.base_url), None, attempts=5, **FAST, breaker=breaker)

    async def chat_error() -> UpstreamError:
        with pytest.raises(UpstreamError) as caught:
            await client.chat(MESSAGES)
        return caught.value

    async def scenario() -> ChatResult:
        try:
            first = await chat_error()
            # the second failure opened the breaker: no third attempt, no pointless wait
            assert (first.kind, first.attempts) == ("server_error", 2)
            assert breaker.state == "open" and len(llm.chats) == 2

            started = time.monotonic()
            fast = await chat_error()
            assert time.monotonic() - started < 0.5
            assert (fast.kind, fast.retryable, fast.attempts) == ("circuit_open", True, 0)
            assert "HTTP 500" in str(fast)  # the last failure, for the operator
            assert len(llm.chats) == 2, "an open breaker must not let a request reach the server"

            await asyncio.sleep(0.35)
            trial = await chat_error()  # the half-open trial meets the third 500: open again
            assert (trial.kind, trial.attempts) == ("server_error", 1)
            assert breaker.state == "open" and len(llm.chats) == 3
            assert (await chat_error()).kind == "circuit_open" and len(llm.chats) == 3

            await asyncio.sleep(0.35)
            return await client.chat(MESSAGES)  # this trial succeeds and closes the breaker
        finally:
            await client.aclose()

    result = run(scenario())
    assert result.attempts == 1 and result.content and len(llm.chats) == 4
    assert changes == ["open", "half_open", "open", "half_open", "closed"]


def test_client_errors_do_not_count_against_the_breaker(scripted: Callable[..., ScriptedLLM]) -> None:
    llm = scripted(400, 404, 422, 200)
    breaker = CircuitBreaker(1, 60)
    client = UpstreamClient(spec(llm.base_url), None, **FAST, breaker=breaker)

    async def scenario() -> ChatResult:
        try:
            for _ in range(3):
                with pytest.raises(UpstreamError) as caught:
                    await client.chat(MESSAGES)
                assert caught.value.kind == "client_error" and caught.value.attempts == 1
                assert breaker.state == "closed"
            return await client.chat(MESSAGES)
        finally:
            await client.aclose()

    assert run(scenario()).attempts == 1
    assert len(llm.chats) == 4


def test_a_half_open_trial_answered_with_a_4xx_does_not_wedge_the_breaker(
    scripted: Callable[..., ScriptedLLM],
) -> None:
    llm = scripted(500, 404)  # then 200s
    breaker = CircuitBreaker(1, 0.2)
    client = UpstreamClient(spec(llm.base_url), None, **FAST, breaker=breaker)

    async def scenario() -> ChatResult:
        try:
            with pytest.raises(UpstreamError, match="HTTP 500"):
                await client.chat(MESSAGES)
            await asyncio.sleep(0.25)
            with pytest.raises(UpstreamError, match="HTTP 404"):  # the trial: no verdict on health
                await client.chat(MESSAGES)
            assert breaker.state == "half_open"
            return await client.chat(MESSAGES)  # the next caller may try, and closes it
        finally:
            await client.aclose()

    assert run(scenario()).attempts == 1
    assert breaker.state == "closed" and len(llm.chats) == 3


# --- API keys -----------------------------------------------------------------------------------


def test_resolve_api_key_from_env_and_file(
    key_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BCSTACK_TEST_UNSET_KEY", raising=False)
    assert resolve_api_key(spec("http://x/v1", api_key_env=key_env)) == API_KEY  # stripped
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    assert resolve_api_key(spec("http://x/v1", api_key_file=key_file)) == API_KEY
    assert resolve_api_key(spec("http://x/v1")) is None

    problems = {
        "BCSTACK_TEST_UNSET_KEY": spec("http://x/v1", api_key_env="BCSTACK_TEST_UNSET_KEY"),
        str(tmp_path / "missing"): spec("http://x/v1", api_key_file=tmp_path / "missing"),
    }
    monkeypatch.setenv("BCSTACK_TEST_BLANK_KEY", "  ")
    problems["BCSTACK_TEST_BLANK_KEY"] = spec("http://x/v1", api_key_env="BCSTACK_TEST_BLANK_KEY")
    blank_file = tmp_path / "blank"
    blank_file.write_text("\n")
    problems[str(blank_file)] = spec("http://x/v1", api_key_file=blank_file)
    for named, bad in problems.items():
        with pytest.raises(UpstreamError) as caught:
            resolve_api_key(bad)
        assert caught.value.kind == "no_api_key" and not caught.value.retryable
        assert named in str(caught.value) and "\n" not in str(caught.value)


def test_a_key_echoed_by_the_upstream_never_reaches_the_error(
    scripted: Callable[..., ScriptedLLM], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    llm = scripted(
        Reply(503, {"error": {"message": "overloaded " + "x" * 280 + API_KEY}}),  # cut mid-key at 300
        Reply(401, {"error": {"message": f"Incorrect API key provided: {API_KEY}"}}),
    )
    client = UpstreamClient(spec(llm.base_url), API_KEY, **FAST)
    with pytest.raises(UpstreamError) as caught:
        run(chat_once(client))
    assert caught.value.kind == "unauthorized" and caught.value.attempts == 2
    assert "Incorrect API key provided: [REDACTED]" in str(caught.value)
    assert "overloaded xxx" in caplog.text  # the retried 503, logged
    for text in (str(caught.value), repr(caught.value), repr(client), caplog.text):
        assert API_KEY[:6] not in text


# --- health probe -------------------------------------------------------------------------------


def test_probe_ok_dead_port_wrong_model_wrong_key(keyed_llm: str) -> None:
    async def probe(s: EndpointSpec, key: str | None) -> str | None:
        client = UpstreamClient(s, key, breaker=CircuitBreaker(1, 60))
        try:
            await client.probe()
            return None
        except UpstreamError as exc:
            assert client.breaker.state == "closed"  # a probe leaves the breaker alone
            return f"{exc.kind}: {exc.reason}"
        finally:
            await client.aclose()

    assert run(probe(spec(keyed_llm), API_KEY)) is None
    assert run(probe(spec(dead_url()), API_KEY)) == "connection: connection refused"
    assert run(probe(spec(keyed_llm, model="gpt-nope"), API_KEY)) == (
        f"client_error: model 'gpt-nope' is not served here: listed: {MODEL}"
    )
    assert run(probe(spec(keyed_llm), None)).startswith("unauthorized: HTTP 401")


# --- the endpoint registry ----------------------------------------------------------------------


def registry(specs: list[EndpointSpec], active: str | None = None, **overrides: Any) -> EndpointRegistry:
    options: dict[str, Any] = {
        "attempts": 2,
        "backoff_seconds": 0.01,
        "backoff_max_seconds": 0.05,
        "breaker_failures": 3,
        "breaker_reset_seconds": 30.0,
    }
    return EndpointRegistry(specs, active, **(options | overrides))


def test_registry_view_never_shows_the_key(
    keyed_llm: str, key_env: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    attempts: list[tuple[str, str]] = []

    async def scenario() -> dict:
        reg = registry(
            [spec(keyed_llm, "a", api_key_env=key_env)],
            on_attempt=lambda name, outcome, s: attempts.append((name, outcome)),
        )
        try:
            await reg.put(spec(keyed_llm, "b", api_key_file=key_file), activate="b")
            assert (await reg.active().client.chat(MESSAGES)).content
            with pytest.raises(RegistryError) as caught:
                await reg.put(spec(keyed_llm, "c", api_key_env="BCSTACK_TEST_UNSET_KEY"))
            assert str(caught.value) == (
                "endpoint 'c' refused: no API key: env var BCSTACK_TEST_UNSET_KEY is not set"
            )
            for endpoint in (reg.get("a"), reg.get("b")):
                assert API_KEY not in repr(endpoint) and API_KEY not in repr(endpoint.client)
            return reg.view()
        finally:
            await reg.aclose()

    view = run(scenario())
    assert [e["api_key"] for e in view["endpoints"]] == [f"env:{key_env}", f"file:{key_file}"]
    assert view["endpoints"][0] == {
        "name": "a",
        "base_url": keyed_llm,
        "model": MODEL,
        "timeout_seconds": 300.0,
        "connect_timeout_seconds": 5.0,
        "temperature": 1.0,
        "top_p": 0.95,
        "max_tokens": 8192,
        "api_key": f"env:{key_env}",
        "breaker": "closed",
    }
    assert attempts == [("b", "ok")]
    assert "coordinator endpoint 'b' activated (model scripted-coordinator" in caplog.text
    assert API_KEY not in json.dumps(view)
    assert API_KEY not in caplog.text


def test_put_of_a_dead_endpoint_changes_nothing(keyed_llm: str, key_env: str) -> None:
    async def scenario() -> None:
        dead = dead_url()
        reg = registry([spec(keyed_llm, "a", api_key_env=key_env), spec(dead, "b")])
        try:
            before = reg.view()
            with pytest.raises(RegistryError) as added:
                await reg.put(spec(dead, "c"), activate="c")
            assert str(added.value) == "endpoint 'c' refused: connection refused"
            with pytest.raises(RegistryError) as activated:  # b is registered, but dead
                await reg.put(activate="b")
            assert str(activated.value) == "endpoint 'b' refused: connection refused"
            with pytest.raises(RegistryError) as changed:  # moving the active endpoint to a dead URL
                await reg.put(spec(dead, "a", api_key_env=key_env))
            assert str(changed.value) == "endpoint 'a' refused: connection refused"
            with pytest.raises(RegistryError) as wrong_model:
                await reg.put(spec(keyed_llm, "a", model="gpt-nope", api_key_env=key_env))
            assert "gpt-nope" in str(wrong_model.value) and MODEL in str(wrong_model.value)
            assert reg.view() == before and reg.active().name == "a"
            with pytest.raises(RegistryError, match="^endpoint 'b' refused: connection refused$"):
                await reg.put(spec(dead, "b"))  # an unchanged spec is still probed
            assert reg.view() == before
        finally:
            await reg.aclose()

    run(scenario())


def test_swap_keeps_episodes_on_the_endpoint_they_started_with(
    keyed_llm: str, other_llm: str, key_env: str
) -> None:
    retries: list[tuple[str, str]] = []

    async def scenario() -> None:
        reg = registry(
            [spec(keyed_llm, "a", api_key_env=key_env)], on_retry=lambda n, k: retries.append((n, k))
        )
        try:
            held = reg.active()  # an episode started before the swap
            view = await reg.put(spec(other_llm, "b", model=OTHER_MODEL), activate="b")
            assert view["active"] == "b" and view["swaps"] == 1
            assert [e["name"] for e in view["endpoints"]] == ["a", "b"]
            assert reg.active().name == "b" and reg.active().spec.model == OTHER_MODEL
            assert held.name == "a" and (await held.client.chat(MESSAGES)).content  # still served by a
            assert (await reg.active().client.chat(MESSAGES)).content

            # changing the active endpoint's spec makes a new Endpoint; the old one keeps working
            before = reg.active()
            view = await reg.put(spec(other_llm, "b", model=OTHER_MODEL, temperature=0.3))
            assert view["swaps"] == 2 and view["endpoints"][1]["temperature"] == 0.3
            assert reg.active() is not before and reg.active().spec.temperature == 0.3
            assert (await before.client.chat(MESSAGES)).content

            # activating the active one, or putting an identical spec, is not a swap
            view = await reg.put(spec(other_llm, "b", model=OTHER_MODEL, temperature=0.3), activate="b")
            assert view["swaps"] == 2 and reg.get("b") is reg.active()
            assert (await reg.put(activate="a"))["swaps"] == 3 and reg.active() is held
        finally:
            await reg.aclose()

    run(scenario())
    assert retries == []


def test_registry_refuses_bad_setups(keyed_llm: str) -> None:
    a, b = spec(keyed_llm, "a"), spec(keyed_llm, "b")
    with pytest.raises(RegistryError, match="^no coordinator endpoint configured"):
        registry([])
    with pytest.raises(RegistryError, match="repeated: a"):
        registry([a, a])
    with pytest.raises(RegistryError, match=r"^unknown endpoint 'x' \(known: a, b\)$"):
        registry([a, b], "x")
    with pytest.raises(RegistryError, match="^endpoint 'a': no API key: env var BCSTACK_TEST_UNSET_KEY"):
        registry([spec(keyed_llm, "a", api_key_env="BCSTACK_TEST_UNSET_KEY")])

    async def scenario() -> None:
        reg = registry([a, b])
        try:
            assert reg.active().name == "a" and isinstance(reg.get("b"), Endpoint)
            with pytest.raises(RegistryError, match=r"^unknown endpoint 'x' \(known: a, b\)$"):
                reg.get("x")
            with pytest.raises(RegistryError, match=r"^unknown endpoint 'x' \(known: a, b\)$"):
                await reg.put(activate="x")
            with pytest.raises(RegistryError, match="^nothing to change"):
                await reg.put()
            with pytest.raises(RegistryError, match="^endpoint 'a' is not reachable: HTTP 401: "):
                await reg.probe_active()  # the stand-in wants a key and a has none
        finally:
            await reg.aclose()

    run(scenario())
