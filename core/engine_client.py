"""The stack's client for an inference engine: SGLang's native HTTP API, spoken to a real SGLang
server or to the CPU engine (`bcstack serve engine`) that serves the same subset.

This is the one module of the stack that knows SGLang's field names; everything else speaks
`GenerateResult`. The names are listed below (`*_FIELDS`, `ROUTES`) and tests/test_sglang_contract.py
checks them against SGLang's own source, for the pinned release and the newest one: request bodies
are built from these names only and responses are read through them only.

Transport: one pooled `httpx.AsyncClient` per client (made on first use, inside the running event
loop); connection failures and 5xx answers are retried with exponential backoff and jitter
(tenacity), a 4xx never is. Failures surface as `EngineError` (the engine refused: status and
SGLang's message) or `EngineUnavailable` (no answer, a timeout, or 5xx after the retries).

Admin routes (`ADMIN_ROUTES`: update_weights_from_disk, pause/continue, flush_cache) send
`admin_token`: a real SGLang server checks it as `--admin-api-key`, the CPU engine as its
`admin_api_key` (`BCSTACK_ENGINE_ADMIN_API_KEY`, else `BCSTACK_ADMIN_TOKEN`). Every other route
sends `api_key` (SGLang's `--api-key`), else the admin token. No token is ever logged: messages
carry routes and statuses only.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

log = logging.getLogger(__name__)

# The largest `sampling_seed` every hop carries exactly: a JSON number (the gateway's body) holds
# integers up to 2**53 - 1 without rounding; SGLang keeps the seeds of a batch as int64.
MAX_SEED = 2**53 - 1


def derive_seed(seed: int, *parts: object) -> int:
    """A seed for one draw below `seed` (a branch of an episode, a turn of a branch): stable across
    runs and processes, different for different `parts`, in [0, MAX_SEED].

    One episode seed fans out to many engine requests; each gets its own derived seed, so that no two
    requests of an episode replay the same stream of uniforms, while two models run with the same
    episode seed draw the same uniforms turn by turn (common random numbers: a paired comparison then
    splits fewer pairs on the draw alone)."""
    digest = hashlib.sha256("\0".join(str(x) for x in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


# --- SGLang's names ---------------------------------------------------------------------------------
# Every name below is checked against the source of each SGLang version the stack targets (the pin,
# `charts/bcstack/values.yaml` worker.engine.image.tag, and the newest release) by
# tests/test_sglang_contract.py (devkit.sglang): a rename upstream fails that test naming the line
# here and the line there.
GENERATE_FIELDS = ("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "stream")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed")
RESPONSE_FIELDS = ("text", "output_ids", "meta_info")
META_INFO_FIELDS = (
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "weight_version",
    "weight_versions",
    "e2e_latency",
    "input_token_logprobs",
    "output_token_logprobs",
)
# meta_info["weight_versions"]: which weight version generated which output tokens, as spans
# (`utils/weight_versions.py`, add_weight_versions_to_meta_info); more than one span when weights
# were swapped while the request ran (an in-place pause keeps it in the running batch).
VERSION_SPAN_FIELDS = ("version", "start", "end")
FINISH_REASON_FIELDS = ("type", "matched", "length", "message")
FINISH_TYPES = ("stop", "length", "abort")
UPDATE_WEIGHTS_FIELDS = ("model_path", "weight_version", "load_format", "abort_all_requests", "flush_cache")
UPDATE_WEIGHTS_RESPONSE_FIELDS = ("success", "message", "num_paused_requests")
PAUSE_FIELDS = ("mode",)
PAUSE_MODES = ("abort", "retract", "in_place")
MODEL_INFO_FIELDS = ("model_path", "tokenizer_path", "is_generation", "weight_version")
ERROR_FIELDS = ("error", "message")  # 400 bodies: {"error": {"message": ...}}
# name -> (method, path). /model_info, not /get_model_info (a deprecated alias that logs a warning per
# call) nor /get_weight_version (404 "deprecated" in 0.5.19, gone in 0.5.23).
ROUTES: dict[str, tuple[str, str]] = {
    "generate": ("POST", "/generate"),
    "health": ("GET", "/health"),
    "health_generate": ("GET", "/health_generate"),
    "model_info": ("GET", "/model_info"),
    "flush_cache": ("POST", "/flush_cache"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
}
# The routes that take the admin key (SGLang's ADMIN_OPTIONAL ones).
ADMIN_ROUTES = ("flush_cache", "pause_generation", "continue_generation", "update_weights_from_disk")
(
    _INPUT_IDS,
    _SAMPLING,
    _RETURN_LOGPROB,
    _LOGPROB_START,
    _STREAM,
) = GENERATE_FIELDS
_MAX_NEW, _TEMPERATURE, _TOP_P, _TOP_K, _STOP_IDS, _SEED = SAMPLING_FIELDS
_TEXT, _OUTPUT_IDS, _META = RESPONSE_FIELDS
(
    _ID,
    _FINISH,
    _PROMPT_TOKENS,
    _COMPLETION_TOKENS,
    _WEIGHT_VERSION,
    _WEIGHT_VERSIONS,
    _LATENCY,
    _INPUT_LP,
    _OUTPUT_LP,
) = META_INFO_FIELDS
_SPAN_VERSION, _SPAN_START, _SPAN_END = VERSION_SPAN_FIELDS
_TYPE, _MATCHED, _LENGTH, _MESSAGE = FINISH_REASON_FIELDS

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]


class EngineError(RuntimeError):
    """The engine answered with an error (a 4xx, or a 5xx once retries ran out)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"engine answered {status}: {message}" if status is not None else message)
        self.status = status
        self.message = message


