"""Rollout data for the trainer: episode records (DESIGN.md §4) turned into validated samples.

The coordinator gateway stores one typed record per episode (`core.records.EpisodeRecord`), each
with its workers' trajectories: token ids, a loss mask (1 on tokens the worker model generated),
and one rollout log-prob per generated token. The record's own validation is the edge: a
trajectory that breaks an invariant is rejected there with its one-line reason. The trainer
learns from worker trajectories only, so a `Sample` is one worker trajectory plus the ids and
rewards that place it in its GRPO group.

    samples, counts = load_samples(Path("coordinator-records.sqlite"), rewards={"e1": 1.0})
    groups = group_samples(samples)

A trajectory that cannot be trained on correctly (lengths that disagree, a log-prob that is not a
log-probability, ...) is rejected with a `SampleError` naming the episode, the worker and the fault,
never silently repaired: a shifted mask would train on the wrong tokens without any visible error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.records import EpisodeRecord, RecordError, load_lenient

logger = logging.getLogger(__name__)

MIXED_VERSION_POLICIES = ("keep", "drop", "error")
_SQLITE_MAGIC = b"SQLite format 3\x00"


class SampleError(ValueError):
    """A worker trajectory that must not be trained on; the message names episode, worker and fault."""


@dataclass(frozen=True)
class Sample:
    """One worker trajectory, ready to pack.

    `rollout_logprobs` is aligned to `token_ids` (the record stores one value per generated token
    only): position t holds the engine's log-prob of token t where `loss_mask[t] == 1`, and 0.0 where
    `loss_mask[t] == 0`. Aligned lists pack and slice together with the tokens; the 0.0 fillers are
    never read because every use is multiplied by the loss mask.
    """

    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    group_id: str
    episode_id: str
    worker_episode_id: str
    question_id: str
    episode_reward: float | None
    contribution: float | None
    # Distinct engine weight versions of the trajectory's turns, in order of first use; more than one
    # means the engine was hot-reloaded mid-episode.
    weight_versions: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def mixed_versions(self) -> bool:
        return len(self.weight_versions) > 1


# --- one record ------------------------------------------------------------------------------------


@dataclass
class RecordSamples:
    """What one record gives the trainer: samples, rejected trajectories, and counts."""

    samples: list[Sample]
    errors: list[SampleError]
    trajectories: int = 0
    skipped_failed: int = 0
    dropped_mixed: int = 0


def read_record(
    data: Mapping[str, Any] | EpisodeRecord,
    reward: float | None,
    contributions: Mapping[str, float] | None,
    mixed_versions: str,
) -> RecordSamples:
    """A record's samples and rejections (see `samples_from_record` for rewards and contributions)."""
    if mixed_versions not in MIXED_VERSION_POLICIES:
        raise ValueError(
            f"mixed_versions must be one of {', '.join(MIXED_VERSION_POLICIES)}, got {mixed_versions!r}"
        )
    # The typed record is the edge: its invariants (core.records) are checked here, per trajectory,
    # so one broken trajectory is rejected with its reason and its siblings still train.
    if isinstance(data, EpisodeRecord):
        record, rejections = data, []
    else:
        try:
            record, rejections = load_lenient(data)
        except RecordError as exc:
            raise SampleError(str(exc)) from None
    rejected = {r.index: r for r in rejections}
    episode_id = record.episode_id
    question_id = record.question_id or ""
    group_id = record.group_id or question_id
    if reward is None and record.grades is not None:
        reward = record.grades.reward
    result = RecordSamples(samples=[], errors=[])
    for index, worker in enumerate(record.workers):
        worker_id = worker.episode_id or f"#{index}"
        where = f"episode {episode_id or '?'}, worker {worker_id}"
        if index in rejected:
            result.trajectories += 1
            result.errors.append(SampleError(f"{where}: {rejected[index].reason}"))
            continue
        trajectory = worker.trajectory
        if trajectory is None:  # a failed branch: no worker response came back
            result.skipped_failed += 1
            continue
        result.trajectories += 1
        if not trajectory.token_ids:
            result.errors.append(SampleError(f"{where}: empty trajectory (no token ids)"))
            continue
        versions = trajectory.weight_versions
        if len(versions) > 1 and mixed_versions != "keep":
            if mixed_versions == "drop":
                result.dropped_mixed += 1
            else:
                result.errors.append(
                    SampleError(f"{where}: turns ran on several weight versions ({', '.join(versions)})")
                )
            continue
        if contributions is not None and worker_id in contributions:
            contribution: float | None = float(contributions[worker_id])
        else:
            contribution = worker.contribution
        result.samples.append(
            Sample(
                token_ids=list(trajectory.token_ids),
                loss_mask=list(trajectory.loss_mask),
                rollout_logprobs=trajectory.aligned_logprobs(),
                group_id=group_id,
                episode_id=episode_id,
                worker_episode_id=worker_id,
                question_id=question_id,
                episode_reward=reward,
                contribution=contribution,
                weight_versions=versions,
            )
        )
    return result


