"""Episode records -> trainer samples: alignment, grouping, rewards, validation, mixed weight versions,
and loading from JSONL and from the coordinator's SQLite record file."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from core.record_store import SqliteRecordStore
from trainer.data import Sample, SampleError, group_samples, load_samples, samples_from_record


def trajectory(turns: list[tuple[int, int, str]], first_id: int = 10) -> dict[str, Any]:
    """A trajectory record of (prompt/observation tokens, generated tokens, weight version) turns."""
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    turn_records = []
    for prompt, generated, version in turns:
        start = len(token_ids)
        token_ids.extend(range(first_id + start, first_id + start + prompt + generated))
        loss_mask.extend([0] * prompt + [1] * generated)
        done = len(logprobs)
        logprobs.extend([-0.1 * (done + i + 1) for i in range(generated)])
        turn_records.append(
            {
                "prompt_start": start,
                "gen_start": start + prompt,
                "gen_end": start + prompt + generated,
                "generated_tokens": generated,
                "weight_version": version,
                "finish_reason": "stop",
            }
        )
    return {
        "token_ids": token_ids,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "turns": turn_records,
        "tool_calls": [],
        "stop_reason": "finish",
        "tokens_used": len(token_ids),
        "turns_used": len(turns),
        "error": "",
    }


def worker(worker_id: str, traj: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "branch": 0,
        "episode_id": worker_id,
        "status": "finished" if traj else "failed",
        "trajectory": traj,
    }


def record(
    episode_id: str = "e1",
    question_id: str = "q1",
    group_id: str = "g1",
    workers: list | None = None,
    **extra: Any,
) -> dict[str, Any]:
    if workers is None:
        workers = [worker(f"{episode_id}-w0", trajectory([(3, 2, "v1"), (2, 3, "v1")]))]
    return {
        "episode_id": episode_id,
        "question_id": question_id,
        "group_id": group_id,
        "status": "finished",
        "workers": workers,
        **extra,
    }


# --- samples_from_record ----------------------------------------------------------------------------


def test_one_aligned_sample_per_worker_trajectory_and_failed_branches_skipped() -> None:
    rec = record(
        workers=[
            worker("w0", trajectory([(3, 2, "v1"), (2, 3, "v1")])),
            worker("w-failed", None),
            worker("w1", trajectory([(4, 1, "v1")], first_id=100)),
        ]
    )
    samples = samples_from_record(rec, reward=1.0, contributions={"w0": 0.25})
    assert [s.worker_episode_id for s in samples] == ["w0", "w1"]
    s0 = samples[0]
    assert s0.token_ids == list(range(10, 20))
    assert s0.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    # The record's five generated-token log-probs land on the five loss_mask == 1 positions, 0.0 elsewhere.
    assert s0.rollout_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5])
    assert len(s0) == 10
    assert (s0.group_id, s0.episode_id, s0.question_id) == ("g1", "e1", "q1")
    assert s0.episode_reward == 1.0
    assert s0.contribution == 0.25
    assert samples[1].contribution is None
    assert s0.weight_versions == ("v1",)
    assert not s0.mixed_versions


def test_group_falls_back_to_question_and_reward_to_the_recorded_grade() -> None:
    rec = record(group_id="", grades={"correct": False, "grader_version": "rule-v1"})
    (sample,) = samples_from_record(rec)
    assert sample.group_id == "q1"
    assert sample.episode_reward == 0.0
    (sample,) = samples_from_record(rec, reward=1.0)
    assert sample.episode_reward == 1.0
    (sample,) = samples_from_record(record())
    assert sample.episode_reward is None


def test_worker_contribution_from_the_record_when_not_given() -> None:
    rec = record(workers=[{**worker("w0", trajectory([(2, 2, "v1")])), "contribution": 0.5}])
    assert samples_from_record(rec)[0].contribution == 0.5
    assert samples_from_record(rec, contributions={"w0": -1.0})[0].contribution == -1.0


def _broken(**changes: Any) -> dict[str, Any]:
    traj = trajectory([(3, 2, "v1"), (2, 3, "v1")])
    traj.update(changes)
    return traj


BASE = trajectory([(3, 2, "v1"), (2, 3, "v1")])


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"token_ids": [], "loss_mask": [], "rollout_logprobs": []}, "empty trajectory"),
        ({"loss_mask": BASE["loss_mask"][:-1]}, "loss_mask has 9 entries for 10 token ids"),
        ({"rollout_logprobs": BASE["rollout_logprobs"][:-1]}, "4 rollout_logprobs for 5 loss_mask==1 tokens"),
        ({"rollout_logprobs": [*BASE["rollout_logprobs"], -0.1]}, "6 rollout_logprobs for 5"),
        ({"rollout_logprobs": [-0.1, 0.5, -0.1, -0.1, -0.1]}, "rollout_logprobs[1] is 0.5"),
        ({"rollout_logprobs": [-0.1, -0.1, math.nan, -0.1, -0.1]}, "rollout_logprobs[2] is nan"),
        ({"rollout_logprobs": [-0.1, -0.1, -0.1, -math.inf, -0.1]}, "rollout_logprobs[3] is -inf"),
        ({"loss_mask": [0, 0, 0, 1, 2, 0, 0, 1, 1, 1]}, "loss_mask value at position 4 is 2"),
        ({"loss_mask": [1, 0, 0, 1, 1, 0, 0, 1, 1, 0]}, "first token is marked as generated"),
        ({"token_ids": [10, 11, -3, 13, 14, 15, 16, 17, 18, 19]}, "token id at position 2 is -3"),
    ],
    ids=[
        "empty",
        "mask-length",
        "too-few-logprobs",
        "too-many-logprobs",
        "positive-logprob",
        "nan-logprob",
        "inf-logprob",
        "mask-value",
        "generated-first-token",
        "negative-token-id",
    ],
)
def test_invalid_trajectories_are_rejected_with_a_one_line_reason(changes: dict, fault: str) -> None:
    rec = record(episode_id="ep-7", workers=[worker("ep-7-w3", _broken(**changes))])
    with pytest.raises(SampleError) as info:
        samples_from_record(rec)
    message = str(info.value)
    assert "\n" not in message
    assert "ep-7" in message and "ep-7-w3" in message
    assert fault in message


def test_a_zero_logprob_is_a_valid_certain_token() -> None:
    rec = record(workers=[worker("w0", _broken(rollout_logprobs=[0.0, -0.1, 0, -0.2, -0.3]))])
    assert samples_from_record(rec)[0].rollout_logprobs[3:5] == [0.0, -0.1]


def test_mixed_weight_versions_keep_drop_or_error() -> None:
    mixed = trajectory([(3, 2, "v1"), (2, 3, "v2"), (1, 1, "v1")])
    rec = record(workers=[worker("w-mixed", mixed), worker("w-clean", trajectory([(2, 2, "v2")]))])

    kept = samples_from_record(rec)
    assert [s.weight_versions for s in kept] == [("v1", "v2"), ("v2",)]
    assert kept[0].mixed_versions

    dropped = samples_from_record(rec, mixed_versions="drop")
    assert [s.worker_episode_id for s in dropped] == ["w-clean"]

    with pytest.raises(SampleError, match=r"w-mixed: turns ran on several weight versions \(v1, v2\)"):
        samples_from_record(rec, mixed_versions="error")

    with pytest.raises(ValueError, match="mixed_versions must be one of keep, drop, error"):
        samples_from_record(rec, mixed_versions="ignore")


def test_group_samples_keeps_first_appearance_order() -> None:
    records = [record(f"e{i}", question_id=f"q{i % 2}", group_id=f"g{i % 2}") for i in range(5)]
    samples = [s for r in records for s in samples_from_record(r)]
    groups = group_samples(samples)
    assert list(groups) == ["g0", "g1"]
    assert [s.episode_id for s in groups["g0"]] == ["e0", "e2", "e4"]
    assert [s.episode_id for s in groups["g1"]] == ["e1", "e3"]


# --- load_samples -----------------------------------------------------------------------------------


def _mixed_records() -> list[dict[str, Any]]:
    """Three records: clean, one with a failed branch + a hot-reloaded worker, one with a bad trajectory."""
    return [
        record(
            "e1",
            workers=[
                worker("e1-w0", trajectory([(3, 2, "v1")])),
                worker("e1-w1", trajectory([(2, 2, "v1")])),
            ],
        ),
        record(
            "e2",
            workers=[
                worker("e2-w0", None),
                worker("e2-w1", trajectory([(3, 2, "v1"), (2, 2, "v2")])),
                worker("e2-w2", trajectory([(4, 4, "v2")])),
            ],
        ),
        record(
            "e3",
            question_id="q2",
            group_id="g2",
            workers=[
                worker("e3-w0", _broken(rollout_logprobs=[-0.1])),
                worker("e3-w1", trajectory([(1, 1, "v2")])),
            ],
        ),
    ]


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_load_jsonl_strict_raises_naming_the_line_and_trajectory(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "records.jsonl", _mixed_records())
    with pytest.raises(
        SampleError, match=r"records\.jsonl:3: episode e3, worker e3-w0: 1 rollout_logprobs for 5"
    ):
        load_samples(path)


def test_load_jsonl_collects_and_reports_rejections(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write_jsonl(tmp_path / "records.jsonl", _mixed_records())
    rejected: list[SampleError] = []
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        samples, counts = load_samples(
            path,
            rewards={"e1": 1.0, "e2": 0.0},
            mixed_versions="drop",
            strict=False,
            on_reject=rejected.append,
        )
    assert [s.worker_episode_id for s in samples] == ["e1-w0", "e1-w1", "e2-w2", "e3-w1"]
    assert counts == {
        "records": 3,
        "trajectories": 6,
        "skipped_failed": 1,
        "dropped_mixed": 1,
        "rejected": 1,
        "samples": 4,
    }
    assert counts["trajectories"] == counts["samples"] + counts["dropped_mixed"] + counts["rejected"]
    assert [str(e) for e in rejected] == [
        "episode e3, worker e3-w0: 1 rollout_logprobs for 5 loss_mask==1 tokens"
    ]
    assert "e3-w0" in caplog.text and "records.jsonl:3" in caplog.text
    assert [s.episode_reward for s in samples] == [1.0, 1.0, 0.0, None]
    assert list(group_samples(samples)) == ["g1", "g2"]


def test_load_jsonl_bad_line_names_it(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(record()) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"records\.jsonl:2: not a JSON episode record"):
        load_samples(path, strict=False)
    with pytest.raises(FileNotFoundError):
        load_samples(tmp_path / "missing.jsonl")


def test_load_from_coordinator_record_store(tmp_path: Path) -> None:
    path = tmp_path / "coordinator-records.sqlite"
    with SqliteRecordStore(path) as store:
        for i, rec in enumerate(_mixed_records()):
            store.put({**rec, "created_at": 1000.0 + i})
    samples, counts = load_samples(path, contributions={"e2-w1": 0.75}, strict=False)
    # Oldest episode first; "keep" keeps the hot-reloaded trajectory.
    assert [s.worker_episode_id for s in samples] == ["e1-w0", "e1-w1", "e2-w1", "e2-w2", "e3-w1"]
    assert samples[2].contribution == 0.75 and samples[2].weight_versions == ("v1", "v2")
    assert counts["records"] == 3 and counts["rejected"] == 1 and counts["dropped_mixed"] == 0
    assert all(isinstance(s, Sample) for s in samples)
    with pytest.raises(SampleError, match="e3-w0"):
        load_samples(path)