class EngineUnavailable(EngineError):
    """No usable answer: connection refused or dropped, a timeout, or 5xx after every retry."""


class EngineUnreachable(EngineUnavailable):
    """The engine is not there or not ready: the connection was refused or dropped, or it answered
    503 (a crashed, restarting or still-loading server; SGLang answers 503 while it loads), as
    opposed to one that answered another 5xx or timed out. Waited out for `unreachable_wait_s`."""


@dataclass(frozen=True)
class GenerateResult:
    output_ids: list[int]
    text: str
    logprobs: list[float]  # one per output id (empty when return_logprob was false)
    finish_reason: FinishReason
    matched: int | str | None  # the stop token id or stop string, for finish_reason "stop"
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    latency_s: float  # the engine's e2e_latency when it reports one, else the client's round trip
    rid: str | None = None
    abort_message: str | None = None
    # (version, start, end) over output_ids when more than one version generated them (a reload
    # while the request ran); empty when one version made them all (`weight_version`).
    version_spans: tuple[tuple[str, int, int], ...] = ()


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, EngineUnavailable):
        return exc.status is None or exc.status >= 500
    return False


def _message_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get(ERROR_FIELDS[0])
        if isinstance(error, dict) and isinstance(error.get(ERROR_FIELDS[1]), str):
            return error[ERROR_FIELDS[1]]
        if isinstance(error, str):
            return error
        for key in (ERROR_FIELDS[1], "detail"):
            if isinstance(body.get(key), str):
                return body[key]
    return str(body)[:500]