def samples_from_record(
    record: Mapping[str, Any] | EpisodeRecord,
    *,
    reward: float | None = None,
    contributions: Mapping[str, float] | None = None,
    mixed_versions: str = "keep",
) -> list[Sample]:
    """One Sample per worker trajectory of an episode record, in the record's worker order.

    Workers whose trajectory is None (failed branches) are skipped. The group is the record's
    `group_id`, or its `question_id` when it has none. The episode reward is `reward`, else the
    record's judge grade (`grades`), else None; a worker's contribution is `contributions[worker episode id]`,
    else the worker entry's `contribution`, else None.

    `mixed_versions` decides about trajectories whose turns ran on more than one weight version (a
    hot reload mid-episode): "keep" them, "drop" them, or "error" (reject them like invalid data).
    Raises SampleError for the first trajectory that is rejected.
    """
    result = read_record(record, reward, contributions, mixed_versions)
    if result.errors:
        raise result.errors[0]
    return result.samples


# --- files of records --------------------------------------------------------------------------------


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON episode record ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield f"{path}:{number}", record


def _sqlite_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    from core.record_store import SqliteRecordStore

    with SqliteRecordStore(path) as store:
        # list() is newest first; the trainer reads in the order episodes finished.
        summaries = store.list(limit=store.count())
        for summary in reversed(summaries):
            record = store.get(summary["episode_id"])
            if record is not None:
                yield f"{path} episode {summary['episode_id']}", record


def read_records(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    if not path.is_file():
        raise FileNotFoundError(f"no episode records at {path}")
    with path.open("rb") as handle:
        magic = handle.read(len(_SQLITE_MAGIC))
    return _sqlite_records(path) if magic == _SQLITE_MAGIC else _jsonl_records(path)


def load_samples(
    path: Path,
    *,
    rewards: Mapping[str, float] | None = None,
    contributions: Mapping[str, float] | None = None,
    mixed_versions: str = "keep",
    strict: bool = True,
    on_reject: Callable[[SampleError], None] | None = None,
) -> tuple[list[Sample], dict[str, int]]:
    """Samples from a file of episode records, and counts of what happened to every trajectory.

    `path` is a JSONL file (one episode record per line) or the coordinator's SQLite record file
    (`core.record_store.RecordStore`), told apart by the SQLite header. `rewards` maps
    episode id to episode reward (records without an entry use their own `reward`, or None);
    `contributions` maps worker episode id to contribution score.

    With `strict` (the default) the first rejected trajectory raises its SampleError. Without it,
    rejected trajectories are left out and reported: each SampleError is logged as a warning and
    passed to `on_reject`; the rest of that record's trajectories are still used.

    Counts: `records`; `trajectories` (worker trajectories present); `skipped_failed` (workers with
    no trajectory); `dropped_mixed`; `rejected`; `samples`. Always
    trajectories == samples + dropped_mixed + rejected.
    """
    path = Path(path)
    counts = dict.fromkeys(
        ("records", "trajectories", "skipped_failed", "dropped_mixed", "rejected", "samples"), 0
    )
    samples: list[Sample] = []
    for origin, record in read_records(path):
        episode_reward = rewards.get(str(record.get("episode_id"))) if rewards is not None else None
        result = read_record(record, episode_reward, contributions, mixed_versions)
        if result.errors and strict:
            raise SampleError(f"{origin}: {result.errors[0]}")
        counts["records"] += 1
        counts["trajectories"] += result.trajectories
        counts["skipped_failed"] += result.skipped_failed
        counts["dropped_mixed"] += result.dropped_mixed
        counts["rejected"] += len(result.errors)
        counts["samples"] += len(result.samples)
        samples.extend(result.samples)
        for error in result.errors:
            logger.warning("rejected trajectory (%s): %s", origin, error)
            if on_reject is not None:
                on_reject(error)
    return samples, counts


def longest_trajectory(path: Path) -> tuple[int, int]:
    """(tokens, turns) of the longest worker trajectory in a records file (SQLite or JSONL), and the
    most turns any trajectory used; (0, 0) for a file with none."""
    tokens = turns = 0
    for _, record in read_records(Path(path)):
        for worker in record.get("workers", []):
            trajectory = worker.get("trajectory") or {}
            tokens = max(tokens, len(trajectory.get("token_ids", [])))
            turns = max(turns, int(trajectory.get("turns_used", 0)))
    return tokens, turns


def group_samples(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    """Samples by group id: groups in order of first appearance, samples in input order."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return groups
