"""`bcstack eval run`: evaluation rounds through the coordinator gateway, graded by the judge proxy.

For each question and round: one coordinator episode (`POST /v1/episodes` on the gateway, with a
deterministic `episode_id`), its grade (`POST /v1/grade` on the judge: the final answer in the
BrowseComp answer format against the gold answer), and three files, written in this order:
`episodes/<round>/<query_id>.json` (the full episode record), `runs/<round>/<query_id>.json` (the
BrowseComp-Plus run file) and one line of `judgements.jsonl` (appended, flushed and fsynced).

Seeds (`--seed`): each (question, round) episode samples with its own seed, derived from the run's
seed, the question id and the round (the gateway gives each branch, and the worker each turn, a seed
derived from it in turn). Two runs of two models with one --seed draw the same uniforms token by
token until their trajectories part: common random numbers, which leave each run's accuracy an
unbiased estimate and cut part of the discordant pairs that sampling noise alone makes (on the
speedrun's dev run, 51 to 45: docs/research/speedrun.md). Without --seed every draw is fresh entropy.

Resume: a (question, round) with a judgement line is done and is never redone. One without is run
again with the same episode id, so an episode that finished on the gateway before the runner was
killed comes back from the gateway's records instead of being run twice. Episodes that end on a
budget, a limit or an error are written and graded like any other: the denominator is always
questions × rounds.

Outages: a gateway or judge that cannot be reached (crashed, restarting) is waited for, up to
`service_wait` seconds per outage; the episode is then asked for again under the same id (the
gateway answers a recorded one from its records and runs an unrecorded one, lost with the crashed
gateway, afresh), and the grade is asked for again. A service still away after that stops the run
with an EvalRunError, never a made-up verdict: what is recorded stays, and the same command resumes.
Outages below the gateway (worker, engine, retrieval) are waited out there (the gateway's
`worker_wait_seconds`, the worker's `engine_wait_seconds` / `retrieval_wait_seconds`);
an episode one of them outlasted ends as it did, and its run file and judgement carry the failure
in `error`, naming the service. The judgement's `confidence` is null when the episode stated none (it never
called finish), so that the report leaves it out of the calibration error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bcstack.evaluation.loaders import EvalQuestion
from bcstack.gateway_client import GatewayError, run_episode
from core.engine_client import derive_seed
from core.grading import response_confidence, response_text
from core.records import (
    EVENT_FINISH_WITHOUT_SEARCH,
    EVENT_FINISH_WITHOUT_SEARCH_BOUNCED,
    EpisodeGrades,
    EpisodeRecord,
)

JUDGEMENTS = "judgements.jsonl"
META = "eval.json"
GRADE_ATTEMPTS = 5  # for a judge that answers 429/503 (busy); one that is away gets `service_wait`
SERVICE_WAIT_SECONDS = 120.0
ID_SAFE = re.compile(r"[^A-Za-z0-9._:-]+")


class EvalRunError(RuntimeError):
    """A run that cannot go on (gateway or judge unreachable, an out dir of another run)."""


@dataclass(frozen=True)
class Task:
    question: EvalQuestion
    round: int


def run_file(record: EpisodeRecord, query_id: str) -> dict[str, Any]:
    """A BrowseComp-Plus run file from an episode record."""
    counts: Counter[str] = Counter()
    retrieved: list[str] = []
    for worker in record.workers:
        for call in worker.trajectory.tool_calls if worker.trajectory else []:
            counts[call.name] += 1
            if call.name == "search":
                retrieved += [d for d in call.docids if d not in retrieved]
    counts["branch"] = len(record.workers)
    output = response_text(record.answer, record.explanation, record.confidence)
    return {
        "query_id": query_id,
        "tool_call_counts": dict(counts),
        "status": record.status,
        "error": failure_of(record),
        "retrieved_docids": retrieved,
        "result": [{"type": "output_text", "output": output}],
        "episode_id": record.episode_id,
        "endpoint": record.endpoint,
        "weight_versions": record.weight_versions,
    }


def guard_of(record: EpisodeRecord) -> str | None:
    """ "bounced" when a worker's search-free answer was sent back because it matched the gold answer
    (the worker then knew it was right), else "voided" when one was given up, else None."""
    events = {e for w in record.workers if w.trajectory is not None for e in w.trajectory.events}
    if EVENT_FINISH_WITHOUT_SEARCH_BOUNCED in events:
        return "bounced"
    return "voided" if EVENT_FINISH_WITHOUT_SEARCH in events else None


def failure_of(record: EpisodeRecord) -> str:
    """What failed in an episode, in one line that names the service ("" when nothing did): the
    episode's own error (the coordinator LLM, a limit) and each failed branch's (the worker, or the
    engine or retrieval service behind it). An episode a kill disrupted beyond the services' waits
    says so here even when the coordinator went on to finish."""
    parts = [record.error] if record.error else []
    for w in record.workers:
        if w.status == "error" and w.error:
            # No trajectory: the worker service itself never answered (the gateway's pool says why).
            where = "" if w.trajectory is not None else "worker service: "
            parts.append(f"branch {w.branch}: {where}{w.error}")
    return "; ".join(dict.fromkeys(parts))[:1000]


def judgement_confidence(response: str, grade: dict[str, Any]) -> float | None:
    """The confidence (0-100) a judgement records: the judge's reading of the one the response
    states, the response's own when the judge gave none (ungraded), and None when it states none.

    The judge's value alone cannot tell "none stated": the answer template has an LLM judge write
    100 for a response without a confidence. An unstated one recorded as a number would put every
    unfinished episode into the calibration error at a confidence nobody gave.
    """
    stated = response_confidence(response)
    if stated is None:
        return None
    judged = grade.get("confidence")
    return stated if judged is None else float(judged)


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def run_file_name(query_id: str) -> str:
    safe = ID_SAFE.sub("_", query_id)
    if safe != query_id:  # keep distinct ids distinct after sanitizing
        safe += "-" + hashlib.sha256(query_id.encode()).hexdigest()[:8]
    return safe


def done_pairs(out: Path) -> set[tuple[str, int]]:
    """(query_id, round) pairs with a judgement line; a torn last line (a kill mid-write) is ignored."""
    path = out / JUDGEMENTS
    done: set[tuple[str, int]] = set()
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            done.add((str(row["query_id"]), int(row["round"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


def _repair_judgements(out: Path) -> None:
    """Drop a torn last line so the next append starts on a line of its own."""
    path = out / JUDGEMENTS
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


class EvalRunner:
    def __init__(
        self,
        out: Path,
        gateway: str,
        judge: str,
        *,
        concurrency: int = 8,
        episode_timeout: float = 3600.0,
        overrides: dict[str, Any] | None = None,
        worker_budget: dict[str, Any] | None = None,
        worker_gold: bool = True,
        service_wait: float = SERVICE_WAIT_SECONDS,
        seed: int | None = None,
    ) -> None:
        self.out = out
        self.service_wait = service_wait
        self.gateway = gateway.rstrip("/")
        self.judge = judge.rstrip("/")
        self.concurrency = concurrency
        self.episode_timeout = episode_timeout
        self.overrides = overrides or {}
        self.worker_budget = worker_budget or {}
        self.worker_gold = worker_gold
        self.seed = seed
        self._lock = asyncio.Lock()

    def prepare(self, questions: list[EvalQuestion], rounds: int) -> tuple[str, list[Task]]:
        """The run id (kept across resumes) and the tasks not done yet."""
        self.out.mkdir(parents=True, exist_ok=True)
        meta_path = self.out / META
        ids = [q.query_id for q in questions]
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if meta.get("query_ids") != ids:
                raise EvalRunError(
                    f"{self.out} holds a run over other questions ({len(meta.get('query_ids', []))}); "
                    "use another --out"
                )
            rounds = max(rounds, int(meta.get("rounds", rounds)))
            if meta.get("seed") != self.seed:
                raise EvalRunError(
                    f"{self.out} was started with seed {meta.get('seed')}, not {self.seed}; resume it with "
                    "the same --seed, or use another --out"
                )
        else:
            meta = {"run_id": uuid.uuid4().hex[:12], "query_ids": ids, "seed": self.seed}
        meta["rounds"] = rounds
        meta.update(
            gateway=self.gateway, judge=self.judge, overrides=self.overrides, worker_budget=self.worker_budget
        )
        _write_json(meta_path, meta)
        _write_json_lines(
            self.out / "questions.jsonl",
            [
                {
                    "query_id": q.query_id,
                    "query": q.query,
                    "answer": q.answer,
                    "tier": q.tier,
                    "evidence_docs": list(q.evidence_docs),
                    "gold_docs": list(q.gold_docs),
                }
                for q in questions
            ],
        )
        _repair_judgements(self.out)
        done = done_pairs(self.out)
        tasks = [Task(q, r) for r in range(rounds) for q in questions if (q.query_id, r) not in done]
        return meta["run_id"], tasks

    async def run(
        self, run_id: str, tasks: list[Task], on_done: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=self.concurrency * 2 + 4)
        timeout = httpx.Timeout(self.episode_timeout, connect=10.0)
        queue: asyncio.Queue[Task] = asyncio.Queue()
        for task in tasks:
            queue.put_nowait(task)
        results: list[dict[str, Any]] = []
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

            async def worker() -> None:
                while not queue.empty():
                    task = queue.get_nowait()
                    row = await self._one(client, run_id, task)
                    results.append(row)
                    if on_done is not None:
                        on_done(row)

            await asyncio.gather(*(worker() for _ in range(max(1, self.concurrency))))
        return results

    async def _one(self, client: httpx.AsyncClient, run_id: str, task: Task) -> dict[str, Any]:
        q, rnd = task.question, task.round
        episode_id = f"eval-{run_id}-{run_file_name(q.query_id)}-r{rnd}"[:128]
        body: dict[str, Any] = {
            "question": q.query,
            "question_id": q.query_id,
            "gold_answer": q.answer,
            "episode_id": episode_id,
        }
        if self.overrides:
            body["overrides"] = self.overrides
        if self.worker_budget:
            body["worker_budget"] = self.worker_budget
        if not self.worker_gold:
            body["worker_gold"] = False
        if self.seed is not None:
            body["worker_sampling"] = {"seed": derive_seed(self.seed, q.query_id, rnd)}
        record = await self._episode(client, body)
        response = response_text(record.answer, record.explanation, record.confidence)
        grade = await self._grade(client, q.query, response, q.answer)
        record.grades = EpisodeGrades(
            correct=grade.get("correct"),
            grader_version=str(grade.get("grader_version") or ""),
            parse_error=bool(grade.get("parse_error")),
            extracted_final_answer=str(grade.get("extracted_final_answer") or ""),
        )
        name = run_file_name(q.query_id)
        _write_json(self.out / "episodes" / str(rnd) / f"{name}.json", record.dump())
        _write_json(self.out / "runs" / str(rnd) / f"{name}.json", run_file(record, q.query_id))
        row = {
            "query_id": q.query_id,
            "round": rnd,
            "tier": q.tier,
            "correct": grade.get("correct"),
            "confidence": judgement_confidence(response, grade),
            "status": record.status,
            "error": failure_of(record),
            "episode_id": record.episode_id or episode_id,
            "grader_version": grade.get("grader_version"),
            "grading_error": grade.get("error"),
            "seconds": record.seconds,
            "guard": guard_of(record),
        }
        async with self._lock:  # whole lines, in completion order, durable before the next
            with (self.out / JUDGEMENTS).open("a") as f:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return row

    async def _episode(self, client: httpx.AsyncClient, body: dict[str, Any]) -> EpisodeRecord:
        """The episode's full record; a gateway that is full (429) or briefly away is waited for."""
        try:
            return await run_episode(
                client, self.gateway, body, full_attempts=30, unreachable_wait_s=self.service_wait
            )
        except GatewayError as exc:
            raise EvalRunError(str(exc)) from None

    async def _grade(
        self, client: httpx.AsyncClient, question: str, response: str, gold: str
    ) -> dict[str, Any]:
        """The judge's verdict; an ungraded one (counted as incorrect) when the judge answers an error,
        or stays busy (429/503) for GRADE_ATTEMPTS tries. EvalRunError when it is unreachable for
        longer than `service_wait`: a verdict it never gave is not recorded."""
        last = ""
        busy = away = 0
        loop = asyncio.get_running_loop()
        away_since: float | None = None
        while True:
            try:
                r = await client.post(
                    f"{self.judge}/v1/grade",
                    json={"question": question, "response": response, "correct_answer": gold},
                )
            except httpx.TransportError as e:
                last = str(e) or type(e).__name__
                away_since = loop.time() if away_since is None else away_since
                if loop.time() - away_since >= self.service_wait:
                    raise EvalRunError(
                        f"the judge {self.judge} was unreachable for {loop.time() - away_since:.0f} s: {last}"
                    ) from None
                away += 1
                await asyncio.sleep(min(0.25 * 2**away, 5))
                continue
            away, away_since = 0, None
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            busy += 1
            if r.status_code not in (429, 503) or busy >= GRADE_ATTEMPTS:
                break
            await asyncio.sleep(min(2**busy, 10))
        return {"correct": None, "confidence": None, "error": f"the judge could not grade: {last}"}


def _write_json_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
