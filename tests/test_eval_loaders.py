"""Evaluation question loaders: FoldAgent splits, encrypted BrowseComp-Plus queries, the toy world, qrels."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcstack.evaluation.loaders import (
    TIERS,
    EvalQuestion,
    LoaderError,
    decrypt_field,
    encrypt_field,
    load_qrels,
    load_questions,
    tier_of,
)
from devkit.toyworld.generator import generate_world, write_world

# Made up for these tests; the benchmark's real canary string appears nowhere in the repository.
PASSWORD = "not-the-canary: a made-up test password ✓"

BCP_ROWS = [
    {
        "query_id": "784",
        "query": "Which harbour town, founded before 1800, hosted the regatta where the winner's boat…?",
        "answer": "Port Ellery",
        "evidence_docs": [
            {
                "docid": "18639",
                "text": "---\ntitle: Regatta\n---\nThe regatta of 1791 — naïve café.",
                "url": "https://e/1",
            },
            {"docid": "502", "text": "---\ntitle: Port Ellery\n---\nA harbour town.", "url": "https://e/2"},
        ],
        "gold_docs": [
            {"docid": "502", "text": "---\ntitle: Port Ellery\n---\nA harbour town.", "url": "https://e/2"}
        ],
        "negative_docs": [{"docid": "7", "text": "unrelated", "url": "https://e/3"}],
    },
    {
        "query_id": "12",
        "query": "Name the 数学 prize won by the author of the 1954 treatise on tides.",
        "answer": "1954",
        "evidence_docs": [{"docid": "99", "text": "tides", "url": "https://e/4"}],
        "gold_docs": [{"docid": "99", "text": "tides", "url": "https://e/4"}],
        "negative_docs": [],
    },
]
BCP_EXPECTED = [
    EvalQuestion("784", BCP_ROWS[0]["query"], "Port Ellery", None, ("18639", "502"), ("502",)),
    EvalQuestion("12", BCP_ROWS[1]["query"], "1954", None, ("99",), ("99",)),
]


def encrypted(rows: list[dict], password: str = PASSWORD) -> list[dict]:
    """BrowseComp-Plus obfuscation: every field but query_id."""
    return [{k: v if k == "query_id" else encrypt_field(v, password) for k, v in row.items()} for row in rows]


def write_rows(rows: list, path: Path) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def load_error(path: Path, **kwargs) -> str:
    with pytest.raises(LoaderError) as info:
        load_questions(path, **kwargs)
    return str(info.value)


# --- BrowseComp-Plus encrypted queries ---------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_encrypted_browsecomp_plus_file_decrypts_to_the_original(tmp_path: Path, suffix: str) -> None:
    rows = encrypted(BCP_ROWS)
    assert rows[0]["query"] != BCP_ROWS[0]["query"]
    assert isinstance(rows[0]["evidence_docs"][0]["text"], str) and "regatta" not in json.dumps(rows)
    assert decrypt_field(rows[0]["evidence_docs"], PASSWORD) == BCP_ROWS[0]["evidence_docs"]
    path = write_rows(rows, tmp_path / f"queries{suffix}")
    assert load_questions(path, password=PASSWORD) == BCP_EXPECTED


@pytest.mark.parametrize(("suffix", "row"), [(".jsonl", "line 1"), (".parquet", "row index 0")])
def test_encrypted_file_without_password_says_how_to_decrypt(tmp_path: Path, suffix: str, row: str) -> None:
    path = write_rows(encrypted(BCP_ROWS), tmp_path / f"queries{suffix}")
    message = load_error(path)
    assert str(path) in message and row in message
    assert "the queries are encrypted; pass --password (the benchmark's canary string)" in message
    assert "config file" in message


@pytest.mark.parametrize(("suffix", "row"), [(".jsonl", "line 1"), (".parquet", "row index 0")])
def test_wrong_password_names_row_and_field(tmp_path: Path, suffix: str, row: str) -> None:
    path = write_rows(encrypted(BCP_ROWS), tmp_path / f"queries{suffix}")
    message = load_error(path, password="a different made-up password")
    assert str(path) in message and row in message and "'query'" in message
    assert "decryption failed (not UTF-8)" in message


def test_wrong_password_on_a_later_row_names_that_row(tmp_path: Path) -> None:
    rows = encrypted(BCP_ROWS[:1]) + encrypted(BCP_ROWS[1:], password="another made-up password")
    message = load_error(write_rows(rows, tmp_path / "q.jsonl"), password=PASSWORD)
    assert "line 2" in message and "'query'" in message and "not UTF-8" in message


def test_password_on_a_clear_text_file_is_refused_clearly(tmp_path: Path) -> None:
    message = load_error(write_rows(BCP_ROWS, tmp_path / "q.jsonl"), password=PASSWORD)
    assert "line 1" in message and "'query'" in message and "not base64" in message


def test_clear_text_browsecomp_plus_file_needs_no_password(tmp_path: Path) -> None:
    assert load_questions(write_rows(BCP_ROWS, tmp_path / "q.jsonl")) == BCP_EXPECTED


# --- FoldAgent split ---------------------------------------------------------------------------------


def foldagent_rows() -> list[dict]:
    rows = []
    for qid, source in ((101, "bc_test_easy"), (7, "bc_test_meduim"), (830, "bc_test_hard")):
        docs = [{"docid": str(qid * 10 + i), "text": f"page {i}", "url": f"https://w/{i}"} for i in range(2)]
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": "You are a research assistant."},
                    {"role": "user", "content": f"question {qid}"},
                ],
                "data_source": source,
                "reward_model": {"ground_truth": f"answer {qid}", "style": "rule"},
                "extra_info": {
                    "query_id": qid,
                    "query": f"question {qid}",
                    "answer": f"answer {qid}",
                    "evidence_docs": docs,
                    "gold_docs": docs[-1:],
                    "negative_docs": [{"docid": "1", "text": "noise", "url": "https://w/n"}],
                },
            }
        )
    return rows


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_foldagent_split_loads_tiers_and_ids(tmp_path: Path, suffix: str) -> None:
    path = write_rows(foldagent_rows(), tmp_path / f"test{suffix}")
    if suffix == ".parquet":
        schema = pq.read_schema(path)
        assert pa.types.is_struct(schema.field("extra_info").type)
        assert pa.types.is_int64(schema.field("extra_info").type.field("query_id").type)
    questions = load_questions(path)
    assert [(q.query_id, q.tier, q.source) for q in questions] == [
        ("101", "easy", "bc_test_easy"),
        ("7", "medium", "bc_test_meduim"),
        ("830", "hard", "bc_test_hard"),
    ]
    assert questions[1] == EvalQuestion(
        "7", "question 7", "answer 7", "medium", ("70", "71"), ("71",), "bc_test_meduim"
    )


@pytest.mark.parametrize(
    ("source", "tier"),
    [
        ("bc_test_easy", "easy"),
        ("bc_test_meduim", "medium"),
        ("bc_test_medium", "medium"),
        ("bc_test_hard", "hard"),
        ("bc_train_meduim", "medium"),
        ("bc_train_hard", "hard"),
        ("hard", "hard"),
        ("bc_test_impossible", None),
        ("browsecomp_plus", None),
        ("", None),
    ],
)
def test_tier_of_data_source(source: str, tier: str | None) -> None:
    assert tier_of(source) == tier
    assert tier is None or tier in TIERS


# --- the toy world -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    write_world(generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0), out)
    return out


def test_toy_world_questions_load_with_tiers_and_evidence(toy_world: Path) -> None:
    questions = load_questions(toy_world / "questions.jsonl")
    assert len(questions) == 24
    assert Counter(q.tier for q in questions) == {"easy": 8, "medium": 8, "hard": 8}
    raw = [json.loads(line) for line in (toy_world / "questions.jsonl").read_text().splitlines()]
    assert [q.query_id for q in questions] == [r["query_id"] for r in raw]
    assert [q.answer for q in questions] == [r["answer"] for r in raw]
    hops = {"easy": 1, "medium": 2, "hard": 3}
    for q, r in zip(questions, raw, strict=True):
        assert q.evidence_docs == tuple(d["docid"] for d in r["evidence_docs"])
        assert len(q.evidence_docs) == hops[q.tier]
        assert q.gold_docs == q.evidence_docs[-1:]
    assert load_questions(toy_world / "train.jsonl") == []


def test_toy_world_qrels_agree_with_its_questions(toy_world: Path) -> None:
    plain = load_questions(toy_world / "questions.jsonl")
    assert load_questions(toy_world / "questions.jsonl", qrels=toy_world / "qrel_evidence.txt") == plain


# --- qrels -------------------------------------------------------------------------------------------


def test_load_qrels_keeps_relevant_docs_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "qrel_evidence.txt"
    path.write_text("784 Q0 502 1\n784 Q0 18639 2\n\n784 Q0 7 0\n12\tQ0\t99\t1\n784 Q0 502 1\n13 Q0 5 0\n")
    assert load_qrels(path) == {"784": ["502", "18639"], "12": ["99"]}


def test_qrels_override_the_question_files_evidence_docs(tmp_path: Path) -> None:
    questions = write_rows(BCP_ROWS, tmp_path / "q.jsonl")
    qrels = tmp_path / "qrels.txt"
    qrels.write_text("784 Q0 1 1\n784 Q0 2 1\n784 Q0 3 0\n555 Q0 9 1\n")
    loaded = load_questions(questions, qrels=qrels)
    assert loaded[0].evidence_docs == ("1", "2")
    assert loaded[0].gold_docs == ("502",)
    assert loaded[1] == BCP_EXPECTED[1]  # not in the qrels: the file's own evidence docs


@pytest.mark.parametrize(
    ("text", "where", "field"),
    [
        ("1 Q0 a 1\n1 Q0 b\n", "line 2", None),
        ("1 Q0 a 1\n\n1 Q0 b yes\n", "line 3", "'rel'"),
        ("1 Q0 a 1 extra\n", "line 1", None),
    ],
)
def test_bad_qrels_line_names_the_line(tmp_path: Path, text: str, where: str, field: str | None) -> None:
    path = tmp_path / "qrels.txt"
    path.write_text(text)
    with pytest.raises(LoaderError) as info:
        load_qrels(path)
    assert str(path) in str(info.value) and where in str(info.value)
    assert field is None or field in str(info.value)
    with pytest.raises(LoaderError, match=where):
        load_questions(write_rows(BCP_ROWS, tmp_path / "q.jsonl"), qrels=path)


# --- bad files ---------------------------------------------------------------------------------------

GOOD = {"query_id": "1", "query": "Who?", "answer": "Ada", "evidence_docs": ["d1"], "gold_docs": ["d1"]}


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("q.jsonl", [GOOD, {"query_id": "2", "answer": "x"}], ("line 2", "'query'", "missing")),
        ("q.jsonl", [GOOD, {**GOOD, "query_id": "2", "answer": None}], ("line 2", "'answer'", "missing")),
        ("q.jsonl", [GOOD, {**GOOD, "query_id": "2", "query": "  "}], ("line 2", "'query'", "empty")),
        ("q.jsonl", [GOOD, {**GOOD, "query_id": "2"}, {**GOOD}], ("line 3", "'query_id'", "also at line 1")),
        (
            "q.jsonl",
            '{"query_id": "1", "query": "Who?", "answer": "Ada"}\n{"query_id": "2", "query"\n',
            ("line 2",),
        ),
        ("q.json", [GOOD, ["not", "an", "object"]], ("line 2", "expected a JSON object")),
        ("q.jsonl", [{"question": "Who?", "label": "Ada"}], ("line 1", "'query_id'", "unknown row format")),
        ("q.jsonl", [{**GOOD, "evidence_docs": [{"text": "no id"}]}], ("line 1", "'evidence_docs[0].docid'")),
        ("q.jsonl", [{**GOOD, "evidence_docs": "d1"}], ("line 1", "'evidence_docs'")),
        ("q.jsonl", [{**GOOD, "query_id": {"id": 1}}], ("line 1", "'query_id'")),
        ("q.jsonl", [{"data_source": "bc_test_easy", "extra_info": None}], ("line 1", "'extra_info'")),
        ("q.jsonl", [{"data_source": 3, "extra_info": GOOD}], ("line 1", "'data_source'")),
        ("q.jsonl", b"\xff\xfe not utf-8\n", ("line 1", "not UTF-8")),
        (
            "q.parquet",
            [GOOD, {**GOOD, "query_id": "2", "query": None}],
            ("row index 1", "'query'", "missing"),
        ),
        ("q.parquet", [{"question": "Who?"}], ("'query_id'", "unknown format")),
        ("q.parquet", b"PAR1 this is not parquet", ("not a readable Parquet file",)),
        ("q.csv", "query_id,query,answer\n1,Who?,Ada\n", ("unknown format '.csv'",)),
    ],
)
def test_bad_question_file_names_file_row_and_field(
    tmp_path: Path, name: str, content: list | str | bytes, expected: tuple[str, ...]
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        write_rows(content, path)
    message = load_error(path)
    assert message.startswith(f"{path}: ")
    for part in expected:
        assert part in message


def test_duplicate_foldagent_query_ids_name_both_rows(tmp_path: Path) -> None:
    rows = foldagent_rows()
    rows[2]["extra_info"]["query_id"] = 101
    message = load_error(write_rows(rows, tmp_path / "test.parquet"))
    assert "row index 2" in message and "also at row index 0" in message and "'101'" in message


def test_missing_file_is_a_loader_error(tmp_path: Path) -> None:
    assert "no such file" in load_error(tmp_path / "absent.jsonl")
    with pytest.raises(LoaderError, match="absent.txt"):
        load_qrels(tmp_path / "absent.txt")


def test_a_json_array_file_loads_like_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps(BCP_ROWS, indent=2), encoding="utf-8")
    assert load_questions(path) == BCP_EXPECTED


# --- properties --------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(value=json_values, password=st.text(min_size=1))
def test_encrypt_then_decrypt_round_trips(value: object, password: str) -> None:
    hidden = encrypt_field(value, password)
    assert decrypt_field(hidden, password) == value
    if isinstance(value, str):
        hidden.encode("ascii")  # base64: plain ASCII whatever the text


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.dictionaries(
            st.sampled_from(
                ["query_id", "query", "answer", "evidence_docs", "gold_docs", "data_source", "extra_info"]
            ),
            json_values,
        ),
        max_size=4,
    ),
    password=st.none() | st.just(PASSWORD),
)
def test_arbitrary_rows_load_or_raise_loader_error(rows: list[dict], password: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_rows(rows, Path(tmp) / "q.jsonl")
        try:
            questions = load_questions(path, password=password)
        except LoaderError as exc:
            assert str(path) in str(exc)
        else:
            assert all(isinstance(q, EvalQuestion) and q.query and q.answer for q in questions)


# --- bcstack eval decrypt ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_decrypt_writes_the_clear_queries_owner_only(tmp_path: Path, suffix: str) -> None:
    from bcstack.evaluation.loaders import decrypt_file

    source = write_rows(encrypted(BCP_ROWS), tmp_path / f"queries{suffix}")
    out = tmp_path / "clear.jsonl"
    assert decrypt_file(source, out, password=PASSWORD) == 2
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows == [{k: v for k, v in row.items() if k != "negative_docs"} for row in BCP_ROWS]
    assert out.stat().st_mode & 0o777 == 0o600
    assert load_questions(out) == BCP_EXPECTED  # no password needed any more


def test_decrypt_with_a_wrong_password_leaves_nothing(tmp_path: Path) -> None:
    from bcstack.evaluation.loaders import decrypt_file

    source = write_rows(encrypted(BCP_ROWS), tmp_path / "queries.jsonl")
    out = tmp_path / "clear.jsonl"
    with pytest.raises(
        LoaderError, match=r"line 1.*query.*decryption failed \(not UTF-8\); wrong password\?"
    ):
        decrypt_file(source, out, password="wrong")
    assert not out.exists() and not list(tmp_path.glob(".clear.jsonl*"))
    with pytest.raises(LoaderError, match="decryption failed \\(not base64\\); is the file encrypted\\?"):
        decrypt_file(write_rows(BCP_ROWS, tmp_path / "plain.jsonl"), out, password=PASSWORD)


def test_the_decrypt_command_reads_the_password_from_the_env_and_never_prints_it(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    source = write_rows(encrypted(BCP_ROWS), tmp_path / "queries.jsonl")
    env = {**os.environ, "BCSTACK_EVAL_PASSWORD": PASSWORD}
    args = [sys.executable, "-m", "bcstack", "eval", "decrypt", "--questions", str(source)]
    done = subprocess.run(
        [*args, "--out", str(tmp_path / "c.jsonl")], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0 and "decrypted 2 queries" in done.stderr
    env["BCSTACK_EVAL_PASSWORD"] = "wrong-password-xyz"
    bad = subprocess.run(
        [*args, "--out", str(tmp_path / "d.jsonl")], capture_output=True, text=True, env=env, timeout=60
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "wrong password?" in bad.stderr
    for run in (done, bad):
        assert PASSWORD not in run.stdout + run.stderr and "wrong-password-xyz" not in run.stdout + run.stderr
