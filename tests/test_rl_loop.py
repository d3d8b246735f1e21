"""`bcstack train rl` end to end on the CPU: a `bcstack up` stack with the untrained tiny model and
the rule judge, three updates synchronous and asynchronous, judge faults, and kill -9 at each phase
followed by --resume.

An untrained worker never answers, so every episode of a group would end alike and every group
would have zero reward variance. The coordinator LLM is therefore swapped at runtime (the gateway's
`PUT /admin/coordinator`) for a stand-in speaking the OpenAI API: it branches once, then finishes
with the gold answer on a question's odd-numbered episodes and a wrong one on the even ones, so each
group of two has one reward of 1 and one of 0 and the worker trajectories get real advantages.
For the fault test a second judge grades with an LLM grader stand-in that returns garbage."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from conftest import find_free_port, wait_until
from fake_openai import Reply, ScriptedLLM, completion, serving_uvicorn
from stack_util import bcstack_process

from bcstack.stack import down, up
from trainer.checkpoint import load_model_state

REQUIRED = (
    "update",
    "weight_version",
    "reward_mean",
    "accuracy",
    "zero_variance_groups",
    "excluded_episodes",
    "dropped_stale",
    "policy_lag_max",
    "kl",
    "rollout_tokens_per_s",
    "train_tokens_per_s",
    "reload_seconds",
)
# Small on purpose: 2 groups x 2 episodes per update, one branch per question, 2-turn workers.
SMALL = [
    "--groups", "2", "--group-size", "2", "--worker-max-tokens", "640", "--worker-max-turns", "2",
    "--max-branches", "1", "--judge-attempts", "2",
]  # fmt: skip


def coordinator_turn(request: dict[str, Any], golds: dict[str, str], seen: dict[str, int]) -> Reply:
    """Branch once; then finish, right on a question's odd-numbered episodes and wrong on the others."""
    messages = request["messages"]
    question = next(m["content"] for m in messages if m["role"] == "user")
    if not any("[Worker Report]" in m["content"] for m in messages if m["role"] == "user"):
        return Reply(body=completion(
            "<function=branch>\n<parameter=description>Answer the question</parameter>\n"
            f"<parameter=prompt>{question}</parameter>\n</function>"
        ))  # fmt: skip
    gold = next((a for q, a in golds.items() if q in question), "unknown")
    n = seen[question] = seen.get(question, 0) + 1
    answer = gold if n % 2 else "certainly not " + gold
    return Reply(body=completion(
        f"<function=finish>\n<parameter=answer>{answer}</parameter>\n"
        "<parameter=explanation>The worker says so [1].</parameter>\n"
        "<parameter=confidence>50%</parameter>\n</function>"
    ))  # fmt: skip


def garbage_grader(request: dict[str, Any]) -> Reply:
    """A grader LLM that answers a third of the prompts (by a hash) with something unparseable."""
    prompt = request["messages"][-1]["content"]
    if int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 3 == 0:
        return Reply(body=completion("I cannot decide."))
    if "correct:" in prompt:
        return Reply(body=completion("extracted_final_answer: x\nreasoning: r\ncorrect: no\nconfidence: 50"))
    return Reply(body=completion("contribution: partial\nreasoning: it searched"))


