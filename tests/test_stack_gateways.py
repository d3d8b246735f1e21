"""`bcstack up --records-backend postgres --gateways N`: the stack's own PostgreSQL in STATE/postgres,
N gateway processes on it and one HAProxy front, whose URL is the stack's one gateway URL.

Real processes on the session's toy kit (expert worker): Debian's PostgreSQL, HAProxy and every
`bcstack serve` service. The state folder is not under pytest's tmp_path: as root the server runs
as the postgres user, who cannot enter root's 0700 pytest folders (tests/fixtures_pg.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from bcstack import stack
from bcstack.cli import app
from bcstack.episodes_cli import _stack as episodes_stack
from bcstack.pgserver import PostgresServer
from bcstack.smoke import from_state
from bcstack.stack import StackError, down, up

# This module's stacks fork their services (conftest.forked_services).
pytestmark = pytest.mark.usefixtures("forked_services")

runner = CliRunner()


def quiet(_line: str) -> None:
    pass


@pytest.fixture
def state():
    folder = Path(tempfile.mkdtemp(prefix="bcstack-gateways-"))
    folder.chmod(0o755)  # the postgres user reaches STATE/postgres through it
    try:
        yield folder / "state"
    finally:
        if (folder / "state" / stack.STATE_FILE).is_file():
            down(folder / "state", say=quiet)
        shutil.rmtree(folder, ignore_errors=True)


def test_several_gateways_need_postgres_and_are_refused_before_anything_starts(tmp_path):
    result = runner.invoke(app, ["up", "--state", str(tmp_path / "s"), "--gateways", "2"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: --gateways 2 needs --records-backend postgres (one store they all share)"
    ]
    with pytest.raises(StackError, match="--records-backend mysql: choose sqlite or postgres"):
        up(tmp_path / "s", records_backend="mysql", say=quiet)
    with pytest.raises(StackError, match="a SQLite file; with --records-backend postgres leave it out"):
        up(tmp_path / "s", records_backend="postgres", records=tmp_path / "r.sqlite", say=quiet)
    assert not (tmp_path / "s").exists()


def test_two_gateways_behind_one_front_share_the_stacks_postgresql_across_down_and_up(toy_kit, state):
    kit_dir = toy_kit["dir"]
    assets = {"world": kit_dir / "world", "kit": kit_dir / "tiny", "index": kit_dir / "idx"}
    info = up(state, **assets, records_backend="postgres", gateways=2, timeout=90, say=quiet)
    services = info["services"]
    gateways = [services["coordinator"]["http"], services["coordinator-2"]["http"]]
    front = info["gateway"]
    assert front == services["front"]["http"] and front not in gateways
    # The apps read that one URL from stack.json.
    assert from_state(state)[0] == front and episodes_stack(state)[0] == front
    server = PostgresServer(state / "postgres", port=info["postgres"]["port"])
    assert info["assets"]["records"] == info["postgres"]["url"] == server.public_url
    # The password is in no command line and not in stack.json.
    assert server.password not in (state / stack.STATE_FILE).read_text()
    for name in ("coordinator", "coordinator-2"):
        cmdline = Path(f"/proc/{services[name]['pid']}/cmdline").read_text()
        assert server.password not in cmdline and "--records" not in cmdline.split("\0")

    easy = [q for q in toy_kit["world"].test if q["data_source"] == "bc_test_easy"][:4]
    bodies = [
        httpx.post(front + "/v1/episodes", json={"question": q["query"]}, timeout=60).json() for q in easy
    ]
    assert [(b["status"], b["answer"]) for b in bodies] == [("finish", q["answer"]) for q in easy]
    ids = sorted(b["episode_id"] for b in bodies)
    with psycopg.connect(server.url) as conn:
        rows = conn.execute("SELECT episode_id FROM episodes ORDER BY episode_id").fetchall()
    assert [r[0] for r in rows] == ids
    for gateway in gateways:  # each gateway answers for every record, whichever ran it
        for episode_id in ids:
            got = httpx.get(f"{gateway}/v1/episodes/{episode_id}", timeout=10)
            assert got.status_code == 200 and got.json()["episode_id"] == episode_id

    # `bcstack restart` gives a gateway the database again (else it would open an empty SQLite file)
    # and starts the front on its port over the same gateways.
    stack.restart(state, "coordinator-2", timeout=60, say=quiet)
    stack.restart(state, "front", timeout=60, say=quiet)
    assert httpx.get(f"{gateways[1]}/v1/episodes/{ids[0]}", timeout=10).status_code == 200
    assert httpx.get(f"{front}/v1/episodes/{ids[1]}", timeout=10).status_code == 200

    services = stack.read_state(state)["services"]
    pids = [s["pid"] for s in services.values()]
    assert len(pids) == 8  # retrieval, engine, worker, coordinator-llm, two gateways, judge, front
    stopped = down(state, say=quiet)
    assert stopped == len(pids) + 1  # and the PostgreSQL server
    assert not any(stack._alive(p) for p in pids) and not server.running()
    with pytest.raises(httpx.HTTPError):
        httpx.get(front + "/health", timeout=2)

    # A second `up` (one gateway: no front) finds the records of the first in the same data folder.
    again = up(state, **assets, records_backend="postgres", timeout=90, say=quiet)
    assert "front" not in again["services"] and again["gateway"] == again["services"]["coordinator"]["http"]
    listed = httpx.get(again["gateway"] + "/v1/episodes", params={"limit": 100}, timeout=10).json()
    assert sorted(e["episode_id"] for e in listed["episodes"]) == ids
    assert json.loads((state / stack.STATE_FILE).read_text())["records_backend"] == "postgres"
