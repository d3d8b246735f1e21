"""What reads records reads the gateways' PostgreSQL store too: `bcstack episodes show --records URL`,
`bcstack records export --records URL` (a SQLite file `bcstack train grpo` reads, or JSONL), and the
episode viewer of a gateway on that store; none of them prints the URL's password."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from fixtures_pg import new_database, pg_server  # noqa: F401 (fixtures)
from typer.testing import CliRunner
from viewer_records import plain_record

from bcstack.cli import app as cli_app
from core.record_store import SqliteRecordStore, open_record_store
from services.coordinator.service import build
from services.coordinator.settings import CoordinatorSettings

runner = CliRunner()


def _seeded(server) -> tuple[str, list]:
    url = new_database(server)
    records = [plain_record(f"ep-{i}", group_id="g1") for i in range(3)]
    with open_record_store(url) as store:
        for record in records:
            store.put(record.dump())
    return url, records


def test_episodes_show_and_records_export_read_a_postgresql_url(pg_server, tmp_path: Path) -> None:  # noqa: F811
    url, records = _seeded(pg_server)
    shown = runner.invoke(cli_app, ["episodes", "show", "ep-1", "--records", url], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "ep-1" in shown.output and pg_server.password not in shown.output

    missing = runner.invoke(cli_app, ["episodes", "show", "nope", "--records", url])
    assert missing.exit_code == 1
    assert "no recorded episode 'nope' in postgresql://bcstack@" in missing.output
    assert pg_server.password not in missing.output

    out = tmp_path / "copy.sqlite"
    exported = runner.invoke(
        cli_app, ["records", "export", "--records", url, "--out", str(out), "--format", "sqlite"]
    )
    assert exported.exit_code == 0, exported.output
    with SqliteRecordStore(out) as copy:
        assert [r["episode_id"] for r in copy.iter_records()] == [r.episode_id for r in records]
    lines = tmp_path / "copy.jsonl"
    assert runner.invoke(cli_app, ["records", "export", "--records", url, "--out", str(lines)]).exit_code == 0
    assert [json.loads(x)["episode_id"] for x in lines.read_text().splitlines()] == ["ep-0", "ep-1", "ep-2"]

    wrong = url.replace(pg_server.password, "not-the-Pa55word")
    refused = runner.invoke(cli_app, ["records", "export", "--records", wrong, "--out", str(tmp_path / "x")])
    assert refused.exit_code != 0 and "not-the-Pa55word" not in refused.output
    assert "password authentication failed" in refused.output


def test_the_viewer_of_a_gateway_on_postgresql_lists_every_replicas_records(pg_server) -> None:  # noqa: F811
    url, records = _seeded(pg_server)
    settings = CoordinatorSettings(
        coordinator_url="http://127.0.0.1:9/v1", records_url=url, replica_name="gw-a"
    )
    app, _, core = build(settings)
    with TestClient(app) as client:
        page = client.get("/ui")
        assert page.status_code == 200
        assert all(r.episode_id in page.text for r in records)
        assert client.get("/ui/episodes/ep-2").status_code == 200
        assert client.get("/v1/episodes/ep-0").json()["episode_id"] == "ep-0"
        health = client.get("/health").json()
        assert health["replica"] == "gw-a" and health["status"] == "ok"
    core.store.close()


def test_a_gateway_whose_postgresql_does_not_answer_starts_not_ready(tmp_path: Path, monkeypatch) -> None:
    from conftest import find_free_port

    from services.coordinator import service

    monkeypatch.setattr(service, "RECORDS_CONNECT_TIMEOUT_SECONDS", 1.0)  # each attempt's wait, not 5 s
    url = f"postgresql://bcstack:Hidden-Pa55@127.0.0.1:{find_free_port()}/bcstack"
    settings = CoordinatorSettings(coordinator_url="http://127.0.0.1:9/v1", records_url=url)
    app, _, core = build(settings)
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "Hidden-Pa55" not in health.text
        assert health.json()["records"].startswith("waiting for postgresql://bcstack@127.0.0.1:")
        answer = client.get("/v1/episodes/anything")
        assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
        assert "Hidden-Pa55" not in answer.text
    core.store.close()
