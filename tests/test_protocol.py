"""The worker protocol: parsing never raises, renders round-trip, observations are byte-exact.

The property tests run 400-800 examples each in `make test`; fuzz at depth with
`BCSTACK_FUZZ_DEPTH=25 python -m pytest tests/test_protocol.py` (25x: 10,000-20,000 each).
"""

from __future__ import annotations

import json
import os
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import protocol as p

FUZZ_DEPTH = float(os.environ.get("BCSTACK_FUZZ_DEPTH", "1"))


def examples(depth_one: int) -> int:
    """Hypothesis examples: `depth_one` / 5 x BCSTACK_FUZZ_DEPTH (1 in the suite), at least 50."""
    return max(50, int(depth_one / 5 * FUZZ_DEPTH))


# --- parsing -------------------------------------------------------------------------------------


def test_parses_several_calls_in_one_turn():
    text = (
        "<think>\nLet me look.\n</think>\n\n"
        "<function=search>\n<parameter=query>Nobel laureate born in Tartu</parameter>\n"
        "<parameter=topk>5</parameter>\n</function>\n"
        "<function=open_page>\n<parameter=docid>18639</parameter>\n</function>"
    )
    assert p.parse_calls(text) == [
        p.FunctionCall("search", {"query": "Nobel laureate born in Tartu", "topk": "5"}),
        p.FunctionCall("open_page", {"docid": "18639"}),
    ]


def test_no_call_cases():
    assert p.parse_calls("") == []
    assert p.parse_calls("I think the answer is 42.") == []
    assert p.parse_calls(None) == []  # type: ignore[arg-type]
    assert p.parse_calls(12345) == []  # type: ignore[arg-type]
    # Mid-sentence mentions of the syntax are prose, not calls (upstream requires line starts).
    assert p.parse_calls("You could write <function=search></function> here.") == []
    # An unterminated call (generation cut by max_new_tokens) is no call.
    assert p.parse_calls("<function=search>\n<parameter=query>abc</parameter>") == []


def test_calls_inside_reasoning_are_ignored():
    text = (
        "<think>\n<function=finish>\n<parameter=answer>draft</parameter>\n</function>\n</think>\n\nNo call."
    )
    assert p.parse_calls(text) == []
    # A turn cut off while still thinking has no actions.
    assert p.parse_calls("<think>\n<function=search>\n<parameter=query>x</parameter>\n</function>\n") == []


def test_only_the_last_group_of_calls_counts():
    draft = "<function=search>\n<parameter=query>draft</parameter>\n</function>"
    real = "<function=search>\n<parameter=query>real</parameter>\n</function>"
    assert p.parse_calls(f"{draft}\n\n\n\nOn second thought:\n{real}") == [
        p.FunctionCall("search", {"query": "real"})
    ]
    assert len(p.parse_calls(f"{draft}\n{real}")) == 2


def test_parameter_values_are_stripped_and_multiline_values_kept():
    text = (
        "<function=finish>\n<parameter=answer>\n  Tartu \n</parameter>\n"
        "<parameter=explanation>line one\nline two</parameter>\n</function>"
    )
    (call,) = p.parse_calls(text)
    assert call.params == {"answer": "Tartu", "explanation": "line one\nline two"}


def test_separator_markers_keep_the_last_segment():
    text = "<function=search>\n<parameter=query>a</parameter>\n</function>\n<[sep]>\nplain text"
    assert p.parse_calls(text) == []


def test_departure_switches_give_upstream_parsing():
    text = "<function= search >\n<parameter=query>\nTartu\n</parameter>\n</function>"
    assert p.parse_calls(text) == [p.FunctionCall("search", {"query": "Tartu"})]
    assert p.parse_calls(text, strip_whitespace=False) == [p.FunctionCall(" search ", {"query": "\nTartu\n"})]
    thought = "<think>\n<function=finish>\n<parameter=answer>x</parameter>\n</function>\n</think>\n\nok"
    assert p.parse_calls(thought, ignore_reasoning=False) == [p.FunctionCall("finish", {"answer": "x"})]


# --- Qwen3's native calls (upstream extract_json_tool) -------------------------------------------


