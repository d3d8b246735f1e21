"""Three coordinator gateway replicas on one PostgreSQL record store, behind one HAProxy front (as a
Kubernetes Service fronts a Deployment): an episode id means one episode across the replicas, and
any replica answers for any record, also when a replica is SIGKILLed in the middle of a run.

Real processes: Debian's PostgreSQL (tests/fixtures_pg.py), three `bcstack serve coordinator`,
HAProxy (`bcstack.front`), the scripted coordinator LLM (`bcstack serve coordinator-llm`) and an
instant worker service (`devkit.stubworker`), driven by the apps' own client
(`bcstack.gateway_client.run_episode`, which retries with the same id).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml
from conftest import find_free_port
from fixtures_pg import new_database, pg_server  # noqa: F401 (fixtures)
from stack_util import bcstack_process, bcstack_processes

from bcstack.front import HaproxyFront
from bcstack.gateway_client import run_episode
from bcstack.pgserver import PostgresServer
from devkit.stubworker import gateway_config, stub_worker

REPLICAS = 3
EPISODES = 2000
CONCURRENCY = 256
CLIENT_POOLS = 8
LEASE_SECONDS = 2.0


@contextlib.contextmanager
def gateways_on(url: str, tmp_path: Path, n: int, *, log_level: str = "WARNING") -> Iterator[dict]:
    """`n` gateways on the record database at `url`, the scripted LLM, a stub worker and, for n > 1,
    HAProxy in front; the URLs and processes."""
    ports = {"llm": find_free_port(), "worker": find_free_port()}
    stub = multiprocessing.get_context("spawn").Process(
        target=stub_worker, args=(ports["worker"],), daemon=True
    )
    stub.start()
    llm = f"http://127.0.0.1:{ports['llm']}"
    config = tmp_path / "gateway.yaml"
    settings = {"max_concurrent_episodes": 1024, "claim_lease_seconds": LEASE_SECONDS, "log_level": log_level}
    config.write_text(yaml.safe_dump(gateway_config(ports["llm"], ports["worker"], **settings)))
    http = [find_free_port() for _ in range(n)]
    specs = [
        (
            ["serve", "coordinator", "--config", str(config), "--port", str(port), "--grpc-port", "0"],
            f"http://127.0.0.1:{port}/health",
            {
                "BCSTACK_COORDINATOR_RECORDS_URL": url,
                "BCSTACK_COORDINATOR_REPLICA_NAME": f"gateway-{i}",
            },
        )
        for i, port in enumerate(http)
    ]
    try:
        with (
            bcstack_process(
                ["serve", "coordinator-llm", "--port", str(ports["llm"])], llm + "/health", forked=True
            ),
            bcstack_processes(specs, forked=True) as gateways,
            contextlib.ExitStack() as fronts,
        ):
            front = None
            if n > 1:
                folder = Path(tempfile.mkdtemp(prefix="front-", dir=tmp_path))
                backends = [f"127.0.0.1:{p}" for p in http]
                front = fronts.enter_context(HaproxyFront(folder, port=find_free_port(), backends=backends))
            yield {
                "url": url,
                "front": front.url if front is not None else f"http://127.0.0.1:{http[0]}",
                "gateways": [f"http://127.0.0.1:{p}" for p in http],
                "procs": gateways,
            }
    finally:
        stub.terminate()


@pytest.fixture
def replicas(pg_server, tmp_path):  # noqa: F811
    with gateways_on(new_database(pg_server), tmp_path, REPLICAS) as stack:
        yield stack


def test_two_thousand_episodes_across_three_replicas_one_killed_each_id_recorded_once(replicas):
    done: list[str] = []
    killed = asyncio.Event()

    async def drive() -> None:
        ids = [f"ep-{i:04d}" for i in range(EPISODES)]
        queue: asyncio.Queue[str] = asyncio.Queue()
        for episode_id in ids:
            queue.put_nowait(episode_id)
        # 256 connections as 8 pools of 32: httpcore's pool scans every connection of its pool for
        # each request it assigns (encode/httpcore#1035, open), and one pool of 256 spent ~28 of
        # this test's 37 s in that scan, in this process, on the cores the gateways need.
        per_pool = CONCURRENCY // CLIENT_POOLS
        limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        async with contextlib.AsyncExitStack() as stack:
            pools = [
                await stack.enter_async_context(httpx.AsyncClient(timeout=120, limits=limits))
                for _ in range(CLIENT_POOLS)
            ]

            async def one_client(client: httpx.AsyncClient) -> None:
                while not queue.empty():
                    episode_id = queue.get_nowait()
                    body = {"question": f"Where was laureate {episode_id} born?", "episode_id": episode_id}
                    record = await run_episode(client, replicas["front"], body, unreachable_wait_s=60)
                    assert record.episode_id == episode_id
                    done.append(episode_id)
                    if len(done) == EPISODES // 3 and not killed.is_set():
                        killed.set()
                        os.kill(replicas["procs"][1].proc.pid, signal.SIGKILL)  # mid-run, episodes in flight

            await asyncio.gather(*(one_client(pools[i % CLIENT_POOLS]) for i in range(CONCURRENCY)))

    asyncio.run(drive())
    assert killed.is_set() and sorted(done) == sorted(f"ep-{i:04d}" for i in range(EPISODES))

    with psycopg.connect(replicas["url"]) as conn:
        ids = [row[0] for row in conn.execute("SELECT episode_id FROM episodes")]
        claims = conn.execute("SELECT count(*) FROM episode_claims").fetchone()[0]
    counts = Counter(ids)
    assert len(ids) == EPISODES and set(counts) == set(done) and max(counts.values()) == 1
    assert claims == 0  # every claim went with its record (the killed replica's lapsed and were taken)

    # Every record is readable on every live replica, whichever ran it.
    live = [g for i, g in enumerate(replicas["gateways"]) if i != 1]
    with httpx.Client(timeout=30) as client:  # one client: each httpx.get builds an SSL context (~25 ms)
        for episode_id in random.Random(0).sample(done, 100):
            bodies = [client.get(f"{g}/v1/episodes/{episode_id}") for g in live]
            assert [b.status_code for b in bodies] == [200] * len(live)
            assert bodies[0].json() == bodies[1].json()
        listed = client.get(f"{live[0]}/v1/episodes", params={"limit": 10_000}).json()
    assert listed["count"] == EPISODES


def test_a_named_episode_runs_once_when_sent_to_every_replica_at_once(replicas):
    """The same id POSTed to all three replicas together: one runs it, the others wait and answer
    its record."""

    async def post_everywhere() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"question": "Who was born in Tartu?", "episode_id": "shared-1"}
            answers = await asyncio.gather(
                *(client.post(f"{g}/v1/episodes", json=body) for g in replicas["gateways"])
            )
        assert [a.status_code for a in answers] == [200] * REPLICAS
        return [a.json() for a in answers]

    answers = asyncio.run(post_everywhere())
    assert len({a["episode_id"] for a in answers}) == 1
    assert len({repr(a) for a in answers}) == 1  # the very same record, not three runs
    with psycopg.connect(replicas["url"]) as conn:
        assert conn.execute("SELECT count(*) FROM episodes WHERE episode_id = 'shared-1'").fetchone()[0] == 1


def test_postgresql_stopping_mid_run_is_503_and_the_clients_episode_lands_once_it_returns(tmp_path):
    """The record database goes away between two episodes: the gateway answers 503 with Retry-After
    (never a 500, never the password), the apps' client keeps retrying the same id, and once the
    database is back the episode runs and is recorded once."""
    folder = Path(tempfile.mkdtemp(prefix="bcstack-pg-outage-"))
    server = PostgresServer(folder, port=find_free_port())
    server.start()
    try:
        with gateways_on(server.url, tmp_path, 1, log_level="INFO") as stack:
            gateway = stack["gateways"][0]

            async def one(client: httpx.AsyncClient, episode_id: str):
                body = {"question": "Where was the laureate born?", "episode_id": episode_id}
                return await run_episode(client, gateway, body, full_attempts=120)

            async def scenario() -> None:
                async with httpx.AsyncClient(timeout=60) as client:
                    assert (await one(client, "before")).episode_id == "before"
                    server.stop(mode="fast")
                    answer = await client.post(
                        f"{gateway}/v1/episodes", json={"question": "Who?", "episode_id": "during"}
                    )
                    assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
                    assert server.password not in answer.text
                    retried = asyncio.create_task(one(client, "during"))
                    await asyncio.sleep(3)
                    assert not retried.done()  # still waiting: nothing lost, nothing faked
                    await asyncio.to_thread(server.start)
                    record = await asyncio.wait_for(retried, timeout=120)
                    assert record.episode_id == "during"

            asyncio.run(scenario())
            with psycopg.connect(server.url) as conn:
                ids = sorted(r[0] for r in conn.execute("SELECT episode_id FROM episodes"))
            assert ids == ["before", "during"]
            log = stack["procs"][0].log()
            outage = "ERROR bcstack.coordinator: cannot claim episode during in record database postgresql://"
            assert outage in log
            assert server.password not in log
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(folder, ignore_errors=True)
