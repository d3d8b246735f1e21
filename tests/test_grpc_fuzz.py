"""gRPC fuzzing: every RPC of every bcstack.v1 service, against real `bcstack serve` processes.

Two tests per RPC, both enumerated from the service descriptors (a new RPC is fuzzed without
touching this file): Hypothesis-generated request messages (valid, boundary and garbage values in
every field, `devkit.grpcfuzz.message_strategy`), and raw garbage bytes sent as the serialized
request. Every call must end OK or with a documented code (`devkit.grpcfuzz.ALLOWED_CODES`:
INVALID_ARGUMENT, NOT_FOUND for a missing docid, RESOURCE_EXHAUSTED for admission, ABORTED for an
episode id running now, UNAVAILABLE for a down upstream), never UNKNOWN (an exception escaped a
servicer), INTERNAL, or a deadline; an OK answer parses as the response type; and afterwards the
process is alive, reports SERVING, and answers a known-good request.

The processes are the fuzz stack (`devkit.fuzzstack`) that `tests/test_http_fuzz.py` fuzzes over
HTTP too, started once for both (`tests/fixtures_fuzz.py`).

Examples are derandomized (the same ones on every run, no example database). In `make test` each
RPC gets a handful of generated requests (`FEWER`, `GENERATED`) and of garbage payloads (`GARBAGE`):
every RPC, every kind of input, a few seconds of calls on 2 cores; `BCSTACK_FUZZ_DEPTH=10` runs
10x as many, and `bench/fuzz_grpc.py` runs the long version (2,000 + 500 per RPC, random draws)
with a report.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from core.kit.grpc_server import sync_channel
from devkit.grpcfuzz import (
    ALLOWED_CODES,
    Rpc,
    all_rpcs,
    call,
    garbage_bytes,
    known_good,
    message_strategy,
    parse_response,
    world_hints,
)

FUZZ_DEPTH = float(os.environ.get("BCSTACK_FUZZ_DEPTH", "1"))
CALL_TIMEOUT_S = 60.0  # far above any fuzzed call's time on the embedded stack: a hang is a finding

# Generated examples per RPC at depth 1, fewer where one call costs more (~50 ms on 2 cores: an
# episode runs the scripted engine and LLM end to end; a batch is several calls); ~10 ms otherwise.
FEWER = {
    "CoordinatorService.RunEpisode": 10,
    "WorkerService.RunEpisode": 10,
    "WorkerService.RunEpisodes": 10,
    "JudgeService.BatchGradeAnswer": 10,
    "JudgeService.BatchGradeContribution": 10,
    "RetrievalService.BatchSearch": 10,
}
GENERATED = 20
GARBAGE = 10
RPCS = all_rpcs()


def examples(base: int) -> int:
    return max(1, int(base * FUZZ_DEPTH))


def fuzz_settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


@pytest.fixture(scope="module")
def stack(fuzz_stack, toy_kit):
    # the services' own message limits (64 MiB), not grpc's 4 MiB default: a fuzzed answer may be large
    channels = {p.grpc_target: sync_channel(p.grpc_target) for p in fuzz_stack.layout if p.grpc_target}
    state = {
        "hints": world_hints(toy_kit["dir"] / "world"),
        "world": toy_kit["world"],
        "by_service": {
            name: (spec, proc, channels[spec.grpc_target])
            for spec, proc in zip(fuzz_stack.layout, fuzz_stack.processes, strict=True)
            for name in spec.grpc_services
        },
    }
    yield state
    for channel in channels.values():
        channel.close()


def still_serving(stack, rpc: Rpc) -> None:
    spec, proc, channel = stack["by_service"][rpc.service]
    assert proc.proc.poll() is None, f"{spec.name} died: {proc.log()[-4000:]}"
    known_good(rpc.service, channel, stack["world"].test[0])


def check(stack, rpc: Rpc, payload: bytes, codes: Counter) -> None:
    if rpc.service not in stack["by_service"]:
        raise AssertionError(
            f"no process of the fuzz stack serves {rpc.service}: add it to devkit.fuzzstack.stack_layout"
        )
    _, _, channel = stack["by_service"][rpc.service]
    outcome = call(channel, rpc, payload, timeout=CALL_TIMEOUT_S)
    codes[outcome.code.name] += 1
    assert outcome.allowed, (
        f"{rpc.id} answered {outcome.code.name}: {outcome.details!r} to {payload[:300]!r}"
        f" (allowed: {', '.join(c.name for c in ALLOWED_CODES)})"
    )
    for answer in outcome.responses:
        parse_response(rpc, answer)


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.id)
def test_generated_requests_get_a_documented_answer(stack, rpc):
    codes: Counter = Counter()
    n = examples(FEWER.get(rpc.id, GENERATED))

    @fuzz_settings(n)
    @given(message_strategy(rpc.request, hints=stack["hints"]))
    def fuzz(message):
        check(stack, rpc, message.SerializeToString(), codes)

    fuzz()
    print(f"{rpc.id}: {sum(codes.values())} generated requests, {dict(codes)}")
    still_serving(stack, rpc)


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.id)
def test_garbage_bytes_get_a_documented_answer(stack, rpc):
    codes: Counter = Counter()

    @fuzz_settings(examples(GARBAGE))
    @given(garbage_bytes())
    def fuzz(payload):
        check(stack, rpc, payload, codes)

    fuzz()
    print(f"{rpc.id}: {sum(codes.values())} garbage payloads, {dict(codes)}")
    still_serving(stack, rpc)
