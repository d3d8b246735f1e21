"""Verifier rewards (core.verifiers) and the toy single-turn domains (devkit.toyworld.domains)."""

from __future__ import annotations

import json
import random
import re

import pytest

from core.single_turn import PromptError, load_prompts
from core.verifiers import (
    CodeVerifier,
    InstructionVerifier,
    MathVerifier,
    SandboxLimits,
    VerifierError,
    extract_answer,
    parse_number,
    verifier_for,
)
from devkit.toyworld.domains import (
    DEV_PROMPTS,
    GENERATORS,
    DomainError,
    Problem,
    all_signatures,
    build_domain,
    distinct_problems,
    write_domain,
)
from devkit.toyworld.domains import _overlaps as split_overlaps


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("5 + 6 = 11.\nAnswer: 11", "11"),
        ("Answer: 3\nwait\nAnswer: 4", "4"),
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("Answer: $\\boxed{12}$", "12"),
        ("the answer is 7", None),
        ("\\boxed{a{b}c}", "a{b}c"),
    ],
)
def test_extracts_the_last_answer_line_then_the_last_box(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", 12),
        ("-3", -3),
        ("0.5", 0.5),
        ("1/2", 0.5),
        ("\\frac{3}{4}", 0.75),
        ("\\frac34", 0.75),
        ("1,234", 1234),
        ("$5$", 5),
        ("7.", 7),
        ("25%", 25),
        ("1e3", 1000),
        ("(2)/(4)", 0.5),
    ],
)
def test_numbers_parse_exactly(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["abc", "1/0", "", "1,23", "x=3"])
def test_non_numbers_are_none(text):
    assert parse_number(text) is None


def test_math_verifier_numeric_equivalence_and_failures():
    v = MathVerifier()
    assert v.score("Answer: 0.50", "1/2").correct
    assert v.score("work\nAnswer: \\boxed{2/4}", "0.5").correct
    assert not v.score("Answer: 13", "12").correct
    wrong = v.score("I think 12", "12")
    assert not wrong.correct and wrong.extracted is None  # never guessed from the last number
    assert not v.score("Answer: twelve", "12").correct
    assert v.score("Answer: \\text{Paris}", "paris").correct  # text labels compare as text
    assert not v.score("x" * 1_000_001 + "\nAnswer: 1", "1").correct  # size limit


def test_code_verifier_runs_tests_in_a_limited_subprocess():
    tests = json.dumps([{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}])
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert CodeVerifier().score(good, tests).correct
    wrong = "```python\nprint(0)\n```"
    assert CodeVerifier().score(wrong, tests).reason == "test 0: wrong output"
    limits = SandboxLimits(wall_seconds=1.0, cpu_seconds=1)
    spin = CodeVerifier(limits).score("```python\nwhile True: pass\n```", tests)
    assert not spin.correct and "limit" in spin.reason or "failed" in spin.reason
    hog = CodeVerifier(SandboxLimits(memory_bytes=256 << 20)).score(
        "```python\nx = bytearray(1 << 30)\nprint(5)\n```", tests
    )
    assert not hog.correct and "MemoryError" in hog.reason
    env = CodeVerifier().score(
        "```python\nimport os\nprint(len(os.environ.get('BCSTACK_ADMIN_TOKEN', '')))\n```",
        json.dumps([{"input": "", "output": "0"}]),
    )
    assert env.correct  # the sandbox sees an empty environment, so no secret leaks into tests
    assert not CodeVerifier().score("no code here", tests).correct
    with pytest.raises(VerifierError):
        CodeVerifier().score(good, "not json")


def test_instruction_checks_are_strict():
    label = json.dumps(
        [{"kind": "lowercase"}, {"kind": "max_words", "n": 5}, {"kind": "include", "word": "blue"}]
    )
    v = InstructionVerifier()
    assert v.score("the sky is blue", label).correct
    assert v.score("The sky is blue", label).reason == "failed: lowercase"
    assert not v.score("the sky is very very blue", label).correct
    with pytest.raises(VerifierError, match="unknown kind"):
        v.score("x", json.dumps([{"kind": "haiku"}]))
    with pytest.raises(VerifierError, match="unknown verifier"):
        verifier_for("chess")