@pytest.fixture(scope="module")
def rl_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    state = root / "stack"
    info = up(
        state,
        worker="tiny",
        docs=600,
        questions_per_tier=3,
        train_questions=(30, 20),
        dense="none",
        say=lambda _m: None,
    )
    golds = {
        q["query"]: q["answer"]
        for q in map(json.loads, (state / "world" / "train.jsonl").read_text().splitlines())
    }
    seen: dict[str, int] = {}
    coordinator = ScriptedLLM(model="stand-in", default=lambda r: coordinator_turn(r, golds, seen))
    grader = ScriptedLLM(model="grader", default=garbage_grader)
    ports = {name: find_free_port() for name in ("coordinator", "grader", "judge")}

    def server(app: ScriptedLLM, port: int) -> uvicorn.Server:
        return uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="error")
        )

    token = (state / "admin-token").read_text().strip()
    try:
        with (
            serving_uvicorn(server(coordinator, ports["coordinator"])),
            serving_uvicorn(server(grader, ports["grader"])),
            bcstack_process(
                ["serve", "judge", "--backend", "openai", "--grader-url",
                 f"http://127.0.0.1:{ports['grader']}/v1", "--grader-model", "grader",
                 "--port", str(ports["judge"])],
                f"http://127.0.0.1:{ports['judge']}/health",
            ),
        ):  # fmt: skip
            swap = httpx.put(
                info["services"]["coordinator"]["http"] + "/admin/coordinator",
                headers={"Authorization": f"Bearer {token}"},
                json={
                    "endpoint": {
                        "name": "stand-in",
                        "base_url": f"http://127.0.0.1:{ports['coordinator']}/v1",
                        "model": "stand-in",
                    },
                    "activate": "stand-in",
                },
                timeout=30,
            )
            assert swap.status_code == 200, swap.text
            yield {
                "state": state,
                "judge": info["services"]["judge"]["http"],
                "garbage_judge": f"http://127.0.0.1:{ports['judge']}",
            }
    finally:
        down(state, say=lambda _m: None)


