"""The worker service end to end with real processes on the toy world.

retrieval (`bcstack serve retrieval`, embedded backends) + engine (`bcstack serve engine`:
the scripted expert, or the CPU engine over the untrained tiny model) + worker
(`bcstack serve worker`), talking over loopback HTTP and gRPC; plus a real Prometheus server
scraping the worker and the engine.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from conftest import find_free_port, link_toy_kit, wait_until
from prom_util import prometheus, query
from prometheus_client.parser import text_string_to_metric_families
from stack_util import bcstack_process, bcstack_processes, retrieval_spec

from core import protocol as p
from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE


@pytest.fixture(scope="module")
def stack(tmp_path_factory, toy_kit):
    tmp = tmp_path_factory.mktemp("stack")
    world = toy_kit["world"]
    link_toy_kit(toy_kit, tmp)
    ports = {name: find_free_port() for name in ("r_http", "r_grpc", "e_http", "t_http", "w_http", "w_grpc")}
    expert = ["serve", "engine", "--policy", "expert", "--tokenizer", str(tmp / "tiny")]
    worker = ["serve", "worker", "--tokenizer", str(tmp / "tiny"), "--engine-url",
              f"http://127.0.0.1:{ports['e_http']}", "--retrieval-address", f"127.0.0.1:{ports['r_grpc']}",
              "--port", str(ports["w_http"]), "--grpc-port", str(ports["w_grpc"])]  # fmt: skip
    # Forked from the forkserver (stack_util): real processes that skip seconds of imports each;
    # `python -m bcstack serve worker` itself runs in the last test.
    with bcstack_processes(
        [
            retrieval_spec(tmp / "idx", ports["r_http"], ports["r_grpc"]),
            ([*expert, "--port", str(ports["e_http"])], f"http://127.0.0.1:{ports['e_http']}/health"),
            (
                ["serve", "engine", "--model", str(tmp / "tiny"), "--port", str(ports["t_http"])],
                f"http://127.0.0.1:{ports['t_http']}/health",
            ),
            (worker, f"http://127.0.0.1:{ports['w_http']}/health"),
        ],  # fmt: skip
        forked=True,
    ):
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['w_grpc']}")
        yield {"tmp": tmp, "world": world, "ports": ports, "stub": worker_pb2_grpc.WorkerServiceStub(channel)}
        channel.close()


def _worker(tiny, engine_url: str, retrieval: str, http: int, grpc_port: int, config=None):
    args = ["serve", "worker", "--tokenizer", str(tiny), "--engine-url", engine_url]
    args += ["--retrieval-address", retrieval, "--port", str(http), "--grpc-port", str(grpc_port)]
    if config is not None:
        args += ["--config", str(config)]
    return bcstack_process(args, f"http://127.0.0.1:{http}/health", forked=True)


def _branch(question: str, **kw) -> worker_pb2.RunWorkerEpisodeRequest:
    return worker_pb2.RunWorkerEpisodeRequest(
        branch=worker_pb2.BranchTask(
            description="answer", prompt=WORKER_TASK_TEMPLATE.format(question=question)
        ),
        **kw,
    )


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_expert_worker_answers_easy_questions_with_well_formed_trajectories(stack):
    easy = [q for q in stack["world"].test if q["data_source"] == "bc_test_easy"]
    for q in easy:
        resp = stack["stub"].RunEpisode(_branch(q["query"]), timeout=120)
        assert resp.report.stop_reason == common_pb2.STOP_REASON_FINISH, resp.trajectory.error
        assert resp.report.answer == q["answer"]
        t = resp.trajectory
        generated = [i for turn in t.turns for i in range(turn.gen_start, turn.gen_end)]
        assert [i for i, m in enumerate(t.loss_mask) if m] == generated
        assert len(t.rollout_logprobs) == len(generated) == resp.usage.completion_tokens
        assert t.tokens_used == len(t.token_ids) == resp.usage.total_tokens
        for prev, cur in zip(t.turns, t.turns[1:], strict=False):
            assert cur.prompt_start == prev.gen_end  # the observation follows the generation
            assert cur.gen_start > cur.prompt_start
        assert p.parse_worker_reports(resp.report.raw_text)[0].answer == q["answer"]
        assert {c.name for c in t.tool_calls} <= {"search", "open_page", "finish"}


def test_a_batch_of_episodes_streams_back_in_completion_order(stack):
    easy = [q for q in stack["world"].test if q["data_source"] == "bc_test_easy"][:3]
    batch = worker_pb2.RunWorkerEpisodesRequest(
        episodes=[_branch(q["query"], episode_id=f"g0-{i}") for i, q in enumerate(easy)]
    )
    responses = list(stack["stub"].RunEpisodes(batch, timeout=120))
    assert sorted(r.episode_id for r in responses) == ["g0-0", "g0-1", "g0-2"]
    answers = {r.episode_id: r.report.answer for r in responses}
    assert answers == {f"g0-{i}": q["answer"] for i, q in enumerate(easy)}
    duplicate = worker_pb2.RunWorkerEpisodesRequest(
        episodes=[_branch("a", episode_id="x"), _branch("b", episode_id="x")]
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stack["stub"].RunEpisodes(duplicate, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    too_many = worker_pb2.RunWorkerEpisodesRequest(episodes=[_branch("q") for _ in range(65)])
    with pytest.raises(grpc.RpcError) as err:
        list(stack["stub"].RunEpisodes(too_many, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "do not fit" in err.value.details()


def test_untrained_tiny_model_episodes_end_with_a_recorded_reason(stack, tmp_path):
    ports = stack["ports"]
    w_http, w_grpc = find_free_port(), find_free_port()
    tiny_engine, retrieval = f"http://127.0.0.1:{ports['t_http']}", f"127.0.0.1:{ports['r_grpc']}"
    with _worker(stack["tmp"] / "tiny", tiny_engine, retrieval, w_http, w_grpc):
        stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"127.0.0.1:{w_grpc}"))
        budget = common_pb2.BudgetOverrides(max_tokens=1200, max_turns=4, max_new_tokens=200)
        reasons = Counter()
        for q in stack["world"].test[:2]:
            resp = stub.RunEpisode(_branch(q["query"], budget=budget), timeout=300)
            t = resp.trajectory
            assert resp.report.stop_reason in (
                common_pb2.STOP_REASON_BUDGET, common_pb2.STOP_REASON_TURNS, common_pb2.STOP_REASON_FINISH,
            ), t.error  # fmt: skip
            assert t.tokens_used <= 1200 and len(t.turns) <= 4
            assert all(turn.generated_tokens <= 200 for turn in t.turns)
            assert all(turn.weight_version for turn in t.turns)
            reasons[resp.report.stop_reason] += 1
        assert sum(reasons.values()) == 2


def test_metrics_match_the_recorded_episodes_and_prometheus_scrapes_them(stack, tmp_path):
    ports = stack["ports"]
    before = _metrics(ports["w_http"])
    results = [stack["stub"].RunEpisode(_branch(q["query"]), timeout=120) for q in stack["world"].test[8:12]]
    after = _metrics(ports["w_http"])
    by_reason = Counter(
        common_pb2.StopReason.Name(r.report.stop_reason).removeprefix("STOP_REASON_").lower() for r in results
    )
    for reason in ("finish", "budget", "turns", "context", "error"):
        key = ("bcstack_worker_episodes_total", (("stop_reason", reason),))
        assert after[key] - before.get(key, 0) == by_reason.get(reason, 0)
    calls = Counter((c.name, c.outcome) for r in results for c in r.trajectory.tool_calls)
    for (tool, outcome), n in calls.items():
        key = ("bcstack_worker_tool_calls_total", (("outcome", outcome), ("tool", tool)))
        assert after[key] - before.get(key, 0) == n
    tokens = ("bcstack_worker_episode_tokens_sum", ())
    assert after[tokens] - before[tokens] == sum(r.trajectory.tokens_used for r in results)
    assert after[("bcstack_worker_limit", (("limit", "max_tokens"),))] == 24576
    assert after[("bcstack_worker_limit", (("limit", "max_turns"),))] == 40

    targets = {"worker": f"127.0.0.1:{ports['w_http']}", "engine": f"127.0.0.1:{ports['e_http']}"}
    with prometheus(tmp_path, targets) as api:

        def scraped():
            series = query(api, 'sum by (stop_reason) (bcstack_worker_episodes_total{job="worker"})')
            engine = query(api, 'up{job="engine"}')
            return series if series and engine and engine[0]["value"][1] == "1" else None

        series = wait_until(scraped, timeout=45, interval=0.5, message="Prometheus to scrape the worker")
        finished = {s["metric"]["stop_reason"]: float(s["value"][1]) for s in series}
        assert finished["finish"] == after[("bcstack_worker_episodes_total", (("stop_reason", "finish"),))]


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (worker_pb2.RunWorkerEpisodeRequest(), "no task"),
        (worker_pb2.RunWorkerEpisodeRequest(branch=worker_pb2.BranchTask(prompt="  ")), "non-empty prompt"),
        (worker_pb2.RunWorkerEpisodeRequest(chat=worker_pb2.ChatTask()), "user message"),
        (_branch("q", budget=common_pb2.BudgetOverrides(max_tokens=0)), "positive integer"),
        (_branch("q", budget=common_pb2.BudgetOverrides(max_turns=-3)), "positive integer"),
        (_branch("q", sampling=common_pb2.SamplingOverrides(top_p=1.5)), "top_p"),
        # bench/fuzz_grpc.py: an infinite temperature reached the engine's JSON body (UNKNOWN)
        (_branch("q", sampling=common_pb2.SamplingOverrides(temperature=float("inf"))), "temperature"),
        (_branch("q", sampling=common_pb2.SamplingOverrides(temperature=float("nan"))), "temperature"),
        (_branch("x" * 300_000), "limit"),
    ],
)
def test_bad_requests_are_invalid_argument_and_the_service_keeps_serving(stack, request_, words):
    with pytest.raises(grpc.RpcError) as err:
        stack["stub"].RunEpisode(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    q = stack["world"].test[0]
    assert stack["stub"].RunEpisode(_branch(q["query"]), timeout=120).report.answer == q["answer"]


class _FakeEngine(BaseHTTPRequestHandler):
    """An SGLang stand-in that fails: 500 on /generate, or hangs (mode set on the server).

    A hung request ends when the test's `with` block does: its thread must not outlive the test and
    write, seconds later, a BrokenPipe traceback into whatever the xdist worker runs next (it broke
    tests/test_loadtest.py's "no traceback" check, whose CliRunner captures the process's stderr)."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.server.mode == "hang" and self.server.closing.wait(self.server.hang_s):
            return  # the test is over: no answer to a client that has gone
        body = json.dumps({"error": {"message": "CUDA out of memory"}}).encode()
        self.send_response(500)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def handle(self):
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that timed out
            super().handle()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _fake_engine(mode: str, hang_s: float = 30.0):
    server = ThreadingHTTPServer(("127.0.0.1", find_free_port()), _FakeEngine)
    server.mode, server.hang_s, server.closing = mode, hang_s, threading.Event()
    # not daemons, so server_close() joins the request threads (block_on_close): none outlives the test
    server.daemon_threads = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.closing.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", ["500", "hang"])