def _tool_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            _tool_call('{"name": "open_page", "arguments": {"docid": "7"}}'),
            [p.FunctionCall("open_page", {"docid": "7"})],
        ),
        # fenced, a Python literal, prose around the object, numbers as text
        (
            _tool_call('```json\n{"name": "open_page", "arguments": {"docid": 7}}\n```'),
            [p.FunctionCall("open_page", {"docid": "7"})],
        ),
        (
            _tool_call("{'name': 'finish', 'arguments': {'answer': 'Tartu'}}"),
            [p.FunctionCall("finish", {"answer": "Tartu"})],
        ),
        (
            _tool_call('Calling: {"name": "finish", "arguments": {"answer": "x", "confidence": null}} now'),
            [p.FunctionCall("finish", {"answer": "x"})],
        ),
        (_tool_call('{"name": "finish", "arguments": "Tartu"}'), [p.FunctionCall("finish", {})]),
        ("<answer>\n  Tartu \n</answer>", [p.FunctionCall("finish", {"answer": "Tartu"})]),
        # search: one call per query, max(10 // (n + 1), 2) hits each; visit: one open_page per url
        (
            _tool_call('{"name": "search", "arguments": {"query": ["a", "b", "c", "d"]}}'),
            [p.FunctionCall("search", {"query": q, "topk": "2"}) for q in "abcd"],
        ),
        (
            _tool_call('{"name": "search", "arguments": {"query": [null]}}'),
            [p.FunctionCall("search", {"topk": "5"})],
        ),
        (
            _tool_call('{"name": "visit", "arguments": {"url": ["https://a", "https://b"]}}'),
            [
                p.FunctionCall("open_page", {"url": "https://a"}),
                p.FunctionCall("open_page", {"url": "https://b"}),
            ],
        ),
        (
            _tool_call('{"name": "visit", "arguments": {"url": "https://a"}}'),
            [p.FunctionCall("open_page", {"url": "https://a"})],
        ),
        (_tool_call('{"name": "search", "arguments": {}}'), []),
        (_tool_call('{"arguments": {"query": ["a"]}}'), []),
        (_tool_call("not json at all"), []),
    ],
)
def test_native_calls(text, expected):
    assert p.parse_calls(text, native=True) == expected
    assert p.parse_calls(text) == []  # off unless asked for: the coordinator reads only <function=…>


def test_native_calls_win_over_function_calls_and_fall_back_to_them():
    xml = "<function=search>\n<parameter=query>xml</parameter>\n</function>"
    native = _tool_call('{"name": "open_page", "arguments": {"docid": "7"}}')
    assert p.parse_calls(f"{xml}\n{native}", native=True) == [p.FunctionCall("open_page", {"docid": "7"})]
    assert p.parse_calls(f"{xml}\n{_tool_call('broken')}", native=True) == [
        p.FunctionCall("search", {"query": "xml"})
    ]
    thought = f"<think>\n{native}\n</think>\n\nNo call."
    assert p.parse_calls(thought, native=True) == []
    assert p.parse_calls(thought, native=True, ignore_reasoning=False) == [
        p.FunctionCall("open_page", {"docid": "7"})
    ]


def test_native_string_query_upstream_makes_a_call_per_character():
    text = _tool_call('{"name": "search", "arguments": {"query": "ab"}}')
    assert p.parse_calls(text, native=True) == [p.FunctionCall("search", {"query": "ab", "topk": "5"})]
    assert p.parse_calls(text, native=True, native_string_is_one=False) == [
        p.FunctionCall("search", {"query": "a", "topk": "3"}),
        p.FunctionCall("search", {"query": "b", "topk": "3"}),
    ]


# --- property tests: the parser is total --------------------------------------------------------

TAGS = ["<function=", "</function>", "<parameter=", "</parameter>", "<think>", "</think>", ">", "\n", "<[x]>"]
fragments = st.one_of(
    st.sampled_from(TAGS),
    st.text(max_size=30),
    st.sampled_from(["search", "open_page", "finish", "branch", "query", "docid", "topk", "answer"]),
)
tag_soup = st.lists(fragments, max_size=60).map("".join)
names = st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=12)
# A value is well formed when it holds none of the protocol's own markers.
_MARKERS = ("<function=", "</function>", "<parameter=", "</parameter>", "<think>", "</think>", "<[")
values = st.text(max_size=200).filter(lambda v: not any(m in v for m in _MARKERS))


@settings(max_examples=examples(4000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=2000))
def test_never_raises_on_arbitrary_text(text):
    calls = p.parse_calls(text)
    assert isinstance(calls, list)
    for c in calls:
        p.validate_call(c)


