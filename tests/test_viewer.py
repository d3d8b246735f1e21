"""The episode viewer without a browser: the view-model of a known record, the record store's
filters (and its version-1 migration), the list's paging, the /ui routes' access rules, and
`bcstack episodes show` (Rich) through typer's CliRunner.

The browser side (rendering, filters through the form, the mask toggle, a screenshot) is
tests/test_viewer_browser.py.
"""

from __future__ import annotations

import json
import sqlite3
import zlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner
from viewer_records import LONG_PAGE, WORKER_TURNS, build_tokenizer, known_record, plain_record, seed_store

from bcstack.cli import app as cli_app
from core import budget
from core.record_store import RecordQuery, SqliteRecordStore
from services.coordinator.episode_list import list_view, parse_filters
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.viewer import TokenDecoder, episode_view, split_thinking

DAY = 86_400.0
T0 = 1_790_000_000.0  # 2026-09-21 14:13:20 UTC


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("viewer-tokenizer"))


@pytest.fixture(scope="module")
def decoder(tokenizer_dir: Path) -> TokenDecoder:
    return TokenDecoder.load(tokenizer_dir)


@pytest.fixture(scope="module")
def encode(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


# --- the episode view-model -------------------------------------------------------------------------


def test_every_worker_turn_reads_back_as_the_model_wrote_it(encode, decoder) -> None:
    record = known_record(encode)
    view = episode_view(record, decoder)
    assert view.decoder_note is None
    [branch] = view.all_branches
    assert [t.model.thinking for t in branch.turns] == [t.thinking for t in WORKER_TURNS]
    assert [t.model.text for t in branch.turns] == [t.call for t in WORKER_TURNS]
    assert [t.observation.text if t.observation else None for t in branch.turns] == [
        t.observation for t in WORKER_TURNS
    ]
    assert [t.weight_version for t in branch.turns] == ["v3", "v4", "v4", "v4"]
    assert [[(c.name, c.outcome) for c in t.tool_calls] for t in branch.turns] == [
        [("search", "ok")],
        [("open_page", "ok")],
        [("open_page", "not_found")],
        [("finish", "ok")],
    ]
    # the worker's task, as the first prompt held it
    assert [role for role, _ in branch.task] == ["system", "user"]


def test_long_pages_fold_and_short_ones_do_not(encode, decoder) -> None:
    [branch] = episode_view(known_record(encode), decoder).all_branches
    search, page, missing, _ = (t.observation for t in branch.turns)
    assert page.folded and LONG_PAGE in page.text and "characters" in page.summary
    assert not search.folded and not missing.folded


def test_bars_use_the_records_own_limits(encode, decoder) -> None:
    record = known_record(encode)
    [branch] = episode_view(record, decoder).all_branches
    trajectory = record.workers[0].trajectory
    assert (branch.tokens.used, branch.tokens.limit) == (trajectory.tokens_used, budget.MAX_TOKENS)
    assert (branch.turns_bar.used, branch.turns_bar.limit) == (4, budget.MAX_TURNS)
    assert not branch.budget_overridden

    record.worker_budget = {"max_tokens": 1000, "max_turns": 4}
    [branch] = episode_view(record, decoder).all_branches
    assert (branch.tokens.limit, branch.turns_bar.limit) == (1000, 4)
    assert branch.tokens.over and branch.tokens.percent == 100.0 and branch.budget_overridden


def test_the_loss_mask_marks_exactly_the_generated_tokens(encode, decoder) -> None:
    record = known_record(encode)
    [branch] = episode_view(record, decoder).all_branches
    trajectory = record.workers[0].trajectory
    trained = [s for s in branch.mask if s.trained]
    assert len(trained) == len(WORKER_TURNS)
    assert sum(s.tokens for s in trained) == sum(trajectory.loss_mask) == branch.trained_tokens
    assert sum(s.tokens for s in branch.mask) == len(trajectory.token_ids)
    for segment, turn in zip(trained, WORKER_TURNS, strict=True):
        assert turn.call in segment.text and turn.thinking in segment.text
    assert not any(turn.observation and turn.observation in s.text for s in trained for turn in WORKER_TURNS)


def test_coordinator_turns_hold_their_branches_and_what_came_back(encode, decoder) -> None:
    view = episode_view(known_record(encode), decoder)
    first, second = view.turns
    assert [b.branch for b in first.branches] == [0] and second.branches == []
    assert first.model.thinking == "One worker should find the year."
    assert first.model.text.startswith("<function=branch>")
    assert first.reply is not None and "answer: 1761" in first.reply.text
    assert (view.coordinator_turns.used, view.coordinator_turns.limit) == (2, 16)
    assert view.verdict.label == "correct" and view.all_branches[0].contribution == 0.75
    assert view.gold_answer == "1761" and view.created == "2026-09-21 14:13:20 UTC"


def test_without_a_tokenizer_the_view_says_why_the_text_is_missing(encode) -> None:
    view = episode_view(known_record(encode), None)
    assert "no tokenizer" in view.decoder_note
    [branch] = view.all_branches
    assert all(t.model is None for t in branch.turns)
    assert [len(t.tool_calls) for t in branch.turns] == [1, 1, 1, 1]  # structure is all still there
    assert branch.mask[0].text.split()[0] == str(known_record(encode).workers[0].trajectory.token_ids[0])


def test_a_tokenizer_too_small_for_the_token_ids_is_called_out(encode, decoder) -> None:
    far = known_record(lambda text: [i + decoder.vocab_size for i in encode(text)])
    assert "not the worker model's tokenizer" in episode_view(far, decoder).decoder_note


@pytest.mark.parametrize(
    ("raw", "thinking", "text"),
    [
        ("<think>\nplan\n</think>\n\nact<|im_end|>", "plan", "act"),
        ("<think>\ncut off mid-tho", "cut off mid-tho", ""),
        ("opened in the prompt\n</think>\n\nact", "opened in the prompt", "act"),
        ("no thinking at all", None, "no thinking at all"),
    ],
)
def test_thinking_is_split_from_the_reply(raw: str, thinking: str | None, text: str) -> None:
    split = split_thinking(raw)
    assert (split.thinking, split.text) == (thinking, text)


def test_a_missing_tokenizer_is_a_one_line_error(tmp_path: Path) -> None:
    from services.coordinator.viewer import DecoderError

    with pytest.raises(DecoderError, match="no tokenizer.json") as excinfo:
        TokenDecoder.load(tmp_path)
    assert "\n" not in str(excinfo.value)


# --- filters, paging, the store's new columns -------------------------------------------------------


def _varied() -> list:
    r = plain_record
    return [
        r("a", status="finish", group_id="g1", weight_versions=("v1",), correct=True, created_at=T0),
        r("b", status="error", group_id="g1", weight_versions=("v1",), correct=False, created_at=T0 + 1),
        r("c", status="finish", group_id="g2", weight_versions=("v1", "v2"), created_at=T0 + DAY),
        r("d", status="turns", group_id="g2", question_id="q-9", endpoint="m2", created_at=T0 + 2 * DAY),
        r(
            "e",
            status="finish",
            group_id="g3",
            weight_versions=("v2",),
            correct=True,
            created_at=T0 + 3 * DAY,
        ),
    ]


def _ids(store: SqliteRecordStore, **query) -> list[str]:
    rows, total = store.search(RecordQuery(**query))
    assert total == len(rows)
    return [r["episode_id"] for r in rows]


def test_each_filter_narrows_the_records(tmp_path: Path) -> None:
    with SqliteRecordStore(seed_store(tmp_path / "r.sqlite", _varied())) as store:
        assert _ids(store) == ["e", "d", "c", "b", "a"]  # newest first
        assert _ids(store, status="finish") == ["e", "c", "a"]
        assert _ids(store, group_id="g2") == ["d", "c"]
        assert _ids(store, question_id="q-9") == ["d"]
        assert _ids(store, endpoint="m2") == ["d"]
        assert _ids(store, weight_version="v2") == ["e", "c"]
        assert _ids(store, graded="correct") == ["e", "a"]
        assert _ids(store, graded="incorrect") == ["b"]
        assert _ids(store, graded="ungraded") == ["d", "c"]
        assert _ids(store, created_from=T0 + DAY, created_to=T0 + 3 * DAY) == ["d", "c"]
        assert _ids(store, status="finish", weight_version="v1") == ["c", "a"]
        assert store.facets() == {
            "status": ["error", "finish", "turns"],
            "endpoint": ["default", "m2"],
            "weight_version": ["v1", "v2"],
        }


def test_a_version_1_record_file_is_migrated_and_stays_readable(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    old = plain_record("old-1", group_id="g-old", weight_versions=("v7",), correct=False).dump()
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE episodes (episode_id TEXT PRIMARY KEY NOT NULL, question_id TEXT, status TEXT NOT NULL,"
        " endpoint TEXT, created_at REAL NOT NULL, body BLOB NOT NULL);"
        "CREATE INDEX episodes_by_time ON episodes (created_at);"
        "CREATE INDEX episodes_by_question ON episodes (question_id, created_at);"
        "PRAGMA user_version = 1;"
    )
    conn.execute(
        "INSERT INTO episodes VALUES (?, ?, ?, ?, ?, ?)",
        ("old-1", "q-1", "finish", "default", T0, zlib.compress(json.dumps(old).encode())),
    )
    conn.commit()
    conn.close()
    with SqliteRecordStore(path) as store:
        assert store.get("old-1") == old
        assert _ids(store, group_id="g-old", weight_version="v7", graded="incorrect") == ["old-1"]
        store.put(plain_record("new-1", group_id="g-old").dump())
        assert _ids(store, group_id="g-old") == ["new-1", "old-1"]
    with SqliteRecordStore(path) as store:  # opened again: already version 2, nothing to do
        assert store.count() == 2


def test_paging_walks_every_record_once_and_keeps_the_filters(tmp_path: Path) -> None:
    records = [
        plain_record(f"p{i:02d}", status="finish" if i % 4 else "error", created_at=T0 + i) for i in range(23)
    ]
    with SqliteRecordStore(seed_store(tmp_path / "r.sqlite", records)) as store:
        seen, params = [], {"status": "finish", "per_page": "5"}
        for _ in range(10):
            page = list_view(store, params)
            seen += [r.episode_id for r in page.rows]
            if page.next_query is None:
                break
            params = dict(p.split("=") for p in page.next_query.split("&"))
        assert page.pages == 4 and page.total == 17 and (page.first_shown, page.last_shown) == (16, 17)
        assert seen == [f"p{i:02d}" for i in reversed(range(23)) if i % 4]
        assert list_view(store, {"page": "99", "per_page": "5"}).page == 5  # past the end: the last page


def test_nonsense_filters_are_reported_and_left_out() -> None:
    query, given, errors = parse_filters(
        {"since": "yesterday", "graded": "maybe", "group_id": " g1 ", "status": ""}
    )
    assert query.created_from is None and query.graded is None and query.group_id == "g1"
    assert given == {"since": "yesterday", "graded": "maybe", "group_id": "g1"}
    assert len(errors) == 2 and all("\n" not in e for e in errors)
    query, _, errors = parse_filters({"since": "2026-09-21", "until": "2026-09-21"})
    assert errors == [] and query.created_to - query.created_from == DAY  # `until` takes its whole day


# --- the /ui routes' access rules (the browser test drives the pages themselves) --------------------


def _client(tmp_path: Path, records: list, **settings) -> TestClient:
    from services.coordinator.service import build

    app, _server, _core = build(
        CoordinatorSettings(
            coordinator_url="http://127.0.0.1:9/v1",
            records_path=seed_store(tmp_path / "r.sqlite", records),
            grpc_port=None,
            **settings,
        )
    )
    return TestClient(app, follow_redirects=False)


def test_the_viewer_takes_the_viewer_or_the_admin_token_and_nothing_else(tmp_path: Path) -> None:
    client = _client(tmp_path, _varied(), viewer_token="view-secret", admin_token="admin-secret")
    anonymous = client.get("/ui")
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
    assert 'name="token"' in anonymous.text  # a form to give the token once
    assert client.get("/ui", headers={"Authorization": "Bearer nope"}).status_code == 403
    for token in ("view-secret", "admin-secret"):
        assert client.get("/ui", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert client.get("/ui/episodes/a").status_code == 401
    assert client.get("/ui/static/viewer.css").status_code == 200  # no secret in a style sheet


def test_a_token_in_the_query_becomes_an_http_only_cookie(tmp_path: Path) -> None:
    client = _client(tmp_path, _varied(), viewer_token="view-secret")
    assert client.get("/ui?token=wrong").status_code == 403
    login = client.get("/ui?status=finish&token=view-secret")
    assert login.status_code == 303 and login.headers["location"] == "/ui?status=finish"
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "view-secret" not in cookie
    assert client.get("/ui?status=finish").status_code == 200  # the cookie jar sends it now
    client.cookies.set("bcstack_viewer", "forged")
    assert client.get("/ui").status_code == 401


def test_with_no_token_configured_the_viewer_is_open_and_a_missing_id_is_a_404_page(tmp_path: Path) -> None:
    client = _client(tmp_path, _varied())
    assert client.get("/ui").status_code == 200
    odd = client.get(
        "/ui", params={"per_page": "²", "page": "-1", "since": "9999-99-99", "graded": "x" * 300}
    )
    assert odd.status_code == 200 and odd.text.count('class="error filter-error"') == 3
    missing = client.get("/ui/episodes/no-such-episode")
    assert missing.status_code == 404 and missing.headers["content-type"].startswith("text/html")
    assert "no-such-episode" in missing.text


# --- bcstack episodes show --------------------------------------------------------------------------

runner = CliRunner()


def _show(*args: str):
    return runner.invoke(cli_app, ["episodes", "show", *args], env={"COLUMNS": "200"})


def test_show_prints_every_turn_tool_call_and_limit(tmp_path: Path, encode, tokenizer_dir: Path) -> None:
    record = known_record(encode)
    path = seed_store(tmp_path / "r.sqlite", [record])
    result = _show(record.episode_id, "--records", str(path), "--tokenizer", str(tokenizer_dir))
    assert result.exit_code == 0, result.output
    out = result.output
    for n, turn in enumerate(WORKER_TURNS, 1):
        assert f"turn {n} · weights" in out and turn.thinking in out
    for signature in (
        "search(query='Boshin Library of Letters', topk='5')",
        "open_page(docid='99999') not_found",
    ):
        assert signature in out
    trajectory = record.workers[0].trajectory
    assert f"{trajectory.tokens_used:,} / {budget.MAX_TOKENS:,}" in out and f"4 / {budget.MAX_TURNS}" in out
    assert "judge: correct" in out and "contribution 0.75" in out and "gold answer: 1761" in out
    assert f"loss mask: {sum(trajectory.loss_mask):,} of {len(trajectory.token_ids):,}" in out
    assert "--full prints all" in out  # the long page is cut short
    full = _show(record.episode_id, "--records", str(path), "--tokenizer", str(tokenizer_dir), "--full")
    assert "--full prints all" not in full.output and LONG_PAGE.splitlines()[-1] in full.output


def test_show_without_a_tokenizer_says_so(tmp_path: Path, encode) -> None:
    record = known_record(encode)
    result = _show(record.episode_id, "--records", str(seed_store(tmp_path / "r.sqlite", [record])))
    assert result.exit_code == 0 and "no tokenizer is configured" in result.output
    assert "(model text not decoded)" in result.output


def test_show_of_a_missing_episode_is_one_line_and_exit_1(tmp_path: Path) -> None:
    result = _show("no-such-episode", "--records", str(seed_store(tmp_path / "r.sqlite", _varied())))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"error: no recorded episode 'no-such-episode' in {tmp_path / 'r.sqlite'}"
    ]


def test_show_wants_one_source(tmp_path: Path) -> None:
    result = _show("x", "--gateway", "http://127.0.0.1:9", "--records", str(tmp_path / "r.sqlite"))
    assert result.exit_code == 2 and "give one of" in result.output
    unreachable = _show("x", "--gateway", "http://127.0.0.1:9")
    assert unreachable.exit_code == 2 and len(unreachable.output.strip().splitlines()) == 1