def test_failing_engine_gives_a_recorded_error_stop(stack, tmp_path, mode):
    ports = stack["ports"]
    w_http, w_grpc = find_free_port(), find_free_port()
    config = tmp_path / "worker.yaml"
    config.write_text("engine_timeout_seconds: 0.4\nengine_retries: 2\n")  # 3 tries of a hang: 1.2 s
    with (
        _fake_engine(mode) as engine_url,
        _worker(stack["tmp"] / "tiny", engine_url, f"127.0.0.1:{ports['r_grpc']}", w_http, w_grpc, config),
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"127.0.0.1:{w_grpc}"))
        t0 = time.monotonic()
        resp = stub.RunEpisode(_branch("anything"), timeout=60)
        assert resp.report.stop_reason == common_pb2.STOP_REASON_ERROR
        assert resp.trajectory.error and time.monotonic() - t0 < 20
        assert (
            stub.RunEpisode(_branch("again"), timeout=60).report.stop_reason == common_pb2.STOP_REASON_ERROR
        )
        assert httpx.get(f"http://127.0.0.1:{w_http}/health").status_code == 200


def test_retrieval_down_is_an_error_stop(stack, tmp_path):
    ports = stack["ports"]
    w_http, w_grpc = find_free_port(), find_free_port()
    config = tmp_path / "worker.yaml"
    config.write_text("retrieval_timeout_seconds: 1\nretrieval_retries: 2\nretrieval_wait_seconds: 0\n")
    nowhere = f"127.0.0.1:{find_free_port()}"
    with _worker(
        stack["tmp"] / "tiny", f"http://127.0.0.1:{ports['e_http']}", nowhere, w_http, w_grpc, config
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"127.0.0.1:{w_grpc}"))
        resp = stub.RunEpisode(_branch(stack["world"].test[0]["query"]), timeout=60)
        assert (
            resp.report.stop_reason == common_pb2.STOP_REASON_ERROR and "UNAVAILABLE" in resp.trajectory.error
        )
        assert resp.trajectory.tool_calls[-1].outcome == "error"


