"""The shared service kit (core/kit): settings, logging, metrics, auth, HTTP and gRPC edges.

Every test starts and stops its own servers on free loopback ports.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import grpc
import httpx
import pytest
import typer
from conftest import find_free_port, wait_for_port, wait_until
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import generate_latest
from pydantic import BaseModel, Field, SecretStr
from typer.testing import CliRunner, Result

from core.kit import logging as kit_logging
from core.kit.auth import require_admin
from core.kit.cli import ServeCommand, serve_command
from core.kit.grpc_server import GrpcServer, aio_channel, service_full_name
from core.kit.http import create_app, uvicorn_server
from core.kit.metrics import new_registry, start_metrics_server
from core.kit.settings import ServiceSettings, SettingsError, env_var_name, load_settings
from core.v1 import judge_pb2, judge_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
TOKEN = "tok-3f9a1c77e2b04d51"


class KitSettings(ServiceSettings):
    service_name: ClassVar[str] = "kit-test"
    port: int = 8100
    batch_size: int = Field(4, gt=0, description="items per batch")
    label: str = "default"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("BCSTACK_"):
            monkeypatch.delenv(name)


# --- settings --------------------------------------------------------------------------------


def test_settings_precedence_defaults_yaml_env_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kit.yaml"
    config.write_text("port: 8200\nbatch_size: 8\nlabel: from-yaml\nlog_level: debug\n")
    monkeypatch.setenv("BCSTACK_KIT_TEST_BATCH_SIZE", "16")
    monkeypatch.setenv("BCSTACK_KIT_TEST_LABEL", "from-env")

    assert load_settings(KitSettings).port == 8100  # class default
    settings = load_settings(KitSettings, config_file=config, label="from-cli", port=None)
    assert settings.port == 8200  # YAML over default (an unset option, None, does not override)
    assert settings.batch_size == 16  # env over YAML
    assert settings.label == "from-cli"  # override over env
    assert settings.log_level == "DEBUG"
    assert settings.host == "127.0.0.1" and settings.grpc_port is None and settings.log_json is False
    assert env_var_name(KitSettings, "batch_size") == "BCSTACK_KIT_TEST_BATCH_SIZE"
    assert env_var_name(KitSettings, "admin_token") == "BCSTACK_ADMIN_TOKEN"


def test_stack_wide_log_settings_from_the_charts_common_configmap(monkeypatch: pytest.MonkeyPatch) -> None:
    # charts/bcstack/templates/configmap.yaml sets these once for every process.
    monkeypatch.setenv("BCSTACK_LOG_LEVEL", "warning")
    monkeypatch.setenv("BCSTACK_LOG_FORMAT", "json")
    settings = load_settings(KitSettings)
    assert settings.log_level == "WARNING" and settings.log_json is True
    monkeypatch.setenv("BCSTACK_KIT_TEST_LOG_LEVEL", "DEBUG")  # the service's own variable wins
    monkeypatch.setenv("BCSTACK_LOG_FORMAT", "text")
    settings = load_settings(KitSettings)
    assert settings.log_level == "DEBUG" and settings.log_json is False
    monkeypatch.setenv("BCSTACK_LOG_FORMAT", "xml")
    with pytest.raises(SettingsError):
        load_settings(KitSettings)


def test_settings_errors_are_one_line_and_name_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("port: 8200\nlabel: [unclosed\n")
    with pytest.raises(SettingsError) as err:
        load_settings(KitSettings, config_file=broken)
    message = str(err.value)
    assert str(broken) in message and "invalid YAML" in message and "line" in message and "\n" not in message

    with pytest.raises(SettingsError, match="expected a mapping"):
        load_settings(KitSettings, config_file=_write(tmp_path / "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(KitSettings, config_file=tmp_path / "missing.yaml")
    with pytest.raises(SettingsError, match="unknown setting 'prot'"):
        load_settings(KitSettings, config_file=_write(tmp_path / "typo.yaml", "prot: 1\n"))
    with pytest.raises(SettingsError, match=r"key 'batch_size'.*greater than 0"):
        load_settings(KitSettings, config_file=_write(tmp_path / "zero.yaml", "batch_size: 0\n"))

    monkeypatch.setenv("BCSTACK_KIT_TEST_PORT", "eighty")
    with pytest.raises(SettingsError) as err:
        load_settings(KitSettings)
    message = str(err.value)
    assert "environment variable BCSTACK_KIT_TEST_PORT" in message and "'eighty'" in message
    assert "\n" not in message
    monkeypatch.delenv("BCSTACK_KIT_TEST_PORT")

    with pytest.raises(SettingsError, match="option --batch-size"):
        load_settings(KitSettings, batch_size="many")


def test_a_misspelt_environment_variable_is_an_error_not_a_silent_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BCSTACK_KIT_TEST_BATCH_SIZ", "16")
    with pytest.raises(SettingsError) as err:
        load_settings(KitSettings)
    message = str(err.value)
    assert "BCSTACK_KIT_TEST_BATCH_SIZ is not a setting of kit-test" in message
    assert "did you mean BCSTACK_KIT_TEST_BATCH_SIZE?" in message and "\n" not in message
    monkeypatch.delenv("BCSTACK_KIT_TEST_BATCH_SIZ")
    # another service's variables share a prefix with a shorter service name: not typos
    from core.kit.settings import unknown_env_settings
    from services.coordinator.settings import CoordinatorSettings

    environ = {"BCSTACK_COORDINATOR_LLM_FAIL_RATE": "0.5", "BCSTACK_COORDINATOR_WORKERS": "a:1"}
    assert unknown_env_settings(CoordinatorSettings, environ) == []
    assert unknown_env_settings(CoordinatorSettings, {"BCSTACK_COORDINATOR_WORKER": "a:1"}) == [
        "environment variable BCSTACK_COORDINATOR_WORKER is not a setting of coordinator "
        "(did you mean BCSTACK_COORDINATOR_WORKERS?)"
    ]


def test_admin_token_is_a_secret_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", TOKEN)
    settings = load_settings(KitSettings)
    assert isinstance(settings.admin_token, SecretStr)
    assert settings.admin_token.get_secret_value() == TOKEN
    for text in (
        repr(settings),
        str(settings),
        settings.model_dump_json(),
        str(settings.model_dump()),
        _serve_kit("--help").output,
    ):
        assert TOKEN not in text
    # A bad secret value is not echoed in the error either.
    with pytest.raises(SettingsError) as err:
        load_settings(KitSettings, admin_token=12345)
    assert "12345" not in str(err.value)
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", "")
    assert load_settings(KitSettings).admin_token is None  # empty = unset = admin disabled


def _serve_kit(*args: str, served: list[KitSettings] | None = None) -> Result:
    """`serve kit-test ARGS`, built by serve_command from KitSettings; `served` gets the settings."""
    app = typer.Typer(add_completion=False)
    command = serve_command(
        KitSettings, (served if served is not None else []).append, help="Serve the kit test.",
        names={"batch_size": "--batch"}, omit=("metrics_port",),
    )  # fmt: skip
    app.command(cls=ServeCommand)(command)
    return CliRunner().invoke(app, list(args))


def test_serve_command_options_are_the_settings() -> None:
    help_text = _serve_kit("--help").output
    options = set(re.findall(r"^  (--[a-z-]+)", help_text, re.MULTILINE))
    secret_and_omitted = {"--admin-token", "--metrics-port"}
    expected = {"--" + name.replace("_", "-") for name in KitSettings.model_fields} - secret_and_omitted
    # batch_size is named --batch: one name, replacing the setting's, never a second one beside it
    assert options == (expected - {"--batch-size"}) | {"--batch", "--config", "--help"}
    assert "--batch-size" not in help_text
    env_vars = set(re.findall(r"BCSTACK_[A-Z_]+", help_text))
    assert env_vars == {env_var_name(KitSettings, name) for name in KitSettings.model_fields} - {
        "BCSTACK_KIT_TEST_METRICS_PORT"
    }


def test_serve_command_refuses_another_name_for_a_boolean() -> None:
    # A boolean setting is its --x/--no-x pair named after the setting, as every boolean of the CLI.
    with pytest.raises(ValueError, match="no other name for boolean setting"):
        serve_command(KitSettings, print, help="h", names={"log_json": "--json-logs"})


def test_serve_command_option_beats_env_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCSTACK_KIT_TEST_BATCH_SIZE", "16")
    monkeypatch.setenv("BCSTACK_KIT_TEST_LABEL", "from-env")
    served: list[KitSettings] = []
    result = _serve_kit("--batch", "8", "--log-json", served=served)
    assert result.exit_code == 0, result.output
    (settings,) = served
    assert (settings.batch_size, settings.label, settings.port) == (8, "from-env", 8100)
    assert settings.log_json is True
    # A boolean is a pair of flags, as every boolean of the CLI; the negative one beats its variable.
    monkeypatch.setenv("BCSTACK_KIT_TEST_LOG_JSON", "true")
    served.clear()
    assert _serve_kit("--no-log-json", served=served).exit_code == 0 and served[0].log_json is False
    served.clear()
    assert _serve_kit(served=served).exit_code == 0 and served[0].log_json is True
    monkeypatch.delenv("BCSTACK_KIT_TEST_LOG_JSON")
    # Values are checked by the settings model, and the message names where the value came from.
    bad = _serve_kit("--batch", "0")  # named as it was typed, not after the setting
    assert bad.exit_code == 2 and "invalid option --batch:" in bad.output, bad.output
    assert _serve_kit("--batch-size", "8").exit_code == 2  # the setting's name is not a second one
    monkeypatch.setenv("BCSTACK_KIT_TEST_PORT", "eighty")
    bad = _serve_kit()
    assert bad.exit_code == 2 and "invalid environment variable BCSTACK_KIT_TEST_PORT" in bad.output


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- logging ---------------------------------------------------------------------------------


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.mark.parametrize("as_json", [False, True])
def test_log_redaction_removes_registered_secrets(root_logging: None, as_json: bool) -> None:
    secret = f"sk-{'json' if as_json else 'text'}-9d8e7f6a5b4c"
    kit_logging.register_secret(SecretStr(secret))
    stream = io.StringIO()
    kit_logging.setup_logging("INFO", json=as_json, stream=stream)
    log = logging.getLogger("bcstack.test.redaction")
    log.info("calling grader with key %s", secret)
    try:
        raise RuntimeError(f"upstream refused key {secret}")
    except RuntimeError:
        log.exception("grader failed")
    output = stream.getvalue()
    assert secret not in output
    assert output.count(kit_logging.REDACTED) >= 2 and "grader failed" in output
    if as_json:
        first = json.loads(output.splitlines()[0])
        assert first["message"] == f"calling grader with key {kit_logging.REDACTED}"
        assert first["level"] == "INFO" and first["logger"] == "bcstack.test.redaction"


# --- HTTP ------------------------------------------------------------------------------------


class Item(BaseModel):
    name: str
    count: int


def _kit_app(admin_token: str | None = TOKEN, max_request_bytes: int = 1024) -> FastAPI:
    settings = load_settings(KitSettings, admin_token=admin_token, max_request_bytes=max_request_bytes)
    app = create_app("kit-test", settings, new_registry())

    @app.get("/items/{item_id}")
    async def get_item(item_id: int) -> dict:
        return {"id": item_id}

    @app.post("/items")
    async def post_item(item: Item) -> dict:
        return {"name": item.name, "count": item.count}

    @app.post("/admin/reload", dependencies=[Depends(require_admin)])
    async def reload() -> dict:
        return {"reloaded": True}

    return app


def test_admin_endpoints_need_the_bearer_token() -> None:
    client = TestClient(_kit_app())
    missing = client.post("/admin/reload")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert client.post("/admin/reload", headers={"Authorization": "Basic abc"}).status_code == 401
    wrong = client.post("/admin/reload", headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 403 and "not-the-token" not in wrong.text
    right = client.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200 and right.json() == {"reloaded": True}
    for response in (missing, wrong, right):
        assert TOKEN not in response.text


def test_admin_endpoints_are_disabled_without_a_token() -> None:
    client = TestClient(_kit_app(admin_token=None))
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": "Bearer "}):
        response = client.post("/admin/reload", headers=headers)
        assert response.status_code == 403
        assert "disabled" in response.json()["detail"]


def test_health_metrics_and_route_templates() -> None:
    client = TestClient(_kit_app())
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "service": "kit-test", "version": client.app.version}
    for item_id in (1, 2, 3):
        assert client.get(f"/items/{item_id}").status_code == 200
    assert client.get("/no/such/path").status_code == 404
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert (
        'bcstack_http_requests_total{code="200",method="GET",route="/items/{item_id}",service="kit-test"} 3.0'
        in text
    )
    assert 'route="/items/1"' not in text  # raw paths never become label values
    assert 'route="<unmatched>"' in text
    assert "bcstack_http_request_duration_seconds_bucket" in text
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(name.startswith("bcstack_") and ":" not in name for name in names)
    assert "_created" not in text
    # OpenMetrics when the scraper asks for it, as Prometheus does.
    openmetrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")


def test_validation_errors_are_json_without_echoing_input() -> None:
    client = TestClient(_kit_app())
    response = client.post("/items", json={"name": "n", "count": "secret-ish-value"})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail[0]["loc"] == ["body", "count"] and detail[0]["type"] == "int_parsing"
    assert "secret-ish-value" not in response.text


def test_request_body_limit_gives_413() -> None:
    client = TestClient(_kit_app(max_request_bytes=64))
    assert client.post("/items", json={"name": "n", "count": 1}).status_code == 200
    oversized = client.post("/items", json={"name": "n" * 100, "count": 1})
    assert oversized.status_code == 413 and "64-byte limit" in oversized.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while the app reads it
        yield b'{"name": "'
        yield b"n" * 100
        yield b'", "count": 1}'

    chunked = client.post("/items", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and "limit" in chunked.json()["detail"]
    assert 'code="413"' in client.get("/metrics").text


# --- gRPC ------------------------------------------------------------------------------------


class FakeJudge(judge_pb2_grpc.JudgeServiceServicer):
    """A tiny JudgeService: exact match; question "invalid" aborts; "slow:S" sleeps S seconds."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def GradeAnswer(self, request: judge_pb2.GradeAnswerRequest, context: grpc.aio.ServicerContext):
        if request.question == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "question is required")
        if request.question.startswith("slow:"):
            self.started.set()
            await asyncio.sleep(float(request.question.removeprefix("slow:")))
        correct = request.response.strip().lower() == request.correct_answer.strip().lower()
        return judge_pb2.GradeAnswerResponse(
            correct=correct, extracted_final_answer=request.response, grader_version="fake-1"
        )


