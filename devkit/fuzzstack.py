"""The stack both fuzzers run against: every service as a real `bcstack serve` process on the
embedded defaults, with BCSTACK_ADMIN_TOKEN set.

    layout = stack_layout(kit, work, free_port)     # writes work/'s config, copies the index
    start [p.args for p in layout] with env=STACK_ENV, wait for each p.health_url; then
    HTTP fuzzing (tests/http_fuzz.py) reads p.http_url of the services in HTTP_SERVICES,
    gRPC fuzzing (devkit.grpcfuzz) calls p.grpc_target for the services in p.grpc_services.

The suite starts it once for both fuzz modules (tests/fixtures_fuzz.py); bench/fuzz_http.py and
bench/fuzz_grpc.py start their own. Nothing either fuzzer sends changes what the other meets: the
admin operations fuzzed with the token (tests/http_fuzz.py `WITH_TOKEN_SAFE`) read state or
refuse, and no RPC is an admin one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ADMIN_TOKEN = "fuzz-admin-token"
STACK_ENV = {"BCSTACK_ADMIN_TOKEN": ADMIN_TOKEN}
LLM_MODEL = "scripted-coordinator"
# The services whose HTTP API is fuzzed, each the process of the same name.
HTTP_SERVICES = ("retrieval", "engine", "worker", "coordinator", "coordinator-llm", "judge")


@dataclass(frozen=True)
class FuzzProcess:
    """One `bcstack serve` process of the fuzzed stack."""

    name: str
    args: list[str]
    http_url: str
    grpc_target: str | None  # where its gRPC services listen; None for HTTP-only processes
    grpc_services: tuple[str, ...]  # full names of the gRPC services it serves

    @property
    def health_url(self) -> str:
        return self.http_url + "/health"


def stack_layout(kit: Path, work: Path, free_port: Callable[[], int]) -> list[FuzzProcess]:
    """The processes, each with the upstreams its operations call. `kit` holds `world/`, `tiny/`
    and `idx/` (the test suite's `toy_kit`, read-only); `work` gets the index copy, the gateway's
    config and records, and the worker's (empty) checkpoint root.

    - retrieval on a copy of the kit's index: the dense shard takes a lock on its WAL, so a
      retrieval process of another test (or bench) on the kit itself would keep this one from
      starting;
    - `engine`, the tiny model with a 512-token context (no generated request decodes for long):
      the engine whose HTTP API is fuzzed;
    - `expert`, the scripted expert engine the worker calls (an episode takes milliseconds,
      whatever the task);
    - the worker on `expert` and retrieval; the judge's rule grader; the gateway on the scripted
      coordinator LLM and the worker, with short upstream retry waits.
    """
    host = "127.0.0.1"
    names = ("r", "rg", "e", "x", "w", "wg", "j", "jg", "l", "c", "cg")
    port = {name: free_port() for name in names}

    def http(name: str) -> str:
        return f"http://{host}:{port[name]}"

    def grpc(name: str) -> str:
        return f"{host}:{port[name]}"

    work.mkdir(parents=True, exist_ok=True)
    (work / "checkpoints").mkdir(exist_ok=True)
    shutil.copytree(kit / "idx", work / "idx", dirs_exist_ok=True)
    gateway_config = work / "gateway.yaml"
    gateway_config.write_text(
        json.dumps(
            {
                "endpoints": [{"name": "scripted", "base_url": http("l") + "/v1", "model": LLM_MODEL}],
                "workers": [grpc("wg")],
                "records_path": str(work / "gateway.sqlite"),
                "upstream_backoff_seconds": 0.05,
                "upstream_backoff_max_seconds": 0.5,
            }
        )
    )  # JSON is YAML
    tiny = str(kit / "tiny")
    return [
        FuzzProcess(
            "retrieval",
            ["serve", "retrieval", "--index-dir", str(work / "idx"), "--port", str(port["r"]),
             "--grpc-port", str(port["rg"])],
            http("r"), grpc("rg"), ("bcstack.v1.RetrievalService",),
        ),
        FuzzProcess(
            "engine",
            ["serve", "engine", "--model", tiny, "--context-length", "512", "--port", str(port["e"])],
            http("e"), None, (),
        ),
        FuzzProcess(
            "expert",
            ["serve", "engine", "--policy", "expert", "--tokenizer", tiny, "--port", str(port["x"])],
            http("x"), None, (),
        ),
        FuzzProcess(
            "worker",
            ["serve", "worker", "--tokenizer", tiny, "--engine-url", http("x"),
             "--retrieval-address", grpc("rg"), "--checkpoint-root", str(work / "checkpoints"),
             "--port", str(port["w"]), "--grpc-port", str(port["wg"])],
            http("w"), grpc("wg"), ("bcstack.v1.WorkerService",),
        ),
        FuzzProcess(
            "judge",
            ["serve", "judge", "--cache-path", str(work / "judge-cache.sqlite"), "--port", str(port["j"]),
             "--grpc-port", str(port["jg"])],
            http("j"), grpc("jg"), ("bcstack.v1.JudgeService",),
        ),
        FuzzProcess(
            "coordinator-llm",
            ["serve", "coordinator-llm", "--model-name", LLM_MODEL, "--port", str(port["l"])],
            http("l"), None, (),
        ),
        FuzzProcess(
            "coordinator",
            ["serve", "coordinator", "--config", str(gateway_config), "--port", str(port["c"]),
             "--grpc-port", str(port["cg"])],
            http("c"), grpc("cg"), ("bcstack.v1.CoordinatorService",),
        ),
    ]  # fmt: skip
