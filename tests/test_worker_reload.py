"""`POST /admin/reload` on the worker: hot weight swaps of the engine, safe under load.

Real processes: retrieval (embedded index over the toy world), the CPU engine serving tiny model A
(admin token set) and the worker (checkpoint root and the same token). Checkpoints inside the root:
`a1` (export of A) and `b1` (export of a second tiny kit, another seed, same architecture), plus
broken copies that must be refused while the old weights keep serving. In-process tests pin the
manager's 409 and failure-after-pause paths with a fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from conftest import find_free_port, wait_until
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from safetensors.torch import load_file, save_file
from stack_util import bcstack_processes

from core.checkpoint import write_sha256sums
from core.engine_client import EngineError
from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE
from services.worker.reload import DISABLED_MESSAGE, ReloadManager, ReloadRefused, resolve_checkpoint
from services.worker.service import add_reload_routes
from trainer.export import export_checkpoint

TOKEN = "reload-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, toy_kit, tiny_kit):
    tmp = tmp_path_factory.mktemp("reload")
    # The session's toy world and its index (conftest.toy_kit); two kits of our own to swap between.
    world = toy_kit["world"]
    tiny_kit(tmp / "a", seed=0)
    tiny_kit(tmp / "b", seed=1)
    rows = json.loads((tmp / "a" / "config.json").read_text())["vocab_size"]
    root = tmp / "checkpoints"
    # The engine keeps A's padded embedding rows, so the exports keep them too.
    export_checkpoint(tmp / "a", root / "a1", vocab_size=rows)
    export_checkpoint(tmp / "b", root / "b1", vocab_size=rows)
    ports = {name: find_free_port() for name in ("r_http", "r_grpc", "e_http", "w_http", "w_grpc")}
    env = {"BCSTACK_ADMIN_TOKEN": TOKEN}
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            bcstack_processes(
                [
                    (["serve", "engine", "--model", str(tmp / "a"), "--port", str(ports["e_http"])],
                     f"http://127.0.0.1:{ports['e_http']}/health", env),
                    (["serve", "retrieval", "--index-dir", str(toy_kit["dir"] / "idx"),
                      "--port", str(ports["r_http"]), "--grpc-port", str(ports["r_grpc"])],
                     f"http://127.0.0.1:{ports['r_http']}/health"),
                    (["serve", "worker", "--tokenizer", str(tmp / "a"),
                      "--engine-url", f"http://127.0.0.1:{ports['e_http']}",
                      "--retrieval-address", f"127.0.0.1:{ports['r_grpc']}",
                      "--port", str(ports["w_http"]), "--grpc-port", str(ports["w_grpc"])],
                     f"http://127.0.0.1:{ports['w_http']}/health",
                     {**env, "BCSTACK_WORKER_CHECKPOINT_ROOT": str(root)}),
                ],
                forked=True,  # real processes that skip seconds of imports each (stack_util)
            )
        )  # fmt: skip
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['w_grpc']}")
        yield {
            "tmp": tmp,
            "root": root,
            "world": world,
            "worker": f"http://127.0.0.1:{ports['w_http']}",
            "engine": f"http://127.0.0.1:{ports['e_http']}",
            "stub": worker_pb2_grpc.WorkerServiceStub(channel),
        }
        channel.close()


def _reload(stack, checkpoint: str, headers=AUTH, **body) -> httpx.Response:
    return httpx.post(
        f"{stack['worker']}/admin/reload",
        json={"checkpoint": checkpoint, **body},
        headers=headers,
        timeout=120,
    )


def _status(stack) -> dict:
    response = httpx.get(f"{stack['worker']}/admin/reload", headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _episode(stack, question: str, budget: common_pb2.BudgetOverrides, timeout: float = 120):
    request = worker_pb2.RunWorkerEpisodeRequest(
        branch=worker_pb2.BranchTask(
            description="answer", prompt=WORKER_TASK_TEMPLATE.format(question=question)
        ),
        budget=budget,
    )
    return stack["stub"].RunEpisode.future(request, timeout=timeout)


def _assert_still_serving(stack, version: str) -> None:
    assert _status(stack)["weight_version"] == version
    short = common_pb2.BudgetOverrides(max_tokens=2000, max_turns=1, max_new_tokens=8)
    resp = _episode(stack, stack["world"].test[0]["query"], short).result()
    assert resp.report.stop_reason != common_pb2.STOP_REASON_ERROR, resp.trajectory.error
    assert {t.weight_version for t in resp.trajectory.turns} == {version}


def _greedy(stack, input_ids: list[int], n: int = 12) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0},
        "return_logprob": True,
    }
    response = httpx.post(f"{stack['engine']}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _hf_greedy(folder: Path, input_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    from services.engine.models import load_causal_lm

    model = load_causal_lm(folder)  # as the engine loads it (dtype as saved)
    ids, logprobs = list(input_ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(input_ids) :], logprobs


def test_reload_under_load_keeps_every_episode_and_serves_the_new_weights(stack):
    ok = _reload(stack, "a1")
    assert ok.status_code == 200, ok.text
    assert ok.json()["weight_version"] == "a1" and ok.json()["previous_version"] == "default"
    assert ok.json()["paused_seconds"] <= ok.json()["seconds"]

    before = _metrics(stack["worker"])
    turns_key = ("bcstack_worker_turn_generated_tokens_count", ())
    budget = common_pb2.BudgetOverrides(max_tokens=3000, max_turns=3, max_new_tokens=96)
    questions = [q["query"] for q in stack["world"].test]
    futures = [_episode(stack, questions[i % len(questions)], budget, timeout=300) for i in range(16)]
    # Reload once the first turns are back and most episodes still have turns to go.
    wait_until(
        lambda: _metrics(stack["worker"])[turns_key] - before.get(turns_key, 0) >= 12,
        timeout=120,
        interval=0.05,
        message="the first turns of the episodes",
    )
    swap = _reload(stack, "b1")
    assert swap.status_code == 200, swap.text
    assert swap.json() | {"seconds": 0, "paused_seconds": 0} == {
        "status": "ok", "weight_version": "b1", "previous_version": "a1", "seconds": 0, "paused_seconds": 0,
    }  # fmt: skip
    responses = [f.result() for f in futures]

    assert all(r.report.stop_reason != common_pb2.STOP_REASON_ERROR for r in responses), [
        r.trajectory.error for r in responses if r.trajectory.error
    ]
    versions = [[t.weight_version for t in r.trajectory.turns] for r in responses]
    assert all(v == sorted(v) for v in versions), versions  # "a1" turns, then "b1" turns
    assert any(v[0] == "a1" and v[-1] == "b1" for v in versions), versions
    status = _status(stack)
    assert status["weight_version"] == "b1"
    assert [(a["checkpoint"], a["outcome"]) for a in status["attempts"][-2:]] == [("a1", "ok"), ("b1", "ok")]

    after = _metrics(stack["worker"])
    assert after[("bcstack_worker_reloads_total", (("outcome", "ok"),))] >= 2
    assert after[("bcstack_worker_reload_paused_seconds_count", ())] >= 2
    assert after[("bcstack_worker_weight_version_info", (("weight_version", "b1"),))] == 1
    assert ("bcstack_worker_weight_version_info", (("weight_version", "a1"),)) not in after

    # The engine now generates what B generates.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack["tmp"] / "a"))
    prompt = tokenizer("Which laureate was born in Tartu?")["input_ids"]
    served = _greedy(stack, prompt)
    expected_ids, expected_lp = _hf_greedy(stack["root"] / "b1", prompt, 12)
    assert served["output_ids"] == expected_ids
    got_lp = [e[0] for e in served["meta_info"]["output_token_logprobs"]]
    assert got_lp == pytest.approx(expected_lp, abs=2e-3)
    assert served["meta_info"]["weight_version"] == "b1"
    a_lp = _hf_greedy(stack["root"] / "a1", prompt, 12)[1]
    assert (
        max(abs(a - b) for a, b in zip(a_lp, expected_lp, strict=True)) > 0.05
    )  # the swap changed something


def _copy(stack, name: str) -> Path:
    out = stack["root"] / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(stack["root"] / "a1", out)
    return out


def _rewrite(folder: Path, change) -> None:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    write_sha256sums(folder)  # only the tensor check can fail


def _bad_hash(stack) -> str:
    folder = _copy(stack, "bad_hash")
    data = bytearray((folder / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / WEIGHTS).write_bytes(bytes(data))
    return "bad_hash"


def _missing_tensor(stack) -> str:
    _rewrite(_copy(stack, "missing_tensor"), lambda t: t.pop("model.norm.weight"))
    return "missing_tensor"


def _wrong_shape(stack) -> str:
    def widen(t):
        t["model.norm.weight"] = torch.ones(t["model.norm.weight"].shape[0] + 1, dtype=torch.bfloat16)

    _rewrite(_copy(stack, "wrong_shape"), widen)
    return "wrong_shape"


def _wrong_vocab(stack) -> str:
    out = stack["root"] / "wrong_vocab"
    if not out.exists():
        export_checkpoint(stack["tmp"] / "a", out)  # the tokenizer's rows, not the engine's padded rows
    return "wrong_vocab"


def _outside(stack) -> Path:
    out = stack["tmp"] / "outside"
    if not out.exists():
        shutil.copytree(stack["root"] / "a1", out)
    return out


def _dotdot(stack) -> str:
    _outside(stack)
    return "../outside"


def _absolute_outside(stack) -> str:
    return str(_outside(stack))


def _symlink_escape(stack) -> str:
    link = stack["root"] / "escape"
    if not link.is_symlink():
        link.symlink_to(_outside(stack), target_is_directory=True)
    return "escape"


@pytest.mark.parametrize(
    ("make", "status", "says"),
    [
        (_bad_hash, 422, "SHA256 mismatch"),
        (_missing_tensor, 422, "missing tensor model.norm.weight"),
        (_wrong_shape, 422, "model.norm.weight has shape"),
        (_wrong_vocab, 422, "vocab"),
        (_dotdot, 403, "not inside the checkpoint root"),
        (_absolute_outside, 403, "not inside the checkpoint root"),
        (_symlink_escape, 403, "not inside the checkpoint root"),
        (lambda stack: "does_not_exist", 404, "not a folder"),
    ],
    ids=[
        "wrong-hash",
        "missing-tensor",
        "wrong-shape",
        "wrong-vocab",
        "dotdot",
        "absolute",
        "symlink",
        "missing",
    ],
)
def test_a_bad_checkpoint_is_rejected_and_the_old_weights_keep_serving(stack, make, status, says):
    version = _status(stack)["weight_version"]
    rejected_key = ("bcstack_worker_reloads_total", (("outcome", "rejected"),))
    before = _metrics(stack["worker"])[rejected_key]
    checkpoint = make(stack)
    response = _reload(stack, checkpoint)
    assert response.status_code == status, response.text
    assert response.json()["status"] == "failed" and says in response.json()["error"], response.json()
    last = _status(stack)["attempts"][-1]
    assert (last["checkpoint"], last["outcome"]) == (checkpoint, "rejected") and says in last["error"]
    assert _metrics(stack["worker"])[rejected_key] == before + 1
    _assert_still_serving(stack, version)


def test_reload_needs_the_admin_token(stack):
    version = _status(stack)["weight_version"]
    missing = _reload(stack, "b1", headers={})
    assert missing.status_code == 401
    wrong = _reload(stack, "b1", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    assert httpx.get(f"{stack['worker']}/admin/reload", timeout=10).status_code == 401
    assert TOKEN not in missing.text + wrong.text
    _assert_still_serving(stack, version)


# --- the manager in process, against a fake engine --------------------------------------------------


class FakeEngine:
    def __init__(self, tmp: Path, *, update_ok: bool = True, pause_error: bool = False) -> None:
        self.version = "v0"
        self.calls: list[str] = []
        self.update_ok = update_ok
        self.pause_error = pause_error
        self.release = asyncio.Event()
        self.release.set()
        (tmp / "served").mkdir(exist_ok=True)
        (tmp / "served" / "config.json").write_text("{}")
        self.served = tmp / "served"

    async def model_info(self):
        return {"model_path": str(self.served), "weight_version": self.version}

    async def weight_version(self):
        return self.version

    async def pause_generation(self, mode):
        self.calls.append(f"pause:{mode}")
        if self.pause_error:
            raise EngineError(503, "engine went away")
        await self.release.wait()

    async def flush_cache(self):
        self.calls.append("flush")
        return False, "Flush cache failed."

    async def update_weights_from_disk(self, path, weight_version=None, flush_cache=True):
        self.calls.append(f"update:flush={flush_cache}")
        if not self.update_ok:
            return False, "Failed to get weights iterator: broken."
        self.version = weight_version
        return True, "Succeeded to update model weights."

    async def continue_generation(self):
        self.calls.append("continue")


def _manager(tmp_path, **kw) -> tuple[ReloadManager, FakeEngine]:
    (tmp_path / "root" / "ck").mkdir(parents=True)
    engine = FakeEngine(tmp_path, **kw)
    return ReloadManager(engine, tmp_path / "root", verify=lambda path, expect_config: None), engine


def test_a_second_reload_while_one_runs_gets_409(tmp_path):
    manager, engine = _manager(tmp_path)

    async def scenario():
        engine.release.clear()
        first = asyncio.create_task(manager.reload("ck"))
        while "pause:in_place" not in engine.calls:
            await asyncio.sleep(0.01)
        with pytest.raises(ReloadRefused) as err:
            await manager.reload("ck", "other")
        engine.release.set()
        return err.value, await first

    refused, done = asyncio.run(scenario())
    assert refused.status == 409
    assert done["weight_version"] == "ck" and done["previous_version"] == "v0"
    assert engine.calls == ["pause:in_place", "flush", "update:flush=False", "continue"]


@pytest.mark.parametrize("kw", [{"update_ok": False}, {"pause_error": True}])
def test_a_failure_after_pausing_continues_generation_and_answers_502(tmp_path, kw):
    manager, engine = _manager(tmp_path, **kw)
    with pytest.raises(ReloadRefused) as err:
        asyncio.run(manager.reload("ck"))
    assert err.value.status == 502
    assert engine.calls[-1] == "continue" and engine.version == "v0"
    assert [a.outcome for a in manager.attempts] == ["failed"]


def test_checkpoint_paths_resolve_inside_the_root_only(tmp_path):
    root = tmp_path / "root"
    (root / "x").mkdir(parents=True)
    assert resolve_checkpoint(root, "x") == (root / "x").resolve()
    assert resolve_checkpoint(root, str(root / "x")) == (root / "x").resolve()
    for bad in ("..", "../root2", "x/../..", ".", str(tmp_path)):
        with pytest.raises(ReloadRefused) as err:
            resolve_checkpoint(root, bad)
        assert err.value.status == 403
    for missing in ("y", str(root / "y")):
        with pytest.raises(ReloadRefused) as err:
            resolve_checkpoint(root, missing)
        assert err.value.status == 404
    with pytest.raises(ReloadRefused) as err:
        resolve_checkpoint(root, "")
    assert err.value.status == 400


def test_reload_without_a_checkpoint_root_is_disabled(tmp_path):
    app = FastAPI()
    app.state.admin_token = SecretStr(TOKEN)
    add_reload_routes(app, ReloadManager(FakeEngine(tmp_path), None))
    with TestClient(app) as client:
        response = client.post("/admin/reload", json={"checkpoint": "x"}, headers=AUTH)
        assert response.status_code == 403
        assert response.json() == {"status": "failed", "error": DISABLED_MESSAGE}
        assert client.get("/admin/reload", headers=AUTH).json()["checkpoint_root"] is None


def test_status_reports_time_of_attempts(tmp_path):
    manager, _ = _manager(tmp_path)
    start = time.time()
    asyncio.run(manager.reload("ck", "v1"))
    status = asyncio.run(manager.status())
    assert status["weight_version"] == "v1"
    attempt = status["attempts"][0]
    assert attempt["outcome"] == "ok" and attempt["started_at"] >= start - 1 and attempt["seconds"] >= 0


def test_watch_mode_reloads_a_new_complete_export_through_the_same_path(tmp_path):
    from services.worker.service import watcher_for
    from services.worker.settings import WorkerSettings

    manager, engine = _manager(tmp_path)
    root = tmp_path / "root"
    export = root / "step-7"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    (export / "SHA256SUMS").write_text("written last\n")
    settings = WorkerSettings(checkpoint_root=root, reload_watch=True, reload_watch_interval_seconds=0.05)
    watcher = watcher_for(settings, manager)
    watcher._verify = lambda path: None  # a stand-in export; the manager verifies too (stubbed in _manager)

    async def scenario():
        watcher.start()
        for _ in range(100):
            if engine.version == "step-7":
                break
            await asyncio.sleep(0.05)
        await watcher.stop()

    asyncio.run(scenario())
    assert engine.version == "step-7" and [a.outcome for a in manager.attempts] == ["ok"]
    with pytest.raises(ValueError, match="needs checkpoint_root"):
        watcher_for(WorkerSettings(reload_watch=True), manager)
    assert watcher_for(WorkerSettings(), manager) is None
