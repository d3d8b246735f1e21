"""Regressions found by tests/test_grpc_fuzz.py, fixed at the gRPC edge every service shares
(core.kit.grpc_server.RequestEdgeInterceptor), for unary and server-streaming RPCs alike:

- request bytes that do not parse as the RPC's request message are INVALID_ARGUMENT with the
  parser's reason, counted as such in the metrics (grpc.aio on its own answered UNKNOWN,
  "Unexpected DecodeError", the code of a servicer bug);
- an error message that quotes a huge request field reaches the client, cut, with its code (the
  client refused the 1.8 MB status trailer and reported RESOURCE_EXHAUSTED instead), and cut by its
  percent-encoded size, not its characters (1,000 four-byte characters are 12 KB on the wire).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest

from core.kit.grpc_server import GrpcServer, aio_channel
from core.kit.settings import ServiceSettings, load_settings
from core.v1 import judge_pb2, judge_pb2_grpc, worker_pb2, worker_pb2_grpc

CORRUPT = b"\x08"  # field 1 as a varint, and the varint is missing


class Judge(judge_pb2_grpc.JudgeServiceServicer):
    async def GradeAnswer(self, request, context):  # noqa: N802 - gRPC method name
        if request.question:  # an error message quoting the request, as servicers write them
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad question {request.question!r}")
        return judge_pb2.GradeAnswerResponse(correct=True, grader_version="ok")


class Worker(worker_pb2_grpc.WorkerServiceServicer):
    async def RunEpisodes(self, request, context):  # noqa: N802
        for episode in request.episodes:
            if episode.question_id:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"bad question_id {episode.question_id!r}"
                )
            yield worker_pb2.RunWorkerEpisodeResponse(episode_id=episode.episode_id)


def _identity(data: bytes) -> bytes:
    return data


def test_undecodable_requests_are_invalid_argument_and_the_server_keeps_serving() -> None:
    async def scenario() -> None:
        server = GrpcServer("decode-test", load_settings(ServiceSettings, grpc_port=0))
        server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, Judge())
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Worker())
        await server.start()
        try:
            async with aio_channel(server.target) as channel:
                grade = channel.unary_unary(
                    "/bcstack.v1.JudgeService/GradeAnswer",
                    request_serializer=_identity,
                    response_deserializer=_identity,
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await grade(CORRUPT, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "bcstack.v1.GradeAnswerRequest" in err.value.details()

                run = channel.unary_stream(
                    "/bcstack.v1.WorkerService/RunEpisodes",
                    request_serializer=_identity,
                    response_deserializer=_identity,
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in run(b"\x0a\xff\xff\xff\xff\x0f", timeout=5):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                # well-formed requests are untouched, unary and streaming
                reply = await judge_pb2_grpc.JudgeServiceStub(channel).GradeAnswer(
                    judge_pb2.GradeAnswerRequest(response="x", correct_answer="x"), timeout=5
                )
                assert reply.correct
                batch = worker_pb2.RunWorkerEpisodesRequest(
                    episodes=[worker_pb2.RunWorkerEpisodeRequest(episode_id=i) for i in ("a", "b")]
                )
                ids = [
                    r.episode_id async for r in worker_pb2_grpc.WorkerServiceStub(channel).RunEpisodes(batch)
                ]
                assert ids == ["a", "b"]
        finally:
            await server.stop(grace=1)
        metrics = generate_latest(server.registry).decode()
        assert 'method="/bcstack.v1.JudgeService/GradeAnswer",service="decode-test"' in metrics
        assert 'code="INVALID_ARGUMENT"' in metrics and 'code="UNKNOWN"' not in metrics

    asyncio.run(scenario())


def test_an_error_quoting_a_huge_field_reaches_the_client_cut() -> None:
    # Four-byte characters: 1,000 of them percent-encode to 12 KB, past the client's 8 KiB soft
    # limit (bench/fuzz_grpc.py found it as RESOURCE_EXHAUSTED when the cut counted characters).
    huge = "é𝄞" * 150_000

    async def scenario() -> None:
        server = GrpcServer("details-test", load_settings(ServiceSettings, grpc_port=0))
        server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, Judge())
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Worker())
        await server.start()
        try:
            async with aio_channel(server.target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await judge_pb2_grpc.JudgeServiceStub(channel).GradeAnswer(
                        judge_pb2.GradeAnswerRequest(question=huge), timeout=10
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = err.value.details()
                assert details.startswith("bad question 'é𝄞é𝄞") and "characters cut" in details
                assert len(details.encode()) * 3 < 8192  # percent-encoded, at most 3 bytes a byte

                batch = worker_pb2.RunWorkerEpisodesRequest(
                    episodes=[worker_pb2.RunWorkerEpisodeRequest(episode_id="a", question_id=huge)]
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in worker_pb2_grpc.WorkerServiceStub(channel).RunEpisodes(batch, timeout=10):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "characters cut" in err.value.details()
        finally:
            await server.stop(grace=1)

    asyncio.run(scenario())


def test_idle_clients_keepalive_pings_do_not_get_the_connection_dropped() -> None:
    """Our clients ping idle connections (channel_options); gRPC's server defaults answered those
    pings with GOAWAY too_many_pings and dropped the connection (seen in the fuzzer's logs). A
    client pinging every second stays READY on a server told to expect that; the defaults accept
    the default clients' interval."""
    from core.kit.grpc_server import KEEPALIVE_SECONDS, channel_options, server_keepalive_options

    accepted = dict(server_keepalive_options())
    assert accepted["grpc.keepalive_permit_without_calls"] == 1
    assert accepted["grpc.http2.min_ping_interval_without_data_ms"] < KEEPALIVE_SECONDS * 1000

    async def scenario() -> set[grpc.ChannelConnectivity]:
        settings = load_settings(ServiceSettings, grpc_port=0)
        server = GrpcServer("keepalive-test", settings, options=server_keepalive_options(1.0))
        server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, Judge())
        await server.start()
        try:
            channel = grpc.aio.insecure_channel(server.target, options=channel_options(keepalive_seconds=1.0))
            async with channel:
                stub = judge_pb2_grpc.JudgeServiceStub(channel)
                await stub.GradeAnswer(judge_pb2.GradeAnswerRequest())
                states = set()
                for _ in range(30):  # 6 s idle: the old defaults dropped it after ~3 pings
                    states.add(channel.get_state())
                    await asyncio.sleep(0.2)
                await stub.GradeAnswer(judge_pb2.GradeAnswerRequest())
                return states
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == {grpc.ChannelConnectivity.READY}