def _grpc_server(judge: FakeJudge, **overrides) -> GrpcServer:
    settings = load_settings(KitSettings, grpc_port=0, **overrides)
    server = GrpcServer("kit-test", settings, new_registry())
    server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, judge)
    return server


def test_service_full_name_comes_from_the_descriptor() -> None:
    assert service_full_name(judge_pb2_grpc.add_JudgeServiceServicer_to_server) == "bcstack.v1.JudgeService"


def test_grpc_server_health_reflection_and_metrics() -> None:
    async def scenario() -> None:
        judge = FakeJudge()
        server = _grpc_server(judge)
        await server.start()
        try:
            async with aio_channel(server.target) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for name in ("", "bcstack.v1.JudgeService"):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING

                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
                listed: list[str] = []
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                async for reply in reflection.ServerReflectionInfo(iter([request]), timeout=5):
                    listed += [s.name for s in reply.list_services_response.service]
                assert "bcstack.v1.JudgeService" in listed and "grpc.health.v1.Health" in listed

                stub = judge_pb2_grpc.JudgeServiceStub(channel)
                graded = await stub.GradeAnswer(
                    judge_pb2.GradeAnswerRequest(question="q", response="Tartu", correct_answer="tartu"),
                    timeout=5,
                )
                assert graded.correct and graded.HasField("correct") and graded.grader_version == "fake-1"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GradeAnswer(judge_pb2.GradeAnswerRequest(question="invalid"), timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop(grace=1)
        # Shutdown flipped every service to NOT_SERVING.
        for name in ("", "bcstack.v1.JudgeService"):
            reply = await server.health.Check(health_pb2.HealthCheckRequest(service=name), None)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        text = generate_latest(server.registry).decode()
        method = "/bcstack.v1.JudgeService/GradeAnswer"
        assert f'bcstack_grpc_requests_total{{code="OK",method="{method}",service="kit-test"}} 1.0' in text
        assert (
            f'bcstack_grpc_requests_total{{code="INVALID_ARGUMENT",method="{method}",service="kit-test"}} 1.0'
            in text
        )
        assert (
            f'bcstack_grpc_request_duration_seconds_count{{method="{method}",service="kit-test"}} 2.0' in text
        )

    asyncio.run(scenario())


def test_grpc_stop_lets_an_in_flight_call_finish() -> None:
    async def scenario() -> None:
        judge = FakeJudge()
        server = _grpc_server(judge)
        await server.start()
        async with aio_channel(server.target) as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            call = asyncio.ensure_future(
                stub.GradeAnswer(
                    judge_pb2.GradeAnswerRequest(question="slow:0.5", response="a", correct_answer="a")
                )
            )
            await asyncio.wait_for(judge.started.wait(), 5)
            await server.stop(grace=5)  # returns once the in-flight call is done
            reply = await asyncio.wait_for(call, 5)  # answered, not cancelled
            assert reply.correct

    asyncio.run(scenario())


def test_standalone_metrics_server_for_grpc_only_processes() -> None:
    registry = new_registry()
    server, _thread = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        text = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).text
        assert "bcstack_process_cpu_seconds_total" in text
    finally:
        server.shutdown()


