"""Canary reload: `bcstack worker reload --canary N --eval FILE (--min-accuracy X | --max-drop PP)`.

The steps, each printed and counted on the workers (`bcstack_worker_canary_reloads_total{step,
outcome}`, the reload POST carries the step):

1. **Look.** Every replica's `GET /admin/reload`: they must all serve one weight version (a roll
   still under way is refused); the rollback target is `--rollback-checkpoint`, else the folder the
   canaries report they last loaded (`checkpoint`); with neither, nothing is touched.
2. **Canary.** The first N replicas reload the checkpoint one at a time, as a rolling reload does.
3. **Evaluate.** Each question of FILE (× `rounds`) runs as one worker episode on the canaries only,
   sent to their gRPC port (named in the same status) through `WorkerPool`, the gateway's own
   router. With `--max-drop` the same questions run at the same time on the other replicas, still on
   the old version, so the comparison is paired. The judge grades every final answer
   (`POST /v1/grade/batch`, as the RL loop does).
4. **Decide.** Canary accuracy ≥ X, or (old − canary) ≤ PP points on the questions graded in both.
5. **Promote or roll back.** Pass: the other replicas reload the checkpoint. Fail: the canaries
   reload the rollback target under the old version's name.

Why worker episodes and not gateway episodes: the gateway routes a branch to any replica of its
pool, and on Kubernetes its pool is one headless Service name, so it cannot be told "only these
pods". A worker episode isolates what changed (the worker's weights) from the coordinator LLM, and
the task text is the coordinator's (`--task-template`, default the toy coordinator's wording).
Written here rather than taken from a library: KServe/Argo canaries split live traffic by
percentage and judge by HTTP metrics, not by graded answers on a fixed question slice.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from bcstack.evaluation.loaders import EvalQuestion
from bcstack.evaluation.report import paired_comparison, wilson_interval
from core.grading import response_text
from core.v1 import common_pb2, worker_pb2
from services.coordinator.workers import WorkerPool
from services.worker.rolling import ADMIN_RELOAD_PATH, ReplicaProgress, ReplicaResult, rolling_reload

Decision = Literal["promoted", "rolled back", "failed"]
Key = tuple[str, int]  # (query_id, round)
JUDGE_ATTEMPTS = 6


class CanaryError(RuntimeError):
    """Nothing was touched: the replicas or the options do not allow a canary (exit 2)."""


@dataclass(frozen=True)
class ReplicaStatus:
    url: str
    weight_version: str | None
    checkpoint: str | None  # the folder its weights came from; None: the weights it started with
    grpc_address: str | None  # host:port of its episode API; None: it serves no gRPC


@dataclass
class SliceResult:
    """One version's answers on the evaluation slice."""

    version: str
    replicas: list[str]
    correct: dict[Key, bool] = field(default_factory=dict)  # graded episodes only
    failed: dict[Key, str] = field(default_factory=dict)  # no response: counted incorrect, the reason
    ungraded: dict[Key, str] = field(default_factory=dict)  # the judge could not parse: left out
    versions_seen: dict[str, int] = field(default_factory=dict)  # turn weight_version -> turns
    seconds: float = 0.0

    @property
    def right(self) -> int:
        return sum(self.correct.values())

    @property
    def graded(self) -> int:
        return len(self.correct)

    @property
    def accuracy(self) -> float:
        return self.right / self.graded if self.graded else math.nan

    def summary(self) -> dict[str, Any]:
        low, high = wilson_interval(self.right, self.graded) if self.graded else (math.nan, math.nan)
        return {
            "version": self.version,
            "replicas": self.replicas,
            "correct": self.right,
            "graded": self.graded,
            "accuracy": self.accuracy,
            "wilson_95": [low, high],
            "failed_episodes": {f"{q}#{r}": why for (q, r), why in sorted(self.failed.items())},
            "ungraded": {f"{q}#{r}": why for (q, r), why in sorted(self.ungraded.items())},
            "turn_weight_versions": self.versions_seen,
            "seconds": round(self.seconds, 2),
        }


@dataclass
class CanaryPlan:
    checkpoint_on_workers: str
    version: str
    canaries: list[ReplicaStatus]
    others: list[ReplicaStatus]
    old_version: str
    rollback_checkpoint: str


