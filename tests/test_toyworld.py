"""The toy world: formats, determinism, tiers, distractors, and the scripted policies solving it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from toy_env import ToyRetrieval, run_worker_episode

from bcstack.evaluation.loaders import tier_of
from core import protocol as p
from devkit.toyworld import grammar as g
from devkit.toyworld.generator import TEST_SOURCES, ToyWorldError, generate_world, load_jsonl, write_world
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE, expert_worker_policy, scripted_coordinator_policy


@pytest.fixture(scope="module")
def world():
    return generate_world(2000, 0)


@pytest.fixture(scope="module")
def env(world):
    return ToyRetrieval(world.corpus)


def _digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_cli_same_seed_gives_byte_identical_files(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "bcstack",
        "toyworld",
        "generate",
        "--docs",
        "1500",
        "--seed",
        "7",
        "--questions-per-tier",
        "20",
    ]
    for name in ("a", "b"):
        subprocess.run([*cmd, "--out", str(tmp_path / name)], check=True, capture_output=True)
    subprocess.run([*cmd[:-1], "8", "--out", str(tmp_path / "c")], check=True, capture_output=True)
    a, b, c = (_digests(tmp_path / n) for n in "abc")
    assert set(a) == {
        "corpus.jsonl",
        "questions.jsonl",
        "train.jsonl",
        "qrel_evidence.txt",
        "qrel_golds.txt",
        "world.json",
    }
    assert a == b
    assert a["corpus.jsonl"] != c["corpus.jsonl"]
    manifest = json.loads((tmp_path / "a" / "world.json").read_text())
    assert manifest["documents"] == 1500 and manifest["files"]["corpus.jsonl"] == a["corpus.jsonl"]


def test_cli_errors_are_clear(tmp_path):
    out = tmp_path / "w"
    ok = subprocess.run(
        [sys.executable, "-m", "bcstack", "toyworld", "generate", "--out", str(out), "--docs", "1500"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    again = subprocess.run(
        [sys.executable, "-m", "bcstack", "toyworld", "generate", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "is not empty" in again.stderr and "Traceback" not in again.stderr
    small = subprocess.run(
        [
            sys.executable,
            "-m",
            "bcstack",
            "toyworld",
            "generate",
            "--out",
            str(tmp_path / "s"),
            "--docs",
            "50",
        ],
        capture_output=True,
        text=True,
    )
    assert small.returncode == 2 and "at least" in small.stderr and "Traceback" not in small.stderr
    assert not (tmp_path / "s").exists()


def test_corpus_format(world):
    docids = [d["docid"] for d in world.corpus]
    assert len(world.corpus) == 2000 and len(set(docids)) == 2000
    assert len({d["url"] for d in world.corpus}) == 2000
    for d in world.corpus:
        assert list(d) == ["docid", "text", "url"]
        assert d["docid"].isdigit()
        assert d["text"].startswith("---\ntitle: ") and "\n---\n\n" in d["text"]
        assert g.doc_title(d["text"])


def test_question_format_and_tiers(world):
    assert Counter(q["data_source"] for q in world.test) == {
        "bc_test_easy": 50,
        "bc_test_meduim": 50,
        "bc_test_hard": 50,
    }
    assert {q["data_source"] for q in world.train} == {"bc_train_meduim", "bc_train_hard"}
    ids = [q["query_id"] for q in world.test + world.train]
    assert len(set(ids)) == len(ids)
    assert len({q["query"] for q in world.test + world.train}) == len(ids)
    by_docid = {d["docid"]: d for d in world.corpus}
    hops = {"bc_test_easy": 1, "bc_test_meduim": 2, "bc_test_hard": 3}
    for q in world.test:
        for key in ("query_id", "query", "answer", "data_source", "evidence_docs", "gold_docs"):
            assert key in q
        assert len(q["evidence_docs"]) == hops[q["data_source"]]
        for doc in q["evidence_docs"] + q["gold_docs"]:
            assert by_docid[doc["docid"]] == doc
        assert q["gold_docs"] == q["evidence_docs"][-1:]
        assert q["answer"] in q["gold_docs"][0]["text"]
        assert g.parse_question(q["query"]) is not None


def test_hard_chains_have_near_duplicate_distractors(world):
    titles = [g.doc_title(d["text"]) for d in world.corpus]
    for q in world.test:
        if q["data_source"] != TEST_SOURCES["hard"]:
            continue
        for doc in q["evidence_docs"]:
            title = g.doc_title(doc["text"])
            if title.endswith(")"):  # a person: namesakes with another profession
                name = title.rsplit(" (", 1)[0]
                twins = [t for t in titles if t != title and t.startswith(name + " (")]
            elif title.split()[-1] in g.ARTIFACT_KINDS:  # an artifact: same name, another kind
                base = title.rsplit(" ", 1)[0]
                twins = [t for t in titles if t != title and t.rsplit(" ", 1)[0] == base]
            else:
                continue
            assert twins, f"no distractor for {title}"


def test_files_and_qrels(tmp_path, world):
    write_world(world, tmp_path / "w")
    assert load_jsonl(tmp_path / "w" / "questions.jsonl") == world.test
    qrels = (tmp_path / "w" / "qrel_golds.txt").read_text().splitlines()
    first = world.test[0]
    assert f"{first['query_id']} Q0 {first['gold_docs'][0]['docid']} 1" in qrels
    with pytest.raises(ToyWorldError, match="not empty"):
        write_world(world, tmp_path / "w")


def test_benchmark_size_corpus():
    big = generate_world(100_000, 1)
    assert len(big.corpus) == 100_000
    assert len({d["docid"] for d in big.corpus}) == 100_000
    assert len(big.test) == 150


def test_too_small_requests_fail_clearly():
    with pytest.raises(ToyWorldError, match="at least"):
        generate_world(100)
    with pytest.raises(ToyWorldError, match="more --docs"):
        generate_world(3000, questions_per_tier=500)


# --- the scripted expert worker ------------------------------------------------------------------


def test_expert_solves_every_test_question_through_the_protocol(world, env):
    results = Counter()
    for q in world.test:
        ep = run_worker_episode(expert_worker_policy, WORKER_TASK_TEMPLATE.format(question=q["query"]), env)
        assert ep.finish is not None, q["query"]
        results[(q["data_source"], ep.finish.answer == q["answer"])] += 1
        # It learned the answer from pages: the gold page was opened, and cited.
        opened = [
            pg.docid
            for m in ep.messages
            if m["role"] == "user"
            for pg in p.parse_observation(m["content"]).pages
        ]
        assert q["gold_docs"][0]["docid"] in opened
        assert f"[{q['gold_docs'][0]['docid']}]" in ep.finish.explanation
        assert set(ep.tool_calls) <= {"search", "open_page", "finish"}
    assert results == {(s, True): 50 for s in TEST_SOURCES.values()}


def test_expert_gives_up_cleanly_when_nothing_is_found(world):
    empty = ToyRetrieval([{"docid": "1", "text": "---\ntitle: Nothing\n---\n\nnothing here", "url": "u"}])
    q = next(q for q in world.test if q["data_source"] == "bc_test_hard")
    ep = run_worker_episode(expert_worker_policy, q["query"], empty)
    assert ep.finish is not None and ep.finish.answer == "unknown" and ep.finish.confidence == "0%"
    assert ep.tool_calls["search"] == 3 and ep.turns == 4


def test_expert_on_a_task_it_cannot_parse():
    reply = expert_worker_policy([{"role": "user", "content": "Write me a poem."}])
    (call,) = p.parse_calls(reply)
    assert call.name == "finish" and call.params["answer"] == "unknown"


# --- the scripted coordinator --------------------------------------------------------------------


def _coordinate(question: str, env: ToyRetrieval, fanout: int = 1, worker=expert_worker_policy):
    messages = [
        {"role": "system", "content": "You coordinate workers."},
        {"role": "user", "content": question},
    ]
    for _ in range(5):
        reply = scripted_coordinator_policy(messages, fanout=fanout)
        messages.append({"role": "assistant", "content": reply})
        actions = [p.validate_call(c, p.COORDINATOR_TOOLS) for c in p.parse_calls(reply)]
        if any(isinstance(a, p.FinishAction) for a in actions):
            return next(a for a in actions if isinstance(a, p.FinishAction)), messages
        reports = []
        for a in actions:
            assert isinstance(a, p.BranchAction)
            ep = run_worker_episode(worker, a.prompt, env)
            fin = ep.finish
            status = "finish" if fin else "turns"
            reports.append(
                p.render_worker_report(
                    p.WorkerReportText(
                        a.description,
                        status,
                        fin.answer if fin else "",
                        fin.explanation if fin else "",
                        fin.confidence if fin else "",
                    )
                )
            )
        messages.append({"role": "user", "content": "\n\n".join(reports)})
    raise AssertionError("coordinator did not finish")


def test_coordinator_branches_then_finishes_with_the_workers_answer(world, env):
    for q in world.test[:12]:
        final, messages = _coordinate(q["query"], env)
        assert final.answer == q["answer"]
        (branch,) = p.parse_calls(messages[2]["content"])
        assert branch.name == "branch" and q["query"] in branch.params["prompt"]


def test_coordinator_fans_out_and_votes(world, env):
    q = world.test[60]
    final, messages = _coordinate(q["query"], env, fanout=3)
    assert len(p.parse_calls(messages[2]["content"])) == 3
    assert final.answer == q["answer"]


def test_coordinator_retries_an_exhausted_worker_then_gives_up(world, env):
    def idle_worker(_messages):
        return "I am still thinking."  # never calls a tool: the episode runs out of turns

    final, messages = _coordinate(world.test[0]["query"], env, worker=idle_worker)
    branches = sum(1 for m in messages if m["role"] == "assistant" and "<function=branch>" in m["content"])
    assert branches == 2 and final.answer == "unknown"


def test_train_questions_never_read_a_test_page():
    world = generate_world(6000, 3, questions_per_tier=20, train_easy=600, train_medium=200, train_hard=60)
    assert world.manifest()["train_tiers"] == {"easy": 600, "medium": 200, "hard": 60}
    test_docs = {d["docid"] for q in world.test for d in q["evidence_docs"]}
    train_docs = {d["docid"] for q in world.train for d in q["evidence_docs"]}
    assert test_docs and train_docs and not test_docs & train_docs
    assert {q["data_source"] for q in world.train} == {"bc_train_easy", "bc_train_meduim", "bc_train_hard"}
    # A world made only for training questions.
    only_train = generate_world(3000, 4, questions_per_tier=0, train_easy=300, train_medium=0, train_hard=0)
    assert only_train.test == [] and len(only_train.train) == 300


def test_the_dev_split_reads_no_test_page_and_no_train_question_reads_a_dev_page(tmp_path):
    kw = dict(questions_per_tier=20, train_easy=600, train_medium=200, train_hard=60)
    world = generate_world(7000, 3, dev_per_tier=20, **kw)
    assert world.manifest()["dev_tiers"] == {"easy": 20, "medium": 20, "hard": 20}
    pages = {
        split: {d["docid"] for q in getattr(world, split) for d in q["evidence_docs"]}
        for split in ("test", "dev", "train")
    }
    assert not pages["test"] & pages["dev"] and not pages["train"] & (pages["test"] | pages["dev"])
    assert {q["data_source"] for q in world.dev} == {"bc_dev_easy", "bc_dev_meduim", "bc_dev_hard"}
    assert {tier_of(q["data_source"]) for q in world.dev} == {"easy", "medium", "hard"}
    ids = [q["query_id"] for split in ("test", "dev", "train") for q in getattr(world, split)]
    assert len(set(ids)) == len(ids)
    # No dev split: the world this generator made before it had one, byte for byte.
    assert generate_world(7000, 3, **kw).corpus == generate_world(7000, 3, dev_per_tier=0, **kw).corpus
    written = write_world(world, tmp_path / "w")
    assert "dev.jsonl" in written and len((tmp_path / "w" / "dev.jsonl").read_text().splitlines()) == 60
    assert json.loads((tmp_path / "w" / "world.json").read_text())["dev_questions"] == 60
