"""The judge proxy against a fake OpenAI-compatible grader run as a real HTTP server, and
`bcstack serve judge` as a real process (rule backend; LLM backend with a key, a cache, a restart).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import httpx
import pytest
import uvicorn
from conftest import LOOPBACK, find_free_port
from fake_openai import Reply, ScriptedLLM, completion, serving_uvicorn
from prometheus_client.parser import text_string_to_metric_families
from stack_util import bcstack_process

from core.kit.settings import load_settings
from core.v1 import judge_pb2, judge_pb2_grpc
from services.judge.core import GraderUnavailable
from services.judge.service import build
from services.judge.settings import JudgeSettings

GRADER_MODEL = "fake-grader"
KEY = "sk-grader-7d41c0e9aa5b3f62"
QUESTION = "Which engine did the founder of Karvo Works design in 1931?"
RESPONSE = "Explanation: the Karvo archive says so [12].\nExact Answer: the Quillan V8\nConfidence: 85%"

VERDICTS = {
    "plain": "extracted_final_answer: the Quillan V8\nreasoning: same engine.\ncorrect: yes\nconfidence: 85",
    "bold_inside": "**extracted_final_answer:** the Quillan V8\n**reasoning:** same engine.\n"
    "**correct:** yes\n**confidence:** 85%",
    "bold_outside": "**extracted_final_answer**: the Quillan V8\n**reasoning**: same.\n**correct**: yes\n"
    "**confidence**: 85",
    "no": "extracted_final_answer: the Quillan V6\nreasoning: another engine.\ncorrect: no\nconfidence: 85",
}
GARBAGE = "I think it is probably right but I cannot say."


def verdict_reply(text: str, **kw: Any) -> Reply:
    return Reply(body=completion(text), **kw)


@contextmanager
def fake_grader(*script: int | Reply, default_text: str = VERDICTS["plain"]) -> Iterator[ScriptedLLM]:
    app = ScriptedLLM(*script, model=GRADER_MODEL, default=lambda request: verdict_reply(default_text))
    port = find_free_port()
    config = uvicorn.Config(
        app, host=LOOPBACK, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=0.2
    )
    with serving_uvicorn(uvicorn.Server(config)):
        app.base_url = f"http://{LOOPBACK}:{port}/v1"
        yield app


def judge_settings(grader: ScriptedLLM, tmp_path, **overrides: Any) -> JudgeSettings:
    values = {
        "backend": "openai",
        "grader_url": grader.base_url,
        "grader_model": GRADER_MODEL,
        "cache_path": tmp_path / "cache.sqlite",
        "upstream_backoff_seconds": 0.01,
        "upstream_backoff_max_seconds": 2.0,
        "grpc_port": None,
        **overrides,
    }
    return load_settings(JudgeSettings, **values)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def grade(judge, response: str = RESPONSE, correct: str = "Quillan V8 engine"):
    return await judge.grade_answer(QUESTION, response, correct)


@pytest.mark.parametrize("variant", ["plain", "bold_inside", "bold_outside"])
def test_llm_verdicts_in_every_markdown_variant_parse_to_the_captured_value(tmp_path, variant):
    with fake_grader(default_text=VERDICTS[variant]) as grader:
        _, _, judge = build(judge_settings(grader, tmp_path))
        v = run(grade(judge))
    assert (v.correct, v.extracted_final_answer, v.parse_error, v.method) == (
        True,
        "the Quillan V8",
        False,
        "llm",
    )
    assert v.confidence == 85 and v.grader_version == f"browsecomp-answer-v1/{GRADER_MODEL}"
    [chat] = grader.chats
    prompt = chat["json"]["messages"][0]["content"]
    assert QUESTION in prompt and RESPONSE in prompt and "Quillan V8 engine" in prompt


def test_an_exact_match_skips_the_grader(tmp_path):
    with fake_grader() as grader:
        _, _, judge = build(judge_settings(grader, tmp_path))

        async def scenario():
            v = await grade(judge, "Exact Answer: 1,738\nConfidence: 70%", "1738")
            assert (v.correct, v.method, v.grader_version) == (True, "exact", "exact-v1")
            assert grader.chats == []
            other = await grade(judge, response="Exact Answer: the Quillan V6", correct="Quillan V8")
            assert other.method == "llm" and len(grader.chats) == 1  # no exact match: the grader decides

        run(scenario())


def test_unparseable_answers_are_asked_again_then_an_explicit_parse_error_that_is_not_cached(tmp_path):
    garbage = [verdict_reply(GARBAGE) for _ in range(3)]
    with fake_grader(*garbage, verdict_reply(GARBAGE), verdict_reply(VERDICTS["no"])) as grader:
        _, _, judge = build(judge_settings(grader, tmp_path))

        async def scenario():
            v = await grade(judge)
            assert (v.correct, v.parse_error, len(grader.chats)) == (None, True, 3)
            again = await grade(judge)  # not cached: asked again; one more garbage, then a verdict
            assert (again.correct, again.parse_error, again.cached, len(grader.chats)) == (
                False,
                False,
                False,
                5,
            )
            cached = await grade(judge)
            assert (cached.correct, cached.cached, len(grader.chats)) == (False, True, 5)

        run(scenario())
        m = metrics_of(judge)
        assert m[("bcstack_judge_parse_errors_total", (("grader", "answer"),))] == 4
        key = (
            "bcstack_judge_verdicts_total",
            (("grader", "answer"), ("method", "llm"), ("outcome", "parse_error")),
        )
        assert m[key] == 1


def test_429_with_retry_after_and_500s_are_retried(tmp_path):
    with fake_grader(Reply(429, headers={"Retry-After": "1"}), 500, 502) as grader:
        _, _, judge = build(judge_settings(grader, tmp_path))
        t0 = time.monotonic()
        v = run(grade(judge))
        assert v.correct is True and len(grader.chats) == 4
        assert time.monotonic() - t0 >= 1.0  # Retry-After honoured
        m = metrics_of(judge)
        assert m[("bcstack_judge_upstream_retries_total", (("kind", "rate_limited"),))] == 1
        assert m[("bcstack_judge_upstream_retries_total", (("kind", "server_error"),))] == 2


def test_a_hanging_or_down_grader_is_a_clear_error_never_a_verdict_and_the_breaker_opens(tmp_path):
    hang = [verdict_reply(VERDICTS["plain"], delay=5) for _ in range(2)]
    with fake_grader(*hang, *[500] * 10) as grader:
        settings = judge_settings(
            grader,
            tmp_path,
            grader_timeout_seconds=0.3,
            upstream_attempts=2,
            breaker_failures=4,
            breaker_reset_seconds=60,
        )
        app, _, judge = build(settings)
        body = {"question": QUESTION, "response": RESPONSE, "correct_answer": "Quillan V8 engine"}

        async def scenario():
            with pytest.raises(GraderUnavailable, match="grader endpoint 'grader': timeout"):
                await grade(judge)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://judge") as c:
                down = await c.post("/v1/grade", json=body)
                assert down.status_code == 503 and "HTTP 500 after 2 attempts" in down.json()["error"]
                assert "correct" not in down.json()
                calls = len(grader.chats)  # 2 hangs + 2 x 500: the breaker (4 failures) is now open
                fast = await c.post("/v1/grade", json=body)
                assert fast.status_code == 503 and "circuit breaker open" in fast.json()["error"]
                assert len(grader.chats) == calls  # no request reached the grader

        run(scenario())
        m = metrics_of(judge)
        assert m[("bcstack_judge_breaker_state", (("state", "open"),))] == 1
        assert m[("bcstack_judge_upstream_errors_total", (("kind", "timeout"),))] == 2


def test_the_concurrency_cap_and_the_rate_limit_hold(tmp_path):
    def timed(grader, **limits):
        _, _, judge = build(judge_settings(grader, tmp_path / str(limits), **limits))

        async def scenario():
            t0 = time.monotonic()
            verdicts = await asyncio.gather(
                *(grade(judge, response=f"Exact Answer: engine {i}") for i in range(20))
            )
            assert all(v.correct for v in verdicts)
            return time.monotonic() - t0

        return run(scenario())

    with fake_grader() as grader:
        grader.default = lambda request: verdict_reply(VERDICTS["plain"], delay=0.1)
        timed(grader, max_concurrent_upstream=3, rate_limit_per_second=1000)
        assert len(grader.chats) == 20 and grader.max_in_flight == 3  # never more than the cap
    with fake_grader() as grader:  # instant answers: only the rate limit can slow 20 calls down
        seconds = timed(grader, max_concurrent_upstream=50, rate_limit_per_second=10)
        assert len(grader.chats) == 20 and seconds >= 0.9  # a burst of 10, then 10 per second


def test_contribution_grades_on_the_documented_scale(tmp_path):
    script = [verdict_reply("contribution: **Substantial**\nreasoning: it found the founder.")]
    script += [verdict_reply(GARBAGE)] * 3
    with fake_grader(*script) as grader:
        _, _, judge = build(judge_settings(grader, tmp_path))

        async def scenario():
            v = await judge.grade_contribution(
                QUESTION, "find the founder", "The founder is Ada Karvo.", "X", "Y"
            )
            assert (v.score, v.label, v.parse_error, v.method) == (0.75, "substantial", False, "llm")
            assert v.grader_version == f"browsecomp-contribution-v1/{GRADER_MODEL}"
            bad = await judge.grade_contribution(QUESTION, "another task", "nothing", "X", "Y")
            assert (bad.score, bad.parse_error) == (0.0, True)

        run(scenario())


def metrics_of(judge) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest

    return _parse(generate_latest(judge.metrics.registry).decode())


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# --- the real process ------------------------------------------------------------------------------


@contextmanager
def judge_process(tmp_path, *args: str, env: dict[str, str] | None = None):
    http, grpc_port = find_free_port(), find_free_port()
    cmd = [
        "serve",
        "judge",
        "--port",
        str(http),
        "--grpc-port",
        str(grpc_port),
        "--cache-path",
        str(tmp_path / "c.db"),
    ]
    with bcstack_process([*cmd, *args], f"http://{LOOPBACK}:{http}/health", env=env) as proc:
        yield {
            "http": f"http://{LOOPBACK}:{http}",
            "grpc": f"{LOOPBACK}:{grpc_port}",
            "proc": proc,
            "cmd": cmd,
        }


def test_rule_backend_over_http_and_grpc_with_batches_and_bad_input(tmp_path):
    with judge_process(tmp_path) as j:
        url = j["http"]
        ok = httpx.post(
            f"{url}/v1/grade",
            json={"question": QUESTION, "response": RESPONSE, "correct_answer": "Quillan V8"},
        )
        assert ok.status_code == 200 and ok.json()["correct"] is True and ok.json()["confidence"] == 85
        wrong = httpx.post(
            f"{url}/v1/grade",
            json={
                "question": QUESTION,
                "response": "Exact Answer: Quillan V6",
                "correct_answer": "Quillan V8",
            },
        ).json()
        assert (wrong["correct"], wrong["method"], wrong["grader_version"]) == (False, "rule", "rule-v1")
        batch = httpx.post(
            f"{url}/v1/grade/batch",
            json={
                "items": [
                    {"response": f"Exact Answer: {n}", "correct_answer": "42"} for n in (42, 43, "42.0")
                ]
            },
        ).json()
        assert [i["correct"] for i in batch["items"]] == [True, False, True]
        contribution = httpx.post(
            f"{url}/v1/grade/contribution",
            json={
                "task": "t",
                "report": "answer: Quillan V8",
                "final_answer": "Quillan V8",
                "gold_answer": "Quillan V8",
            },
        ).json()
        assert (contribution["label"], contribution["score"]) == ("decisive", 1.0)
        for bad in (
            {"response": "x"},
            {"response": "x", "correct_answer": ""},
            {"response": "x", "correct_answer": "y", "z": 1},
        ):
            assert httpx.post(f"{url}/v1/grade", json=bad).status_code == 422
        huge = httpx.post(
            f"{url}/v1/grade/batch", json={"items": [{"response": "a", "correct_answer": "a"}] * 513}
        )
        assert huge.status_code == 422

        with grpc.insecure_channel(j["grpc"]) as channel:
            stub = judge_pb2_grpc.JudgeServiceStub(channel)
            r = stub.GradeAnswer(
                judge_pb2.GradeAnswerRequest(
                    question=QUESTION, response=RESPONSE, correct_answer="Quillan V8"
                )
            )
            assert r.HasField("correct") and r.correct and r.method == "exact"
            many = stub.BatchGradeContribution(
                judge_pb2.BatchGradeContributionRequest(
                    items=[
                        judge_pb2.GradeContributionRequest(report=rep, final_answer="A", gold_answer="B")
                        for rep in ("B!", "A", "C")
                    ]
                )
            )
            assert [i.label for i in many.items] == ["decisive", "marginal", "none"]
            with pytest.raises(grpc.RpcError) as err:
                stub.GradeAnswer(judge_pb2.GradeAnswerRequest(response="x"))
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "correct_answer" in err.value.details()
            )
        m = _parse(httpx.get(f"{url}/metrics").text)
        assert (
            m[
                (
                    "bcstack_judge_verdicts_total",
                    (("grader", "answer"), ("method", "rule"), ("outcome", "incorrect")),
                )
            ]
            >= 2
        )


def test_cache_coalesces_100_identical_requests_survives_a_restart_and_never_leaks_the_key(tmp_path):
    # The grader holds its answer until all 100 client calls have been sent and a second has passed
    # (at most 30 s), so the 99 that are not the first find its call in flight however loaded the
    # machine is: a fixed delay let the first finish before the last arrived on a busy CI runner.
    sent: list[float] = []

    def all_sent() -> bool:
        return len(sent) == 100 and time.monotonic() - sent[-1] >= 1.0 or time.monotonic() - sent[0] > 30

    held = lambda request: verdict_reply(VERDICTS["plain"], until=all_sent)  # noqa: E731
    with fake_grader(Reply(401, body={"error": {"message": f"bad key {KEY}"}})) as grader:
        grader.default = held
        env = {
            "GRADER_KEY": KEY,
            "BCSTACK_JUDGE_GRADER_API_KEY_ENV": "GRADER_KEY",
            "BCSTACK_JUDGE_BACKEND": "openai",
        }
        args = ["--grader-url", grader.base_url, "--grader-model", GRADER_MODEL]
        body = {"question": QUESTION, "response": RESPONSE, "correct_answer": "Quillan V8 engine"}
        with judge_process(tmp_path, *args, env=env) as j:
            # the first call is refused with a 401 that echoes the key: a clear error, no key in it
            refused = httpx.post(f"{j['http']}/v1/grade", json={**body, "question": "other"}, timeout=30)
            assert refused.status_code == 503 and KEY not in refused.text and "HTTP 401" in refused.text
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
            with httpx.Client(timeout=60, limits=limits) as client, cf.ThreadPoolExecutor(100) as pool:

                def grade(_: int) -> httpx.Response:
                    sent.append(time.monotonic())
                    return client.post(f"{j['http']}/v1/grade", json=body)

                answers = list(pool.map(grade, range(100)))
            assert {a.status_code for a in answers} == {200} and {a.json()["correct"] for a in answers} == {
                True
            }
            assert len(grader.chats) == 2  # the refused one + exactly one for the 100 identical requests
            m = _parse(httpx.get(f"{j['http']}/metrics").text)
            assert m[("bcstack_judge_cache_requests_total", (("grader", "answer"), ("result", "miss")))] == 1
            hits = m[("bcstack_judge_cache_requests_total", (("grader", "answer"), ("result", "hit")))]
            coalesced = m[
                ("bcstack_judge_cache_requests_total", (("grader", "answer"), ("result", "coalesced")))
            ]
            assert (hits, coalesced) == (0, 99)
            metrics_text = httpx.get(f"{j['http']}/metrics").text
            log_text = j["proc"].log()
        assert all(c["headers"]["authorization"] == f"Bearer {KEY}" for c in grader.chats)  # it was sent
        assert KEY not in metrics_text and KEY not in log_text
        with judge_process(tmp_path, *args, env=env) as j:  # a restart: the verdict is on disk
            again = httpx.post(f"{j['http']}/v1/grade", json=body, timeout=30).json()
            assert again["cached"] is True and again["correct"] is True
            assert len(grader.chats) == 2
            assert KEY not in j["proc"].log()


def test_serve_judge_openai_without_a_url_is_a_clear_error(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bcstack",
            "serve",
            "judge",
            "--backend",
            "openai",
            "--port",
            "0",
            "--cache-path",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "grader_url" in result.stderr and "Traceback" not in result.stderr
    assert json.dumps(result.stderr)  # one readable line
