"""The coordinator gateway end to end, every part a real process on loopback.

Retrieval (`bcstack serve retrieval`, embedded backends over a toy world) + the scripted expert
engine + worker replicas (`bcstack serve worker`) + scripted coordinator LLMs
(`bcstack serve coordinator-llm`, some with injected faults) + the gateway
(`bcstack serve coordinator`), talking HTTP, SSE and gRPC. Each is forked from the forkserver
(stack_util: its own process, seconds of imports skipped) but the restarted gateway, which starts
as `python -m bcstack serve coordinator`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from conftest import find_free_port, link_toy_kit, wait_until
from prometheus_client.parser import text_string_to_metric_families
from stack_util import bcstack_process, bcstack_processes, retrieval_spec
from test_worker_rolling import StandInApiServer, _kubeconfig, _pod

from core.v1 import coordinator_pb2, coordinator_pb2_grpc

ADMIN = "gateway-admin-token-123"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
LOCAL = "127.0.0.1"


def _url(port: int, path: str = "") -> str:
    return f"http://{LOCAL}:{port}{path}"


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = httpx.get(_url(port, "/metrics"), timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _llm_requests(port: int, outcome: str = "ok") -> float:
    return _metrics(port)[("bcstack_coordinator_llm_requests_total", (("outcome", outcome),))]


def coordinator_llm_spec(model: str, **faults) -> tuple[tuple, dict]:
    """(a `bcstack_processes` spec, the endpoint) of a stand-in coordinator LLM with `faults`."""
    port = find_free_port()
    env = {f"BCSTACK_COORDINATOR_LLM_{k.upper()}": str(v) for k, v in faults.items()}
    # A stand-in has nothing worth draining: its requests left hanging (fail_mode "hang") would hold
    # its SIGTERM for the default 10 s grace, once per module that stops one.
    env.setdefault("BCSTACK_COORDINATOR_LLM_SHUTDOWN_GRACE_SECONDS", "0.5")
    args = ["serve", "coordinator-llm", "--port", str(port), "--model-name", model]
    return (args, _url(port, "/health"), env), {
        "port": port,
        "base_url": _url(port, "/v1"),
        "model": model,
    }


@contextlib.contextmanager
def coordinator_llm(model: str, **faults):
    spec, endpoint = coordinator_llm_spec(model, **faults)
    with bcstack_process(spec[0], spec[1], env=spec[2], forked=True):
        yield endpoint


@contextlib.contextmanager
def coordinator_llms(**specs: dict):
    """Several stand-in LLMs started at once: name -> faults (with "model"); yields name -> endpoint."""
    built = {name: coordinator_llm_spec(**faults) for name, faults in specs.items()}
    with bcstack_processes([spec for spec, _ in built.values()], forked=True):
        yield {name: endpoint for name, (_, endpoint) in built.items()}


def worker(stack, http: int, grpc_port: int, env: dict[str, str] | None = None):
    args = ["serve", "worker", "--tokenizer", str(stack["tmp"] / "tiny"), "--engine-url", stack["engine"]]
    args += ["--retrieval-address", stack["retrieval"], "--port", str(http), "--grpc-port", str(grpc_port)]
    return bcstack_process(args, _url(http, "/health"), env=env, forked=True)


@contextlib.contextmanager
def gateway(
    stack,
    name: str,
    endpoints: list[dict],
    workers: list[str] | None = None,
    *,
    host: str = LOCAL,
    http: int | None = None,
    **settings,
):
    http, grpc_port = http or find_free_port(), find_free_port()
    config = {
        "endpoints": [
            {"name": e["name"], "base_url": e["base_url"], "model": e["model"], **e.get("extra", {})}
            for e in endpoints
        ],
        "workers": workers or stack["workers"],
        "records_path": str(stack["tmp"] / f"{name}.sqlite"),
        "upstream_backoff_seconds": 0.05,
        "upstream_backoff_max_seconds": 2.0,
        **settings,
    }
    path = stack["tmp"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["serve", "coordinator", "--config", str(path), "--port", str(http), "--grpc-port", str(grpc_port)]
    args += ["--host", host]
    with bcstack_process(
        args, f"http://{host}:{http}/health", env={"BCSTACK_ADMIN_TOKEN": ADMIN}, forked=True
    ) as proc:
        yield {"http": http, "grpc": grpc_port, "proc": proc, "args": args, "config": config}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, toy_kit):
    tmp = tmp_path_factory.mktemp("gateway")
    world = toy_kit["world"]
    link_toy_kit(toy_kit, tmp)
    ports = {name: find_free_port() for name in ("r_http", "r_grpc", "e_http", "w1", "w1g", "w2", "w2g")}
    state = {
        "tmp": tmp,
        "world": world,
        "easy": [q for q in world.test if q["data_source"] == "bc_test_easy"],
        "engine": _url(ports["e_http"]),
        "retrieval": f"{LOCAL}:{ports['r_grpc']}",
        "workers": [f"{LOCAL}:{ports['w1g']}", f"{LOCAL}:{ports['w2g']}"],
    }

    def worker_spec(http: int, grpc_port: int) -> tuple[list[str], str]:
        args = ["serve", "worker", "--tokenizer", str(tmp / "tiny"), "--engine-url", state["engine"]]
        args += ["--retrieval-address", state["retrieval"]]
        args += ["--port", str(http), "--grpc-port", str(grpc_port)]
        return args, _url(http, "/health")

    with contextlib.ExitStack() as es:
        es.enter_context(
            bcstack_processes(
                [
                    retrieval_spec(tmp / "idx", ports["r_http"], ports["r_grpc"]),
                    (
                        [
                            "serve",
                            "engine",
                            "--policy",
                            "expert",
                            "--tokenizer",
                            str(tmp / "tiny"),
                            "--port",
                            str(ports["e_http"]),
                        ],
                        _url(ports["e_http"], "/health"),
                    ),
                    worker_spec(ports["w1"], ports["w1g"]),
                    worker_spec(ports["w2"], ports["w2g"]),
                ],  # fmt: skip
                forked=True,
            )
        )
        state["llm_a"] = es.enter_context(coordinator_llm("coord-a"))
        state["llm_b"] = es.enter_context(coordinator_llm("coord-b"))
        yield state


@pytest.fixture(scope="module")
def gw(stack):
    with gateway(stack, "main", [{"name": "a", **stack["llm_a"]}]) as g:
        yield g


def post(gw, body: dict, timeout: float = 120, **params) -> httpx.Response:
    return httpx.post(_url(gw["http"], "/v1/episodes"), json=body, params=params, timeout=timeout)


def test_easy_questions_are_answered_and_their_records_are_complete(stack, gw):
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda q: post(
                    gw, {"question": q["query"], "question_id": q["query_id"], "gold_answer": q["answer"]}
                ),
                stack["easy"],
            )
        )
    for q, r in zip(stack["easy"], answers, strict=True):
        assert r.status_code == 200, gw["proc"].log()[-5000:]
        body = r.json()
        assert (body["status"], body["answer"], body["endpoint"]) == ("finish", q["answer"], "a")
        assert body["worker_reports"][0]["status"] == "finish"
        assert body["worker_reports"][0]["replica"] in stack["workers"]
        record = httpx.get(_url(gw["http"], f"/v1/episodes/{body['episode_id']}"), timeout=10).json()
        assert (record["question_id"], record["gold_answer"]) == (q["query_id"], q["answer"])
        assert record["endpoint"] == "a"
        assert record["endpoint_detail"] == {"model": "coord-a", "base_url": stack["llm_a"]["base_url"]}
        roles = [m["role"] for m in record["coordinator"]["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        [w] = record["workers"]
        t = w["trajectory"]
        assert w["status"] == "finish" and w["episode_id"] == f"{body['episode_id']}.w0"
        assert len(t["token_ids"]) == len(t["loss_mask"]) == t["tokens_used"] == w["usage"]["total_tokens"]
        assert len(t["rollout_logprobs"]) == sum(t["loss_mask"]) > 0
        assert record["weight_versions"] and all(turn["weight_version"] for turn in t["turns"])
        assert record["worker_usage"]["total_tokens"] == t["tokens_used"]
        assert record["seconds"] > 0 and record["finished_at"] >= record["created_at"]
    # both replicas took work
    assert {r.json()["worker_reports"][0]["replica"] for r in answers} == set(stack["workers"])
    m = _metrics(gw["http"])
    assert m[("bcstack_coordinator_episodes_total", (("endpoint", "a"), ("status", "finish")))] >= len(
        answers
    )
    assert m[("bcstack_coordinator_active_endpoint_info", (("name", "a"),))] == 1
    listed = httpx.get(_url(gw["http"], "/v1/episodes"), params={"question_id": stack["easy"][0]["query_id"]})
    assert [e["question_id"] for e in listed.json()["episodes"]] == [stack["easy"][0]["query_id"]]


def test_streaming_reports_each_step_then_the_final_answer(stack, gw):
    q = stack["easy"][0]
    events = []
    with httpx.stream(
        "POST",
        _url(gw["http"], "/v1/episodes"),
        params={"stream": "true"},
        json={"question": q["query"]},
        timeout=120,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
    kinds = [k for k, _ in events]
    assert kinds == [
        "episode_started",
        "coordinator_turn",
        "branch_started",
        "branch_finished",
        "coordinator_turn",
        "final",
    ]
    final = events[-1][1]
    assert final["status"] == "finish" and final["answer"] == q["answer"]
    assert events[3][1]["answer"] == q["answer"]
    stored = httpx.get(_url(gw["http"], f"/v1/episodes/{final['episode_id']}"), timeout=10).json()
    assert stored["answer"] == q["answer"]


def test_grpc_run_episode_and_its_errors(stack, gw):
    q = stack["easy"][1]
    with grpc.insecure_channel(f"{LOCAL}:{gw['grpc']}") as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        resp = stub.RunEpisode(
            coordinator_pb2.RunCoordinatorEpisodeRequest(question=q["query"], question_id=q["query_id"]),
            timeout=120,
        )
        assert (resp.status, resp.answer, resp.endpoint, resp.question_id) == (
            "finish",
            q["answer"],
            "a",
            q["query_id"],
        )
        assert len(resp.worker_reports) == 1 and resp.worker_usage.total_tokens > 0 and resp.usage.turns == 2
        with pytest.raises(grpc.RpcError) as err:
            stub.RunEpisode(coordinator_pb2.RunCoordinatorEpisodeRequest(question=""), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_requests_are_clear_4xx_and_a_repeated_episode_id_is_not_run_twice(stack, gw):
    assert post(gw, {"question": ""}).status_code == 422
    assert post(gw, {"question": "   "}).status_code == 422
    long = post(gw, {"question": "x" * 20_001})
    assert long.status_code == 422 and "at most 20000" in long.json()["error"]
    assert post(gw, {"question": "q", "colour": "red"}).status_code == 422
    assert post(gw, {"question": "q", "overrides": {"max_turns": 0}}).status_code == 422
    missing = httpx.get(_url(gw["http"], "/v1/episodes/nope"), timeout=5)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]

    q = stack["easy"][2]
    first = post(gw, {"question": q["query"], "episode_id": "retry-me-1"}).json()
    before = _llm_requests(stack["llm_a"]["port"])
    again = post(gw, {"question": q["query"], "episode_id": "retry-me-1"}).json()
    assert again == first and _llm_requests(stack["llm_a"]["port"]) == before


def test_limits_end_the_episode_with_a_recorded_status(stack, gw):
    q = stack["easy"][3]
    body = post(gw, {"question": q["query"], "overrides": {"max_turns": 1}}).json()
    assert body["status"] == "turns" and body["answer"] == ""
    record = httpx.get(_url(gw["http"], f"/v1/episodes/{body['episode_id']}")).json()
    assert record["limits"]["max_turns"] == 1 and len(record["coordinator"]["turns"]) == 1
    tight = post(gw, {"question": q["query"], "worker_budget": {"max_turns": 1}}).json()
    assert tight["worker_reports"][0]["status"] == "turns"  # the budget reached the worker


def test_admin_needs_the_token_and_a_dead_endpoint_is_refused(stack, gw):
    url = _url(gw["http"], "/admin/coordinator")
    change = {
        "endpoint": {"name": "b", **{k: stack["llm_b"][k] for k in ("base_url", "model")}},
        "activate": "b",
    }
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert httpx.put(url, json=change).status_code == 401
    assert httpx.put(url, json=change, headers={"Authorization": "Bearer wrong"}).status_code == 403
    view = httpx.get(url, headers=AUTH).json()
    assert view["active"] == "a" and [e["name"] for e in view["endpoints"]] == ["a"]  # nothing changed

    dead = {
        "endpoint": {"name": "dead", "base_url": _url(find_free_port(), "/v1"), "model": "m"},
        "activate": "dead",
    }
    refused = httpx.put(url, json=dead, headers=AUTH, timeout=30)
    assert refused.status_code == 409 and "dead" in refused.json()["error"]
    unknown = httpx.put(url, json={"activate": "nope"}, headers=AUTH)
    assert unknown.status_code in (404, 409) and "nope" in unknown.json()["error"]
    after = httpx.get(url, headers=AUTH).json()
    assert after["active"] == "a" and [e["name"] for e in after["endpoints"]] == ["a"]


def test_endpoint_swap_under_load_moves_only_new_episodes(stack):
    with gateway(stack, "swap", [{"name": "a", **stack["llm_a"]}]) as g:
        a0, b0 = _llm_requests(stack["llm_a"]["port"]), _llm_requests(stack["llm_b"]["port"])
        questions = [stack["world"].test[i % len(stack["world"].test)] for i in range(50)]
        swap: dict[str, float] = {}

        def do_swap():
            wait_until(
                lambda: _metrics(g["http"])[("bcstack_coordinator_active_episodes", ())] >= 10, timeout=60
            )
            swap["start"] = time.time()
            change = {
                "endpoint": {"name": "b", "base_url": stack["llm_b"]["base_url"], "model": "coord-b"},
                "activate": "b",
            }
            r = httpx.put(_url(g["http"], "/admin/coordinator"), json=change, headers=AUTH, timeout=30)
            assert r.status_code == 200, gw["proc"].log()[-5000:]
            swap["end"] = time.time()

        def one(i: int) -> dict:
            if i >= 25:  # the second half arrives after the swap
                wait_until(lambda: "end" in swap, timeout=120)
            return post(
                g, {"question": questions[i]["query"], "question_id": f"swap-{i}"}, timeout=300
            ).json()

        with cf.ThreadPoolExecutor(51) as pool:
            swapper = pool.submit(do_swap)
            results = list(pool.map(one, range(50)))
            swapper.result()
        assert {r["status"] for r in results} == {"finish"}  # zero failed episodes
        records = [httpx.get(_url(g["http"], f"/v1/episodes/{r['episode_id']}")).json() for r in results]
        by = {name: [rec for rec in records if rec["endpoint"] == name] for name in ("a", "b")}
        assert by["a"] and by["b"] and len(by["a"]) + len(by["b"]) == 50
        assert all(rec["created_at"] <= swap["end"] for rec in by["a"])
        assert all(rec["created_at"] >= swap["start"] for rec in by["b"])
        # Every episode that arrived after the swap runs on b. (A first-half request is sent before the
        # swap but may reach the gateway after it on a loaded machine, and then rightly runs on b: the
        # swap is decided by when an episode is created, asserted just above, not by its index.)
        late = [rec for rec in records if int(rec["question_id"].removeprefix("swap-")) >= 25]
        assert len(late) == 25 and all(rec["endpoint"] == "b" for rec in late)
        # every coordinator turn of an episode went to the endpoint its record names
        turns = {name: sum(len(rec["coordinator"]["turns"]) for rec in by[name]) for name in by}
        assert _llm_requests(stack["llm_a"]["port"]) - a0 == turns["a"]
        assert _llm_requests(stack["llm_b"]["port"]) - b0 == turns["b"]
        m = _metrics(g["http"])
        assert m[("bcstack_coordinator_endpoint_swaps_total", ())] == 1
        assert m[("bcstack_coordinator_active_endpoint_info", (("name", "b"),))] == 1


def test_a_swap_reaches_every_replica_through_the_store_and_outlives_a_restart(stack):
    """`bcstack coordinator swap` against two replicas sharing one record store: the change goes to
    the first, the second adopts it from the store and runs its episodes on it; the key file appears
    only after the command started (the kubelet writing a runtime keys Secret into the pods), and a
    replica started afterwards comes up on the new endpoint. A second swap finds the replicas through
    the Kubernetes API (a stand-in API server listing two "pods" on 127.0.0.1 and 127.0.0.2)."""
    from typer.testing import CliRunner

    from bcstack.cli import app

    shared = str(stack["tmp"] / "swap-shared.sqlite")
    key = stack["tmp"] / "runtime-keys" / "b"  # not there yet
    a = [{"name": "a", **stack["llm_a"]}]
    settings = {"records_path": shared, "endpoint_sync_seconds": 0.2}
    env = {"BCSTACK_ADMIN_TOKEN": ADMIN}
    port = find_free_port()  # two "pods", 127.0.0.1 and 127.0.0.2, on one port as a Service's pods are
    with (
        gateway(stack, "rep1", a, http=port, **settings) as g1,
        gateway(stack, "rep2", a, host="127.0.0.2", http=port, **settings) as g2,
    ):
        urls = [_url(g1["http"]), f"http://127.0.0.2:{port}"]
        swap = ["coordinator", "swap", "b", "--base-url", stack["llm_b"]["base_url"], "--model", "coord-b"]
        swap += ["--api-key-file", str(key), "--gateway", urls[0], "--gateway", urls[1], "--wait", "60"]

        def kubelet() -> None:
            time.sleep(1.5)
            key.parent.mkdir(exist_ok=True)
            key.write_text("sk-runtime-b\n")

        with cf.ThreadPoolExecutor(1) as pool:
            pool.submit(kubelet)
            result = CliRunner().invoke(app, swap, env=env)
        assert result.exit_code == 0, result.output
        assert "waiting for the key" in result.output and "every replica (2) runs 'b'" in result.output
        health = [httpx.get(f"{u}/health").json() for u in urls]
        assert [h["endpoint"] for h in health] == ["b", "b"]
        assert health[0]["endpoint_version"] == health[1]["endpoint_version"] == 1
        view = httpx.get(f"{urls[1]}/admin/coordinator", headers=AUTH).json()
        b_view = next(e for e in view["endpoints"] if e["name"] == "b")
        assert b_view["api_key"] == f"file:{key}"  # where the key comes from, never the key
        assert "sk-runtime-b" not in json.dumps(view) and "sk-runtime-b" not in result.output
        q = stack["easy"][0]
        record = post(g2, {"question": q["query"]}).json()  # rep2 never heard the PUT
        assert record["status"] == "finish" and record["endpoint"] == "b"

        dead = ["coordinator", "swap", "dead", "--base-url", _url(find_free_port(), "/v1"), "--model", "m"]
        refused = CliRunner().invoke(app, [*dead, "--gateway", urls[0], "--wait", "0"], env=env)
        assert refused.exit_code == 1 and "refused" in refused.output and "dead" in refused.output
        assert [httpx.get(f"{u}/health").json()["endpoint_version"] for u in urls] == [1, 1]

        # Back to a, the replicas found through the Kubernetes API (`--k8s-selector`): the change
        # goes to the first pod, and every pod listed is checked.
        pods = {
            "research": [
                _pod("gw-0", "Running", "127.0.0.1", "coordinator"),
                _pod("gw-1", "Running", "127.0.0.2", "coordinator"),
            ]
        }
        with StandInApiServer(pods) as api, tempfile.TemporaryDirectory() as kube:
            selector = "app.kubernetes.io/instance=bc,app.kubernetes.io/component=coordinator"
            back = CliRunner().invoke(
                app,
                [
                    "coordinator",
                    "swap",
                    "a",
                    "--k8s-selector",
                    selector,
                    "--k8s-port",
                    str(port),
                    "--wait",
                    "30",
                ],
                env={
                    **env,
                    "KUBECONFIG": str(_kubeconfig(Path(kube) / "config", api.url)),
                    "KUBERNETES_SERVICE_HOST": "",
                },
            )
        assert back.exit_code == 0, back.output
        assert "every replica (2) runs 'a'" in back.output and "127.0.0.2" in back.output
        assert [httpx.get(f"{u}/health").json()["endpoint"] for u in urls] == ["a", "a"]

    with gateway(stack, "rep3", a, **settings) as g3:  # a replica (re)started after the swaps
        health = httpx.get(_url(g3["http"], "/health")).json()
        assert health["endpoint"] == "a" and health["endpoint_version"] == 2
        view = httpx.get(_url(g3["http"], "/admin/coordinator"), headers=AUTH).json()
        assert {e["name"] for e in view["endpoints"]} == {"a", "b"}  # b, added at runtime, is back too
        record = post(g3, {"question": stack["easy"][1]["query"]}).json()
        assert record["endpoint"] == "a"
        m = _metrics(g3["http"])
        assert m[("bcstack_coordinator_active_endpoint_info", (("name", "a"),))] == 1


def test_upstream_faults_and_a_killed_worker_never_lose_an_episode(stack):
    ports = {"w3": find_free_port(), "w3g": find_free_port()}
    w3_address = f"{LOCAL}:{ports['w3g']}"
    with contextlib.ExitStack() as es:
        llms = es.enter_context(
            coordinator_llms(
                r429={"model": "m429", "fail_rate": 0.5, "fail_mode": "http429", "retry_after_seconds": 1},
                r500={"model": "m500", "fail_rate": 0.5, "fail_mode": "http500"},
                garbage={"model": "mgarbage", "fail_rate": 0.5, "fail_mode": "garbage"},
                hang={"model": "mhang", "fail_rate": 0.3, "fail_mode": "hang", "hang_seconds": 20},
                down={"model": "mdown", "fail_rate": 1.0, "fail_mode": "http500"},
            )
        )
        w3 = es.enter_context(worker(stack, ports["w3"], ports["w3g"]))
        endpoints = [
            {"name": name, **llm, "extra": {"timeout_seconds": 2.0} if name == "hang" else {}}
            for name, llm in llms.items()
        ]
        g = es.enter_context(
            gateway(
                stack,
                "faults",
                endpoints,
                workers=[w3_address, stack["workers"][0]],
                upstream_attempts=4,
                breaker_failures=6,
                breaker_reset_seconds=60,
            )
        )
        url = _url(g["http"], "/admin/coordinator")
        easy = stack["easy"]
        for name in llms:
            assert httpx.put(url, json={"activate": name}, headers=AUTH, timeout=30).status_code == 200
            with cf.ThreadPoolExecutor(4) as pool:
                bodies = list(
                    pool.map(lambda q: post(g, {"question": q["query"]}, timeout=300).json(), easy[:4])
                )
            statuses = [b["status"] for b in bodies]
            for b in bodies:  # every episode ended with a recorded status
                stored = httpx.get(_url(g["http"], f"/v1/episodes/{b['episode_id']}")).json()
                assert stored["status"] == b["status"] and stored["endpoint"] == name
            if name in ("r429", "r500", "garbage"):
                assert statuses.count("finish") >= 3, (name, bodies)
            if name == "down":
                assert set(statuses) == {"error"} and all("down" in b["error"] for b in bodies)
        m = _metrics(g["http"])
        assert (
            m[
                (
                    "bcstack_coordinator_upstream_retries_total",
                    (("endpoint", "r429"), ("kind", "rate_limited")),
                )
            ]
            > 0
        )
        assert (
            m[
                (
                    "bcstack_coordinator_upstream_retries_total",
                    (("endpoint", "r500"), ("kind", "server_error")),
                )
            ]
            > 0
        )
        assert (
            m[("bcstack_coordinator_upstream_errors_total", (("endpoint", "hang"), ("kind", "timeout")))] > 0
        )
        assert m[("bcstack_coordinator_breaker_state", (("endpoint", "down"), ("state", "open")))] == 1
        # the open breaker fails fast: no request reaches the dead endpoint any more
        seen = _llm_requests(llms["down"]["port"], "fault_http500")
        fast = post(g, {"question": easy[0]["query"]}).json()
        assert fast["status"] == "error" and "circuit" in fast["error"]
        assert _llm_requests(llms["down"]["port"], "fault_http500") == seen

        # a worker replica killed mid-episode: its branches are retried on the other one
        assert httpx.put(url, json={"activate": "r500"}, headers=AUTH, timeout=30).status_code == 200
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(post, g, {"question": q["query"]}, 300) for q in easy]

            def w3_busy() -> bool:
                view = httpx.get(url, headers=AUTH, timeout=5).json()["workers"]
                return any(w["address"] == w3_address and w["in_flight"] > 0 for w in view)

            wait_until(w3_busy, timeout=60, interval=0.02)
            w3.kill()
            bodies = [f.result().json() for f in futures]
        assert all(b["status"] in ("finish", "error", "turns") for b in bodies)
        assert sum(b["status"] == "finish" for b in bodies) >= 6
        records = [httpx.get(_url(g["http"], f"/v1/episodes/{b['episode_id']}")).json() for b in bodies]
        moved = [w for rec in records for w in rec["workers"] if w["attempts"] > 1]
        assert moved and all(w["replica"] == stack["workers"][0] for w in moved if w["status"] == "finish")


def test_full_gateway_answers_429_with_retry_after(stack):
    with coordinator_llm("slow", fail_rate=1.0, fail_mode="hang", hang_seconds=3) as slow:
        endpoint = {"name": "slow", **slow, "extra": {"timeout_seconds": 10.0}}
        with (
            gateway(stack, "full", [endpoint], max_concurrent_episodes=1, retry_after_seconds=7) as g,
            cf.ThreadPoolExecutor(1) as pool,
        ):
            first = pool.submit(post, g, {"question": "Who?", "overrides": {"max_turns": 1}})
            wait_until(
                lambda: _metrics(g["http"])[("bcstack_coordinator_active_episodes", ())] == 1, timeout=30
            )
            full = post(g, {"question": "Who else?"})
            assert full.status_code == 429 and full.headers["retry-after"] == "7"
            with grpc.insecure_channel(f"{LOCAL}:{g['grpc']}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.RunEpisode(coordinator_pb2.RunCoordinatorEpisodeRequest(question="x"), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert first.result().json()["status"] in ("turns", "finish")


def test_episodes_beyond_the_workers_capacity_wait_for_room_instead_of_failing(stack):
    """A worker admitting one episode at a time, four episodes at once through the gateway: the
    branches the full worker refused wait for room (counted as resource_exhausted attempts) and
    every episode finishes, as an RL loop with more groups in flight than the workers admit needs."""
    http, grpc_port = find_free_port(), find_free_port()
    with worker(stack, http, grpc_port, env={"BCSTACK_WORKER_MAX_CONCURRENT_EPISODES": "1"}):
        address = f"{LOCAL}:{grpc_port}"
        with (
            gateway(stack, "one-slot", [{"name": "a", **stack["llm_a"]}], workers=[address]) as g,
            cf.ThreadPoolExecutor(4) as pool,
        ):
            questions = stack["easy"][:4]
            bodies = list(
                pool.map(
                    lambda q: post(g, {"question": q["query"], "overrides": {"max_branches": 1}}).json(),
                    questions,
                )
            )
            assert [b["status"] for b in bodies] == ["finish"] * 4
            refused = _metrics(g["http"])[
                (
                    "bcstack_coordinator_worker_attempts_total",
                    (("outcome", "resource_exhausted"), ("replica", address)),
                )
            ]
            assert refused > 0


def test_a_killed_gateway_loses_no_finished_episode(stack):
    with gateway(stack, "crash", [{"name": "a", **stack["llm_a"]}]) as g:
        ids = [post(g, {"question": q["query"]}).json()["episode_id"] for q in stack["easy"][:3]]
        before = [httpx.get(_url(g["http"], f"/v1/episodes/{i}")).json() for i in ids]
        g["proc"].kill()  # SIGKILL right after the answers: no shutdown code runs
        args, http = g["args"], g["http"]
    # restarted as `python -m bcstack serve coordinator`: one gateway of this module starts cold
    with bcstack_process(args, _url(http, "/health"), env={"BCSTACK_ADMIN_TOKEN": ADMIN}):
        after = [httpx.get(_url(http, f"/v1/episodes/{i}")).json() for i in ids]
        assert after == before
        assert httpx.get(_url(http, "/v1/episodes")).json()["count"] == 3


def test_serve_coordinator_without_an_endpoint_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bcstack",
            "serve",
            "coordinator",
            "--port",
            "0",
            "--records",
            str(tmp_path / "r.db"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr.startswith("error: no coordinator endpoint configured")
        and "Traceback" not in result.stderr
    )
