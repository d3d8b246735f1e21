"""The typed episode record (core.records): old records load, invariants fail at the edge with one
line, and the protobuf edge round-trips a trajectory exactly."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.record_store import SqliteRecordStore
from core.records import (
    SCHEMA,
    SCHEMA_V1,
    EpisodeRecord,
    RecordError,
    WorkerTrajectory,
    load_lenient,
    trajectory_from_proto,
    trajectory_to_proto,
    validate_trajectory,
)
from core.v1 import common_pb2, worker_pb2

# Written by the gateway at commit fb39542 (before the typed record): one expert episode of the toy
# world through `bcstack up`, fetched from GET /v1/episodes/{id}.
V1_RECORD = Path(__file__).parent / "data" / "episode_record_v1.json"


def v1() -> dict[str, Any]:
    return json.loads(V1_RECORD.read_text())


def test_a_record_stored_by_the_previous_gateway_loads_as_the_current_schema(tmp_path: Path) -> None:
    data = v1()
    assert data["schema"] == SCHEMA_V1
    with SqliteRecordStore(tmp_path / "r.sqlite") as store:
        store.put(data)
        stored = store.get(data["episode_id"])
    record = EpisodeRecord.load(stored)
    assert record.schema_ == SCHEMA
    assert record.grades is None
    (worker,) = record.workers
    t = worker.trajectory
    assert t is not None and t.events == []
    assert len(t.token_ids) == len(t.loss_mask) == t.tokens_used == 2214
    assert len(t.rollout_logprobs) == sum(t.loss_mask) == worker.usage.completion_tokens
    assert [(s.prompt_start, s.gen_start, s.gen_end) for s in t.turns] == [
        (0, 385, 446),
        (446, 1721, 1775),
        (1775, 2136, 2214),
    ]
    assert t.weight_versions == ("default",)
    assert [c.name for c in t.tool_calls] == ["search", "open_page", "finish"]
    # Everything the old record held survives a load and a dump, under the new schema name.
    dumped = record.dump()
    assert dumped["schema"] == SCHEMA
    old = {k: v for k, v in data.items() if k != "schema"}
    for key, value in old.items():
        if key != "workers":
            assert dumped[key] == value, key
    new_worker = dumped["workers"][0]
    for key, value in data["workers"][0].items():
        if key != "trajectory":
            assert new_worker[key] == value, key
    for key, value in data["workers"][0]["trajectory"].items():
        if key == "turns":  # every old key of every turn, beside the fields added since
            assert [
                {k: turn[k] for k in old}
                for turn, old in zip(new_worker["trajectory"][key], value, strict=True)
            ] == value
            assert all(turn["version_spans"] == [] for turn in new_worker["trajectory"][key])
        else:
            assert new_worker["trajectory"][key] == value, key


def test_an_unknown_schema_version_is_refused_not_guessed() -> None:
    with pytest.raises(RecordError, match=r"unknown record schema 'bcstack.episode/9'"):
        EpisodeRecord.load({**v1(), "schema": "bcstack.episode/9"})


def test_a_misspelt_field_is_an_error_not_silently_dropped() -> None:
    with pytest.raises(RecordError, match="grade"):
        EpisodeRecord.load({**v1(), "grade": {"correct": True}})


def _with_trajectory(**changes: Any) -> dict[str, Any]:
    data = v1()
    data["workers"][0]["trajectory"].update(changes)
    return data


T = v1()["workers"][0]["trajectory"]


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"loss_mask": T["loss_mask"][:-1]}, "loss_mask has 2213 entries for 2214 token ids"),
        (
            {"rollout_logprobs": T["rollout_logprobs"][:-1]},
            "192 rollout_logprobs for 193 loss_mask==1 tokens",
        ),
        ({"rollout_logprobs": [0.5, *T["rollout_logprobs"][1:]]}, "rollout_logprobs[0] is 0.5"),
        ({"rollout_logprobs": [math.nan, *T["rollout_logprobs"][1:]]}, "rollout_logprobs[0] is nan"),
        ({"token_ids": [-1, *T["token_ids"][1:]]}, "token id at position 0 is -1"),
        (
            {"loss_mask": [1, *T["loss_mask"][1:]], "rollout_logprobs": [-0.1, *T["rollout_logprobs"]]},
            "first token is marked as generated",
        ),
        (
            {"turns": [T["turns"][0], {**T["turns"][1], "prompt_start": 440}, T["turns"][2]]},
            "turn 1 starts at 440, the previous turn ended at 446",
        ),
        (
            {"turns": [{**T["turns"][0], "generated_tokens": 60}, *T["turns"][1:]]},
            "turn 0 spans 61 tokens but says 60",
        ),
        ({"stop_reason": "finished"}, "stop_reason"),
    ],
    ids=[
        "mask-length",
        "logprob-count",
        "positive",
        "nan",
        "negative-id",
        "first-generated",
        "gap",
        "span",
        "stop",
    ],
)
def test_a_broken_trajectory_fails_at_the_edge_with_one_line(changes: dict[str, Any], fault: str) -> None:
    with pytest.raises(RecordError) as info:
        EpisodeRecord.load(_with_trajectory(**changes))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("episode v1-fixture-0: workers.0.trajectory")
    assert fault in message


def test_generated_tokens_outside_every_turn_are_caught() -> None:
    mask = list(T["loss_mask"])
    mask[10] = 1  # inside the prompt, which no turn generated
    lps = list(T["rollout_logprobs"])
    lps.insert(0, -0.5)
    with pytest.raises(RecordError, match="turn 0 generated 61 tokens but 62|outside every turn"):
        validate_trajectory({**T, "loss_mask": mask, "rollout_logprobs": lps})


def test_token_ids_are_checked_against_the_vocabulary_when_the_reader_knows_it() -> None:
    EpisodeRecord.load(v1(), vocab_size=max(T["token_ids"]) + 1)
    with pytest.raises(RecordError, match=r"not a token id \(vocabulary of 100\)"):
        EpisodeRecord.load(v1(), vocab_size=100)


def test_lenient_loading_sets_aside_only_the_broken_trajectory() -> None:
    data = v1()
    good = copy.deepcopy(data["workers"][0])
    bad = copy.deepcopy(good)
    bad["episode_id"] = "v1-fixture-0.w1"
    bad["trajectory"]["loss_mask"] = bad["trajectory"]["loss_mask"][:-1]
    data["workers"] = [good, bad, {**copy.deepcopy(good), "episode_id": "w-failed", "trajectory": None}]
    record, rejected = load_lenient(data)
    assert [w.trajectory is not None for w in record.workers] == [True, False, False]
    assert [(r.index, r.worker_episode_id) for r in rejected] == [(1, "v1-fixture-0.w1")]
    assert "loss_mask has 2213 entries" in rejected[0].reason


def test_the_protobuf_edge_round_trips_a_trajectory() -> None:
    t = EpisodeRecord.load(v1()).workers[0].trajectory
    assert t is not None
    t = t.model_copy(update={"events": ["finish_without_search"], "stop_reason": "budget"})
    message = trajectory_to_proto(t, worker_pb2.Trajectory)
    assert list(message.token_ids) == t.token_ids
    assert message.stop_reason == common_pb2.STOP_REASON_BUDGET
    back = trajectory_from_proto(message)
    # float32 on the wire: log-probs come back as the nearest float32
    assert back.rollout_logprobs == pytest.approx(t.rollout_logprobs, abs=1e-6)
    assert back.model_dump(exclude={"rollout_logprobs"}) == t.model_dump(exclude={"rollout_logprobs"})


def test_an_unset_stop_reason_from_an_old_worker_reads_as_error() -> None:
    t = trajectory_from_proto(worker_pb2.Trajectory())
    assert t.stop_reason == "error" and t.token_ids == []


@st.composite
def trajectories(draw: st.DrawFn) -> dict[str, Any]:
    """Well-formed trajectories: turns of (observation/prompt tokens > 0, generated tokens)."""
    spans = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=0, max_size=5))
    ids: list[int] = []
    mask: list[int] = []
    turns = []
    for prompt, generated in spans:
        start = len(ids)
        ids += draw(st.lists(st.integers(0, 5000), min_size=prompt + generated, max_size=prompt + generated))
        mask += [0] * prompt + [1] * generated
        turns.append(
            {
                "prompt_start": start,
                "gen_start": start + prompt,
                "gen_end": start + prompt + generated,
                "generated_tokens": generated,
            }
        )
    lps = draw(st.lists(st.floats(-30, 0), min_size=sum(mask), max_size=sum(mask)))
    return {
        "token_ids": ids,
        "loss_mask": mask,
        "rollout_logprobs": lps,
        "turns": turns,
        "stop_reason": "finish",
    }


@settings(max_examples=60, deadline=None)
@given(trajectories())
def test_well_formed_trajectories_validate_and_align(data: dict[str, Any]) -> None:
    t = WorkerTrajectory.model_validate(data)
    aligned = t.aligned_logprobs()
    assert len(aligned) == len(t.token_ids)
    assert [lp for lp, m in zip(aligned, t.loss_mask, strict=True) if m] == t.rollout_logprobs
    assert trajectory_from_proto(trajectory_to_proto(t, worker_pb2.Trajectory)).token_ids == t.token_ids
