"""`bcstack serve engine`: the subset of SGLang's native HTTP API the stack uses, on the CPU.

    POST /generate                  one prompt: text | input_ids, sampling_params, return_logprob,
                                    logprob_start_len, rid, stream (SSE)  -> {text, output_ids, meta_info}
    GET  /health                    200 once the model is loaded (503 while starting or failed)
    GET  /health_generate           200 when one greedy token comes back in time, else 503
    GET  /model_info                {model_path, served_model_name, tokenizer_path, is_generation,
                                    weight_version, load_format, ...}
    GET  /get_model_info            the same, a deprecated alias (a warning per call), as in SGLang
    GET  /get_weight_version        404 "deprecated, use /model_info" (SGLang 0.5.19), and
    GET  /weight_version            the same
    POST /abort_request             admin; {rid | abort_all}
    POST /flush_cache               admin; empties the prefix cache, 400 while requests run or wait
    POST /pause_generation          admin; {mode: abort | retract | in_place}
    POST /continue_generation       admin
    POST /update_weights_from_disk  admin; {model_path, weight_version, load_format,
                                    abort_all_requests, flush_cache} -> {success, message,
                                    num_paused_requests}, 200 / 400
    GET  /metrics                   bcstack_engine_* (and the shared bcstack_http_*)

Status codes and bodies follow SGLang's `http_server.py`: a refused `/generate` is 400 with
`{"error": {"message"}}`; a streamed one sends `data: {json}\\n\\n` chunks (cumulative `text`,
`output_ids` and `meta_info`, `finish_reason` null until the last) and `data: [DONE]\\n\\n`.
503 (not SGLang's) says the engine cannot take work now: still loading, failed, or its queue is
full.

Auth: SGLang marks the weight, pause, flush and abort routes `ADMIN_OPTIONAL` (guarded by
`--admin-api-key` when one is set, open otherwise, `srt/utils/auth.py`). Here they take
`admin_api_key` (`BCSTACK_ENGINE_ADMIN_API_KEY`: secrets have no CLI option), else
`BCSTACK_ADMIN_TOKEN`; the stack's rule is stricter than
SGLang's (DESIGN.md §8): with neither they are disabled (403), never open, and a wrong key is 403
where SGLang says 401. `api_key` (SGLang's `--api-key`) guards every other route except /health*,
/metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry

from core.kit.auth import bearer_token, require_admin, token_matches
from core.kit.http import create_app
from core.kit.metrics import new_registry
from services.engine import openapi as doc
from services.engine import protocol as proto
from services.engine.core import EngineCore, EngineUnavailable
from services.engine.metrics import EngineMetrics
from services.engine.scheduler import PAUSE_MODES
from services.engine.sequence import Sequence
from services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

SERVICE = "engine"
WEIGHT_VERSION_DEPRECATED = (
    "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(proto.error_body(message), status_code=status)


async def _json_body(request: Request, *, empty_ok: bool = False) -> Any:
    raw = await request.body()
    if not raw.strip():
        if empty_ok:
            return {}
        raise proto.RequestError("The request body is empty; send a JSON object.")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise proto.RequestError(f"The request body is not valid JSON: {e}.") from None


def build_http_app(
    core: EngineCore, settings: EngineSettings, registry: CollectorRegistry, *, load_on_startup: bool = True
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The model loads after the port opens, so /health answers 503 "starting" meanwhile.
        loading = asyncio.create_task(core.start()) if load_on_startup else None
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            await core.close()

    app = create_app(SERVICE, settings, registry, health_check=core.health, lifespan=lifespan)
    if settings.admin_api_key is not None and settings.admin_api_key.get_secret_value():
        app.state.admin_token = settings.admin_api_key
    metrics = core.metrics
    kit_openapi, limited = app.openapi, False

    def openapi() -> dict[str, Any]:
        # The model's limits, once it is loaded (the port opens before: /health says "starting").
        nonlocal limited
        schema = kit_openapi()
        if not limited and core.model is not None:
            doc.document_model_limits(
                schema, vocab_size=core.model.vocab_size, context_length=core.context_length
            )
            limited = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def require_api_key(request: Request) -> None:
        """SGLang's --api-key: every route but /health*, /metrics needs it when it is set."""
        expected = settings.api_key
        if expected is None or not expected.get_secret_value():
            return
        presented = bearer_token(request)
        if presented is None or not token_matches(presented, expected):
            raise HTTPException(401, detail="Unauthorized")

    normal = [Depends(require_api_key)]
    admin = [Depends(require_admin)]

    def rejected(status: int, message: str) -> JSONResponse:
        if metrics is not None:
            metrics.rejected.labels(str(status)).inc()
        return _error(status, message)

    @app.post("/generate", dependencies=normal, **doc.GENERATE)
    async def generate(request: Request) -> Any:
        try:
            gen = proto.parse_generate_request(await _json_body(request))
            seq = core.submit(gen)
        except proto.RequestError as e:
            return rejected(400, str(e))
        except EngineUnavailable as e:
            return rejected(503, str(e))
        if gen.stream:
            return StreamingResponse(_stream(core, seq), media_type="text/event-stream")
        try:
            await seq.wait_finished()
        except asyncio.CancelledError:
            core.abort(seq)
            raise
        return JSONResponse(seq.response())

    # SGLang serves PUT /generate and GET /flush_cache too; registered apart so that each
    # operation has its own OpenAPI operationId.
    app.put("/generate", dependencies=normal, operation_id="generate_put", **doc.GENERATE)(generate)

    @app.get("/health_generate", **doc.HEALTH_GENERATE)
    async def health_generate() -> Any:
        ok, message = await core.health_generate()
        body = {"status": "ok" if ok else "unhealthy", "message": message}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/model_info", dependencies=normal)
    async def model_info() -> Any:
        return core.model_info()

    @app.get("/get_model_info", dependencies=normal)
    async def get_model_info() -> Any:
        log.warning(
            "Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
            "Please use '/model_info' instead."
        )
        return core.model_info()

    async def weight_version() -> Any:
        """SGLang 0.5.19 `http_server.weight_version`: a 404 stub (both routes are gone in 0.5.23)."""
        raise HTTPException(404, detail=WEIGHT_VERSION_DEPRECATED)

    for path in ("/get_weight_version", "/weight_version"):
        app.get(path, dependencies=normal, operation_id=path.strip("/"), **doc.WEIGHT_VERSION)(weight_version)

    @app.post("/abort_request", dependencies=admin, **doc.ABORT)
    async def abort_request(request: Request) -> Any:
        try:
            body = await _json_body(request, empty_ok=True)
            if not isinstance(body, dict):
                raise proto.RequestError("The request body must be a JSON object.")
            rid, abort_all = body.get("rid"), body.get("abort_all")
            abort_all = False if abort_all is None else abort_all  # null means the default, as in SGLang
            if rid is not None and not isinstance(rid, str):
                raise proto.RequestError("rid must be a string.")
            if not isinstance(abort_all, bool):
                raise proto.RequestError("abort_all must be true or false.")
            core.abort_request(rid, abort_all)
        except proto.RequestError as e:
            return _error(400, str(e))
        except EngineUnavailable as e:
            return _error(503, str(e))
        return PlainTextResponse("", status_code=200)

    @app.post("/flush_cache", dependencies=admin, **doc.FLUSH)
    async def flush_cache() -> Any:
        try:
            flushed = await core.flush_cache()
        except EngineUnavailable as e:
            return _error(503, str(e))
        if not flushed:  # SGLang: 400 with FlushCacheReqOutput's empty message replaced
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )

    app.get("/flush_cache", dependencies=admin, operation_id="flush_cache_get", **doc.FLUSH)(flush_cache)

    @app.post("/pause_generation", dependencies=admin, **doc.PAUSE)
    async def pause_generation(request: Request) -> Any:
        try:
            body = await _json_body(request, empty_ok=True)
            mode = body.get("mode", "abort") if isinstance(body, dict) else None
            if mode not in PAUSE_MODES:
                raise proto.RequestError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
            await core.pause(mode)
        except proto.RequestError as e:
            return _error(400, str(e))
        except EngineUnavailable as e:
            return _error(503, str(e))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation", dependencies=admin, **doc.CONTINUE)
    async def continue_generation() -> Any:
        try:
            core.resume()
        except EngineUnavailable as e:
            return _error(503, str(e))
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk", dependencies=admin, **doc.UPDATE_WEIGHTS)
    async def update_weights_from_disk(request: Request) -> Any:
        def failed(message: str, status: int = 400) -> JSONResponse:
            body = {"success": False, "message": message, "num_paused_requests": 0}
            return JSONResponse(body, status_code=status)

        try:
            body = await _json_body(request)
        except proto.RequestError as e:
            return failed(str(e))
        model_path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(model_path, str) or not model_path:
            return failed("model_path is required (the folder holding the new weights).")
        version = body.get("weight_version")
        load_format = body.get("load_format")
        flush = body.get("flush_cache", True)
        if not isinstance(flush, bool):
            return failed("flush_cache must be true or false.")
        if version is not None and not isinstance(version, str):
            return failed("weight_version must be a string.")
        if load_format is not None and not isinstance(load_format, str):
            return failed("load_format must be a string.")
        try:
            result = await core.update_weights_from_disk(
                model_path,
                weight_version=version,
                load_format=load_format,
                abort_all_requests=bool(body.get("abort_all_requests", False)),
                flush_cache=flush,
            )
        except EngineUnavailable as e:
            return failed(str(e), 503)
        body = {
            "success": result.success,
            "message": result.message,
            "num_paused_requests": result.num_paused_requests,
        }
        return JSONResponse(body, status_code=200 if result.success else 400)

    return app


async def _stream(core: EngineCore, seq: Sequence) -> AsyncIterator[bytes]:
    """SSE chunks as SGLang sends them; a client that goes away aborts its request."""
    try:
        while True:
            await seq.updated.wait()
            seq.updated.clear()
            yield b"data: " + json.dumps(seq.response()).encode() + b"\n\n"
            if seq.finished:
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not seq.finished:
            core.abort(seq)


def build(settings: EngineSettings) -> tuple[FastAPI, EngineCore]:
    """The app and its engine on one registry (what `bcstack serve engine` runs); loads on startup."""
    registry = new_registry()
    core = EngineCore(settings, EngineMetrics(registry))
    return build_http_app(core, settings, registry), core