def train_rl(
    stack: dict, out: str, *args: str, env: dict[str, str] | None = None, timeout: float = 400, ranks: int = 1
):
    """`bcstack train rl` on the stack; with `ranks` > 1 under `torchrun --nproc_per_node RANKS` (gloo)."""
    state = stack["state"]
    launcher = [sys.executable, "-m", "bcstack"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", str(ranks), "-m", "bcstack"]
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
    command = [
        *launcher, "train", "rl", "--state", str(state), "--judge", stack["judge"],
        "--questions", str(state / "world" / "train.jsonl"), "--model", str(state / "tiny"),
        "--ref", str(state / "tiny"), "--out", str(state / "train" / out), *SMALL, *args,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def served_version(stack: dict) -> str:
    info = json.loads((stack["state"] / "stack.json").read_text())["services"]
    return httpx.get(info["engine"]["http"] + "/get_model_info", timeout=10).json()["weight_version"]


def episode_records(stack: dict, ids: list[str]) -> list[dict[str, Any]]:
    gateway = json.loads((stack["state"] / "stack.json").read_text())["services"]["coordinator"]["http"]
    return [httpx.get(f"{gateway}/v1/episodes/{i}", timeout=10).json() for i in ids]


# The asynchronous run is also the torchrun one: two ranks at tp=2, rank 0 running the loop (issue 16).
@pytest.mark.parametrize(("lag", "ranks"), [(0, 1), (1, 2)])
def test_three_updates_train_reload_and_respect_the_staleness_bound(
    rl_stack: dict, lag: int, ranks: int
) -> None:
    out = rl_stack["state"] / "train" / f"lag{lag}"
    extra = [] if lag == 0 else [
        "--eval-every", "3", "--eval-questions", str(rl_stack["state"] / "world" / "questions.jsonl"),
        "--report-to", "tensorboard",
    ]  # fmt: skip
    if ranks > 1:
        extra += ["--tp", str(ranks)]
    done = train_rl(
        rl_stack, f"lag{lag}", "--updates", "3", "--max-policy-lag", str(lag), *extra, ranks=ranks
    )
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((out / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert state["layout"] == {"dp": 1, "tp": ranks}
    metrics = lines(out / "metrics.jsonl")
    if lag:
        # A held-out round on the current weights after update 3, with its Wilson interval, and the
        # same numbers in TensorBoard's event files.
        last = metrics[-1]
        assert last["eval_questions"] == 9 and 0 <= last["eval_wilson_low"] <= last["eval_wilson_high"] <= 1
        assert (out / "eval" / "u000003" / "judgements.jsonl").is_file()
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [m["update"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert set(REQUIRED) <= set(m), set(REQUIRED) - set(m)
        assert m["policy_lag_max"] <= lag
        assert m["weight_version"] == f"rl-u{m['update']}"
        # One right and one wrong answer per group: no zero-variance group, a real gradient.
        assert m["reward_mean"] == 0.5 and m["zero_variance_groups"] == 0
        assert m["grad_norm"] > 1e-4
    # The policy moved: the last checkpoint's weights differ from the tiny model it started from.
    trained = load_model_state(out / "checkpoints" / "step-00000003")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(rl_stack["state"] / "tiny").state_dict()
    assert any(not torch.equal(trained[k].float(), base[k].float()) for k in base if k in trained)
    # Every worker serves the last update's weights, and the episodes record the versions they ran on.
    assert served_version(rl_stack) == "rl-u3"
    updates = lines(out / "updates.jsonl")
    for row in updates:
        trained_at = row["update"] - 1  # the policy version the update started from
        for record in episode_records(rl_stack, row["trained_episode_ids"]):
            versions = [
                t["weight_version"]
                for w in record["workers"]
                if w["trajectory"]
                for t in w["trajectory"]["turns"]
            ]
            assert versions, record["episode_id"]
            for v in versions:
                assert v.startswith("rl-u")
                assert trained_at - lag <= int(v.removeprefix("rl-u")) <= trained_at
    all_ids = [i for row in updates for i in row["episode_ids"]]
    assert len(all_ids) == len(set(all_ids)) == 3 * 2 * 2


def test_judge_parse_errors_exclude_episodes_and_a_dead_judge_stops_the_run(rl_stack: dict) -> None:
    garbage = {**rl_stack, "judge": rl_stack["garbage_judge"]}
    config = rl_stack["state"] / "faults.yaml"  # settings from a file; flags on the command line win
    config.write_text("updates: 1\nmax-policy-lag: 0\ngroups: 3\n")
    done = train_rl(garbage, "faults", "--config", str(config), "--groups", "4")
    (m,) = lines(rl_stack["state"] / "train" / "faults" / "metrics.jsonl")
    assert done.returncode == 0, done.stdout + done.stderr
    assert m["excluded_episodes"] > 0 and m["graded_episodes"] + m["excluded_episodes"] == 4 * 2
    assert m["graded_episodes"] > 0

    dead = {**rl_stack, "judge": f"http://127.0.0.1:{find_free_port()}"}
    done = train_rl(dead, "dead-judge", "--updates", "1", "--max-policy-lag", "0")
    assert done.returncode != 0
    assert "did not grade after 2 tries" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    assert lines(rl_stack["state"] / "train" / "dead-judge" / "metrics.jsonl") == []


def test_a_time_limit_stops_after_the_update_in_progress_and_resume_continues(rl_stack: dict) -> None:
    out = rl_stack["state"] / "train" / "limited"
    done = train_rl(rl_stack, "limited", "--updates", "5", "--max-minutes", "0.001", "--max-policy-lag", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "time limit (0.001 min) reached at update 1" in done.stdout
    assert [m["update"] for m in lines(out / "metrics.jsonl")] == [1]
    assert (out / "checkpoints" / "step-00000001").is_dir() and (out / "exports" / "u000001").is_dir()
    done = train_rl(rl_stack, "limited", "--updates", "2", "--max-policy-lag", "0", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [m["update"] for m in lines(out / "metrics.jsonl")] == [1, 2]

    bad = train_rl(rl_stack, "limited-bad", "--max-minutes", "0")
    assert bad.returncode != 0 and "--max-minutes must be > 0" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr

    # Dynamic sampling where no group can carry a signal (one episode per group): it gives up after
    # 8 x --groups such groups with one error line, instead of sampling forever.
    starved = train_rl(
        rl_stack, "starved", "--updates", "1", "--max-policy-lag", "0", "--groups", "1", "--group-size", "1",
        "--dynamic-sampling", "--negative-advantage-scale", "0.5",
    )  # fmt: skip
    assert starved.returncode != 0
    said = starved.stdout + starved.stderr
    assert "dynamic sampling left out 8 groups whose rewards were all equal" in said
    assert "Traceback" not in starved.stderr


def test_kill_9_at_any_phase_then_resume_applies_no_update_twice(rl_stack: dict) -> None:
    out = rl_stack["state"] / "train" / "crash"
    for phase, update in (("rollouts", 2), ("update", 3), ("export", 3), ("reload", 4)):
        done = train_rl(
            rl_stack, "crash", "--updates", "4", "--max-policy-lag", "1", "--resume",
            env={"BCSTACK_RL_CRASH_AT": f"{phase}:{update}"},
        )  # fmt: skip
        assert done.returncode == -signal.SIGKILL, (phase, done.stdout + done.stderr)
        assert max((m["update"] for m in lines(out / "metrics.jsonl")), default=0) == update - 1
    done = train_rl(rl_stack, "crash", "--updates", "4", "--max-policy-lag", "1", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = lines(out / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    assert sum(m["discarded_inflight"] for m in metrics) > 0  # the async producer had groups in flight
    trained = [i for row in lines(out / "updates.jsonl") for i in row["episode_ids"]]
    assert len(trained) == len(set(trained)) == 4 * 2 * 2
    assert served_version(rl_stack) == "rl-u4"
    assert json.loads((out / "run.json").read_text())["generation"] == 5


def test_a_worker_replica_that_dies_costs_its_episodes_not_the_run(rl_stack: dict) -> None:
    """Two worker replicas behind a second gateway; one is SIGKILLed after the first update: the
    gateway moves its branches to the other, its reload fails and is counted, the run goes on."""
    state = rl_stack["state"]
    info = json.loads((state / "stack.json").read_text())["services"]
    token = (state / "admin-token").read_text().strip()
    http, grpc_port, gateway_port, gateway_grpc = (find_free_port() for _ in range(4))
    env = {"BCSTACK_ADMIN_TOKEN": token}
    second = bcstack_process(
        ["serve", "worker", "--tokenizer", str(state / "tiny"), "--engine-url", info["engine"]["http"],
         "--retrieval", info["retrieval"]["grpc"], "--checkpoint-root", str(state / "train"),
         "--port", str(http), "--grpc-port", str(grpc_port)],
        f"http://127.0.0.1:{http}/health", env=env,
    )  # fmt: skip
    with second as replica:
        gateway = bcstack_process(
            ["serve", "coordinator", "--coordinator-url", info["coordinator-llm"]["http"] + "/v1",
             "--workers", f"{info['worker']['grpc']},127.0.0.1:{grpc_port}",
             "--records", str(state / "records-two-replicas.sqlite"),
             "--port", str(gateway_port), "--grpc-port", str(gateway_grpc)],
            f"http://127.0.0.1:{gateway_port}/health", env=env,
        )  # fmt: skip
        with gateway:
            out = state / "train" / "replica-dies"
            command = [
                sys.executable, "-m", "bcstack", "train", "rl", "--gateway", f"http://127.0.0.1:{gateway_port}",
                "--judge", rl_stack["judge"], "--workers", f"{info['worker']['http']},http://127.0.0.1:{http}",
                "--questions", str(state / "world" / "train.jsonl"), "--model", str(state / "tiny"),
                "--ref", str(state / "tiny"), "--out", str(out), "--updates", "2", "--max-policy-lag", "0",
                *SMALL,
            ]  # fmt: skip
            run = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, **env},
            )  # fmt: skip
            wait_until(lambda: lines(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else [],
                       timeout=300, message="the first update")  # fmt: skip
            replica.kill()
            output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output
    metrics = lines(out / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2], (metrics, output)
    assert [m["reload_failed_replicas"] for m in metrics] == [0, 1], (metrics, output)
    assert metrics[1]["graded_episodes"] == 4, (metrics, output)  # every episode ran, on the survivor
    assert f"reload of http://127.0.0.1:{http}" in output
