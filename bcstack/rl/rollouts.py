"""Rollouts for the RL loop: one question group through the live stack, graded by the judge service.

    client = StackClient(gateway_url, judge_url)
    rollout = await client.rollout(group, episode_ids, policy_version=3)

`rollout` submits the group's episodes to the coordinator gateway concurrently (POST /v1/episodes
with `group_id`, deterministic `episode_id`s and the gold answer), reads each typed record back
(GET /v1/episodes/{id}, `core.records.EpisodeRecord`), then grades every final answer with the
judge's answer grader and every worker report with its contribution grader, in two batch calls
(POST /v1/grade/batch, /v1/grade/contribution/batch).

Grades that fail are not zeros: an answer the judge could not parse (`correct: null`) excludes
its episode from the update, with the reason; a contribution it could not parse leaves that worker
with the episode term of its advantage only (`trainer.advantages`). A judge that is down (HTTP 503,
no connection) is retried with backoff; after `judge_attempts` tries `JudgeDown` ends the run
rather than training on missing rewards.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bcstack.gateway_client import GatewayError, run_episode
from bcstack.rl.sampler import Group
from core.grading import response_text
from core.records import EpisodeGrades, EpisodeRecord

VERSION_PREFIX = "rl-u"
_VERSION_RE = re.compile(rf"^{re.escape(VERSION_PREFIX)}(\d+)$")


class RolloutError(RuntimeError):
    """The gateway failed in a way the loop cannot wait out (a bad request, a broken record)."""


class JudgeDown(RolloutError):
    """The judge did not answer after every retry: the run stops instead of training on no rewards."""


def weight_version(update: int) -> str:
    """The weight version the loop gives the policy after `update` updates (`rl-u0` is the start)."""
    return f"{VERSION_PREFIX}{update}"


def version_index(version: str) -> int | None:
    """`rl-u7` -> 7; None for a version the loop did not name (the engine's own, before the run)."""
    match = _VERSION_RE.match(version or "")
    return int(match.group(1)) if match else None


@dataclass
class GroupRollout:
    """One group's episodes, graded; `rewards` holds only the episodes that can be trained on."""

    group: Group
    submitted_version: int
    records: list[EpisodeRecord]
    rewards: dict[str, float] = field(default_factory=dict)
    contributions: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)  # episode id -> why it cannot be trained on
    seconds: float = 0.0

    def oldest_version(self) -> int:
        """The oldest policy version any turn of the group ran on; -1 for a turn on a version the
        loop did not set (a replica that missed a reload), which makes the group stale."""
        versions = [
            version_index(version)
            for record in self.records
            for worker in record.workers
            if worker.trajectory is not None
            for turn in worker.trajectory.turns
            for version in turn.weight_versions or (turn.weight_version,)
        ]
        if any(v is None for v in versions):
            return -1
        return min((v for v in versions if v is not None), default=self.submitted_version)

    @property
    def zero_variance(self) -> bool:
        """Every trainable episode got the same reward: group-centred advantages are all zero."""
        return len(set(self.rewards.values())) <= 1

    def rollout_tokens(self) -> int:
        return sum(
            len(w.trajectory.token_ids) for r in self.records for w in r.workers if w.trajectory is not None
        )


class StackClient:
    """The gateway and the judge over HTTP, with the waits a shared stack needs (429, restarts)."""

    def __init__(
        self,
        gateway: str,
        judge: str,
        *,
        worker_budget: dict[str, int] | None = None,
        worker_sampling: dict[str, float] | None = None,
        overrides: dict[str, Any] | None = None,
        judge_attempts: int = 5,
        judge_backoff_seconds: float = 1.0,
        timeout: float = 3600.0,
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self.judge = judge.rstrip("/")
        self.worker_budget = worker_budget or {}
        self.worker_sampling = worker_sampling or {}
        self.overrides = overrides or {}
        self.judge_attempts = judge_attempts
        self.judge_backoff_seconds = judge_backoff_seconds
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def episode(self, body: dict[str, Any]) -> EpisodeRecord:
        """Run one episode and return its stored record; a full or restarting gateway is waited for."""
        try:
            return await run_episode(self.client, self.gateway, body)
        except GatewayError as exc:
            raise RolloutError(str(exc)) from None

    async def _judge(self, path: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not items:
            return []
        last = ""
        for attempt in range(self.judge_attempts):
            try:
                r = await self.client.post(f"{self.judge}{path}", json={"items": items})
                if r.status_code == 200:
                    return list(r.json()["items"])
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code not in (429, 500, 502, 503, 504):
                    raise JudgeDown(f"the judge at {self.judge} refused {path}: {last}")
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(min(self.judge_backoff_seconds * 2**attempt, 30))
        raise JudgeDown(
            f"the judge at {self.judge} did not grade after {self.judge_attempts} tries ({last}); "
            "stopping rather than training on missing rewards"
        )

    async def rollout(self, group: Group, episode_ids: Sequence[str], policy_version: int) -> GroupRollout:
        started = time.perf_counter()
        q = group.question
        bodies = [
            {
                "question": q.query,
                "question_id": q.query_id,
                "gold_answer": q.answer,
                "group_id": group.group_id,
                "episode_id": episode_id,
                **({"worker_budget": self.worker_budget} if self.worker_budget else {}),
                **({"worker_sampling": self.worker_sampling} if self.worker_sampling else {}),
                **({"overrides": self.overrides} if self.overrides else {}),
            }
            for episode_id in episode_ids
        ]
        records = list(await asyncio.gather(*(self.episode(b) for b in bodies)))
        result = GroupRollout(group, policy_version, records)

        answers = await self._judge(
            "/v1/grade/batch",
            [
                {
                    "question": q.query,
                    "response": response_text(r.answer, r.explanation, r.confidence),
                    "correct_answer": q.answer,
                }
                for r in records
            ],
        )
        for record, verdict in zip(records, answers, strict=True):
            record.grades = EpisodeGrades(
                correct=verdict.get("correct"),
                grader_version=str(verdict.get("grader_version") or ""),
                parse_error=bool(verdict.get("parse_error")),
                extracted_final_answer=str(verdict.get("extracted_final_answer") or ""),
            )
            if record.grades.reward is None:
                why = "the judge could not parse its verdict" if record.grades.parse_error else "ungraded"
                result.excluded[record.episode_id] = why
            else:
                result.rewards[record.episode_id] = record.grades.reward

        workers = [
            (record, worker)
            for record in records
            if record.episode_id in result.rewards
            for worker in record.workers
            if worker.trajectory is not None
        ]
        scores = await self._judge(
            "/v1/grade/contribution/batch",
            [
                {
                    "question": q.query,
                    "task": worker.prompt or worker.description,
                    "report": worker.report_text(),
                    "final_answer": record.answer,
                    "gold_answer": q.answer,
                }
                for record, worker in workers
            ],
        )
        for (_, worker), verdict in zip(workers, scores, strict=True):
            score = None if verdict.get("parse_error") else verdict.get("score")
            worker.contribution = None if score is None else float(score)
            if worker.contribution is not None:
                result.contributions[worker.episode_id] = worker.contribution
        result.seconds = time.perf_counter() - started
        return result
