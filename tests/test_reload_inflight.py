"""A hot reload with worker episodes in flight, against the CPU engine as the pinned SGLang: the
sequence (in-place pause, best-effort flush, update with flush_cache false, continue) on the path
that succeeds and on each failure path (the update refused, the engine killed between pause and
continue), asserting the label the engine and the worker report afterwards and what every in-flight
episode's trajectory records as its weight versions. In process: the engine behind
tests/engine_inproc.py, the episode runner with the toy BM25 double for retrieval."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest
from engine_inproc import TOKEN, EngineHost
from test_worker_runner import ToyRetrievalClient, _task

from core.budget import BudgetLimits
from core.engine_client import EngineClient
from devkit.toyworld.generator import generate_world
from services.worker.reload import ReloadManager, ReloadRefused
from services.worker.runner import EpisodeRunner, Sampling

EPISODES = 6
LIMITS = BudgetLimits(max_tokens=3000, max_turns=4, max_new_tokens_per_turn=96, context_length=2048)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_kit):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("inflight")
    root = tmp / "checkpoints"
    a, b = tiny_kit(root / "a1", seed=0), tiny_kit(root / "b1", seed=1)
    (root / "broken").mkdir()  # no config.json: the engine refuses it after the pause
    shutil.copy(a / "tokenizer_config.json", root / "broken" / "tokenizer_config.json")
    world = generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0)
    return {
        "root": root,
        "a": a,
        "b": b,
        "tokenizer": AutoTokenizer.from_pretrained(str(a)),
        "questions": [q["query"] for q in world.test][:EPISODES],
        "corpus": world.corpus,
    }


class _KillBeforeContinue:
    """The engine client, except that the engine crashes (and its supervisor restarts it) right
    before the reload's continue_generation."""

    def __init__(self, client: EngineClient, host: EngineHost) -> None:
        self._client, self._host = client, host
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def continue_generation(self) -> None:
        if self.armed:
            await self._host.restart()
        await self._client.continue_generation()


class _Plain:
    def __init__(self, client: EngineClient) -> None:
        self._client, self.armed = client, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _reload_under_load(setup, checkpoint: str, *, kill: bool = False) -> dict[str, Any]:
    """Start on a1 (reloaded while idle), run EPISODES episodes, reload `checkpoint` once the first
    turns are back; the outcome, the trajectories and what engine and worker report after."""

    async def run() -> dict[str, Any]:
        host = await EngineHost(setup["a"], context_length=LIMITS.context_length).start()
        client = EngineClient(
            "http://engine",
            transport=host.transport,
            admin_token=TOKEN,
            backoff_s=0.01,
            unreachable_wait_s=60,
        )
        engine: Any = _KillBeforeContinue(client, host) if kill else _Plain(client)
        manager = ReloadManager(engine, setup["root"], verify=lambda path, expect_config: None)
        try:
            await manager.reload("a1")  # idle: the flush succeeds, a clean start
            engine.armed = True
            turns: list[Any] = []
            runner = EpisodeRunner(
                client,
                ToyRetrievalClient(setup["corpus"]),
                setup["tokenizer"],
                limits=LIMITS,
                sampling=Sampling(temperature=1.0, top_p=1.0),
                on_turn=turns.append,
            )
            episodes = [asyncio.create_task(runner.run(_task(q))) for q in setup["questions"]]
            while len(turns) < 3:
                await asyncio.sleep(0.005)
            try:
                answer: Any = await manager.reload(checkpoint)
            except ReloadRefused as e:
                answer = e
            results = await asyncio.gather(*episodes)
            status = await manager.status()
            return {
                "answer": answer,
                "trajectories": [r.worker_trajectory() for r in results],
                "errors": [r.trajectory.error for r in results],
                "engine_label": (await client.model_info())["weight_version"],
                "engine_path": host.core.model_path,
                "status": status,
                "checkpoint": manager.checkpoint,
                "attempt": manager.attempts[-1],
            }
        finally:
            await client.close()
            await host.close()

    return asyncio.run(run())


def _versions(trajectory) -> list[tuple[str, ...]]:
    return [turn.weight_versions for turn in trajectory.turns]


