"""The judge: episode-correctness and worker-contribution grades, rule-based or by an LLM grader.

    judge = Judge(settings, grader=OpenAIGrader(settings, metrics) | None, cache=VerdictCache(path), metrics)
    verdict = await judge.grade_answer(question, response, correct_answer)

Answer grading, in order: the exact-match fast path (normalized or numerically equal answers are
correct without any grader call); then the `rule` backend (incorrect unless it matches), or the
LLM grader through the cache (an identical request is answered from the cache, and concurrent
identical requests share one upstream call). An LLM answer that does not parse is asked again, up
to `parse_attempts` calls; after that the verdict is an explicit `parse_error` with
`correct: null`, never a guess, and it is not cached (a later request asks again). A grader that
cannot be reached raises `GraderUnavailable`: the caller gets a clear error, never a verdict.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiolimiter import AsyncLimiter

from core import grading as g
from core.grading import EXACT_VERSION, RULE_VERSION  # noqa: F401 - re-exported for the service
from core.kit.apikeys import resolve_api_key
from core.kit.breaker import CircuitBreaker
from core.kit.upstream import UpstreamClient, UpstreamError
from services.judge.cache import VerdictCache
from services.judge.metrics import JudgeMetrics
from services.judge.settings import JudgeSettings


class GraderUnavailable(RuntimeError):
    """The grader could not be reached (after retries, or its breaker is open). One line, no secrets."""


class OpenAIGrader:
    """An OpenAI-compatible chat endpoint behind a concurrency cap, a rate limit, retries and a breaker."""

    def __init__(self, settings: JudgeSettings, metrics: JudgeMetrics, transport: Any = None) -> None:
        spec = settings.grader_spec()
        self.model = spec.model
        self.client = UpstreamClient(
            spec,
            resolve_api_key(spec, role="grader"),
            attempts=settings.upstream_attempts,
            backoff_seconds=settings.upstream_backoff_seconds,
            backoff_max_seconds=settings.upstream_backoff_max_seconds,
            breaker=CircuitBreaker(
                settings.breaker_failures, settings.breaker_reset_seconds, on_change=metrics.breaker_changed
            ),
            on_retry=lambda kind: metrics.retries.labels(kind).inc(),
            on_attempt=metrics.attempt,
            transport=transport,
            role="grader",
        )
        self._slots = asyncio.Semaphore(settings.max_concurrent_upstream)
        # aiolimiter's leaky bucket: at most `rate` calls start per second, bursts included.
        self._rate = AsyncLimiter(settings.rate_limit_per_second, 1.0)

    async def complete(self, prompt: str) -> str:
        async with self._slots, self._rate:
            result = await self.client.chat([{"role": "user", "content": prompt}])
        return result.content

    async def aclose(self) -> None:
        await self.client.aclose()


class Judge:
    def __init__(
        self,
        settings: JudgeSettings,
        grader: OpenAIGrader | None,
        cache: VerdictCache,
        metrics: JudgeMetrics,
    ) -> None:
        if settings.backend == "openai" and grader is None:
            raise ValueError("backend 'openai' needs a grader")
        self.settings = settings
        self.grader = grader if settings.backend == "openai" else None
        self.cache = cache
        self.metrics = metrics
        self.answer_template = g.load_template("answer")
        self.contribution_template = g.load_template("contribution")

    @property
    def backend(self) -> str:
        return "openai" if self.grader is not None else "rule"

    def versions(self) -> dict[str, str]:
        """The grader_version each kind of verdict carries."""
        if self.grader is None:
            return {"answer": RULE_VERSION, "contribution": RULE_VERSION, "exact": EXACT_VERSION}
        return {
            "answer": f"{self.answer_template.id}/{self.grader.model}",
            "contribution": f"{self.contribution_template.id}/{self.grader.model}",
            "exact": EXACT_VERSION,
        }

    # --- episode correctness ---------------------------------------------------------------------

    async def grade_answer(self, question: str, response: str, correct_answer: str) -> g.AnswerVerdict:
        verdict = g.exact_verdict(response, correct_answer, EXACT_VERSION)
        if verdict is None and self.grader is None:
            verdict = g.rule_answer(response, correct_answer, RULE_VERSION)
        if verdict is None:
            verdict = await self._llm_answer(question, response, correct_answer)
        outcome = "parse_error" if verdict.parse_error else ("correct" if verdict.correct else "incorrect")
        self.metrics.verdicts.labels("answer", outcome, verdict.method).inc()
        return verdict

    async def _llm_answer(self, question: str, response: str, correct_answer: str) -> g.AnswerVerdict:
        assert self.grader is not None
        version = self.versions()["answer"]
        inputs = {"question": question, "response": response, "correct_answer": correct_answer}

        def verdict(parsed: g.ParsedAnswer | None) -> g.AnswerVerdict:
            if parsed is None:
                return g.AnswerVerdict(
                    correct=None,
                    extracted_final_answer="",
                    reasoning=self._unparsed(),
                    confidence=g.response_confidence(response),
                    parse_error=True,
                    grader_version=version,
                    method="llm",
                )
            return g.AnswerVerdict(
                correct=parsed.correct,
                extracted_final_answer=parsed.extracted_final_answer,
                reasoning=parsed.reasoning,
                confidence=parsed.confidence,
                parse_error=False,
                grader_version=version,
                method="llm",
            )

        value = await self._llm_verdict(
            "answer",
            self.answer_template,
            inputs,
            g.render_answer_prompt(self.answer_template, **inputs),
            g.parse_answer_verdict,
            verdict,
        )
        return g.AnswerVerdict.from_dict(value)

    # --- worker contribution ---------------------------------------------------------------------

    async def grade_contribution(
        self, question: str, task: str, report: str, final_answer: str, gold_answer: str
    ) -> g.ContributionVerdict:
        if self.grader is None:
            verdict = g.rule_contribution(report, final_answer, gold_answer, RULE_VERSION)
        else:
            verdict = await self._llm_contribution(question, task, report, final_answer, gold_answer)
        self.metrics.verdicts.labels(
            "contribution", "parse_error" if verdict.parse_error else verdict.label, verdict.method
        ).inc()
        return verdict

    async def _llm_contribution(
        self, question: str, task: str, report: str, final_answer: str, gold_answer: str
    ) -> g.ContributionVerdict:
        assert self.grader is not None
        version = self.versions()["contribution"]
        inputs = {
            "question": question,
            "task": task,
            "report": report,
            "final_answer": final_answer,
            "gold_answer": gold_answer,
        }

        def verdict(parsed: g.ParsedContribution | None) -> g.ContributionVerdict:
            if parsed is None:
                return g.ContributionVerdict(
                    score=0.0,
                    label="",
                    reasoning=self._unparsed(),
                    parse_error=True,
                    grader_version=version,
                    method="llm",
                )
            return g.ContributionVerdict(
                score=parsed.score,
                label=parsed.label,
                reasoning=parsed.reasoning,
                parse_error=False,
                grader_version=version,
                method="llm",
            )

        value = await self._llm_verdict(
            "contribution",
            self.contribution_template,
            inputs,
            g.render_contribution_prompt(self.contribution_template, **inputs),
            g.parse_contribution,
            verdict,
        )
        return g.ContributionVerdict.from_dict(value)

    async def _llm_verdict(
        self,
        grader: str,
        template: g.Template,
        inputs: dict[str, str],
        prompt: str,
        parse: Any,
        verdict: Any,
    ) -> dict[str, Any]:
        """Ask the grader (up to `parse_attempts` times for a parseable answer) through the cache.

        Identical inputs are answered from the cache or share the call in flight; a parse_error
        verdict is not cached, so a later request asks again. Sets `cached` on the result.
        """
        assert self.grader is not None

        async def compute() -> dict[str, Any]:
            for _ in range(self.settings.parse_attempts):
                parsed = parse(await self._complete(grader, prompt))
                if parsed is not None:
                    return verdict(parsed).to_dict()
                self.metrics.parse_errors.labels(grader).inc()
            return verdict(None).to_dict()

        key = VerdictCache.key(grader, template.id, self.grader.model, inputs)
        value, how = await self.cache.get_or_compute(key, compute, keep=lambda v: not v["parse_error"])
        self.metrics.cache.labels(grader, how).inc()
        return {**value, "cached": how == "hit"}

    def _unparsed(self) -> str:
        return f"the grader's answer did not parse in {self.settings.parse_attempts} tries"

    async def _complete(self, grader: str, prompt: str) -> str:
        assert self.grader is not None
        try:
            return await self.grader.complete(prompt)
        except UpstreamError as exc:
            self.metrics.unavailable.labels(grader).inc()
            raise GraderUnavailable(f"grader unavailable: {exc}") from None

    async def aclose(self) -> None:
        if self.grader is not None:
            await self.grader.aclose()
        self.cache.close()
