"""`bcstack up` with given assets and service settings, and `bcstack records export`.

The option checks run without starting anything; one end-to-end `up` runs the stack on the
session's toy kit (world, tiny kit and index used as they are) with a worker setting given.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import httpx
import pytest
import typer
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from bcstack import stack
from bcstack.cli import app
from bcstack.stack import StackError, down, plan, up
from core.kit.settings import load_settings
from core.record_store import SqliteRecordStore
from services.engine.settings import EngineSettings
from services.worker.settings import WorkerSettings
from trainer.data import read_records

runner = CliRunner()


def quiet(_line: str) -> None:
    pass


def serve_command(service: str):
    """The click command `bcstack serve <service>` really is (the serve factory's options)."""
    return typer.main.get_command(app).commands["serve"].commands[service]


def parse_serve(service: str, args: list[str]):
    """Parse a `bcstack serve <service>` command line as the real command does, then load its
    settings from what was typed, as `serve_command` does before it starts the service."""
    ctx = serve_command(service).make_context(service, list(args))
    typed = {
        name: value
        for name, value in ctx.params.items()
        if name != "config" and ctx.get_parameter_source(name).name == "COMMANDLINE"
    }
    return load_settings({"worker": WorkerSettings, "engine": EngineSettings}[service], **typed)


def fake_world(root):
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text('{"docid": "d1", "text": "t", "url": "u"}\n')
    (root / "questions.jsonl").write_text("")
    return root


# --- settings ---------------------------------------------------------------------------------


def test_an_unknown_setting_names_the_closest_one_before_anything_is_built(tmp_path):
    with pytest.raises(
        StackError, match=r"snipet_words: no such worker setting; did you mean snippet_words\?"
    ):
        up(tmp_path / "state", worker_settings={"snipet_words": "24"}, say=quiet)
    with pytest.raises(StackError, match="did you mean max_running_requests"):
        up(tmp_path / "state", engine_settings={"max_runing_requests": "4"}, say=quiet)
    assert not (tmp_path / "state").exists()  # nothing built, nothing started

    result = runner.invoke(app, ["up", "--state", str(tmp_path / "s"), "--worker-setting", "snipet_words=24"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --worker-setting snipet_words: no such worker setting; did you mean snippet_words?"
    ]


def test_a_bad_value_gives_pydantics_message_in_one_line(tmp_path):
    with pytest.raises(StackError) as bad_int:
        up(tmp_path, worker_settings={"snippet_words": "many"}, say=quiet)
    assert str(bad_int.value) == (
        "--worker-setting snippet_words=many: "
        "Input should be a valid integer, unable to parse string as an integer"
    )
    with pytest.raises(StackError, match=r"snippet_words=0: Input should be greater than or equal to 1$"):
        up(tmp_path, worker_settings={"snippet_words": 0}, say=quiet)
    with pytest.raises(StackError, match="dtype=float64: Input should be 'auto', 'float32' or 'bfloat16'"):
        up(tmp_path, engine_settings={"dtype": "float64"}, say=quiet)
    result = runner.invoke(app, ["up", "--state", str(tmp_path), "--engine-setting", "max_running_requests"])
    assert result.exit_code == 2
    assert result.stderr == "error: --engine-setting takes KEY=VALUE, not 'max_running_requests'\n"


def test_settings_up_gives_itself_and_secrets_are_refused(tmp_path):
    with pytest.raises(StackError, match="--worker-setting engine_url: `bcstack up` sets it itself"):
        up(tmp_path, worker_settings={"engine_url": "http://elsewhere"}, say=quiet)
    with pytest.raises(StackError, match="set BCSTACK_ENGINE_API_KEY in the environment"):
        up(tmp_path, engine_settings={"api_key": "s3cret"}, say=quiet)


def test_plan_gives_the_settings_as_options_the_serve_commands_accept(tmp_path):
    assets = {"world": tmp_path / "world", "tiny": tmp_path / "tiny", "index": tmp_path / "index"}
    services = {
        s.name: s
        for s in plan(
            tmp_path,
            assets,
            "expert",
            "token",
            worker_settings={"snippet_words": "24", "reflection-nudge": False, "top_k": 5},
            engine_settings={"max_running_requests": "4", "dtype": "float32"},
            records=tmp_path / "elsewhere" / "records.sqlite",
        )
    }
    worker, engine = services["worker"].args, services["engine"].args
    assert worker[:2] == ["serve", "worker"] and engine[:2] == ["serve", "engine"]
    assert "--snippet-words" in worker and "--no-reflection-nudge" in worker  # a boolean: a flag
    w = parse_serve("worker", worker[2:])
    assert (w.snippet_words, w.reflection_nudge, w.top_k) == (24, False, 5)
    assert (w.port, str(w.tokenizer), w.engine_url) == (
        services["worker"].http_port,
        str(assets["tiny"]),
        services["engine"].http,
    )
    e = parse_serve("engine", engine[2:])
    assert (e.max_running_requests, e.dtype, e.policy, e.world) == (4, "float32", "expert", assets["world"])
    gateway = services["coordinator"].args
    assert gateway[gateway.index("--records") + 1] == str(tmp_path / "elsewhere" / "records.sqlite")
    # Without settings the command lines are what they were.
    plain = {s.name: s.args for s in plan(tmp_path, assets, "expert", "token")}
    assert (
        "--snippet-words" not in plain["worker"]
        and parse_serve("worker", plain["worker"][2:]).snippet_words == 512
    )


def test_plan_with_replicas_pairs_each_worker_with_its_own_engine_behind_one_gateway(tmp_path):
    assets = {"world": tmp_path / "world", "tiny": tmp_path / "tiny", "index": tmp_path / "index"}
    services = {s.name: s for s in plan(tmp_path, assets, "expert", "token", replicas=3)}
    assert [n for n in services if stack.base_name(n) in ("engine", "worker")] == [
        "engine", "worker", "engine-2", "worker-2", "engine-3", "worker-3"
    ]  # fmt: skip
    ports = [p for s in services.values() for p in (s.http_port, s.grpc_port) if p]
    assert len(ports) == len(set(ports))
    for r in ("", "-2", "-3"):
        worker, engine = services[f"worker{r}"], services[f"engine{r}"]
        assert worker.args[:2] == ["serve", "worker"] and engine.args[:2] == ["serve", "engine"]
        assert parse_serve("worker", worker.args[2:]).engine_url == engine.http
    gateway = services["coordinator"].args
    assert gateway[gateway.index("--workers") + 1].split(",") == [
        services[f"worker{r}"].grpc for r in ("", "-2", "-3")
    ]
    info = {"services": {n: {"http": s.http} for n, s in reversed(services.items())}}
    assert stack.worker_urls(info) == [services[f"worker{r}"].http for r in ("", "-2", "-3")]
    with pytest.raises(StackError, match="at least 1"):
        plan(tmp_path, assets, "expert", "token", replicas=0)


# --- given folders ----------------------------------------------------------------------------


def test_given_folders_that_are_not_what_they_claim_are_refused(tmp_path):
    half_world = tmp_path / "half-world"
    half_world.mkdir()
    (half_world / "corpus.jsonl").write_text("")
    with pytest.raises(
        StackError, match=r"--world .*half-world: not a toy world folder \(no questions.jsonl\)"
    ):
        up(tmp_path / "state", world=half_world, say=quiet)

    no_model = tmp_path / "no-model"
    no_model.mkdir()
    (no_model / "tokenizer.json").write_text("{}")
    with pytest.raises(StackError, match=r"--kit .*no-model: not a model folder \(no config.json\)"):
        up(tmp_path / "state", kit=no_model, say=quiet)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text("{}")
    with pytest.raises(StackError, match="--kit .*no-tokenizer: no tokenizer"):
        up(tmp_path / "state", kit=no_tokenizer, say=quiet)

    with pytest.raises(StackError, match=r"--index-dir .*: not an index folder \(no manifest.json\)"):
        up(tmp_path / "state", index=tmp_path / "nowhere", say=quiet)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "manifest.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(StackError, match="--index-dir .*partial: an incomplete index"):
        up(tmp_path / "state", index=partial, say=quiet)

    with pytest.raises(StackError, match="--dense qdrant: choose edge or none"):
        up(tmp_path / "state", dense="qdrant", say=quiet)
    assert not (tmp_path / "state").exists()


def test_an_index_to_build_gets_the_dense_backend_asked_for(tmp_path, monkeypatch):
    world = fake_world(tmp_path / "world")
    kit = tmp_path / "kit"  # never opened here: no service starts
    kit.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (kit / name).write_text("{}")
    calls = []

    def fake_index(args, check):
        calls.append(args)
        index = args[args.index("--index-dir") + 1]
        (tmp_path / "state" / "index").mkdir(parents=True)
        (tmp_path / "state" / "index" / "manifest.json").write_text(
            json.dumps({"complete": True, "dense": args[args.index("--dense") + 1]})
        )
        assert index == str(tmp_path / "state" / "index")
        return stack.subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(stack.subprocess, "run", fake_index)
    assets = stack.ensure_assets(
        tmp_path / "state",
        docs=10,
        seed=0,
        questions_per_tier=1,
        say=quiet,
        world=world,
        kit=kit,
        dense="none",
    )
    [args] = calls
    assert args[:4] == [sys.executable, "-m", "bcstack", "index"]
    assert args[args.index("--corpus") + 1] == str(world / "corpus.jsonl") and "--dense" in args
    assert assets == {"world": world, "tiny": kit, "index": tmp_path / "state" / "index"}
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["index"]  # no world, no tiny built
    # Built, it is used as it is; asked for another dense backend, it is refused, not silently used.
    stack.ensure_assets(
        tmp_path / "state", docs=10, seed=0, questions_per_tier=1, say=quiet, world=world, kit=kit
    )
    assert len(calls) == 1
    with pytest.raises(StackError, match="was built with dense 'none', not 'edge'; remove it to rebuild it"):
        stack.ensure_assets(
            tmp_path / "state",
            docs=10,
            seed=0,
            questions_per_tier=1,
            say=quiet,
            world=world,
            kit=kit,
            dense="edge",
        )


# --- records export ---------------------------------------------------------------------------


def test_records_export_copies_a_live_store_to_jsonl_and_sqlite(tmp_path):
    path = tmp_path / "records.sqlite"
    store = SqliteRecordStore(path)
    ids = [f"e{i}" for i in range(5)]
    try:
        for i, episode_id in enumerate(ids):
            store.put(
                {
                    "episode_id": episode_id,
                    "status": "finished",
                    "question_id": f"q{i}",
                    "created_at": 100.0 + i,
                }
            )
        # Still open: the records sit in the write-ahead log, which a plain copy of the file misses.
        assert (tmp_path / "records.sqlite-wal").stat().st_size > 0
        for fmt in ("jsonl", "sqlite"):
            out = tmp_path / "out" / f"records.{fmt}"
            result = runner.invoke(
                app, ["records", "export", "--records", str(path), "--out", str(out), "--format", fmt]
            )
            assert result.exit_code == 0, result.output
            assert result.stdout == f"5 record(s) written to {out} ({fmt})\n"
            got = [record for _origin, record in read_records(out)]
            assert [r["episode_id"] for r in got] == ids
            assert got == [store.get(episode_id) for episode_id in ids]
        store.put({"episode_id": "e5", "status": "finished"})  # the store is still usable
    finally:
        store.close()


def test_records_export_refuses_what_is_not_a_record_store(tmp_path):
    def export(records, fmt="jsonl"):
        result = runner.invoke(
            app,
            ["records", "export", "--records", str(records), "--out", str(tmp_path / "o"), "--format", fmt],
        )
        assert result.exit_code == 2
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: --")
        return result.stderr

    assert "no such file" in export(tmp_path / "missing.sqlite")
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    assert "not a record store (not a SQLite file)" in export(text)
    other = tmp_path / "cache.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE grades (key TEXT)")
    assert "not a record store (no episodes table)" in export(other)
    with sqlite3.connect(other) as conn:  # left as it was: still not in WAL mode
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    SqliteRecordStore(tmp_path / "r.sqlite").close()
    assert "--format csv: choose jsonl or sqlite" in export(tmp_path / "r.sqlite", fmt="csv")
    assert not (tmp_path / "o").exists()


# --- end to end -------------------------------------------------------------------------------


def _untouched(kit_dir) -> dict[str, tuple[int, int]]:
    """Size and mtime of what must stay as it is: the world, the tiny kit and the index as built.

    Not all of idx/: the retrieval service, opening any index, rewrites its Qdrant Edge shard files
    and leaves the doc store's SQLite -wal/-shm beside it (services/retrieval); `up` writes nothing.
    """
    files = [p for d in ("world", "tiny") for p in (kit_dir / d).rglob("*") if p.is_file()]
    files += [kit_dir / "idx" / "manifest.json", kit_dir / "idx" / "docstore.sqlite"]
    return {str(p.relative_to(kit_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def test_up_runs_on_a_given_world_index_and_kit_with_worker_settings(toy_kit, tmp_path):
    kit_dir = toy_kit["dir"]
    before = _untouched(kit_dir)
    state, records = tmp_path / "state", tmp_path / "elsewhere" / "records.sqlite"
    info = up(
        state,
        worker="expert",
        world=kit_dir / "world",
        kit=kit_dir / "tiny",
        index=kit_dir / "idx",
        worker_settings={"snippet_words": "24", "max_turns": "7"},
        records=records,
        replicas=2,
        timeout=60,
        say=quiet,
    )
    try:
        assert json.loads((state / "stack.json").read_text()) == info
        assert info["replicas"] == 2 and {"engine-2", "worker-2"} <= set(info["services"])
        assert info["settings"] == {"worker": {"snippet_words": "24", "max_turns": "7"}, "engine": {}}
        assert info["assets"]["index"] == str(kit_dir / "idx") and info["assets"]["records"] == str(records)
        assert not {"world", "tiny", "index"} & {p.name for p in state.iterdir()}  # nothing built
        worker = info["services"]["worker"]
        cmdline = Path(f"/proc/{worker['pid']}/cmdline").read_text().split("\0")
        assert cmdline[cmdline.index("--snippet-words") + 1] == "24"
        metrics = text_string_to_metric_families(httpx.get(worker["http"] + "/metrics", timeout=5).text)
        limits = {
            s.labels["limit"]: s.value for f in metrics if f.name == "bcstack_worker_limit" for s in f.samples
        }
        assert limits["max_turns"] == 7
        easy = [q for q in toy_kit["world"].test if q["data_source"] == "bc_test_easy"][:6]
        gateway = info["services"]["coordinator"]["http"]

        def ask(q: dict) -> dict:
            return httpx.post(gateway + "/v1/episodes", json={"question": q["query"]}, timeout=60).json()

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(easy)) as pool:
            bodies = list(pool.map(ask, easy))
        assert [(b["status"], b["answer"]) for b in bodies] == [("finish", q["answer"]) for q in easy]
        wait_until(lambda: records.is_file(), timeout=10, message="the record file")
        wait_until(lambda: len(list(read_records(records))) == len(easy), timeout=10, message="every record")
        assert {r["episode_id"] for _o, r in read_records(records)} == {b["episode_id"] for b in bodies}
        # Episodes sent together are spread over both replicas (least in flight first).
        served = []
        for name in ("worker", "worker-2"):
            text = httpx.get(info["services"][name]["http"] + "/metrics", timeout=5).text
            served.append(
                sum(
                    s.value
                    for f in text_string_to_metric_families(text)
                    if f.name == "bcstack_worker_episodes"
                    for s in f.samples
                    if s.name == "bcstack_worker_episodes_total"
                )
            )
        assert sum(served) == len(easy) and min(served) >= 1, served
        # `bcstack smoke --state` checks every replica's metrics too.
        from bcstack.smoke import from_state, run_smoke

        gateway_url, targets = from_state(state)
        checks = {c.name: c for c in run_smoke(None, targets, "", timeout=10)}
        assert {"engine-2 /metrics", "worker-2 /metrics"} <= set(checks)
        assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]
        pids = [s["pid"] for s in info["services"].values()]
    finally:
        down(state, say=quiet)
    assert not any(stack._alive(p) for p in pids)  # every replica stopped too
    assert _untouched(kit_dir) == before  # used as they are: nothing rebuilt
