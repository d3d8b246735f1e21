"""What a trained worker sees: FoldAgent's observations, byte for byte, through the episode runner.

Golden observations for every fidelity case (exact strings, written out here, not rendered),
the no-search guard and its trajectory events, Qwen3's native calls, each departure setting
against its upstream value, and a replay: a recorded episode's observations rendered again from
its tool calls and the documents alone give the same bytes.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, fields, replace

import pytest
from toy_env import ToyRetrieval

from core import protocol as p
from core.kit.metrics import new_registry
from core.records import trajectory_from_proto
from core.v1 import common_pb2, worker_pb2
from devkit.toyworld.generator import generate_world
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE, expert_worker_policy
from services.worker.metrics import WorkerMetrics
from services.worker.prompts import WORKER_SYSTEM_PROMPT
from services.worker.runner import (
    EVENT_FINISH_WITHOUT_SEARCH,
    EVENT_FINISH_WITHOUT_SEARCH_BOUNCED,
    EpisodeResult,
    EpisodeRunner,
    ProtocolSettings,
)
from services.worker.service import WorkerCore, protocol_settings, response_of
from services.worker.settings import WorkerSettings

NUDGE = (
    "\n\n* Please reflect on the information we have obtained, and keep searching for additional "
    "information if we still can not answer the question. Do not give the answer if the information "
    "is still not enough."
)
NO_CALL = "No function call was detected in the model response."
BOUNCE = (
    "Answer submission failed. You MUST use the search tool to verify the answer and all the evidence, "
    "and cite the correct source document in your explanation to support your claim."
)
SEEN = (
    "(This page was already seen in a previous search. Here, a shorter snippet is shown. If you find "
    "this page relevant, please use the open_page tool to inspect the full content) "
)
# Every departure switched to upstream's behaviour.
UPSTREAM = ProtocolSettings(
    strip_call_whitespace=False,
    ignore_calls_in_reasoning=False,
    unknown_function_replaces=True,
    report_missing_page=False,
    zero_topk_is_default=False,
    native_string_is_one=False,
)

PAGES = [
    p.Page("101", "https://w/a", "Alpha is a town\nin   Tartu county."),
    p.Page("202", "https://w/b", "Beta river flows north."),
]


def _hits(query: str, *, seen: bool = False, n: int = 2) -> str:
    """The golden search block over PAGES (first time, or both already seen)."""
    a = f"{SEEN}Alpha is a town in Tartu county." if seen else "Alpha is a town in Tartu county."
    b = f"{SEEN}Beta river flows north." if seen else "Beta river flows north."
    blocks = [
        f"\n--- #1: 101---\ndocid: 101\nurl: https://w/a\ncontent: {a}\n",
        f"\n--- #2: 202---\ndocid: 202\nurl: https://w/b\ncontent: {b}\n",
    ]
    return f'[Search Results for "{query}"]\n' + "".join(blocks[:n]) + "\n"


OPENED_B = "[Opened Page Content]\ndocid: 202\nurl: https://w/b\ncontent: Beta river flows north.\n\n"


def _xml(name: str, **params: str) -> str:
    return p.render_call(p.FunctionCall(name, params))


def _native(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, tiny_kit):
    from transformers import AutoTokenizer

    out = tiny_kit(tmp_path_factory.mktemp("tiny") / "model")
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def world():
    return generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0)


@dataclass
class Out:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str = "v0"
    version_spans: tuple = ()


class PolicyEngine:
    """Decodes the prompt into messages, asks the policy for the next reply, returns its tokens."""

    def __init__(self, tokenizer, policy) -> None:
        self.tokenizer, self.policy = tokenizer, policy
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, input_ids, *, max_new_tokens, **_):
        text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        messages = []
        for block in text.split("<|im_start|>")[1:]:
            role, _, rest = block.partition("\n")
            messages.append({"role": role, "content": rest.split("<|im_end|>")[0]})
        reply = self.policy([m for m in messages if m["content"] or m["role"] != "assistant"])
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos][:max_new_tokens]
        return Out(ids, [-0.5] * len(ids), "stop")


def scripted(replies: list[str]):
    """A policy that writes ``replies`` in order, whatever it is shown."""
    queue = list(replies)
    return lambda _messages: queue.pop(0) if queue else "Out of script."


class FixedRetrieval:
    """Every search finds PAGES in order; open finds a page by docid or url."""

    async def search(self, query, k, *, snippet_words=None):
        return PAGES[:k]

    async def open(self, docid, url):
        return [pg for pg in PAGES if (docid and pg.docid == docid) or (url and pg.url == url)]


class ToyRetrievalClient:
    def __init__(self, corpus) -> None:
        self.env = ToyRetrieval(corpus)

    async def search(self, query, k, *, snippet_words=None):
        return self.env.search(query, k)

    async def open(self, docid, url):
        return self.env.open(docid, url)


def _task(question: str = "Where is Alpha?") -> list[dict[str, str]]:
    return [
        {"role": "system", "content": WORKER_SYSTEM_PROMPT},
        {"role": "user", "content": WORKER_TASK_TEMPLATE.format(question=question)},
    ]


def _episode(
    tokenizer,
    replies: list[str],
    protocol: ProtocolSettings | None = None,
    *,
    gold: str | None = None,
    retrieval=None,
) -> EpisodeResult:
    runner = EpisodeRunner(
        PolicyEngine(tokenizer, scripted(replies)),
        retrieval or FixedRetrieval(),
        tokenizer,
        protocol=protocol,
    )
    return asyncio.run(runner.run(_task(), gold_answer=gold))


def _observations(result: EpisodeResult) -> list[str]:
    return [m["content"] for m in result.messages[3::2]]


# --- the turn's observation --------------------------------------------------------------------


def test_a_turn_without_a_call_gets_the_no_call_line_alone(tokenizer):
    cut_in_thought = "<think>\nI should search for\n<function=search>\n<parameter=query>alpha</parameter>\n"
    result = _episode(tokenizer, ["I think it is Tartu.", cut_in_thought, _xml("search", query="alpha")])
    assert _observations(result)[:3] == [NO_CALL, NO_CALL, _hits("alpha") + NUDGE]


def test_only_the_last_group_of_calls_runs(tokenizer):
    draft, real = _xml("search", query="draft"), _xml("search", query="real")
    result = _episode(tokenizer, [f"{draft}\n\n\n\nOn second thought:\n{real}"])
    assert _observations(result)[0] == _hits("real") + NUDGE
    assert [c.params["query"] for c in result.trajectory.tool_calls] == ["real"]


def test_empty_finish_gets_the_resubmit_message_alone(tokenizer):
    result = _episode(tokenizer, [_xml("search", query="alpha") + "\n" + _xml("finish", answer=" ")])
    assert _observations(result)[0] == (
        "Fail to parse answer. Please resubmit with the correct tool call format, eg\n"
        "<function=finish>\n<parameter=answer>YOUR ANSWER</parameter>\n"
        "<parameter=explanation>YOUR EXPLANATION</parameter>\n"
        "<parameter=confidence>YOUR CONFIDENCE</parameter>\n</function>"
    )


# --- the no-search guard -----------------------------------------------------------------------


def test_a_right_answer_before_any_search_is_bounced_once_then_voided(tokenizer):
    answer = _xml("finish", answer="Tartu", explanation="I know it.", confidence="90%")
    result = _episode(tokenizer, [answer, answer], gold="tartu (Estonia)")
    assert _observations(result) == [BOUNCE]
    assert result.status == "finish" and result.answer == "" and result.explanation == "I know it."
    assert result.trajectory.events == [EVENT_FINISH_WITHOUT_SEARCH_BOUNCED, EVENT_FINISH_WITHOUT_SEARCH]
    assert [c.outcome for c in result.trajectory.tool_calls] == ["no_search", "voided"]


@pytest.mark.parametrize(("answer", "gold"), [("Narva", "Tartu"), ("Tartu", None)])
def test_a_wrong_or_ungraded_answer_before_any_search_is_voided_at_once(tokenizer, answer, gold):
    result = _episode(tokenizer, [_xml("finish", answer=answer)], gold=gold)
    assert result.status == "finish" and result.answer == "" and result.turns == 1
    assert result.trajectory.events == [EVENT_FINISH_WITHOUT_SEARCH]


@pytest.mark.parametrize(
    "replies",
    [
        [_xml("search", query="alpha"), _xml("finish", answer="Tartu")],
        [_xml("search", query="alpha") + "\n" + _xml("finish", answer="Tartu")],  # the same turn
        ["<function=search>\n</function>", _xml("finish", answer="Tartu")],  # upstream counts any search call
        [_native("search", query=["alpha"]), "<answer>Tartu</answer>"],
    ],
)
def test_an_answer_after_a_search_stands(tokenizer, replies):
    result = _episode(tokenizer, replies, gold="Tartu")
    assert result.status == "finish" and result.answer == "Tartu" and result.trajectory.events == []


def test_the_guard_is_a_setting(tokenizer):
    result = _episode(tokenizer, [_xml("finish", answer="Tartu")], ProtocolSettings(no_search_guard=False))
    assert result.answer == "Tartu" and result.trajectory.events == []


def test_the_guard_reaches_the_record_and_the_gold_answer_reaches_the_runner(tokenizer):
    result = _episode(tokenizer, [_xml("finish", answer="Narva")], gold="Tartu")
    message = response_of(result, "task")
    assert list(message.trajectory.events) == [EVENT_FINISH_WITHOUT_SEARCH]
    assert trajectory_from_proto(message.trajectory).events == [EVENT_FINISH_WITHOUT_SEARCH]
    settings = WorkerSettings()
    core = WorkerCore(None, settings, WorkerMetrics(new_registry(), settings))  # type: ignore[arg-type]
    chat = worker_pb2.ChatTask(messages=[common_pb2.Message(role="user", content="q")])
    assert (
        core.prepare(worker_pb2.RunWorkerEpisodeRequest(chat=chat, gold_answer="Tartu")).gold_answer
        == "Tartu"
    )
    assert core.prepare(worker_pb2.RunWorkerEpisodeRequest(chat=chat)).gold_answer is None


@pytest.mark.parametrize(
    ("gold", "answer", "match"),
    [
        ("Tartu", "tartu (Estonia)", True),  # parentheticals and case
        ("Université de Genève", '"Universite de Geneve"', True),  # accents and quotes
        ("The Beatles", "Beatles", True),  # articles
        ("Paris, 1889", "Paris", True),  # four-digit years
        ("Nolan Ryan", "Ryan Nolan", True),  # word order
        ("Christopher Nolan", "Chris Nolan", True),  # a first name up to a prefix of 4+ letters
        ("Alfred Smith", "Al Smith", False),  # ... not a shorter one
        ("John Smith", "Jane Smith", False),
        ("1889", "1890", False),
        ("Tartu", "Narva", False),
    ],
)
def test_lenient_match(gold, answer, match):
    assert p.lenient_match(gold, answer) is match


# --- Qwen3's native calls ----------------------------------------------------------------------


def test_native_search_runs_one_search_per_query_sharing_topk(tokenizer):
    # Two queries: max(10 // 3, 2) = 3 hits each; the second search sees both pages again.
    result = _episode(tokenizer, [_native("search", query=["alpha", "beta"])])
    assert _observations(result)[0] == _hits("alpha") + _hits("beta", seen=True) + NUDGE
    assert [c.params for c in result.trajectory.tool_calls] == [
        {"query": "alpha", "topk": "3"},
        {"query": "beta", "topk": "3"},
    ]


def test_native_visit_opens_each_url(tokenizer):
    result = _episode(tokenizer, [_native("visit", url=["https://w/b"])])
    assert _observations(result)[0] == OPENED_B + NUDGE


def test_native_answer_block_finishes(tokenizer):
    result = _episode(
        tokenizer, [_xml("search", query="a"), "<think>\nDone.\n</think>\n\n<answer>Tartu</answer>"]
    )
    assert result.status == "finish" and result.answer == "Tartu"


def test_native_calls_are_a_setting(tokenizer):
    result = _episode(
        tokenizer, [_native("search", query=["alpha"])], ProtocolSettings(native_tool_calls=False)
    )
    assert _observations(result)[0] == NO_CALL


# --- each departure, and upstream's behaviour one switch away ------------------------------------

DEPARTURES = [
    (
        "strip_call_whitespace",
        "<function=search>\n<parameter=query>\nalpha\n</parameter>\n</function>",
        _hits("alpha") + NUDGE,
        _hits("\nalpha\n") + NUDGE,
    ),
    (
        "ignore_calls_in_reasoning",
        "<think>\n<function=search>\n<parameter=query>alpha</parameter>\n</function>\n</think>\n\nHmm.",
        NO_CALL,
        _hits("alpha") + NUDGE,
    ),
    (
        "unknown_function_replaces",
        "\n".join([_xml("search", query="alpha"), _xml("browse", url="x"), _xml("open_page", docid="202")]),
        _hits("alpha") + '[Error] The function "browse" is not supported.' + OPENED_B + NUDGE,
        '[Error] The function "browse" is not supported.' + OPENED_B + NUDGE,
    ),
    (
        "report_missing_page",
        _xml("open_page", docid="999"),
        '[Error] No page was found for docid "999".' + NUDGE,
        NUDGE.strip(),
    ),
    (
        "zero_topk_is_default",
        _xml("search", query="alpha", topk="0"),
        _hits("alpha") + NUDGE,
        _hits("alpha", n=1) + NUDGE,
    ),
    (
        "native_string_is_one",
        _native("search", query="ab"),
        _hits("ab") + NUDGE,
        _hits("a") + _hits("b", seen=True) + NUDGE,
    ),
]


@pytest.mark.parametrize(("setting", "reply", "ours", "upstream"), DEPARTURES, ids=[d[0] for d in DEPARTURES])
def test_each_departure_and_its_upstream_switch(tokenizer, setting, reply, ours, upstream):
    assert _observations(_episode(tokenizer, [reply]))[0] == ours
    switched = replace(ProtocolSettings(), **{setting: getattr(UPSTREAM, setting)})
    assert _observations(_episode(tokenizer, [reply], switched))[0] == upstream


def test_upstream_flips_exactly_the_departures_and_the_service_runs_the_defaults():
    flipped = {
        f.name
        for f in fields(ProtocolSettings)
        if getattr(UPSTREAM, f.name) != getattr(ProtocolSettings(), f.name)
    }
    assert flipped == {d[0] for d in DEPARTURES}
    assert protocol_settings(WorkerSettings()) == ProtocolSettings()
    assert protocol_settings(WorkerSettings(unknown_function_replaces=True)).unknown_function_replaces


# --- replay: observations rendered again from the recorded tool calls ---------------------------


def _replay(result: EpisodeResult, corpus: list[dict], ps: ProtocolSettings) -> list[str]:
    """Every observation of a recorded episode, from its tool calls and the documents they showed."""
    docs = {d["docid"]: p.Page(d["docid"], d["url"], d["text"]) for d in corpus}
    seen: set[str] = set()
    out = []
    for turn in range(len(_observations(result))):
        obs = p.TurnObservation(
            reflection_nudge=ps.reflection_nudge, unknown_function_replaces=ps.unknown_function_replaces
        )
        records = [c for c in result.trajectory.tool_calls if c.turn == turn]
        if not records:
            obs.stand_alone(p.NO_CALL_ERROR)
        for rec in records:
            action = p.validate_call(
                p.FunctionCall(rec.name, rec.params),
                default_topk=ps.default_topk,
                max_topk=ps.max_topk,
                zero_topk_is_default=ps.zero_topk_is_default,
            )
            shown = [docs[d] for d in rec.docids]
            if rec.outcome == "unknown_tool":
                obs.add_unsupported(rec.name)
            elif isinstance(action, p.CallError):
                obs.add(action.message)
            elif isinstance(action, p.SearchAction):
                obs.add(p.render_search_results(action.query, shown, seen, action.topk))
            elif isinstance(action, p.OpenPageAction):
                obs.add(
                    p.render_open_result(
                        shown, action.docid, action.url, report_missing=ps.report_missing_page
                    )
                )
            else:
                obs.stand_alone(p.NO_SEARCH_BOUNCE if rec.outcome == "no_search" else p.EMPTY_FINISH_RESUBMIT)
        out.append(obs.text())
    return out


@pytest.mark.parametrize("ps", [ProtocolSettings(), UPSTREAM], ids=["ours", "upstream"])
def test_a_recorded_episode_replays_to_the_same_bytes(tokenizer, world, ps):
    q = world.test[0]
    evidence = q["evidence_docs"][0]
    other = next(d for d in world.corpus if d["docid"] != evidence["docid"])
    title = evidence["text"].split("title: ", 1)[1].split("\n", 1)[0]
    replies = [
        "Let me think about where to start.",
        _xml("finish", answer=q["answer"], explanation="From memory.", confidence="60%"),
        "\n".join([_xml("search", query=title, topk="3"), _xml("browse", q="x"), _xml("open_page")]),
        _native("search", query=[title, "founded"]),
        _native("visit", url=[other["url"]]),
        _xml("open_page", docid=evidence["docid"]) + "\n" + _xml("open_page", docid="no-such-doc"),
        _xml("search", query=title, topk="0"),
        _xml("finish", answer=""),
        f"<answer>{q['answer']}</answer>",
    ]
    result = _episode(tokenizer, replies, ps, gold=q["answer"], retrieval=ToyRetrievalClient(world.corpus))
    assert result.status == "finish" and result.answer == q["answer"]
    assert result.trajectory.events == [EVENT_FINISH_WITHOUT_SEARCH_BOUNCED]
    assert len(_observations(result)) == len(replies) - 1
    assert _replay(result, world.corpus, ps) == _observations(result)


def test_expert_episodes_replay_to_the_same_bytes(tokenizer, world):
    runner = EpisodeRunner(
        PolicyEngine(tokenizer, expert_worker_policy), ToyRetrievalClient(world.corpus), tokenizer
    )
    for q in world.test[:6]:
        result = asyncio.run(runner.run(_task(q["query"]), gold_answer=q["answer"]))
        assert result.status == "finish" and len(_observations(result)) >= 2
        assert _replay(result, world.corpus, ProtocolSettings()) == _observations(result)