def grpc_address(url: str, port: int) -> str:
    host = urlsplit(url).hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def replica_statuses(client: httpx.AsyncClient, urls: Sequence[str], token: str) -> list[ReplicaStatus]:
    """Every replica's reload status; CanaryError naming the first that cannot be read."""
    statuses = []
    for url in urls:
        try:
            response = await client.get(
                f"{url}{ADMIN_RELOAD_PATH}", headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as e:
            raise CanaryError(f"{url}: GET {ADMIN_RELOAD_PATH} failed: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise CanaryError(
                f"{url}: GET {ADMIN_RELOAD_PATH} answered HTTP {response.status_code}: {response.text[:200]}"
            )
        body = response.json()
        port = body.get("grpc_port")
        statuses.append(
            ReplicaStatus(
                url,
                body.get("weight_version"),
                body.get("checkpoint"),
                grpc_address(url, int(port)) if port else None,
            )
        )
    return statuses


def plan_canary(
    statuses: list[ReplicaStatus],
    canary: int,
    *,
    checkpoint_on_workers: str,
    version: str,
    rollback_checkpoint: str | None,
    baseline: bool,
) -> CanaryPlan:
    """The canaries, the others, the old version and the way back; CanaryError when the replicas
    cannot take a canary (nothing touched)."""
    total = len(statuses)
    if not 1 <= canary <= total:
        raise CanaryError(f"--canary {canary}: there are {total} replica(s); pick 1..{total}")
    if baseline and canary == total:
        raise CanaryError(
            f"--max-drop compares the canaries with replicas still on the old version, but --canary {canary} "
            f"takes all {total}; use fewer canaries or --min-accuracy"
        )
    versions = {s.weight_version for s in statuses}
    if None in versions:
        unknown = ", ".join(s.url for s in statuses if s.weight_version is None)
        raise CanaryError(f"cannot read the weight version of {unknown}; is its engine up?")
    if len(versions) > 1:
        serving = "; ".join(f"{s.url} serves {s.weight_version!r}" for s in statuses)
        raise CanaryError(
            f"the replicas serve different versions ({serving}); finish or roll back that rollout first"
        )
    old = statuses[0].weight_version or ""
    if old == version:
        raise CanaryError(
            f"every replica already serves {version!r}; name the new weights with --weight-version"
        )
    canaries, others = statuses[:canary], statuses[canary:]
    no_grpc = [s.url for s in canaries + (others if baseline else []) if s.grpc_address is None]
    if no_grpc:
        raise CanaryError(f"{', '.join(no_grpc)} serve(s) no gRPC port, where evaluation episodes go")
    back = rollback_checkpoint
    if back is None:
        reported = {s.checkpoint for s in canaries}
        if None in reported:
            raise CanaryError(
                f"the canaries serve {old!r}, the weights they started with, and no reload recorded "
                "its folder: pass --rollback-checkpoint PATH (those weights' export inside the workers' "
                "checkpoint root)"
            )
        if len(reported) > 1:
            raise CanaryError(
                f"the canaries loaded {old!r} from different folders "
                f"({', '.join(sorted(map(str, reported)))}); pass --rollback-checkpoint PATH"
            )
        back = reported.pop() or ""
    return CanaryPlan(checkpoint_on_workers, version, canaries, others, old, back)


def task_request(
    question: EvalQuestion,
    round_: int,
    template: str,
    *,
    temperature: float | None,
    seed: int | None,
    budget: dict[str, int] | None = None,
) -> worker_pb2.RunWorkerEpisodeRequest:
    sampling = common_pb2.SamplingOverrides()
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed + round_
    return worker_pb2.RunWorkerEpisodeRequest(
        episode_id=f"canary-{uuid.uuid4().hex}",
        question_id=question.query_id,
        branch=worker_pb2.BranchTask(
            description="canary evaluation", prompt=template.format(question=question.query)
        ),
        sampling=sampling,
        budget=common_pb2.BudgetOverrides(**(budget or {})),
        gold_answer=question.answer,
    )


async def grade(
    client: httpx.AsyncClient, judge: str, items: list[dict[str, str]], *, backoff: float = 1.0
) -> list[dict[str, Any]]:
    """The judge's answer verdicts for `items`, in order (retried while it is busy or away)."""
    if not items:
        return []
    last = ""
    for attempt in range(JUDGE_ATTEMPTS):
        try:
            r = await client.post(f"{judge}/v1/grade/batch", json={"items": items})
            if r.status_code == 200:
                return list(r.json()["items"])
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code not in (429, 500, 502, 503, 504):
                break
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(min(backoff * 2**attempt, 30))
    raise RuntimeError(f"the judge at {judge} did not grade the canary slice ({last})")


async def evaluate_slice(
    replicas: Sequence[ReplicaStatus],
    version: str,
    questions: Sequence[EvalQuestion],
    *,
    judge: str,
    rounds: int,
    template: str,
    temperature: float | None,
    seed: int | None,
    timeout: float,
    concurrency: int,
    budget: dict[str, int] | None = None,
    on_episode: Callable[[], None] = lambda: None,
) -> SliceResult:
    """Run the slice on `replicas` only and grade it; episodes that fail count as incorrect."""
    started = time.perf_counter()
    result = SliceResult(version, [r.url for r in replicas])
    pool = WorkerPool(
        [r.grpc_address or "" for r in replicas],
        attempts=len(replicas) + 1,
        timeout_seconds=timeout,
        full_wait_seconds=timeout,
    )
    gate = asyncio.Semaphore(concurrency)
    keys = [(q, r) for q in questions for r in range(rounds)]

    async def one(question: EvalQuestion, round_: int) -> Any:
        async with gate:
            outcome = await pool.run(
                task_request(question, round_, template, temperature=temperature, seed=seed, budget=budget)
            )
        on_episode()
        return outcome

    try:
        outcomes = await asyncio.gather(*(one(q, r) for q, r in keys))
    finally:
        await pool.close()
    items, graded_keys = [], []
    for (question, round_), outcome in zip(keys, outcomes, strict=True):
        key = (question.query_id, round_)
        if outcome.response is None:
            result.failed[key] = outcome.error
            result.correct[key] = False
            continue
        for turn in outcome.response.trajectory.turns:
            result.versions_seen[turn.weight_version] = result.versions_seen.get(turn.weight_version, 0) + 1
        report = outcome.response.report
        items.append(
            {
                "question": question.query,
                "response": response_text(report.answer, report.explanation, report.confidence),
                "correct_answer": question.answer,
            }
        )
        graded_keys.append(key)
    async with httpx.AsyncClient(timeout=timeout) as client:
        verdicts = await grade(client, judge, items)
    for key, verdict in zip(graded_keys, verdicts, strict=True):
        if verdict.get("correct") is None:
            result.ungraded[key] = str(verdict.get("error") or "the judge could not parse its verdict")
        else:
            result.correct[key] = bool(verdict["correct"])
    result.seconds = time.perf_counter() - started
    return result


@dataclass
class Verdict:
    passed: bool
    reason: str
    paired: dict[str, Any] | None = None


def decide(
    canary: SliceResult,
    baseline: SliceResult | None,
    *,
    min_accuracy: float | None,
    max_drop_pp: float | None,
) -> Verdict:
    """Pass or fail, with the reason in one line. Episodes that ran on another version fail it."""
    strays = {v: n for v, n in canary.versions_seen.items() if v != canary.version}
    if strays:
        return Verdict(False, f"canary episodes ran on other weight versions too: {strays}")
    if baseline is not None:
        strays = {v: n for v, n in baseline.versions_seen.items() if v != baseline.version}
        if strays:
            return Verdict(False, f"baseline episodes ran on other weight versions: {strays}")
    if canary.graded == 0:
        return Verdict(False, "the judge graded none of the canary's episodes")
    if min_accuracy is not None:
        ok = canary.accuracy >= min_accuracy
        return Verdict(
            ok,
            f"canary accuracy {canary.right}/{canary.graded} = {100 * canary.accuracy:.1f}% "
            f"{'>=' if ok else '<'} the required {100 * min_accuracy:.1f}%",
        )
    assert baseline is not None and max_drop_pp is not None
    paired = paired_comparison(canary.correct, baseline.correct)
    paired.pop("by_question", None)
    if paired["n"] == 0:
        return Verdict(False, "no question was graded on both versions", paired)
    # Both accuracies on the same (question, round) pairs, so the drop is a paired difference.
    drop = -paired["delta_pp"]
    ok = drop <= max_drop_pp
    return Verdict(
        ok,
        f"canary {paired['both_correct'] + paired['improved']}/{paired['n']} vs old "
        f"{paired['both_correct'] + paired['regressed']}/{paired['n']} on the same questions: a drop of "
        f"{drop:+.1f} pp, {'within' if ok else 'over'} the allowed {max_drop_pp:g} pp "
        f"({paired['improved']} improved, {paired['regressed']} regressed, "
        f"McNemar p={paired['mcnemar_p']:.3g})",
        paired,
    )


@dataclass
class CanaryReport:
    plan: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    canary: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None
    verdict: dict[str, Any] | None = None
    decision: Decision = "failed"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def step_rows(step: str, results: list[ReplicaResult]) -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "replica": r.url,
            "state": r.state,
            "weight_version": r.weight_version,
            "previous": r.previous_version,
            "seconds": r.seconds,
            "error": r.error,
        }
        for r in results
    ]


