"""Canary reload (`bcstack worker reload --canary`, bcstack/canary.py): the plan, the decision and the
CLI's refusals. The canary on the live stack, with a good and a broken checkpoint, is in
test_canary_live.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bcstack.canary import CanaryError, ReplicaStatus, SliceResult, decide, grpc_address, plan_canary
from bcstack.cli import app

runner = CliRunner()


def replicas(*versions: str, checkpoint: str | None = "/ckpt/v1", grpc: bool = True) -> list[ReplicaStatus]:
    return [
        ReplicaStatus(f"http://w{i}:8002", v, checkpoint, f"w{i}:50052" if grpc else None)
        for i, v in enumerate(versions)
    ]


def plan(statuses, canary=1, *, rollback=None, baseline=False, version="v2"):
    return plan_canary(
        statuses,
        canary,
        checkpoint_on_workers="/ckpt/v2",
        version=version,
        rollback_checkpoint=rollback,
        baseline=baseline,
    )


def test_the_plan_splits_canaries_from_the_rest_and_rolls_back_to_what_they_loaded():
    p = plan(replicas("v1", "v1", "v1"), 1)
    assert [s.url for s in p.canaries] == ["http://w0:8002"]
    assert [s.url for s in p.others] == ["http://w1:8002", "http://w2:8002"]
    assert (p.old_version, p.rollback_checkpoint, p.version) == ("v1", "/ckpt/v1", "v2")
    assert plan(replicas("v1", "v1"), 1, rollback="/ckpt/other").rollback_checkpoint == "/ckpt/other"


@pytest.mark.parametrize(
    ("statuses", "canary", "kw", "message"),
    [
        (replicas("v1", "v1"), 3, {}, "--canary 3: there are 2 replica(s)"),
        (replicas("v1", "v1"), 2, {"baseline": True}, "--max-drop compares the canaries with replicas"),
        (replicas("v1", "v0"), 1, {}, "serve different versions"),
        (replicas("v2", "v2"), 1, {}, "already serves 'v2'"),
        (replicas("v1", "v1", checkpoint=None), 1, {}, "pass --rollback-checkpoint"),
        (replicas("v1", "v1", grpc=False), 1, {}, "serve(s) no gRPC port"),
        ([ReplicaStatus("http://w0:8002", None, None, "w0:1")], 1, {}, "cannot read the weight version"),
    ],
)
def test_replicas_that_cannot_take_a_canary_are_refused_before_anything_is_touched(
    statuses, canary, kw, message
):
    with pytest.raises(CanaryError, match=re.escape(message)):
        plan(statuses, canary, **kw)


def test_grpc_addresses_keep_the_host_of_the_http_url():
    assert grpc_address("http://10.0.0.7:8002", 50052) == "10.0.0.7:50052"
    assert grpc_address("http://[fd00::7]:8002", 50052) == "[fd00::7]:50052"


def slice_of(version: str, answers: list[bool], seen: dict[str, int] | None = None) -> SliceResult:
    result = SliceResult(version, ["x"])
    result.correct = {(f"q{i}", 0): a for i, a in enumerate(answers)}
    result.versions_seen = seen if seen is not None else {version: 3}
    return result


def test_min_accuracy_passes_at_the_threshold_and_fails_below_it():
    assert decide(slice_of("v2", [True, True, False, False]), None, min_accuracy=0.5, max_drop_pp=None).passed
    verdict = decide(slice_of("v2", [True, False, False, False]), None, min_accuracy=0.5, max_drop_pp=None)
    assert not verdict.passed and "1/4 = 25.0% < the required 50.0%" in verdict.reason


def test_max_drop_is_the_paired_difference_on_questions_graded_on_both_versions():
    old = slice_of("v1", [True, True, True, True])
    new = slice_of("v2", [True, True, True, False])
    ok = decide(new, old, min_accuracy=None, max_drop_pp=25)
    assert ok.passed and "a drop of +25.0 pp, within" in ok.reason and ok.paired["regressed"] == 1
    too_far = decide(new, old, min_accuracy=None, max_drop_pp=20)
    assert not too_far.passed and "over the allowed 20 pp" in too_far.reason
    # A question the old version never had graded is not compared.
    del old.correct[("q3", 0)]
    assert decide(new, old, min_accuracy=None, max_drop_pp=0).passed


def test_episodes_on_another_version_or_none_graded_fail_the_canary():
    stray = decide(slice_of("v2", [True], {"v2": 2, "v1": 1}), None, min_accuracy=0.0, max_drop_pp=None)
    assert not stray.passed and "other weight versions" in stray.reason
    empty = decide(slice_of("v2", []), None, min_accuracy=0.0, max_drop_pp=None)
    assert not empty.passed and "graded none" in empty.reason


@pytest.fixture
def questions(tmp_path: Path) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"query_id": "q1", "query": "Who?", "answer": "Ada"}) + "\n")
    return path


CANARY = ["--canary", "1", "--eval", "{q}", "--judge", "http://j"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--eval", "{q}"], "--eval belong(s) to a canary reload: add --canary N"),
        (["--canary", "1", "--eval", "{q}"], "--canary needs --eval QUESTIONS and --judge URL"),
        (
            [*CANARY, "--min-accuracy", "0.5", "--max-drop", "5"],
            "exactly one of --min-accuracy X or --max-drop PP",
        ),
        (
            [*CANARY, "--max-drop", "5", "--task-template", "{t}"],
            "has no {question} placeholder",
        ),
        (
            ["--canary", "1", "--eval", "{empty}", "--judge", "http://j", "--max-drop", "5"],
            "no questions",
        ),
    ],
)
def test_canary_options_are_checked_in_one_line_before_any_replica_is_called(
    extra, message, questions, tmp_path, monkeypatch
):
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", "t")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    template = tmp_path / "t.txt"
    template.write_text("Research this.")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [a.format(q=questions, t=template, empty=empty) for a in extra]
    # No worker listens on port 9: an option checked after the first call would fail differently.
    result = runner.invoke(
        app, ["worker", "reload", "--checkpoint", str(checkpoint), "--workers", "127.0.0.1:9", *args]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output