@settings(max_examples=examples(4000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tag_soup)
def test_never_raises_on_truncated_and_nested_tags(text):
    for c in p.parse_calls(text):
        assert isinstance(p.validate_call(c, p.WORKER_TOOLS + p.COORDINATOR_TOOLS), p.Action)


@settings(
    max_examples=examples(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.integers(min_value=10_000, max_value=400_000), st.sampled_from(TAGS))
def test_never_raises_on_huge_parameters(size, tag):
    text = f"<function=search>\n<parameter=query>{'x' * size}{tag}</parameter>\n</function>"
    for c in p.parse_calls(text):
        p.validate_call(c)


NATIVE_TAGS = [
    "<tool_call>", "</tool_call>", "<answer>", "</answer>", "{", "}", "[", "]", "```",
    '"name"', '"arguments"', ":", ",", '"search"', '"visit"', '"query"', '"url"', "null", "'", '"',
]  # fmt: skip
native_soup = st.lists(st.one_of(fragments, st.sampled_from(NATIVE_TAGS)), max_size=80).map("".join)


@settings(max_examples=examples(4000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(native_soup, st.booleans(), st.booleans(), st.booleans())
def test_never_raises_on_native_tag_soup_with_any_switches(text, strip, ignore_reasoning, string_is_one):
    calls = p.parse_calls(
        text,
        native=True,
        strip_whitespace=strip,
        ignore_reasoning=ignore_reasoning,
        native_string_is_one=string_is_one,
    )
    for c in calls:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in c.params.items())
        assert isinstance(p.validate_call(c), p.Action)


@settings(max_examples=examples(2000), deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=20,
    )
)
def test_never_raises_on_any_json_arguments(arguments):
    for name in ("search", "visit", "finish"):
        text = _tool_call(json.dumps({"name": name, "arguments": arguments}))
        for c in p.parse_calls(text, native=True):
            p.validate_call(c)


well_formed_call = st.builds(
    p.FunctionCall,
    name=names,
    params=st.dictionaries(names, values.map(str.strip), max_size=4),
)


@settings(max_examples=examples(3000), deadline=None)
@given(st.lists(well_formed_call, min_size=1, max_size=4))
def test_render_then_parse_round_trips(calls):
    assert p.parse_calls(p.render_calls(calls)) == calls


@settings(max_examples=examples(2000), deadline=None)
@given(
    st.lists(
        well_formed_call.filter(
            lambda c: c.name not in ("search", "visit") and "tool_call>" not in json.dumps(c.params)
        ),
        min_size=1,
        max_size=4,
    )
)
def test_native_calls_round_trip(calls):
    text = "\n".join(_tool_call(json.dumps({"name": c.name, "arguments": c.params})) for c in calls)
    assert p.parse_calls(text, native=True) == calls


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (p.FunctionCall("search", {}), p.CallError(p.SEARCH_QUERY_ERROR)),
        (p.FunctionCall("search", {"query": "x", "topk": "abc"}), p.SearchAction("x", 10)),
        (p.FunctionCall("search", {"query": "x", "topk": "3"}), p.SearchAction("x", 3)),
        (p.FunctionCall("search", {"query": "x", "topk": "500"}), p.SearchAction("x", 10)),
        (p.FunctionCall("search", {"query": "x", "topk": "0"}), p.SearchAction("x", 10)),
        (p.FunctionCall("search", {"query": "x", "topk": "²"}), p.SearchAction("x", 10)),
        (p.FunctionCall("search", {"query": "x", "topk": "0000003"}), p.SearchAction("x", 3)),
        (p.FunctionCall("open_page", {}), p.CallError(p.OPEN_PAGE_ARG_ERROR)),
        (p.FunctionCall("open_page", {"url": "https://a"}), p.OpenPageAction(None, "https://a")),
        (p.FunctionCall("finish", {"answer": "Tartu"}), p.FinishAction("Tartu", "", "")),
        (p.FunctionCall("browse", {}), p.CallError('[Error] The function "browse" is not supported.')),
        (p.FunctionCall("branch", {"prompt": "x"}), p.CallError(p.unsupported_function_error("branch"))),
    ],
)
def test_worker_validation(call, expected):
    assert p.validate_call(call) == expected


def test_zero_topk_upstream_shows_one_hit():
    call = p.FunctionCall("search", {"query": "x", "topk": "0"})
    action = p.validate_call(call, zero_topk_is_default=False)
    assert action == p.SearchAction("x", 0)
    out = p.render_search_results("x", [PAGE_A, PAGE_B], set(), action.topk)
    assert out.count("--- #") == 1


def test_coordinator_validation():
    tools = p.COORDINATOR_TOOLS
    assert p.validate_call(
        p.FunctionCall("branch", {"description": "d", "prompt": "q"}), tools
    ) == p.BranchAction("d", "q")
    assert p.validate_call(p.FunctionCall("branch", {"description": "d"}), tools) == p.CallError(
        '[Error] The "branch" function requires a "prompt" argument.'
    )
    assert isinstance(p.validate_call(p.FunctionCall("search", {"query": "q"}), tools), p.CallError)


# --- golden observations -------------------------------------------------------------------------

PAGE_A = p.Page("101", "https://w/a", "---\ntitle: A\n---\n\nalpha beta\ngamma")
PAGE_B = p.Page("202", "https://w/b", "bee " * 600)


def test_golden_search_results_fresh():
    seen: set[str] = set()
    out = p.render_search_results("who is alpha", [PAGE_A], seen, topk=5)
    assert out == (
        '[Search Results for "who is alpha"]\n'
        "\n--- #1: 101---\ndocid: 101\nurl: https://w/a\ncontent: --- title: A --- alpha beta gamma\n"
        "\n"
    )
    assert seen == {"101"}


