"""An instant worker service for gateway benchmarks and tests: a real gRPC `bcstack.v1.WorkerService`
that answers every branch at once with a canned finished report and a small trajectory, so what is
measured or tested is the gateway (bench/gateway.py, bench/gateway_scale.py,
tests/test_gateway_replicas.py).

    multiprocessing.get_context("spawn").Process(target=stub_worker, args=(port,), daemon=True).start()
    config = gateway_config(llm_port, worker_port, log_level="WARNING")   # a gateway's --config
"""

from __future__ import annotations

import asyncio


def stub_worker(port: int) -> None:
    """A WorkerService that finishes every branch at once (run in a child process)."""
    import grpc

    from core import protocol as p
    from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    class Instant(worker_pb2_grpc.WorkerServiceServicer):
        async def RunEpisode(self, request, context):  # noqa: N802
            text = p.render_worker_report(
                p.WorkerReportText(request.branch.description, "finish", "Tartu", "[d1] says so", "90%")
            )
            return worker_pb2.RunWorkerEpisodeResponse(
                episode_id=request.episode_id,
                report=common_pb2.WorkerReport(
                    answer="Tartu",
                    explanation="[d1] says so",
                    confidence="90%",
                    stop_reason=common_pb2.STOP_REASON_FINISH,
                    raw_text=text,
                    episode_id=request.episode_id,
                ),
                trajectory=worker_pb2.Trajectory(
                    token_ids=list(range(64)),
                    loss_mask=[0] * 48 + [1] * 16,
                    rollout_logprobs=[-0.1] * 16,
                    turns=[
                        worker_pb2.Turn(
                            prompt_start=0,
                            gen_start=48,
                            gen_end=64,
                            generated_tokens=16,
                            weight_version="stub",
                            finish_reason="stop",
                        )
                    ],
                    stop_reason=common_pb2.STOP_REASON_FINISH,
                    tokens_used=64,
                    turns_used=1,
                ),
                usage=common_pb2.Usage(prompt_tokens=48, completion_tokens=16, total_tokens=64, turns=1),
            )

    async def serve() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(Instant(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def gateway_config(llm_port: int, worker_port: int, **settings: object) -> dict:
    """A gateway's configuration (`bcstack serve coordinator --config`) against the scripted
    coordinator LLM on `llm_port` and this stub worker on `worker_port`, plus `settings`."""
    return {
        "endpoints": [
            {
                "name": "scripted",
                "base_url": f"http://127.0.0.1:{llm_port}/v1",
                "model": "scripted-coordinator",
            }
        ],
        "workers": [f"127.0.0.1:{worker_port}"],
        **settings,
    }