def test_toy_domains_are_deterministic_deduplicated_and_split(tmp_path):
    a = build_domain("arithmetic", train=300, test=50, seed=3)
    assert a == build_domain("arithmetic", train=300, test=50, seed=3)
    assert a["train"] != build_domain("arithmetic", train=300, test=50, seed=4)["train"]
    assert (len(a["train"]), len(a["dev"]), len(a["test"])) == (300, DEV_PROMPTS, 50)
    keys = {s: {r["signature"] for r in a[s]} for s in ("train", "dev", "test")}
    assert sum(len(k) for k in keys.values()) == 300 + DEV_PROMPTS + 50  # unique within and across
    v = MathVerifier()
    for row, chat in zip(a["train"], a["sft"], strict=True):  # every worked reply is right
        reply = chat["messages"][1]["content"]
        assert chat["messages"][0]["content"] == row["prompt"]
        assert v.score(reply, row["label"]).correct
    s = build_domain("sequence", train=200, test=20)
    assert all(int(r["label"]) >= 0 for r in s["train"])

    manifest = write_domain(tmp_path / "m", "sequence", train=200, test=20)
    assert manifest["splits"] == {"train": 200, "dev": DEV_PROMPTS, "test": 20}
    rows = load_prompts(tmp_path / "m" / "test.jsonl")
    assert len(rows) == 20 and rows[0].domain == "sequence" and rows[0].messages[0]["role"] == "user"
    with pytest.raises(DomainError, match="not empty"):
        write_domain(tmp_path / "m", "sequence", train=200, test=20)
    with pytest.raises(
        DomainError, match=r"the sequence domain has 2,583 distinct problems .* at most 2,519"
    ):
        build_domain("sequence", train=100_000, test=10)


def test_toy_domains_are_held_out_by_numeric_signature(monkeypatch):
    """At the bench's size (1,600 train / 64 dev / 200 test), no test or dev problem has a training
    problem's numbers and operations under other names; problems differing only in name and thing
    are one problem; the signature spaces are counted exactly, and a build can use all of them."""
    assert (distinct_problems("arithmetic"), distinct_problems("sequence")) == (1944, 2583)
    for domain in ("arithmetic", "sequence"):
        rows = build_domain(domain, train=1600, test=200, seed=0)
        keys = {s: [r["signature"] for r in rows[s]] for s in ("train", "dev", "test")}
        train = set(keys["train"])
        assert len(train) == 1600 and not train & set(keys["test"]) and not train & set(keys["dev"])
        assert not set(keys["dev"]) & set(keys["test"]) and not split_overlaps(rows)
        assert all(r["signature"] in all_signatures(domain) for s in keys for r in rows[s])
    # The arithmetic signature is the start and each step; the text of the row says the same numbers.
    rng = random.Random(1)
    for _ in range(200):
        p = GENERATORS["arithmetic"](rng)
        numbers = re.findall(r"\d+", p.question)
        assert re.findall(r"\d+", p.signature) == numbers and p.signature[0] == numbers[0][0]
    # Two problems that differ only in the name and the thing are duplicates: the first is kept.
    mia = Problem(
        "Mia has 7 shells. She finds 5 more shells. How many shells does Mia have now?", 12, "", "7+5"
    )
    omar = Problem("Omar has 7 keys. He finds 5 more keys. How many keys does Omar have now?", 12, "", "7+5")
    real = GENERATORS["arithmetic"]
    first = iter([mia, omar])
    monkeypatch.setitem(GENERATORS, "arithmetic", lambda rng: next(first, None) or real(rng))
    rows = build_domain("arithmetic", train=10, test=5)
    prompts = [r["prompt"] for s in ("train", "dev", "test") for r in rows[s]]
    assert mia.question in rows["dev"][0]["prompt"] and not any(omar.question in p for p in prompts)
    assert rows["_stats"][0]["duplicates_removed"] >= 1
    monkeypatch.setitem(GENERATORS, "arithmetic", real)
    # Every arithmetic problem fits in one build, and one more is a one-line error that says so.
    full = build_domain("arithmetic", train=1944 - DEV_PROMPTS - 100, test=100, seed=2)
    assert {r["signature"] for s in ("train", "dev", "test") for r in full[s]} == all_signatures("arithmetic")
    with pytest.raises(DomainError) as e:
        build_domain("arithmetic", train=2000, test=200)
    assert "\n" not in str(e.value)
    assert "arithmetic domain has 1,944 distinct problems" in str(e.value) and "2,264 were asked" in str(
        e.value
    )
    # The split audit reads the written rows' signatures.
    rows = build_domain("arithmetic", train=10, test=5)
    rows["test"][0] = {**rows["test"][0], "signature": rows["train"][0]["signature"]}
    assert split_overlaps(rows) == [
        f"1 signatures in both train and test (e.g. {rows['train'][0]['signature']})"
    ]


def test_prompt_files_refuse_bad_rows_with_their_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "2+2?", "label": 4}\n{"prompt": "x"}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: no \"label\""):
        load_prompts(path)
    path.write_text(
        '{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}\n'
    )
    assert load_prompts(path)[0].label == "1"  # verl's field
    path.write_text('{"prompt": [{"role": "assistant", "content": "hi"}], "label": "1"}\n')
    with pytest.raises(PromptError, match="last message must be the user's"):
        load_prompts(path)
    path.write_text("not json\n")
    with pytest.raises(PromptError, match="not JSON"):
        load_prompts(path)