def test_golden_search_results_snippet_cut_to_512_words():
    out = p.render_search_results("bee", [PAGE_B], set(), topk=1)
    content = out.split("content: ", 1)[1].rstrip("\n")
    assert content == " ".join(["bee"] * 512)


def test_golden_seen_page_is_shortened_and_counts_a_quarter():
    seen = {"202"}
    hits = [PAGE_B, PAGE_B, PAGE_B, PAGE_B, PAGE_A, PAGE_B]
    out = p.render_search_results("q", hits, seen, topk=1)
    short = " ".join(["bee"] * 128)
    block = f"docid: 202\nurl: https://w/b\ncontent: {p.SEEN_PAGE_NOTICE}{short}\n"
    # Four seen hits count 0.25 each: the list stops after the fourth, before PAGE_A.
    assert (
        out
        == '[Search Results for "q"]\n' + "".join(f"\n--- #{i}: 202---\n{block}" for i in range(1, 5)) + "\n"
    )
    assert seen == {"202"}


def test_golden_topk_counts_fresh_hits():
    pages = [p.Page(str(i), f"u{i}", f"text {i}") for i in range(10)]
    out = p.render_search_results("q", pages, set(), topk=3)
    assert out.count("--- #") == 3 and "--- #3: 2---" in out and "--- #4" not in out


def test_golden_open_page():
    assert p.render_open_page([PAGE_A]) == (
        "[Opened Page Content]\ndocid: 101\nurl: https://w/a\n"
        "content: ---\ntitle: A\n---\n\nalpha beta\ngamma\n\n"
    )


def test_golden_open_page_truncated_keeps_whitespace():
    page = p.Page("7", "u", "one  two\nthree four five")
    assert p.render_open_page([page], page_words=3) == (
        "[Opened Page Content]\ndocid: 7\nurl: u\ncontent: one  two\nthree\n[Document is truncated.]\n\n"
    )
    # Upstream marks a page of exactly N words as truncated too.
    assert "[Document is truncated.]" in p.render_open_page([p.Page("7", "u", "a b c")], page_words=3)
    assert "[Document is truncated.]" not in p.render_open_page([p.Page("7", "u", "a b")], page_words=3)


def test_golden_turn_observation_with_nudge_and_errors():
    parts = [p.SEARCH_QUERY_ERROR, p.render_open_page([PAGE_A])]
    assert p.finish_observation(parts) == (
        '[Error] The "search" function requires a "query" argument.[Opened Page Content]\n'
        "docid: 101\nurl: https://w/a\ncontent: ---\ntitle: A\n---\n\nalpha beta\ngamma\n\n\n\n"
        "* Please reflect on the information we have obtained, and keep searching for additional "
        "information if we still can not answer the question. Do not give the answer if the "
        "information is still not enough."
    )
    assert p.finish_observation([p.OPEN_PAGE_ARG_ERROR], reflection_nudge=False) == (
        '[Error] The "open_page" function requires either a "docid" or a "url".'
    )


def test_golden_error_lines():
    assert p.NO_CALL_ERROR == "No function call was detected in the model response."
    assert p.unsupported_function_error("x") == '[Error] The function "x" is not supported.'
    assert p.page_not_found_error("9", None) == '[Error] No page was found for docid "9".'
    assert p.EMPTY_FINISH_RESUBMIT.startswith("Fail to parse answer. Please resubmit")


def test_observation_parses_back():
    seen: set[str] = set()
    text = p.finish_observation(
        [p.render_search_results("q", [PAGE_A, PAGE_B], seen, 5), p.render_open_page([PAGE_A])]
    )
    obs = p.parse_observation(text)
    assert obs.queries == ["q"]
    assert [(h.rank, h.docid, h.url) for h in obs.hits] == [
        (1, "101", "https://w/a"),
        (2, "202", "https://w/b"),
    ]
    assert obs.pages == [PAGE_A]
    again = p.parse_observation(p.render_search_results("q", [PAGE_A], seen, 5))
    assert again.hits[0].seen_before and again.hits[0].content == "--- title: A --- alpha beta gamma"


def test_worker_report_round_trip():
    done = p.WorkerReportText("find x", "finish", "Tartu", "see [12]", "80%")
    cut = p.WorkerReportText("find y", "budget")
    text = p.render_worker_report(done) + "\n\n" + p.render_worker_report(cut)
    assert p.render_worker_report(cut) == (
        "[Worker Report]\ntask: find y\nstatus: budget\n"
        "note: the worker ran out of its token budget before finishing; no answer was given."
    )
    assert p.parse_worker_reports(text) == [done, cut]
