"""`bcstack loadtest retrieval`: real load against a small in-test server on loopback.

The server implements the retrieval contract on both transports (HTTP `POST /search`, gRPC
`RetrievalService/Search` from the checked-in stubs), answers a fixed result after a small delay,
and counts what it receives, so the tests can check that the report misses no request.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import typer
import uvicorn
from conftest import LOOPBACK, find_free_port, wait_for_port
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from PIL import Image
from typer.testing import CliRunner

from core.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.retrieval import loadtest
from services.retrieval.loadtest import LoadTestConfig, LoadTestConfigError, run_loadtest
from services.retrieval.loadtest_cli import app as loadtest_app

ROOT = Path(__file__).resolve().parents[1]
FAIL_PREFIX = "FAIL"  # queries starting with this get HTTP 503 / gRPC UNAVAILABLE
HIT = {"docid": "doc-1", "url": "https://toy.example/doc-1", "text": "a fixed hit", "score": 1.0}


class ToyRetrievalServer:
    """HTTP + gRPC retrieval contract on free loopback ports, counting requests and queries."""

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s = delay_s
        self.http_port = find_free_port()
        self.grpc_port = find_free_port()
        self.http_queries: Counter[str] = Counter()
        self.grpc_queries: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(self._http_app(), host=LOOPBACK, port=self.http_port, log_level="warning")
        )
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(self._servicer(), self._grpc)
        self._grpc.add_insecure_port(f"{LOOPBACK}:{self.grpc_port}")

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_count(self) -> int:
        return sum(self.http_queries.values())

    @property
    def grpc_count(self) -> int:
        with self._lock:
            return sum(self.grpc_queries.values())

    def reset(self) -> None:
        with self._lock:
            self.http_queries.clear()
            self.grpc_queries.clear()

    def _http_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/search")
        async def search(body: dict):
            query = body.get("query", "")
            self.http_queries[query] += 1  # one event-loop thread: no lock needed
            await asyncio.sleep(self.delay_s)
            if query.startswith(FAIL_PREFIX):
                return JSONResponse({"detail": "retrievers unavailable"}, status_code=503)
            return {"results": [HIT] * min(body.get("k", 10), 3)}

        return app

    def _servicer(self) -> retrieval_pb2_grpc.RetrievalServiceServicer:
        server = self

        class Servicer(retrieval_pb2_grpc.RetrievalServiceServicer):
            def Search(self, request, context):
                with server._lock:
                    server.grpc_queries[request.query] += 1
                time.sleep(server.delay_s)
                if request.query.startswith(FAIL_PREFIX):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "retrievers unavailable")
                return retrieval_pb2.SearchResponse(hits=[retrieval_pb2.SearchHit(**HIT)])

        return Servicer()

    def __enter__(self) -> ToyRetrievalServer:
        self._grpc.start()
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        wait_for_port(self.http_port)
        wait_for_port(self.grpc_port)
        return self

    def __exit__(self, *exc: object) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
        self._grpc.stop(grace=None)


@pytest.fixture(scope="module")
def server():
    with ToyRetrievalServer() as srv:
        yield srv


@pytest.fixture
def fresh(server):
    server.reset()
    return server


def _cli(*args: str):
    """Invoke the command mounted the way bcstack/cli.py mounts it (its help renderer too)."""
    root = typer.Typer(rich_markup_mode=None)
    root.add_typer(loadtest_app, name="loadtest")

    @root.callback()
    def _root() -> None:
        pass

    return CliRunner().invoke(root, ["loadtest", "retrieval", *args])


def _assert_png(path: Path) -> None:
    assert path.stat().st_size > 10_000, "an empty or trivial plot"
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 400


def test_http_closed_loop_counts_every_request_and_writes_the_report(fresh, tmp_path):
    questions = tmp_path / "questions.jsonl"
    asked = [f"toy question number {i}" for i in range(7)]
    questions.write_text(
        "".join(json.dumps({"query_id": str(i), "query": q}) + "\n" for i, q in enumerate(asked))
    )
    out = tmp_path / "out"
    result = _cli(
        "--url", fresh.http_url, "--concurrency", "4", "--duration", "2", "--queries", str(questions),
        "--k", "5", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] > 50 and report["errors"] == 0 and report["errors_by_kind"] == {}
    # Nothing uncounted: the server saw exactly what the report (and Locust's own stats) counted.
    assert fresh.http_count == report["requests"] + report["warmup_requests"]
    assert report["locust_stats"]["requests"] == fresh.http_count
    assert report["aborted_requests"] == 0
    # Users cycled through the file's queries, and only those.
    assert set(fresh.http_queries) == set(asked)
    assert max(fresh.http_queries.values()) - min(fresh.http_queries.values()) <= 1
    # The report carries what a reader needs to redo the numbers.
    assert report["config"]["concurrency"] == 4 and report["config"]["k"] == 5
    assert report["machine"]["cpu_cores"] >= 1 and report["machine"]["cpu_model"]
    assert report["started_at"] and report["versions"]["locust"]
    assert len(report["samples"]["latency_ms"]) == report["requests"]
    assert sum(report["histogram"]["counts"]) == report["requests"]
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"] < 1000
    assert lat["p50"] >= fresh.delay_s * 1000 * 0.9, "latency must include the server's delay"
    assert (
        abs(report["achieved_qps"] - report["requests"] / report["window_s"]) < 0.1 * report["achieved_qps"]
    )
    # One row per second of the window, and every request in a row; a closed-loop user that passed
    # its deadline check just before the window ended sends a hair after it, in a row of its own
    # (seen once in a two-worker suite run: three rows, the last with one request).
    seconds = [row["second"] for row in report["timeline"]]
    assert seconds[:2] == [0, 1] and seconds == list(range(len(seconds))) and len(seconds) <= 3, seconds
    assert sum(row["requests"] for row in report["timeline"]) == report["requests"]
    _assert_png(out / "latency.png")
    # Table on stdout, live progress on stderr.
    assert "achieved QPS" in result.stdout and "p99" in result.stdout
    assert "req/s" in result.stderr and "p50" in result.stderr


def test_grpc_closed_loop_with_warmup(fresh, tmp_path):
    config = LoadTestConfig(
        url=fresh.grpc_addr, grpc=True, concurrency=4, duration_s=2, warmup_s=0.5, mode="lexical"
    )
    report = run_loadtest(config)
    assert report.requests > 50 and report.errors == 0, report.errors_by_message
    assert report.warmup_requests > 0, "the warmup must send load"
    assert fresh.grpc_count == report.requests + report.warmup_requests
    assert report.locust_stats["requests"] == fresh.grpc_count
    assert report.versions.get("grpcio")
    assert report.latency_ms["p50"] >= fresh.delay_s * 1000 * 0.9
    assert set(fresh.grpc_queries) <= set(loadtest.DEFAULT_QUERIES) and len(fresh.grpc_queries) > 1
    report.write_json(tmp_path / "report.json")
    loadtest.write_latency_png(report, tmp_path / "latency.png")
    assert json.loads((tmp_path / "report.json").read_text())["config"]["grpc"] is True
    _assert_png(tmp_path / "latency.png")


def test_open_loop_holds_the_target_rate(fresh, tmp_path):
    out = tmp_path / "out"
    result = _cli("--url", fresh.http_url, "--qps", "50", "--duration", "3", "--out", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["errors"] == 0
    assert report["achieved_qps"] == pytest.approx(50, rel=0.2)
    assert report["sent_qps"] == pytest.approx(50, rel=0.2)
    assert report["requests"] == pytest.approx(150, rel=0.2)
    assert report["target_qps"] == 50 and report["rate_honoured"] is True
    assert fresh.http_count == report["requests"] + report["warmup_requests"]
    # Arrivals follow the schedule: every second of the window got about 50 requests.
    assert [row["requests"] for row in report["timeline"][:3]] == [pytest.approx(50, abs=10)] * 3
    assert report["schedule_lag_ms"]["p50"] < 20
    assert "target QPS" in result.stdout


def test_open_loop_reports_when_the_server_cannot_keep_up(fresh):
    # 4 users against a 50 ms server can carry at most ~80 QPS: a 200 QPS target must be flagged.
    fresh.delay_s = 0.05
    try:
        report = run_loadtest(LoadTestConfig(url=fresh.http_url, qps=200, users=4, duration_s=1.5))
    finally:
        fresh.delay_s = 0.002
    assert report.errors == 0
    assert report.achieved_qps < 120 and report.rate_honoured is False
    assert report.late_starts > 0 and report.schedule_lag_ms["max"] > 100
    assert any("target rate not reached" in w for w in report.warnings())
    assert fresh.http_count == report.requests + report.warmup_requests


def test_server_errors_are_counted_by_kind_and_fail_the_run(fresh, tmp_path):
    queries = tmp_path / "queries.txt"
    queries.write_text("a good query\n\nFAIL this one\n")
    out = tmp_path / "out"
    result = _cli(
        "--url", fresh.http_url, "--concurrency", "2", "--duration", "1", "--queries", str(queries),
        "--out", str(out), "-q",
    )  # fmt: skip
    assert result.exit_code == 1
    report = json.loads((out / "report.json").read_text())
    assert report["errors_by_kind"] == {"http_503": report["errors"]}
    assert report["errors"] == pytest.approx(report["requests"] / 2, abs=2)
    assert any("retrievers unavailable" in msg for msg in report["errors_by_message"])
    assert fresh.http_count == report["requests"] + report["warmup_requests"]

    grpc_report = run_loadtest(
        LoadTestConfig(url=fresh.grpc_addr, grpc=True, concurrency=2, duration_s=1, queries=("FAIL", "ok"))
    )
    assert set(grpc_report.errors_by_kind) == {"grpc_unavailable"}
    assert grpc_report.problem() and "failed" in grpc_report.problem()


def test_closed_port_is_one_line_before_any_load_or_folder(tmp_path):
    port = find_free_port()
    out = tmp_path / "out"
    for grpc_flag in ([], ["--grpc"]):
        url = f"{LOOPBACK}:{port}" if grpc_flag else f"http://{LOOPBACK}:{port}"
        start = time.monotonic()
        result = _cli("--url", url, *grpc_flag, "--concurrency", "2", "--duration", "1", "--out", str(out))
        assert result.exit_code == 1 and "Traceback" not in result.output
        error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(error_lines) == 1 and "nothing answers" in error_lines[0] and str(port) in error_lines[0]
        assert not out.exists()  # no report of requests that were never worth sending
        # Refused at once, gRPC included (its channel alone would retry until the 5 s deadline; the
        # HTTP case, first, also pays the command's first imports).
        assert time.monotonic() - start < (4.5 if grpc_flag else 10)


def test_the_grpc_precheck_connects_only_to_host_port_targets():
    from services.retrieval.loadtest_cli import _refused

    port = find_free_port()
    assert "ConnectionRefusedError" in (_refused(f"{LOOPBACK}:{port}", 1.0) or "")
    for target in (f"[::1]:{port}", f"localhost:{port}"):  # refused, or no IPv6 on this machine
        assert _refused(target, 1.0) is not None, target
    # A name with a scheme is the gRPC channel's to resolve: no TCP connect is tried.
    for target in (f"ipv4:{LOOPBACK}:{port}", f"dns:///localhost:{port}", "unix:/tmp/x.sock", "noport"):
        assert _refused(target, 1.0) is None, target


def test_the_default_report_folder_is_under_the_state_folder(fresh, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _cli(
        "--url", fresh.http_url, "--concurrency", "1", "--duration", "1", "--max-requests", "3", "-q"
    )
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [".bcstack"]
    (folder,) = (tmp_path / ".bcstack" / "loadtest").iterdir()
    assert (folder / "report.json").is_file() and (folder / "latency.png").is_file()


def test_a_closed_port_under_load_reports_errors(tmp_path):
    """The library still measures a target that dies mid-run: every request an error, by kind."""
    port = find_free_port()
    report = run_loadtest(LoadTestConfig(url=f"http://{LOOPBACK}:{port}", concurrency=2, duration_s=1))
    assert report.requests > 0 and report.errors == report.requests
    assert set(report.errors_by_kind) == {"connection_refused"}
    assert report.problem() and "failed" in report.problem()

    grpc_report = run_loadtest(
        LoadTestConfig(url=f"{LOOPBACK}:{port}", grpc=True, concurrency=2, duration_s=1)
    )
    assert grpc_report.requests > 0 and grpc_report.errors == grpc_report.requests
    assert set(grpc_report.errors_by_kind) == {"grpc_unavailable"}


def test_max_requests_ends_the_run_early(fresh):
    start = time.monotonic()
    report = run_loadtest(LoadTestConfig(url=fresh.http_url, concurrency=3, duration_s=30, max_requests=40))
    assert time.monotonic() - start < 15
    assert report.requests == 40 and report.errors == 0 and fresh.http_count == 40
    assert report.window_s < 10


def test_a_load_generator_that_overruns_its_hard_limit_is_killed(fresh, monkeypatch):
    monkeypatch.setattr(loadtest, "STARTUP_ALLOWANCE_S", -2.3)  # hard limit 0.2 s: less than startup
    with pytest.raises(loadtest.LoadTestError, match="killed"):
        run_loadtest(LoadTestConfig(url=fresh.http_url, concurrency=1, duration_s=1, timeout_s=0.5))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "2", "--qps", "5", "--duration", "1"], "exactly one"),
        (["--duration", "1"], "exactly one"),
        (["--concurrency", "2", "--duration", "0"], "--duration"),
        (["--qps", "5", "--duration", "-3"], "--duration"),
        (["--concurrency", "2", "--duration", "1", "--queries", "/no/such/queries.txt"], "not found"),
        (["--concurrency", "0", "--duration", "1"], "concurrency"),
    ],
    ids=["both", "neither", "zero-duration", "negative-duration", "missing-queries", "zero-users"],
)
def test_usage_errors_exit_2(args, message, tmp_path):
    result = _cli("--url", f"http://{LOOPBACK}:9", "--out", str(tmp_path / "out"), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists(), "a usage error must not start a run"


def test_config_validation_in_python():
    with pytest.raises(LoadTestConfigError, match="exactly one"):
        LoadTestConfig(url="http://127.0.0.1:1", duration_s=1)
    with pytest.raises(LoadTestConfigError, match="duration"):
        LoadTestConfig(url="http://127.0.0.1:1", duration_s=0, qps=5)
    with pytest.raises(LoadTestConfigError, match="host:port"):
        LoadTestConfig(url="http://127.0.0.1:1", duration_s=1, qps=5, grpc=True)
    with pytest.raises(LoadTestConfigError, match="http://"):
        LoadTestConfig(url="127.0.0.1:1", duration_s=1, qps=5)
    assert LoadTestConfig(url="http://h:1", duration_s=1, qps=5).target() == ("http://h:1", "/search")
    assert LoadTestConfig(url="http://h:1/v2/find", duration_s=1, qps=5).target() == (
        "http://h:1",
        "/v2/find",
    )
    assert LoadTestConfig(url="h:1", grpc=True, duration_s=1, qps=5).target() == ("h:1", "")
    assert LoadTestConfig(url="http://h:1", duration_s=1, qps=2.5).user_count == 8
    assert LoadTestConfig(url="http://h:1", duration_s=1, qps=300).user_count == 300


def test_load_queries_reads_text_and_jsonl(tmp_path):
    text = tmp_path / "q.txt"
    text.write_text("first query\n\n  second query  \n")
    assert loadtest.load_queries(text) == ("first query", "second query")
    jsonl = tmp_path / "questions.jsonl"
    jsonl.write_text('{"query_id": "1", "query": "who?"}\n{"query_id": "2", "query": "when?"}\n')
    assert loadtest.load_queries(jsonl) == ("who?", "when?")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query_id": "1"}\n')
    with pytest.raises(LoadTestConfigError, match=r"bad.jsonl:1"):
        loadtest.load_queries(bad)
    with pytest.raises(LoadTestConfigError, match="not found"):
        loadtest.load_queries(tmp_path / "missing.txt")


def test_statistics_helpers():
    assert loadtest.percentile([], 50) is None
    assert loadtest.percentile([1, 2, 3, 4], 50) == 2.5  # numpy.percentile([1, 2, 3, 4], 50)
    assert loadtest.percentile(list(range(101)), 99) == 99
    hist = loadtest.log_histogram([1.0, 2.0, 2.0, 10.0, 100.0])
    assert sum(hist["counts"]) == 5 and len(hist["edges_ms"]) == len(hist["counts"]) + 1
    assert hist["edges_ms"][0] <= 1.0 and hist["edges_ms"][-1] >= 100.0
    rows = loadtest.per_second_timeline(
        [0.1, 0.5, 1.2, 1.9], [1.0, 3.0, 5.0, 7.0], [True, True, True, False], 2.0
    )
    assert [(r["requests"], r["errors"], r["p50_ms"]) for r in rows] == [(2, 0, 2.0), (2, 1, 5.0)]


def test_help_explains_every_option_with_units():
    result = _cli("--help")
    assert result.exit_code == 0
    for option in ("--url", "--concurrency", "--qps", "--duration", "--grpc", "--queries", "--k", "--out",
                   "--warmup", "--timeout", "--users", "--max-requests"):  # fmt: skip
        assert option in result.output
    assert "seconds" in result.output and "requests per second" in result.output


def test_importing_the_module_does_not_monkey_patch_the_caller():
    code = (
        "import asyncio, socket, sys\n"
        "import services.retrieval.loadtest, services.retrieval.loadtest_cli\n"
        "assert 'locust' not in sys.modules and 'gevent' not in sys.modules, 'locust/gevent imported'\n"
        "assert socket.socket.__module__ == 'socket', socket.socket.__module__\n"
        "asyncio.run(asyncio.sleep(0))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
