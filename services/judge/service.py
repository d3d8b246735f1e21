"""The judge proxy (`bcstack serve judge`): grading over HTTP and gRPC around `core.Judge`.

HTTP: `POST /v1/grade`, `POST /v1/grade/contribution`, and `.../batch` forms (`{"items": [...]}`,
answered in order, graded concurrently within the grader's limits; all or nothing), `/health`,
`/metrics`. gRPC: `bcstack.v1.JudgeService`. A grader that cannot be reached is 503 /
UNAVAILABLE with the reason; bad input is 422 / INVALID_ARGUMENT.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.grading import AnswerVerdict, ContributionVerdict
from core.kit.grpc_server import GrpcServer
from core.kit.http import create_app
from core.kit.metrics import new_registry
from core.v1 import judge_pb2, judge_pb2_grpc
from services.judge.cache import VerdictCache
from services.judge.core import GraderUnavailable, Judge, OpenAIGrader
from services.judge.metrics import JudgeMetrics
from services.judge.settings import JudgeSettings

SERVICE = "judge"
log = logging.getLogger("bcstack.judge")


def request_models(settings: JudgeSettings) -> tuple[type[BaseModel], type[BaseModel]]:
    """Request shapes with the configured size limits."""
    limit = settings.max_field_chars

    class GradeRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        question: str = Field("", max_length=limit)
        response: str = Field(max_length=limit)
        correct_answer: str = Field(min_length=1, max_length=limit)

    class ContributionRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        question: str = Field("", max_length=limit)
        task: str = Field("", max_length=limit)
        report: str = Field(max_length=limit)
        final_answer: str = Field("", max_length=limit)
        gold_answer: str = Field(min_length=1, max_length=limit)

    return GradeRequest, ContributionRequest


class AnswerGrade(BaseModel):
    correct: bool | None
    extracted_final_answer: str | None
    reasoning: str | None
    confidence: float | None
    parse_error: bool
    grader_version: str
    method: str
    cached: bool


class ContributionGrade(BaseModel):
    score: float | None
    label: str | None
    reasoning: str | None
    parse_error: bool
    grader_version: str
    method: str
    cached: bool


class AnswerGrades(BaseModel):
    items: list[AnswerGrade]


class ContributionGrades(BaseModel):
    items: list[ContributionGrade]


class Unavailable(BaseModel):
    error: str


def _responses(ok: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    unavailable = {"description": "the grader LLM cannot be reached (Retry-After)", "model": Unavailable}
    return {200: {"model": ok}, 503: unavailable}


def answer_body(v: AnswerVerdict) -> dict[str, Any]:
    return {
        "correct": v.correct,
        "extracted_final_answer": v.extracted_final_answer,
        "reasoning": v.reasoning,
        "confidence": v.confidence,
        "parse_error": v.parse_error,
        "grader_version": v.grader_version,
        "method": v.method,
        "cached": v.cached,
    }


def contribution_body(v: ContributionVerdict) -> dict[str, Any]:
    return {
        "score": v.score,
        "label": v.label,
        "reasoning": v.reasoning,
        "parse_error": v.parse_error,
        "grader_version": v.grader_version,
        "method": v.method,
        "cached": v.cached,
    }


def _unavailable(exc: Exception) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": "5"})


def build_http(judge: Judge, registry: Any) -> FastAPI:
    settings = judge.settings
    started = time.time()
    GradeRequest, ContributionRequest = request_models(settings)  # noqa: N806 - classes

    class GradeBatch(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[GradeRequest] = Field(min_length=1, max_length=settings.max_batch)  # type: ignore[valid-type]

    class ContributionBatch(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[ContributionRequest] = Field(min_length=1, max_length=settings.max_batch)  # type: ignore[valid-type]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Logged at startup, after `run_service` has set logging up.
        log.info(
            "judge: %s backend%s, verdicts cached in %s",
            judge.backend,
            f" ({settings.grader_url}, model {settings.grader_model})" if judge.grader else "",
            settings.cache_path or "memory only",
        )
        yield
        await judge.aclose()

    app = create_app(
        SERVICE,
        settings,
        registry,
        lifespan=lifespan,
        health_check=lambda: {
            "backend": judge.backend,
            "grader_versions": judge.versions(),
            "cached_verdicts": judge.cache.count(),
            "uptime_s": round(time.time() - started),
        },
    )

    async def one_answer(r: Any) -> dict[str, Any]:
        return answer_body(await judge.grade_answer(r.question, r.response, r.correct_answer))

    async def one_contribution(r: Any) -> dict[str, Any]:
        v = await judge.grade_contribution(r.question, r.task, r.report, r.final_answer, r.gold_answer)
        return contribution_body(v)

    @app.post("/v1/grade", responses=_responses(AnswerGrade))
    async def grade(body: GradeRequest) -> Any:  # type: ignore[valid-type]
        try:
            return await one_answer(body)
        except GraderUnavailable as exc:
            return _unavailable(exc)

    @app.post("/v1/grade/batch", responses=_responses(AnswerGrades))
    async def grade_batch(body: GradeBatch) -> Any:
        try:
            return {"items": await asyncio.gather(*(one_answer(r) for r in body.items))}
        except GraderUnavailable as exc:
            return _unavailable(exc)

    @app.post("/v1/grade/contribution", responses=_responses(ContributionGrade))
    async def contribution(body: ContributionRequest) -> Any:  # type: ignore[valid-type]
        try:
            return await one_contribution(body)
        except GraderUnavailable as exc:
            return _unavailable(exc)

    @app.post("/v1/grade/contribution/batch", responses=_responses(ContributionGrades))
    async def contribution_batch(body: ContributionBatch) -> Any:
        try:
            return {"items": await asyncio.gather(*(one_contribution(r) for r in body.items))}
        except GraderUnavailable as exc:
            return _unavailable(exc)

    return app


def answer_message(body: dict[str, Any]) -> judge_pb2.GradeAnswerResponse:
    msg = judge_pb2.GradeAnswerResponse(
        extracted_final_answer=body["extracted_final_answer"],
        reasoning=body["reasoning"],
        parse_error=body["parse_error"],
        grader_version=body["grader_version"],
        cached=body["cached"],
        method=body["method"],
    )
    if body["correct"] is not None:
        msg.correct = body["correct"]
    if body["confidence"] is not None:
        msg.confidence = body["confidence"]
    return msg


def contribution_message(body: dict[str, Any]) -> judge_pb2.GradeContributionResponse:
    return judge_pb2.GradeContributionResponse(**body)


class JudgeServicer(judge_pb2_grpc.JudgeServiceServicer):
    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self.GradeRequest, self.ContributionRequest = request_models(judge.settings)

    async def _validated(self, model: type[BaseModel], message: Any, context: Any, where: str = "") -> Any:
        fields = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}
        try:
            return model(**fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first["loc"])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}{field}: {first['msg']}")

    async def _run(self, context: Any, coro: Any) -> Any:
        try:
            return await coro
        except GraderUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def GradeAnswer(self, request, context):  # noqa: N802 - gRPC method name
        r = await self._validated(self.GradeRequest, request, context)
        v = await self._run(context, self.judge.grade_answer(r.question, r.response, r.correct_answer))
        return answer_message(answer_body(v))

    async def GradeContribution(self, request, context):  # noqa: N802
        r = await self._validated(self.ContributionRequest, request, context)
        v = await self._run(
            context,
            self.judge.grade_contribution(r.question, r.task, r.report, r.final_answer, r.gold_answer),
        )
        return contribution_message(contribution_body(v))

    async def _batch_size(self, n: int, context: Any) -> None:
        if not 1 <= n <= self.judge.settings.max_batch:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a batch holds 1 to {self.judge.settings.max_batch} items, got {n}",
            )

    async def BatchGradeAnswer(self, request, context):  # noqa: N802
        await self._batch_size(len(request.items), context)
        items = [
            await self._validated(self.GradeRequest, m, context, f"items.{i}.")
            for i, m in enumerate(request.items)
        ]
        verdicts = await self._run(
            context,
            asyncio.gather(
                *(self.judge.grade_answer(r.question, r.response, r.correct_answer) for r in items)
            ),
        )
        return judge_pb2.BatchGradeAnswerResponse(items=[answer_message(answer_body(v)) for v in verdicts])

    async def BatchGradeContribution(self, request, context):  # noqa: N802
        await self._batch_size(len(request.items), context)
        items = [
            await self._validated(self.ContributionRequest, m, context, f"items.{i}.")
            for i, m in enumerate(request.items)
        ]
        verdicts = await self._run(
            context,
            asyncio.gather(
                *(
                    self.judge.grade_contribution(r.question, r.task, r.report, r.final_answer, r.gold_answer)
                    for r in items
                )
            ),
        )
        return judge_pb2.BatchGradeContributionResponse(
            items=[contribution_message(contribution_body(v)) for v in verdicts]
        )


def build(settings: JudgeSettings, transport: Any = None) -> tuple[FastAPI, GrpcServer | None, Judge]:
    """The judge and both transports (what `bcstack serve judge` runs).

    Raises ValueError / CacheError / UpstreamError (no API key) with a one-line reason.
    """
    registry = new_registry()
    metrics = JudgeMetrics(registry)
    grader = OpenAIGrader(settings, metrics, transport) if settings.backend == "openai" else None
    judge = Judge(settings, grader, VerdictCache(settings.cache_path), metrics)
    app = build_http(judge, registry)
    server = None
    if settings.grpc_port is not None:
        server = GrpcServer(SERVICE, settings, registry)
        server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, JudgeServicer(judge))
    return app, server, judge
