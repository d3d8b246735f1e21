"""The core.v1 gRPC contracts: stubs are current, services exist, messages round-trip."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from bcstack import protogen
from core.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    judge_pb2,
    judge_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

REPO = Path(__file__).resolve().parent.parent

SERVICES = {
    (retrieval_pb2, "RetrievalService"): {
        "Search": ("SearchRequest", "SearchResponse"),
        "BatchSearch": ("BatchSearchRequest", "BatchSearchResponse"),
        "Open": ("OpenRequest", "OpenResponse"),
    },
    (worker_pb2, "WorkerService"): {
        "RunEpisode": ("RunWorkerEpisodeRequest", "RunWorkerEpisodeResponse"),
        "RunEpisodes": ("RunWorkerEpisodesRequest", "RunWorkerEpisodeResponse"),
    },
    (judge_pb2, "JudgeService"): {
        "GradeAnswer": ("GradeAnswerRequest", "GradeAnswerResponse"),
        "GradeContribution": ("GradeContributionRequest", "GradeContributionResponse"),
        "BatchGradeAnswer": ("BatchGradeAnswerRequest", "BatchGradeAnswerResponse"),
        "BatchGradeContribution": ("BatchGradeContributionRequest", "BatchGradeContributionResponse"),
    },
    (coordinator_pb2, "CoordinatorService"): {
        "RunEpisode": ("RunCoordinatorEpisodeRequest", "RunCoordinatorEpisodeResponse")
    },
}


def test_checked_in_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    checked_in = protogen.generated_files(REPO)
    assert [p.name for p in fresh] == [p.name for p in checked_in], (
        "the set of stubs in core/v1 differs from proto/: run `make proto`"
    )
    stale = [
        str(p.relative_to(REPO))
        for p, f in zip(checked_in, fresh, strict=True)
        if not filecmp.cmp(p, f, shallow=False)
    ]
    assert not stale, f"stale gRPC stubs {stale}: run `make proto` and commit the result"
    assert {p.name for p in fresh} >= {
        f"{stem}{suffix}"
        for stem in ("common", "retrieval", "worker", "judge", "coordinator")
        for suffix in protogen.GENERATED_SUFFIXES
    }


def test_protogen_check_reports_a_stale_stub(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    (repo / "proto").mkdir(parents=True)
    for src in protogen.proto_files():
        dst = repo / "proto" / src.relative_to(protogen.PROTO_ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    protogen.write_stubs(repo)
    assert protogen.stale_files(repo) == []
    (repo / "core" / "v1" / "judge_pb2.py").write_text("# edited by hand\n")
    (repo / "core" / "v1" / "gone_pb2.py").write_text("# no proto behind it\n")
    assert protogen.stale_files(repo) == ["core/v1/gone_pb2.py", "core/v1/judge_pb2.py"]


def test_generated_imports_are_absolute() -> None:
    text = (REPO / "core" / "v1" / "worker_pb2_grpc.py").read_text()
    assert "from core.v1 import worker_pb2" in text
    assert "from core.v1 import common_pb2" in (REPO / "core" / "v1" / "worker_pb2.py").read_text()


# Methods that stream their responses back (the rest are unary).
STREAMING = {"RunEpisodes"}


@pytest.mark.parametrize(
    ("key", "methods"), SERVICES.items(), ids=lambda v: v[1] if isinstance(v, tuple) else ""
)
def test_services_and_methods_exist(key: tuple, methods: dict[str, tuple[str, str]]) -> None:
    module, service_name = key
    service = module.DESCRIPTOR.services_by_name[service_name]
    assert service.full_name == f"bcstack.v1.{service_name}"
    assert set(service.methods_by_name) == set(methods)
    for name, (request, response) in methods.items():
        method = service.methods_by_name[name]
        assert (method.input_type.name, method.output_type.name) == (request, response)
        assert not method.client_streaming
        assert method.server_streaming == (name in STREAMING)
    grpc_module = {
        "RetrievalService": retrieval_pb2_grpc,
        "WorkerService": worker_pb2_grpc,
        "JudgeService": judge_pb2_grpc,
        "CoordinatorService": coordinator_pb2_grpc,
    }[service_name]
    for attr in (f"{service_name}Stub", f"{service_name}Servicer", f"add_{service_name}Servicer_to_server"):
        assert hasattr(grpc_module, attr), attr


def test_stop_reasons_and_defaults() -> None:
    names = [v.name for v in common_pb2.StopReason.DESCRIPTOR.values]
    assert names == [
        "STOP_REASON_UNSPECIFIED",
        "STOP_REASON_FINISH",
        "STOP_REASON_BUDGET",
        "STOP_REASON_TURNS",
        "STOP_REASON_CONTEXT",
        "STOP_REASON_ERROR",
    ]
    # Unset overrides are distinguishable from explicit zeros (proto3 `optional`).
    budget = common_pb2.BudgetOverrides(max_turns=0)
    assert budget.HasField("max_turns") and not budget.HasField("max_tokens")
    assert retrieval_pb2.SearchRequest().mode == retrieval_pb2.SEARCH_MODE_HYBRID
    assert not judge_pb2.GradeAnswerResponse().HasField("correct")  # no verdict
    assert retrieval_pb2.OpenRequest(url="https://x").WhichOneof("target") == "url"


def test_trajectory_round_trip() -> None:
    trajectory = worker_pb2.Trajectory(
        token_ids=[151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198, 40, 1184, 151645],
        loss_mask=[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        rollout_logprobs=[-0.25, -1.5, -0.125],
        turns=[
            worker_pb2.Turn(
                prompt_start=0,
                gen_start=9,
                gen_end=12,
                generated_tokens=3,
                weight_version="step-000120",
                finish_reason="stop",
            )
        ],
        tool_calls=[
            worker_pb2.ToolCallRecord(
                turn=0,
                name="search",
                params={"query": "Nobel laureate born in Tartu", "topk": "5"},
                outcome="ok",
            ),
            worker_pb2.ToolCallRecord(
                turn=0,
                name="open_page",
                params={},
                outcome="missing_parameter",
                error="Missing parameter: docid",
            ),
        ],
        stop_reason=common_pb2.STOP_REASON_BUDGET,
        tokens_used=12,
        turns_used=1,
    )
    response = worker_pb2.RunWorkerEpisodeResponse(
        episode_id="ep-1",
        report=common_pb2.WorkerReport(stop_reason=common_pb2.STOP_REASON_BUDGET, raw_text="out of budget"),
        trajectory=trajectory,
        usage=common_pb2.Usage(prompt_tokens=9, completion_tokens=3, total_tokens=12, turns=1, tool_calls=2),
    )
    parsed = worker_pb2.RunWorkerEpisodeResponse.FromString(response.SerializeToString())
    assert parsed == response
    assert list(parsed.trajectory.token_ids) == list(trajectory.token_ids)
    assert list(parsed.trajectory.rollout_logprobs) == [-0.25, -1.5, -0.125]  # exact in float32
    assert sum(parsed.trajectory.loss_mask) == len(parsed.trajectory.rollout_logprobs)
    assert dict(parsed.trajectory.tool_calls[0].params) == {
        "query": "Nobel laureate born in Tartu",
        "topk": "5",
    }
    assert parsed.trajectory.stop_reason == common_pb2.STOP_REASON_BUDGET
    assert parsed.trajectory.turns[0].weight_version == "step-000120"


def test_worker_task_is_chat_or_branch() -> None:
    request = worker_pb2.RunWorkerEpisodeRequest(
        episode_id="e",
        chat=worker_pb2.ChatTask(
            messages=[
                common_pb2.Message(role="system", content="s"),
                common_pb2.Message(role="user", content="u"),
            ]
        ),
    )
    assert request.WhichOneof("task") == "chat"
    request.branch.CopyFrom(worker_pb2.BranchTask(description="d", prompt="p"))
    assert request.WhichOneof("task") == "branch"
    assert not request.HasField("chat")