def test_a_reload_with_episodes_running_keeps_them_and_records_mixed_turns(setup) -> None:
    out = _reload_under_load(setup, "b1")
    assert out["answer"]["weight_version"] == "b1", out["answer"]
    assert not any(out["errors"]), out["errors"]
    assert out["engine_label"] == out["status"]["weight_version"] == "b1"
    assert out["engine_path"] == str(setup["root"] / "b1") and out["checkpoint"] == setup["root"] / "b1"
    # Requests were running at the pause: the flush was refused, and said so.
    assert "prefix cache not flushed" in (out["attempt"].error or "")
    mixed = 0
    for trajectory in out["trajectories"]:
        assert trajectory.weight_versions in (("a1",), ("a1", "b1"), ("b1",)), _versions(trajectory)
        for turn in trajectory.turns:
            if turn.version_spans:  # generated across the swap: a1 tokens, then b1 tokens
                mixed += 1
                assert [s.version for s in turn.version_spans] == ["a1", "b1"]
                assert turn.version_spans[0].start == 0
                assert turn.version_spans[0].end == turn.version_spans[1].start
                assert turn.version_spans[1].end == turn.generated_tokens
                assert turn.weight_version == "b1"
    assert mixed >= 1, [_versions(t) for t in out["trajectories"]]


def test_a_refused_update_leaves_label_and_weights_on_the_old_version(setup) -> None:
    out = _reload_under_load(setup, "broken")
    refused = out["answer"]
    assert isinstance(refused, ReloadRefused) and refused.status == 502
    assert "engine refused the weights" in refused.error and "the engine serves 'a1'" in refused.error
    assert not any(out["errors"]), out["errors"]
    assert out["engine_label"] == out["status"]["weight_version"] == "a1"
    assert out["engine_path"] == str(setup["root"] / "a1") and out["checkpoint"] == setup["root"] / "a1"
    for trajectory in out["trajectories"]:  # every token of every episode from a1
        assert trajectory.weight_versions == ("a1",), _versions(trajectory)
        assert not any(turn.version_spans for turn in trajectory.turns)


def test_an_engine_killed_between_pause_and_continue_comes_back_on_its_start_up_weights(
    setup, caplog
) -> None:
    caplog.set_level("DEBUG")
    out = _reload_under_load(setup, "b1", kill=True)
    assert "reload of b1 failed" in caplog.text and TOKEN not in caplog.text  # sent, never logged
    failed = out["answer"]
    assert isinstance(failed, ReloadRefused) and failed.status == 502
    assert "reports weight_version 'default' after the reload, not 'b1'" in failed.error
    # The restarted engine serves the weights it was started with under their start-up label, and
    # the worker says so: no label claims b1.
    assert out["engine_label"] == out["status"]["weight_version"] == "default"
    assert out["engine_path"] == str(setup["a"]) and out["checkpoint"] is None
    assert out["status"]["checkpoint"] is None
    # In-flight turns lost their connection and were sent again to the restarted engine.
    assert not any(out["errors"]), out["errors"]
    restarted = 0
    for trajectory in out["trajectories"]:
        versions = trajectory.weight_versions
        assert "b1" not in versions and versions in (("a1",), ("a1", "default"), ("default",)), versions
        assert not any(turn.version_spans for turn in trajectory.turns)
        restarted += "default" in versions
    assert restarted >= 1


def test_readiness_holds_through_the_workers_own_reload_only(tmp_path) -> None:
    """GET /ready (the pod's readiness in the chart): the engine's /health_generate decides, except
    while this worker's reload has generation paused, when SGLang's health routes would fail."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from services.worker.service import add_ready_route

    class Engine:
        healthy, slow = True, False

        async def health_generate(self) -> bool:
            if self.slow:
                await asyncio.sleep(5)
            return self.healthy

    engine, app = Engine(), FastAPI()
    manager = ReloadManager(engine, tmp_path)  # type: ignore[arg-type]
    add_ready_route(app, engine, manager, timeout_s=0.2)
    with TestClient(app) as http:
        assert http.get("/ready").status_code == 200
        engine.healthy = False
        assert http.get("/ready").status_code == 503
        manager.in_progress = True  # paused by our own reload: still ready
        assert http.get("/ready").json() == {"status": "reloading"}
        manager.in_progress, engine.healthy, engine.slow = False, True, True
        assert http.get("/ready").status_code == 503  # no answer within the probe's budget
