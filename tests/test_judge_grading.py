"""The judge's grading core: templates, verdict parsing, normalization and the rule grader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.grading import (
    CONTRIBUTION_SCALE,
    AnswerVerdict,
    ContributionVerdict,
    ParsedAnswer,
    exact_match,
    exact_verdict,
    extract_exact_answer,
    load_template,
    normalize_answer,
    parse_answer_verdict,
    parse_contribution,
    parse_number,
    render_answer_prompt,
    render_contribution_prompt,
    response_confidence,
    rule_answer,
    rule_contribution,
)
from devkit.toyworld.generator import generate_world

VERDICT = """extracted_final_answer: Kleiranax
reasoning: The response names Kleiranax, which is the correct answer.
correct: yes
confidence: 85%"""


def browsecomp_response(answer: str, confidence: str = "90%") -> str:
    explanation = "Explanation: The founding record [doc-17] gives it."
    return f"{explanation}\nExact Answer: {answer}\nConfidence: {confidence}"


# --------------------------------------------------------------------------- templates


def test_templates_load_with_name_and_version() -> None:
    answer, contribution = load_template("answer"), load_template("contribution", "v1")
    assert (answer.name, answer.version, answer.id) == ("browsecomp-answer", "v1", "browsecomp-answer-v1")
    assert contribution.id == "browsecomp-contribution-v1"
    assert not answer.text.startswith("#")
    for field in ("extracted_final_answer:", "reasoning:", "correct:", "confidence:"):
        assert field in answer.text
    for field in ("contribution:", "reasoning:"):
        assert field in contribution.text


def test_contribution_template_lists_the_scale() -> None:
    text = load_template("contribution").text
    for label, score in CONTRIBUTION_SCALE.items():
        assert re.search(rf"\b{label}\b \({score}\)", text), label
    assert CONTRIBUTION_SCALE == {
        "decisive": 1.0,
        "substantial": 0.75,
        "partial": 0.5,
        "marginal": 0.25,
        "none": 0.0,
    }


def test_rendering_leaves_braces_in_inputs_alone() -> None:
    t = load_template("answer")
    prompt = render_answer_prompt(
        t, question="What is {x} in {0}?", response="{correct_answer} {response}", correct_answer="{}{{"
    )
    assert "What is {x} in {0}?" in prompt
    assert "{correct_answer} {response}" in prompt  # an input is never filled in by a later placeholder
    assert "{}{{" in prompt
    assert prompt.count("{correct_answer}") == 1


def test_contribution_prompt_renders_every_input() -> None:
    t = load_template("contribution")
    inputs = {
        "question": "Q {a}",
        "task": "find the year",
        "report": "It was {1738}",
        "final_answer": "1738",
        "gold_answer": "1,738",
    }
    prompt = render_contribution_prompt(t, **inputs)
    for value in inputs.values():
        assert value in prompt
    assert not re.search(r"\{(question|task|report|final_answer|gold_answer)\}", prompt.replace("{a}", ""))


def test_unknown_template_version_names_the_file() -> None:
    with pytest.raises(ValueError, match=r"answer_v999\.txt"):
        load_template("answer", "v999")
    with pytest.raises(ValueError, match=r"answer_\.\./answer_v1\.txt"):
        load_template("answer", "../answer_v1")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("no header here\n\nquestion {question} {response} {correct_answer}", "header"),
        ("# name: x\n\n{question} {response} {correct_answer}", "version"),
        ("# name: x\n# version: v2\n\n{question} {response} {correct_answer}", "version"),
        ("# name: x\n# version: v1\n\n{question} {response}", "correct_answer"),
        ("# name: x\n# version: v1\n\n", "prompt text"),
    ],
)
def test_malformed_template_names_the_file(tmp_path: Path, content: str, problem: str) -> None:
    (tmp_path / "answer_v1.txt").write_text(content)
    with pytest.raises(ValueError, match=problem) as err:
        load_template("answer", "v1", directory=tmp_path)
    assert "answer_v1.txt" in str(err.value)


# --------------------------------------------------------------------------- answer verdicts


@pytest.mark.parametrize(
    "text",
    [
        VERDICT,
        VERDICT.replace("correct: yes", "**correct:** yes"),
        VERDICT.replace("correct: yes", "**correct**: yes"),
        VERDICT.replace("correct: yes", "Correct: Yes"),
        VERDICT.replace("correct: yes", "  - **Correct:** **Yes.**  "),
        VERDICT.replace("correct: yes", "* correct: `yes`"),
        VERDICT.replace("correct: yes", "### correct: YES!"),
        "\n".join(f"**{line.replace(': ', ':** ', 1)}" for line in VERDICT.splitlines()),
        "\n".join(f"- **{line.replace(': ', '**: ', 1)}" for line in VERDICT.splitlines()),
    ],
)
def test_markdown_variants_parse(text: str) -> None:
    parsed = parse_answer_verdict(text)
    assert parsed == ParsedAnswer(
        extracted_final_answer="Kleiranax",
        reasoning="The response names Kleiranax, which is the correct answer.",
        correct=True,
        confidence=85.0,
    )


def test_captured_value_not_whole_match() -> None:
    # simple-evals compares match.group(0) ("correct: yes") with "yes" and so grades everything wrong.
    parsed = parse_answer_verdict(
        "extracted_final_answer: 1738\nreasoning: same year\ncorrect: yes\nconfidence: 90"
    )
    assert parsed is not None
    assert parsed.correct is True
    assert parsed.extracted_final_answer == "1738"
    no = parse_answer_verdict(
        "extracted_final_answer: 1739\nreasoning: off by one\ncorrect: no\nconfidence: 90"
    )
    assert no is not None and no.correct is False


@pytest.mark.parametrize(
    "text",
    [
        VERDICT.replace("correct: yes", "correct: maybe"),
        VERDICT.replace("correct: yes", "correct: yes, mostly"),
        VERDICT.replace("correct: yes", "correct:"),
        VERDICT.replace("correct: yes\n", ""),
        VERDICT.replace("correct: yes", "correctness: yes"),
        "",
        "yes",
        "The answer is correct.",
    ],
)
def test_unclear_or_missing_correct_is_unparseable(text: str) -> None:
    assert parse_answer_verdict(text) is None


def test_reasoning_spans_lines_and_fields_come_in_any_order() -> None:
    text = (
        "correct: no\n"
        "confidence: 40\n"
        "reasoning: The response says 1739.\n"
        "\n"
        "The correct answer is 1738; these differ.\n"
        "extracted_final_answer: 1739\n"
    )
    parsed = parse_answer_verdict(text)
    assert parsed == ParsedAnswer(
        extracted_final_answer="1739",
        reasoning="The response says 1739.\n\nThe correct answer is 1738; these differ.",
        correct=False,
        confidence=40.0,
    )


def test_correct_value_on_the_next_line() -> None:
    parsed = parse_answer_verdict("extracted_final_answer: None\nreasoning: nothing given\ncorrect:\n  no\n")
    assert parsed is not None and parsed.correct is False
    assert parsed.extracted_final_answer == "None"
    assert parsed.confidence is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("85%", 85.0),
        ("85", 85.0),
        ("85 %", 85.0),
        ("**85%**", 85.0),
        ("0.85", 85.0),  # a decimal at most 1, without %, is a fraction
        ("1.0", 100.0),
        ("1", 1.0),  # an integer is a percentage
        ("0.5%", 0.5),
        ("85/100", 85.0),
        ("150%", 100.0),
        ("-5", 0.0),
        ("high", None),
        ("N/A", None),
    ],
)
def test_confidence_scale_and_clamp(value: str, expected: float | None) -> None:
    parsed = parse_answer_verdict(
        f"extracted_final_answer: x\nreasoning: r\ncorrect: yes\nconfidence: {value}"
    )
    assert parsed is not None
    assert parsed.confidence == expected


def test_first_of_a_repeated_field_wins() -> None:
    parsed = parse_answer_verdict("correct: no\nreasoning: r\ncorrect: yes")
    assert parsed is not None and parsed.correct is False


# --------------------------------------------------------------------------- contribution verdicts


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("contribution: decisive\nreasoning: it found the year", "decisive"),
        ("**Contribution:** Substantial\n**Reasoning:** key evidence", "substantial"),
        ("- **contribution**: PARTIAL.\n- reasoning: narrowed it", "partial"),
        ("reasoning: off topic\ncontribution: marginal (0.25)", "marginal"),
        ("contribution: `none`\nreasoning: empty report", "none"),
    ],
)
def test_contribution_labels_parse(text: str, label: str) -> None:
    parsed = parse_contribution(text)
    assert parsed is not None
    assert (parsed.label, parsed.score) == (label, CONTRIBUTION_SCALE[label])
    assert parsed.reasoning and "reasoning" not in parsed.reasoning.lower()


@pytest.mark.parametrize(
    "text",
    [
        "contribution: great\nreasoning: r",
        "contribution: none of it\nreasoning: r",
        "reasoning: r",
        "",
        "decisive",
    ],
)
def test_contribution_off_scale_is_unparseable(text: str) -> None:
    assert parse_contribution(text) is None


_FIELD_WORDS = st.sampled_from(
    [
        "correct:",
        "**correct:**",
        "confidence:",
        "reasoning:",
        "extracted_final_answer:",
        "contribution:",
        "yes",
        "no",
        "decisive",
        "%",
        "0.85",
        "**",
        "- ",
        "#",
        "\n",
        " ",
        "{",
        "}",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(st.one_of(_FIELD_WORDS, st.text(max_size=5))).map("".join)))
def test_parsers_never_raise(text: str) -> None:
    answer = parse_answer_verdict(text)
    assert answer is None or isinstance(answer.correct, bool)
    assert answer is None or answer.confidence is None or 0.0 <= answer.confidence <= 100.0
    contribution = parse_contribution(text)
    assert contribution is None or contribution.label in CONTRIBUTION_SCALE
    normalize_answer(text)
    parse_number(text)
    extract_exact_answer(text)
    response_confidence(text)
    rule_answer(text, text, "v")
    rule_contribution(text, text, text, "v")


@pytest.mark.timeout(10)
def test_parsers_handle_huge_whitespace_runs() -> None:
    # A label followed by a long run of blanks once made the line pattern backtrack quadratically.
    for text in ("correct" + " " * 200_000 + "x", "**correct**" + " " * 200_000 + "*", "- " * 100_000):
        assert parse_answer_verdict(text) is None
        assert parse_contribution(text.replace("correct", "contribution")) is None
        assert extract_exact_answer(text.replace("correct", "exact answer")) == ""


def test_parsers_take_non_strings() -> None:
    assert parse_answer_verdict(None) is None  # type: ignore[arg-type]
    assert parse_contribution(b"contribution: none") is None  # type: ignore[arg-type]


# --------------------------------------------------------------------------- normalization and numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  The   Beatles ", "beatles"),
        ('"Kleiranax."', "kleiranax"),
        ("**Wudiax Repix**", "wudiax repix"),
        ("an Apple", "apple"),
        ("A", "a"),
        ("Theodore", "theodore"),
        ("1,738", "1738"),
        ("1,738,000.5", "1738000.5"),
        ("12,5", "12,5"),
        ("ＫＬＥＩＲＡＮＡＸ", "kleiranax"),  # NFKC folds full-width letters
        ("Straße", "strasse"),
        ("U.S.", "u.s"),
        (".5", ".5"),
        ("“the end”", "end"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1738", 1738.0),
        ("1,738", 1738.0),
        ("1738.0", 1738.0),
        ("-12.5", -12.5),
        ("\u221212", -12.0),
        ("85%", 85.0),
        ("85 percent", 85.0),
        ("$1,500", 1500.0),
        ("$1.5 million", 1_500_000.0),
        ("12 km", 12.0),
        ("3 square miles", 3.0),
        ("1738.", 1738.0),
        ("about 1738", None),
        ("1738-1740", None),
        ("March 5, 1738", None),
        ("1e5", None),
        ("Kleiranax", None),
        ("", None),
    ],
)
def test_parse_number(text: str, expected: float | None) -> None:
    assert parse_number(text) == expected


# --------------------------------------------------------------------------- BrowseComp responses


def test_extract_exact_answer_from_the_browsecomp_format() -> None:
    response = "Explanation: It was founded in 1738 [doc-3].\nExact Answer: 1738\nConfidence: 85%"
    assert extract_exact_answer(response) == "1738"
    assert response_confidence(response) == 85.0
    bold = "**Explanation:** long story\nover lines\n\n**Exact Answer:** **Wudiax Repix**\n**Confidence:** 70"
    assert extract_exact_answer(bold) == "Wudiax Repix"
    assert response_confidence(bold) == 70.0
    assert extract_exact_answer("Explanation: x\nExact Answer:\n1738\nConfidence: 9%") == "1738"
    assert extract_exact_answer("Explanation: x\n**Exact Answer: 1738**\n- Confidence: 9%") == "1738"


def test_extract_exact_answer_without_the_format() -> None:
    assert extract_exact_answer("  Kleiranax  ") == "Kleiranax"
    assert response_confidence("Kleiranax") is None
    assert extract_exact_answer("x" * 250) == ""
    assert extract_exact_answer("It might be 1738.\nOr perhaps 1739.") == ""
    assert extract_exact_answer("") == ""


def test_exact_and_numeric_match() -> None:
    assert exact_match(browsecomp_response("1,738"), "1738")
    assert exact_match(browsecomp_response("1738.0"), "1,738")
    assert exact_match(browsecomp_response('"the Kleiranax"'), "Kleiranax")
    assert exact_match("1738", "1738")
    assert not exact_match(browsecomp_response("1739"), "1738")
    assert not exact_match(browsecomp_response("17380"), "1738")
    assert not exact_match(browsecomp_response(""), "")
    assert not exact_match("It might be 1738.\nOr perhaps 1739.", "1738")


def test_exact_verdict_is_the_fast_path() -> None:
    verdict = exact_verdict(browsecomp_response("Kleiranax", "80%"), "kleiranax", "browsecomp-answer-v1")
    assert verdict == AnswerVerdict(
        correct=True,
        extracted_final_answer="Kleiranax",
        reasoning="normalized exact match",
        confidence=80.0,
        parse_error=False,
        grader_version="browsecomp-answer-v1",
        method="exact",
    )
    assert exact_verdict(browsecomp_response("Droudri"), "Kleiranax", "v") is None


def test_rule_answer() -> None:
    right = rule_answer(browsecomp_response("1,738"), "1738", "rule-v1")
    assert (right.correct, right.method, right.confidence, right.extracted_final_answer) == (
        True,
        "rule",
        90.0,
        "1,738",
    )
    assert not right.parse_error
    wrong = rule_answer(browsecomp_response("1739"), "1738", "rule-v1")
    assert wrong.correct is False and "1739" in wrong.reasoning
    empty = rule_answer("I could not find it.\nSorry.", "1738", "rule-v1")
    assert (
        empty.correct is False and empty.extracted_final_answer == "" and "no exact answer" in empty.reasoning
    )


def test_verdicts_round_trip_through_dicts() -> None:
    verdict = rule_answer(browsecomp_response("1738"), "1738", "rule-v1")
    assert AnswerVerdict.from_dict(verdict.to_dict() | {"extra": 1}) == verdict
    assert AnswerVerdict.from_dict(verdict.to_dict() | {"cached": True}).cached is True
    contribution = rule_contribution("It is 1738.", "1738", "1738", "rule-v1")
    assert ContributionVerdict.from_dict(contribution.to_dict()) == contribution
    with pytest.raises(ValueError):
        AnswerVerdict.from_dict({"correct": True})


@pytest.mark.parametrize(
    ("report", "final", "gold", "label"),
    [
        ("The conservatory was founded in 1,738 [doc-3].", "1738", "1738", "decisive"),
        ("The founder was WUDIAX\nREPIX, per [doc-9].", "Droudri", "Wudiax Repix", "decisive"),
        ("Founded in 1739.", "1739", "1738", "marginal"),
        ("Founded in 17380.", "17380", "1738", "marginal"),
        ("Nothing relevant found.", "1739", "1738", "none"),
        ("Founded in 1739.", "1738", "1738", "none"),
        ("Budget exhausted before any finding.", "", "1738", "none"),
        ("Anything at all, 1738.", "1738", "", "none"),
    ],
)
def test_rule_contribution_labels(report: str, final: str, gold: str, label: str) -> None:
    verdict = rule_contribution(report, final, gold, "rule-v1")
    assert (verdict.label, verdict.score, verdict.method) == (label, CONTRIBUTION_SCALE[label], "rule")
    assert verdict.reasoning and not verdict.parse_error


def _report(
    answer: str, explanation: str, task: str = "find the founding year", status: str = "finish"
) -> str:
    from core.protocol import WorkerReportText, render_worker_report

    return render_worker_report(WorkerReportText(task, status, answer, explanation, "80%"))


@pytest.mark.parametrize(
    ("report", "final", "gold", "label"),
    [
        (_report("1738", "Founded in 1738 [doc-3]."), "1738", "1738", "decisive"),
        # The gold answer in the explanation (or the task) is not the worker's answer.
        (_report("1739", "Some pages say 1738, but [doc-3] says 1739."), "1739", "1738", "marginal"),
        (_report("1739", "Not 1738: [doc-3] says 1739."), "1740", "1738", "none"),
        (
            _report("Quillan", "the year 1738 is the founding", task="who founded it in 1738?"),
            "x",
            "1738",
            "none",
        ),
        # A worker that ran out of budget gave no answer, whatever its task says.
        (_report("", "", task="check that it was 1738", status="budget"), "1738", "1738", "none"),
    ],
)
def test_rule_contribution_reads_the_answer_field(report: str, final: str, gold: str, label: str) -> None:
    verdict = rule_contribution(report, final, gold, "rule-v1")
    assert verdict.label == label, verdict.reasoning
    assert "answer field" in verdict.reasoning or "no answer" in verdict.reasoning


# --------------------------------------------------------------------------- the toy world


def _perturbations(answer: str, other_answers: list[str]) -> list[str]:
    out = [next(a for a in other_answers if normalize_answer(a) != normalize_answer(answer))]
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    if digits:
        i = digits[-1]
        out.append(answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :])
    words = answer.split()
    out.append(" ".join(words[:-1]) if len(words) > 1 else answer[:-1])  # a word (or a letter) dropped
    return out


def test_rule_grader_on_toy_world_answers() -> None:
    world = generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0)
    answers = [q["answer"] for q in world.test]
    assert len(answers) == 24 and any(" " in a for a in answers) and any(a.isdigit() for a in answers)
    for q in world.test:
        gold = q["answer"]
        verdict = rule_answer(browsecomp_response(gold), gold, "rule-v1")
        assert verdict.correct is True, q
        assert verdict.confidence == 90.0 and verdict.extracted_final_answer == gold
        assert exact_verdict(browsecomp_response(gold), gold, "rule-v1") is not None
        for wrong in _perturbations(gold, answers):
            assert rule_answer(browsecomp_response(wrong), gold, "rule-v1").correct is False, (gold, wrong)