class EngineClient:
    """Async client for one engine base URL; share it across episodes (it pools connections)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        max_connections: int = 256,
        api_key: str | None = None,
        admin_token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        unreachable_wait_s: float = 0.0,
    ) -> None:
        """`retries` counts attempts in all (1 = no retry), as the worker's `engine_retries` does.

        `unreachable_wait_s`: an engine that cannot be reached or is not ready (connection refused or
        dropped, 503: it crashed, is restarting or loading) is retried, at the backoff, until this long
        after the first attempt even when `retries` are used up; other 5xx answers and timeouts get
        `retries` only."""
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.attempts = max(1, retries)
        self.unreachable_wait_s = max(0.0, unreachable_wait_s)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.api_key = api_key
        self.admin_token = admin_token
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self.timeout, limits=self.limits, transport=self._transport
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- transport -------------------------------------------------------------------------------

    def _headers(self, admin: bool) -> dict[str, str]:
        # The chart gives SGLang one token as both --api-key and --admin-api-key (0.5.19 serves its
        # arguments, the admin key among them, at GET /server_info unless --api-key guards it), so a
        # client holding only the admin token sends it on every route.
        token = (self.admin_token or self.api_key) if admin else (self.api_key or self.admin_token)
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _send(self, route: str, body: dict[str, Any] | None) -> httpx.Response:
        method, path = ROUTES[route]
        headers = self._headers(route in ADMIN_ROUTES)
        try:
            response = await self.client.request(method, path, json=body, headers=headers)
        except httpx.TimeoutException as e:
            raise EngineUnavailable(None, f"{self.base_url}{path}: timed out ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise EngineUnreachable(None, f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        if response.status_code == 503:
            raise EngineUnreachable(response.status_code, _message_of(response))
        if response.status_code >= 500:
            raise EngineUnavailable(response.status_code, _message_of(response))
        return response

    async def _request(
        self,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        ok_statuses: tuple[int, ...] = (200,),
        retry: bool = True,
    ) -> httpx.Response:
        """One call with retries on connection failures and 5xx; EngineError on other statuses."""
        response: httpx.Response | None = None
        attempts = self.attempts if retry else 1

        def stop(state: RetryCallState) -> bool:
            if state.attempt_number < attempts:
                return False
            unreachable = state.outcome is not None and isinstance(
                state.outcome.exception(), EngineUnreachable
            )
            return not (retry and unreachable and state.seconds_since_start < self.unreachable_wait_s)

        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_retryable),
            stop=stop,
            wait=wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            before_sleep=lambda state: log.warning(
                "engine %s%s failed (%s); retrying",
                self.base_url,
                ROUTES[route][1],
                state.outcome.exception(),
            ),
            reraise=True,
        ):
            with attempt:
                response = await self._send(route, body)
        assert response is not None
        if response.status_code not in ok_statuses:
            raise EngineError(response.status_code, _message_of(response))
        return response

    # --- generation ------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        """Token-in-token-out generation: `output_ids` (the stop token included) with one log-prob each."""
        sampling: dict[str, Any] = {_MAX_NEW: max_new_tokens, _TEMPERATURE: temperature, _TOP_P: top_p}
        if top_k is not None:
            sampling[_TOP_K] = top_k
        if stop_token_ids:
            sampling[_STOP_IDS] = list(stop_token_ids)
        if seed is not None:
            sampling[_SEED] = seed
        body = {
            _INPUT_IDS: list(input_ids),
            _SAMPLING: sampling,
            _RETURN_LOGPROB: return_logprob,
            _STREAM: False,
        }
        started = time.perf_counter()
        response = await self._request("generate", body)
        return self._result(response.json(), return_logprob, time.perf_counter() - started)

    def _result(self, payload: Any, return_logprob: bool, round_trip_s: float) -> GenerateResult:
        try:
            meta = payload[_META]
            finish = meta[_FINISH] or {}
            kind = finish.get(_TYPE)
            if kind not in FINISH_TYPES:
                raise ValueError(f"unknown finish_reason {finish!r}")
            triples = meta.get(_OUTPUT_LP) or []
            logprobs = [float(entry[0]) for entry in triples] if return_logprob else []
            # A server that leaves output_ids out (older SGLang releases did) still lists the ids
            # in the log-prob triples.
            raw_ids = payload.get(_OUTPUT_IDS)
            output_ids = [int(t) for t in (raw_ids if raw_ids is not None else [e[1] for e in triples])]
            latency = meta.get(_LATENCY)
            spans = tuple(
                (str(s[_SPAN_VERSION]), int(s[_SPAN_START]), int(s[_SPAN_END]))
                for s in meta.get(_WEIGHT_VERSIONS) or ()
            )
            return GenerateResult(
                output_ids=output_ids,
                text=str(payload.get(_TEXT, "")),
                logprobs=logprobs,
                finish_reason=kind,
                matched=finish.get(_MATCHED),
                prompt_tokens=int(meta[_PROMPT_TOKENS]),
                completion_tokens=int(meta.get(_COMPLETION_TOKENS, len(output_ids))),
                weight_version=meta.get(_WEIGHT_VERSION),
                latency_s=float(latency) if latency is not None else round_trip_s,
                rid=meta.get(_ID),
                abort_message=finish.get(_MESSAGE) if kind == "abort" else None,
                version_spans=spans if len({v for v, _, _ in spans}) > 1 else (),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(200, f"unexpected /generate answer: {type(e).__name__}: {e}") from None

    async def score(self, input_ids: list[int], start: int = 0) -> list[float | None]:
        """One entry per input token from `start`: None for the token at `start` (SGLang scores
        no token at `logprob_start_len`, `_process_input_token_logprobs`), then
        log p(token_i | tokens before it).

        `max_new_tokens` 0 with `logprob_start_len` = `start`: SGLang's prompt scoring. To score a
        response that begins at position P (teacher log-probs of a student's tokens, on-policy
        distillation), ask from `start = P - 1` and drop the leading None.
        """
        if not 0 <= start < len(input_ids):
            raise ValueError(f"start {start} outside the {len(input_ids)} input tokens")
        body = {
            _INPUT_IDS: list(input_ids),
            _SAMPLING: {_MAX_NEW: 0},
            _RETURN_LOGPROB: True,
            _LOGPROB_START: start,
            _STREAM: False,
        }
        payload = (await self._request("generate", body)).json()
        try:
            entries = payload[_META][_INPUT_LP]
            values = [None if e[0] is None else float(e[0]) for e in entries]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(200, f"unexpected scoring answer: {type(e).__name__}: {e}") from None
        if len(values) != len(input_ids) - start:
            raise EngineError(
                200, f"scored {len(values)} positions for {len(input_ids) - start} input tokens from {start}"
            )
        return values

    # --- info and health -------------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        info = (await self._request("model_info")).json()
        return {key: info.get(key) for key in MODEL_INFO_FIELDS} | info

    async def weight_version(self) -> str | None:
        """The served weights' label, from /model_info (SGLang updates it with the weights only when
        an update succeeds)."""
        return (await self.model_info()).get(_WEIGHT_VERSION)

    async def health(self) -> bool:
        """True when the engine answers /health with 200 (no retries: a probe)."""
        try:
            await self._request("health", retry=False)
        except EngineError:
            return False
        return True

    async def health_generate(self) -> bool:
        """True when the engine generates one token (/health_generate 200; no retries)."""
        try:
            await self._request("health_generate", retry=False)
        except EngineError:
            return False
        return True

    # --- admin -----------------------------------------------------------------------------------

    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix (radix) cache: (True, text), or (False, why) when the engine refused
        (HTTP 400: SGLang flushes only an idle scheduler, `Scheduler.flush_cache`)."""
        response = await self._request("flush_cache", ok_statuses=(200, 400))
        return response.status_code == 200, response.text.strip()

    async def pause_generation(self, mode: PauseMode = "in_place") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._request("pause_generation", {PAUSE_FIELDS[0]: mode})

    async def continue_generation(self) -> None:
        await self._request("continue_generation", {})

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """Hot-swap the served weights; (False, message) when the engine refused them (HTTP 400).

        `flush_cache` true (SGLang's default) makes the engine flush its prefix cache after loading;
        SGLang refuses that flush while any request is queued or running (0.5.19: an assertion
        that takes the scheduler down; 0.5.23: a 400 after the weights changed), so a reload with
        requests in flight passes false (services/worker/reload.py)."""
        path, version, fmt, abort_all, flush = UPDATE_WEIGHTS_FIELDS
        body: dict[str, Any] = {path: model_path, abort_all: abort_all_requests, flush: flush_cache}
        if weight_version is not None:
            body[version] = weight_version
        if load_format is not None:
            body[fmt] = load_format
        response = await self._request("update_weights_from_disk", body, ok_statuses=(200, 400))
        success_key, message_key, _ = UPDATE_WEIGHTS_RESPONSE_FIELDS
        try:
            answer = response.json()
            return bool(answer[success_key]), str(answer.get(message_key, ""))
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(response.status_code, f"unexpected update answer: {e}") from None