async def run_canary(
    plan: CanaryPlan,
    questions: Sequence[EvalQuestion],
    *,
    token: str,
    judge: str,
    min_accuracy: float | None,
    max_drop_pp: float | None,
    rounds: int = 1,
    template: str,
    temperature: float | None = None,
    seed: int | None = None,
    budget: dict[str, int] | None = None,
    timeout: float = 600.0,
    concurrency: int = 4,
    say: Callable[[str], None] = print,
    on_reload: Callable[[ReplicaProgress], None] | None = None,
    on_episode: Callable[[str], None] = lambda _side: None,
) -> CanaryReport:
    """Steps 2–5 of the module docstring; every step in the report, the decision last."""
    report = CanaryReport(
        plan={
            "checkpoint": plan.checkpoint_on_workers,
            "version": plan.version,
            "old_version": plan.old_version,
            "rollback_checkpoint": plan.rollback_checkpoint,
            "canaries": [s.url for s in plan.canaries],
            "others": [s.url for s in plan.others],
            "questions": len(questions),
            "rounds": rounds,
            "budget": budget or {},
            "temperature": temperature,
            "min_accuracy": min_accuracy,
            "max_drop_pp": max_drop_pp,
        }
    )
    canary_urls = [s.url for s in plan.canaries]

    async def roll(step: str, urls: list[str], checkpoint: str, version: str) -> list[ReplicaResult]:
        results = await rolling_reload(
            urls, checkpoint, version, token, timeout=timeout, on_progress=on_reload, canary_step=step
        )
        report.steps.extend(step_rows(step, results))
        return results

    async def rollback(why: str, urls: list[str] | None = None) -> CanaryReport:
        say(f"rolling back the canaries to {plan.old_version!r} from {plan.rollback_checkpoint}: {why}")
        results = await roll("rollback", urls or canary_urls, plan.rollback_checkpoint, plan.old_version)
        bad = [r for r in results if r.state != "reloaded"]
        report.decision = "failed" if bad else "rolled back"
        if bad:
            say(
                "ROLLBACK FAILED: "
                + "; ".join(f"{r.url} serves {r.weight_version!r} ({r.error or r.state})" for r in bad)
                + f"; reload them by hand: bcstack worker reload --checkpoint {plan.rollback_checkpoint} "
                f"--weight-version {plan.old_version} --workers {','.join(r.url for r in bad)}"
            )
        return report

    total = len(canary_urls) + len(plan.others)
    say(f"canary: {len(canary_urls)} of {total} replica(s) load {plan.version!r}")
    results = await roll("canary", canary_urls, plan.checkpoint_on_workers, plan.version)
    failed = next((r for r in results if r.state == "failed"), None)
    if failed is not None:
        report.verdict = asdict(Verdict(False, f"canary reload failed on {failed.url}: {failed.error}"))
        # The canaries the roll reached (the failed one may be half-way); the skipped ones were never touched.
        return await rollback(
            f"the canary reload failed on {failed.url}", [r.url for r in results if r.state != "skipped"]
        )

    baseline_replicas = plan.others if max_drop_pp is not None else []
    say(
        f"evaluating {len(questions)} question(s) × {rounds} round(s) on the canaries"
        + (
            f" and, paired, on {len(baseline_replicas)} replica(s) still on {plan.old_version!r}"
            if baseline_replicas
            else ""
        )
    )

    def slice_of(replicas: list[ReplicaStatus], version: str, side: str) -> Any:
        return evaluate_slice(
            replicas,
            version,
            questions,
            judge=judge,
            rounds=rounds,
            template=template,
            temperature=temperature,
            seed=seed,
            timeout=timeout,
            concurrency=concurrency,
            budget=budget,
            on_episode=lambda: on_episode(side),
        )

    try:
        if baseline_replicas:
            canary, baseline = await asyncio.gather(
                slice_of(plan.canaries, plan.version, "canary"),
                slice_of(baseline_replicas, plan.old_version, "baseline"),
            )
        else:
            canary, baseline = await slice_of(plan.canaries, plan.version, "canary"), None
    except RuntimeError as e:  # the judge is down: no decision can be made, so the old weights win
        report.verdict = asdict(Verdict(False, str(e)))
        return await rollback(str(e))
    report.canary = canary.summary()
    report.baseline = baseline.summary() if baseline is not None else None
    verdict = decide(canary, baseline, min_accuracy=min_accuracy, max_drop_pp=max_drop_pp)
    report.verdict = asdict(verdict)
    say(f"{'PASS' if verdict.passed else 'FAIL'}: {verdict.reason}")
    if not verdict.passed:
        return await rollback(verdict.reason)

    others = [s.url for s in plan.others]
    if others:
        say(f"promoting {plan.version!r} to the other {len(others)} replica(s)")
        results = await roll("promote", others, plan.checkpoint_on_workers, plan.version)
        failed = next((r for r in results if r.state == "failed"), None)
        if failed is not None:
            report.decision = "failed"
            say(
                f"PROMOTION STOPPED at {failed.url}: {failed.error}; the canaries serve {plan.version!r}, "
                "the rest as the table shows; rerun the reload (without --canary) to finish"
            )
            return report
    report.decision = "promoted"
    return report