SIGTERM_SERVICE = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    from core.v1 import judge_pb2, judge_pb2_grpc
    from core.kit.grpc_server import GrpcServer
    from core.kit.http import create_app
    from core.kit.runner import run_service
    from core.kit.settings import ServiceSettings, load_settings

    http_port, grpc_port, marker = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])

    class SlowJudge(judge_pb2_grpc.JudgeServiceServicer):
        async def GradeAnswer(self, request, context):
            marker.touch()
            await asyncio.sleep(1.5)
            return judge_pb2.GradeAnswerResponse(correct=True, grader_version="slow")

    settings = load_settings(ServiceSettings, port=http_port, grpc_port=grpc_port, shutdown_grace_seconds=20)
    grpc_server = GrpcServer("slow-judge", settings)
    grpc_server.add(judge_pb2_grpc.add_JudgeServiceServicer_to_server, SlowJudge())
    app = create_app("slow-judge", settings, grpc_server.registry)
    run_service(settings, http_app=app, grpc_server=grpc_server)
    print("exited cleanly", flush=True)
    """
)


def test_sigterm_drains_in_flight_rpc_then_exits(tmp_path: Path) -> None:
    http_port, grpc_port = find_free_port(), find_free_port()
    marker = tmp_path / "rpc-started"
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SERVICE, str(http_port), str(grpc_port), str(marker)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(grpc_port, timeout=30)
        wait_for_port(http_port, timeout=30)
        assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).json()["service"] == "slow-judge"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            future = stub.GradeAnswer.future(judge_pb2.GradeAnswerRequest(question="q"), timeout=30)
            wait_until(marker.exists, timeout=10, message="the slow RPC to start")
            proc.send_signal(signal.SIGTERM)
            reply = future.result(timeout=30)  # finishes inside the grace period
            assert reply.correct and reply.grader_version == "slow"
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        assert "exited cleanly" in stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# --- a real Prometheus server ----------------------------------------------------------------


@pytest.mark.slow
def test_real_prometheus_scrapes_the_app(tmp_path: Path) -> None:
    binary = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if binary is None:
        pytest.fail(
            "the Prometheus server is not installed (Debian package `prometheus`): run `make install-test`"
        )

    app_port, prom_port = find_free_port(), find_free_port()
    settings = load_settings(KitSettings, port=app_port, log_level="warning")
    app = create_app("kit-prom", settings, new_registry())
    http = uvicorn_server(app, settings)
    thread = threading.Thread(target=http.run, name="uvicorn-kit-prom", daemon=True)
    thread.start()

    config = tmp_path / "prometheus.yml"
    config.write_text(
        textwrap.dedent(
            f"""
            global:
              scrape_interval: 1s
              scrape_timeout: 1s
              evaluation_interval: 1s
            scrape_configs:
              - job_name: bcstack-kit
                static_configs:
                  - targets: ["127.0.0.1:{app_port}"]
            """
        )
    )
    prom_log = (tmp_path / "prometheus.log").open("w")
    prometheus = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=prom_log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(app_port, timeout=15)
        for _ in range(3):
            assert httpx.get(f"http://127.0.0.1:{app_port}/health", timeout=5).status_code == 200
        api = f"http://127.0.0.1:{prom_port}/api/v1/query"
        query = 'bcstack_http_requests_total{job="bcstack-kit",service="kit-prom",route="/health",code="200"}'

        def scraped() -> list[dict] | None:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
            body = httpx.get(api, params={"query": query}, timeout=2).json()
            assert body["status"] == "success", body
            return body["data"]["result"]

        result = wait_until(scraped, timeout=45, interval=0.5, message="Prometheus to scrape the app")
        assert float(result[0]["value"][1]) >= 3
        assert result[0]["metric"]["method"] == "GET"
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()
        prom_log.close()
        http.should_exit = True
        thread.join(timeout=10)