def test_a_full_worker_pushes_back_with_resource_exhausted(stack, tmp_path):
    ports = stack["ports"]
    w_http, w_grpc = find_free_port(), find_free_port()
    config = tmp_path / "worker.yaml"
    config.write_text("max_concurrent_episodes: 1\nengine_timeout_seconds: 10\nengine_retries: 1\n")
    with (
        _fake_engine("hang", hang_s=2.0) as engine_url,
        _worker(stack["tmp"] / "tiny", engine_url, f"127.0.0.1:{ports['r_grpc']}", w_http, w_grpc, config),
    ):
        channel = grpc.insecure_channel(f"127.0.0.1:{w_grpc}")
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        first = stub.RunEpisode.future(_branch("first"), timeout=60)
        wait_until(lambda: _metrics(w_http)[("bcstack_worker_active_episodes", ())] == 1, timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            stub.RunEpisode(_branch("second"), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert first.result().report.stop_reason == common_pb2.STOP_REASON_ERROR
        assert _metrics(w_http)[("bcstack_worker_rejected_total", (("reason", "full"),))] == 1
        channel.close()


def test_bcstack_serve_worker_without_tokenizer_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "bcstack", "serve", "worker", "--port", "0"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "tokenizer" in result.stderr and "Traceback" not in result.stderr
