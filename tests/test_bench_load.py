"""The gateway benches' load generator (`bench/gateway.py`'s `drive`): closed loop, N clients each
posting its next episode when its last returns; open loop (issue 33's replica CPU at a load below
saturation), episodes arriving at a fixed mean rate whatever the server does, at most N in flight,
an arrival beyond that refused and counted. Against a small aiohttp server that answers
`POST /v1/episodes` as the gateway does, after a set delay."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from conftest import bench_module

ROOT = Path(__file__).resolve().parents[1]


def _gateway_bench():
    return bench_module("gateway")


async def _with_server(delay: float, body):
    """Run `body(url, seen)` against a server answering each episode after `delay` s; `seen` counts
    the episodes it was sent and the most it held at once."""
    seen = {"posted": 0, "in_flight": 0, "most": 0}

    async def episode(request: web.Request) -> web.Response:
        data = await request.json()
        seen["posted"] += 1
        number = seen["posted"]
        seen["in_flight"] += 1
        seen["most"] = max(seen["most"], seen["in_flight"])
        try:
            await asyncio.sleep(delay)
        finally:
            seen["in_flight"] -= 1
        episode_id = data.get("episode_id") or f"ep{number}"
        return web.json_response({"episode_id": episode_id, "status": "finish", "usage": {"turns": 2}})

    app = web.Application()
    app.router.add_post("/v1/episodes", episode)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        return await body(f"http://127.0.0.1:{port}", seen)
    finally:
        await runner.cleanup()


def test_the_open_loop_offers_the_rate_asked_whatever_the_server_takes():
    drive = _gateway_bench().drive

    async def body(url, seen):
        return await drive(url, 64, 2.0, rate=40.0), dict(seen)

    run, seen = asyncio.run(_with_server(0.05, body))
    # Poisson arrivals at 40/s for 2 s, seeded: ~80 episodes (sd ~9), every one answered.
    assert 50 <= run["episodes"] <= 110, run
    assert run["episodes"] == seen["posted"] and run["errors"] == 0 and run["refused"] == 0
    assert run["turns"] == 2 * run["episodes"]
    assert len(set(run["episode_ids"])) == run["episodes"]
    # A 50 ms answer at 40/s: a few in flight at once, not one after another as a closed loop of 1.
    assert seen["most"] >= 2


def test_the_open_loop_refuses_arrivals_beyond_its_cap_and_counts_them():
    drive = _gateway_bench().drive

    async def body(url, seen):
        return await drive(url, 2, 1.0, rate=50.0), dict(seen)

    run, seen = asyncio.run(_with_server(0.5, body))
    # Two in flight, each held 0.5 s: ~4-6 sent in a second, the other ~45 arrivals refused.
    assert seen["most"] <= 2
    assert run["episodes"] == seen["posted"] <= 8
    assert run["refused"] >= 25
    assert run["errors"] == 0


def test_the_closed_loop_keeps_its_clients_busy():
    drive = _gateway_bench().drive

    async def body(url, seen):
        return await drive(url, 4, 1.0, named=True), dict(seen)

    run, seen = asyncio.run(_with_server(0.1, body))
    # Four clients, 0.1 s per episode, 1 s: ~40 episodes, four in flight throughout, none refused.
    assert 30 <= run["episodes"] <= 48 and run["refused"] == 0
    assert seen["most"] == 4
    assert all(i.count("-") == 1 for i in run["episode_ids"])  # named: run id - counter


def test_a_rate_that_is_not_positive_is_refused():
    drive = _gateway_bench().drive
    with pytest.raises(ValueError, match="positive"):
        asyncio.run(drive("http://127.0.0.1:9", 4, 1.0, rate=0.0))


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--rate", "fast", "--rate takes numbers"),
        ("--rate", "0", "--rate takes positive"),
        ("--per-replica-rate", "-5", "--per-replica-rate takes positive"),
        ("--concurrency", "", "part 2 needs a load"),
    ],
)
def test_gateway_scale_refuses_a_bad_load_in_one_line(option, value, says):
    args = [sys.executable, str(ROOT / "bench" / "gateway_scale.py"), "--gateways-only", option, value]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr
