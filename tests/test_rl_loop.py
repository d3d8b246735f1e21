"""`bcstack train rl` end to end on the CPU: a `bcstack up` stack whose worker is the tiny model
SFT'd on one expert episode, with the stack's own scripted coordinator (it finishes with what its
worker reported) and rule judge; one update raises a correct trajectory the run never saw, two
updates synchronous and asynchronous (two ranks at tp=2), judge faults, time limits, kill -9 at
each phase followed by --resume, and a worker replica that dies.

The worker is SFT'd (80 steps) on two copies of one expert episode that differ only in the answer
they finish with: the gold one and another city of the world. Sampled at temperature 1 (the
worker's default) it follows the episode and writes either answer about half the time, so each
reward is the judge's verdict on the answer the worker itself wrote, and a group of a few episodes
usually holds both. The untrained tiny model never answers: every group would end alike.

Every `bcstack train rl` is forked from a process that has imported it (`stack_util.bcstack_forked`;
the two-rank one as two ranks with torchrun's environment, `stack_util.bcstack_ranks`: torchrun
itself is run in tests/test_trainer_distributed.py): a process of its own, exit status and SIGKILL
included, without the ~8 s of imports each. For the fault test a second judge grades with an LLM
grader stand-in that returns garbage for one of the run's two questions."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from conftest import find_free_port, wait_until
from fake_openai import Reply, ScriptedLLM, completion, serving_uvicorn
from stack_util import ForkedBcstack, bcstack_forked, bcstack_process, bcstack_ranks, warm_forkserver

from bcstack.stack import down, setting_flags, up
from core.records import EpisodeRecord
from trainer.checkpoint import load_model_state

# This module's stacks fork their services (conftest.forked_services).
pytestmark = pytest.mark.usefixtures("forked_services")

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
# Short observations keep the trajectories (~1,000 tokens) and so the training short; the expert
# stack and the RL stack use the same settings, so the SFT'd worker sees its training context again.
SETTINGS = {
    "snippet_words": "12", "page_words": "40", "max_topk": "3", "reflection_nudge": "false",
    "max_new_tokens_per_turn": "160", "max_turns": "4",
}  # fmt: skip
# The expert episode takes 3 turns and ~1,000 tokens; one branch per question.
BUDGET = [
    "--worker-max-tokens", "1400", "--worker-max-turns", "4", "--max-branches", "1", "--judge-attempts", "2",
]  # fmt: skip
SMALL = ["--groups", "2", "--group-size", "2", *BUDGET]  # 2 groups x 2 episodes per update
SFT_STEPS = 80
# Torch on one thread per process: the trainer runs beside the engine (and, under `make test
# PYTEST_WORKERS=2`, another module's processes) on two cores, where OpenMP's two threads spin at
# their barriers waiting for a core; measured here beside other load, 40 SFT steps took 12-47 s on
# two threads and 7-9 s on one.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def quiet(_line: str) -> None:
    pass


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """This process's torch on one thread for a while (ONE_THREAD's reason)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fixed_trajectories(record: dict[str, Any], wrong: str, tokenizer_dir: Path) -> dict[str, dict[str, list]]:
    """{"right", "wrong"}: the expert worker's token ids and loss mask, and the same with its final
    turn answering `wrong` instead of the gold answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    trajectory = record["workers"][0]["trajectory"]
    ids, mask = trajectory["token_ids"], trajectory["loss_mask"]
    start = trajectory["turns"][-1]["gen_start"]
    final = tokenizer.decode(ids[start:])
    gold = f"<parameter=answer>{record['gold_answer']}</parameter>"
    assert final.count(gold) == 1, final
    changed = final.replace(gold, f"<parameter=answer>{wrong}</parameter>")
    changed = tokenizer.encode(changed, add_special_tokens=False)
    return {
        "right": {"token_ids": ids, "loss_mask": mask},
        "wrong": {"token_ids": ids[:start] + changed, "loss_mask": mask[:start] + [1] * len(changed)},
    }


@pytest.fixture(scope="module")
def rl_stack(tmp_path_factory):
    """The world, one expert episode through an expert stack, the SFT, then the stack the RL runs use."""
    from trainer.sft import SFTConfig, train_sft
    from trainer.sft_data import SFTSample, SourceSpec, build_mixture

    warm_forkserver()  # its imports run while the stacks start
    root = tmp_path_factory.mktemp("rl")
    records = root / "expert" / "records.sqlite"
    expert = up(
        root / "expert", worker="expert", docs=400, questions_per_tier=3, train_questions=(0, 0),
        dense="none", worker_settings=SETTINGS, records=records, timeout=120, say=quiet,
    )  # fmt: skip
    assets = {name: Path(expert["assets"][name]) for name in ("world", "tiny", "index")}
    questions = [json.loads(line) for line in (assets["world"] / "questions.jsonl").read_text().splitlines()]
    # An easy question with a city for an answer, and another city of the world as the wrong one.
    train = next(q for q in questions if q["data_source"] == "bc_test_easy" and q["answer"].isalpha())
    wrong = next(a for a in (q["answer"] for q in questions) if a.isalpha() and a[0] != train["answer"][0])
    try:
        gateway = expert["services"]["coordinator"]["http"]
        body = {"question": train["query"], "question_id": train["query_id"], "gold_answer": train["answer"]}
        done = httpx.post(gateway + "/v1/episodes", json=body, timeout=60).json()
        assert done["answer"] == train["answer"], done
        record = httpx.get(f"{gateway}/v1/episodes/{done['episode_id']}", timeout=10).json()
    finally:
        down(root / "expert", say=quiet)
    fixed = fixed_trajectories(record, wrong, assets["tiny"])
    rows = tuple(
        SFTSample(tuple(t["token_ids"]), tuple(t["loss_mask"]), "expert", name) for name, t in fixed.items()
    )
    config = SFTConfig(
        lr=1e-2, min_lr=3e-3, warmup_fraction=0.05, weight_decay=0.0, global_batch=2,
        epochs=SFT_STEPS, checkpoint_every=10**6,
    )  # fmt: skip
    mixture = build_mixture({"expert": rows}, [SourceSpec("expert", records)])
    with one_torch_thread():
        train_sft(assets["tiny"], mixture, root / "sft", config=config, say=quiet)
    sft = root / "sft" / "serving"

    (root / "train.jsonl").write_text(json.dumps(train) + "\n")
    (root / "held-out.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions if q != train))
    state = root / "stack"
    info = up(
        state, worker=str(sft), world=assets["world"], kit=assets["tiny"], index=assets["index"],
        worker_settings=SETTINGS, timeout=120, say=quiet,
    )  # fmt: skip
    try:
        yield {
            "state": state,
            "judge": info["services"]["judge"]["http"],
            "sft": sft,
            "tokenizer": assets["tiny"],
            "questions": root / "train.jsonl",
            "held_out": root / "held-out.jsonl",
            "gold": train["answer"],
            "fixed": fixed,
        }
    finally:
        down(state, say=quiet)


def rl_args(stack: dict, out: str, *args: str) -> list[str]:
    state = stack["state"]
    return [
        "train", "rl", "--state", str(state), "--judge", stack["judge"],
        "--questions", str(stack["questions"]), "--model", str(stack["sft"]), "--ref", str(stack["sft"]),
        "--out", str(state / "train" / out),
        *SMALL, *args,
    ]  # fmt: skip


def train_rl(stack: dict, out: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    """`bcstack train rl` on the stack, forked (stack_util.bcstack_forked), on one OpenMP thread."""
    return bcstack_forked(rl_args(stack, out, *args), env={**ONE_THREAD, **(env or {})}, timeout=timeout)


def ranks_rl(stack: dict, out: str, *args: str, ranks: int, timeout: float = 300):
    """`bcstack train rl` as RANKS ranks joined as torchrun joins them (stack_util.bcstack_ranks, gloo)."""
    return bcstack_ranks(rl_args(stack, out, *args), ranks, env=ONE_THREAD, timeout=timeout)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def served_version(stack: dict) -> str:
    info = json.loads((stack["state"] / "stack.json").read_text())["services"]
    return httpx.get(info["engine"]["http"] + "/model_info", timeout=10).json()["weight_version"]


def episode_records(stack: dict, ids: list[str]) -> list[dict[str, Any]]:
    gateway = json.loads((stack["state"] / "stack.json").read_text())["services"]["coordinator"]["http"]
    return [httpx.get(f"{gateway}/v1/episodes/{i}", timeout=10).json() for i in ids]


def trajectory_logprob(model_dir: Path, checkpoint: Path | None, trajectory: dict[str, list]) -> float:
    """Sum of the log-probs of the trajectory's supervised tokens (its loss mask, as training masks
    them) under the model, or under the model with the trainer checkpoint's weights."""
    from trainer.data import Sample
    from trainer.grpo import load_policy
    from trainer.packing import pack, per_token_logprobs

    model = load_policy(model_dir)
    if checkpoint is not None:
        model.load_state_dict(load_model_state(checkpoint))
    ids, mask = trajectory["token_ids"], trajectory["loss_mask"]
    sample = Sample(ids, mask, [0.0] * len(ids), "g", "e", "e.w0", "q", 0.0, None, ())
    with torch.no_grad(), one_torch_thread():
        logp = per_token_logprobs(model, pack([sample], [0]))[0]
    return float((logp * torch.tensor(mask, dtype=logp.dtype)).sum())


def test_one_update_on_the_judges_grades_of_the_workers_answers_raises_a_correct_trajectory(
    rl_stack: dict,
) -> None:
    """Rollouts at temperature 1 through the gateway, graded by the stack's rule judge, one GRPO
    update: the log-prob of the expert's correct trajectory (held fixed: never a rollout of the run)
    gains on that of its copy with the wrong answer. Dynamic sampling keeps the one group
    to be trained a group with both verdicts, resampling a group that ended alike."""
    out = rl_stack["state"] / "train" / "learn"
    done = train_rl(
        rl_stack, "learn", "--updates", "1", "--max-policy-lag", "0", "--groups", "1", "--group-size", "4",
        "--dynamic-sampling", "--lr", "1e-4",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # Its log starts with the recipe it ran (the defaults for what was not given).
    assert (
        "1 group(s) of 4 episodes per update, 1 optimizer step(s) per update, LR 0.0001 (norm gains x 1), "
        "negative advantages x 1, sample-mean loss, rollout top-p 1, dynamic sampling on, policy lag up to 0"
    ) in done.stdout
    (m,) = lines(out / "metrics.jsonl")
    (row,) = lines(out / "updates.jsonl")
    # The rewards are the rule judge's verdicts on the answers the workers wrote: the coordinator
    # finished with its worker's reported answer, and the trained rewards average to the rule
    # grades of those records, some right and some wrong.
    from trainer.grpo import rule_grades

    records = [EpisodeRecord.load(r) for r in episode_records(rl_stack, row["trained_episode_ids"])]
    assert len(records) == 4
    for record in records:
        # Rollouts sample at top-p 1.0 (train rl --rollout-top-p): the engine's recorded log-probs are
        # those of the distribution sampled from; the gold answer reaches the guard as FoldAgent trains.
        assert (record.worker_sampling, record.worker_gold) == ({"top_p": 1.0}, True)
        (worker,) = record.workers
        assert worker.trajectory is not None, record.episode_id
        if worker.report.answer:  # a worker out of turns reports none (the structure is rarely missed)
            assert record.answer == worker.report.answer, record.episode_id
    grades = [rule_grades(r).reward for r in records]
    assert m["reward_mean"] == pytest.approx(sum(grades) / len(grades))
    assert 0 < m["reward_mean"] < 1 and m["zero_variance_groups"] == 0
    # Every sampled episode counts, the resampled groups' too: the worker is right about half the time.
    assert 0 < m["sampled_reward_mean"] < 1 and m["sampled_episodes"] == 4 * (1 + m["filtered_zero_variance"])
    assert m["sampled_token_nll"] > 0 and "entropy" not in m

    checkpoint = out / "checkpoints" / "step-00000001"
    fixed, sft = rl_stack["fixed"], rl_stack["sft"]
    right = trajectory_logprob(sft, None, fixed["right"]), trajectory_logprob(sft, checkpoint, fixed["right"])
    wrong = trajectory_logprob(sft, None, fixed["wrong"]), trajectory_logprob(sft, checkpoint, fixed["wrong"])
    # The two fixed trajectories differ only in the answer; the update moves the tokens they share
    # alike (by how long and how many the right and wrong rollouts were, which is the draw's), so
    # what the judge's rewards teach is the gap: the right answer gains on the wrong one.
    assert right[1] - wrong[1] > right[0] - wrong[0], (right, wrong)


# The asynchronous run is also the two-rank one: tp=2, rank 0 running the loop (issue 16).
@pytest.mark.parametrize(("lag", "ranks"), [(0, 1), (1, 2)])
def test_two_updates_train_reload_and_respect_the_staleness_bound(
    rl_stack: dict, lag: int, ranks: int
) -> None:
    out = rl_stack["state"] / "train" / f"lag{lag}"
    args = ["--updates", "2", "--max-policy-lag", str(lag)]
    if lag:
        args += [
            "--eval-every", "2", "--eval-questions", str(rl_stack["held_out"]), "--report-to", "tensorboard",
        ]  # fmt: skip
    if ranks > 1:
        done = ranks_rl(rl_stack, f"lag{lag}", *args, "--tp", str(ranks), ranks=ranks)
    else:
        done = train_rl(rl_stack, f"lag{lag}", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["layout"] == {"dp": 1, "tp": ranks}
    metrics = lines(out / "metrics.jsonl")
    if lag:
        # A held-out round on the current weights after update 2, with its Wilson interval, and the
        # same numbers in TensorBoard's event files.
        last = metrics[-1]
        assert last["eval_questions"] == 8 and 0 <= last["eval_wilson_low"] <= last["eval_wilson_high"] <= 1
        assert (out / "eval" / "u000002" / "judgements.jsonl").is_file()
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert [m["update"] for m in metrics] == [1, 2]
    for m in metrics:
        assert set(REQUIRED) <= set(m), set(REQUIRED) - set(m)
        assert m["policy_lag_max"] <= lag
        assert m["weight_version"] == f"rl-u{m['update']}"
        assert m["graded_episodes"] == 4 and 0 <= m["reward_mean"] <= 1
    # The policy moved: the last checkpoint's weights differ from the model it started from.
    trained = load_model_state(out / "checkpoints" / "step-00000002")
    from safetensors.torch import load_file

    base = load_file(rl_stack["sft"] / "model.safetensors")
    assert any(not torch.equal(trained[k].float(), base[k].float()) for k in base if k in trained)
    # Every worker serves the last update's weights, and the episodes record the versions they ran on.
    assert served_version(rl_stack) == "rl-u2"
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
    assert len(all_ids) == len(set(all_ids)) == 2 * 2 * 2


def garbage_grader(request: dict[str, Any], garbled: str) -> Reply:
    """A grader LLM that answers every prompt about the question `garbled` with something unparseable."""
    prompt = request["messages"][-1]["content"]
    if garbled in prompt:
        return Reply(body=completion("I cannot decide."))
    if "correct:" in prompt:
        return Reply(body=completion("extracted_final_answer: x\nreasoning: r\ncorrect: no\nconfidence: 50"))
    return Reply(body=completion("contribution: partial\nreasoning: it searched"))


def test_judge_parse_errors_exclude_episodes_and_a_dead_judge_stops_the_run(rl_stack: dict) -> None:
    # Two questions, so each pass over them asks both: the grader garbles every verdict on the
    # second, and grades the first (a right answer there is graded without it: the exact match).
    held_out = json.loads(rl_stack["held_out"].read_text().splitlines()[0])
    questions = rl_stack["state"] / "faults.jsonl"
    questions.write_text(rl_stack["questions"].read_text() + json.dumps(held_out) + "\n")
    grader = ScriptedLLM(model="grader", default=lambda r: garbage_grader(r, held_out["query"]))
    grader_port, judge_port = find_free_port(), find_free_port()
    server = uvicorn.Server(
        uvicorn.Config(grader, host="127.0.0.1", port=grader_port, lifespan="off", log_level="error")
    )
    with (
        serving_uvicorn(server),
        bcstack_process(
            ["serve", "judge", "--backend", "openai", "--grader-url", f"http://127.0.0.1:{grader_port}/v1",
             "--grader-model", "grader", "--cache-path", str(rl_stack["state"] / "garbage-judge.sqlite"),
             "--port", str(judge_port)],
            f"http://127.0.0.1:{judge_port}/health",
        ),
    ):  # fmt: skip
        garbage = {**rl_stack, "judge": f"http://127.0.0.1:{judge_port}", "questions": questions}
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
    """Update 1 commits; then update 2 is killed in each phase in turn, each run resuming the last."""
    out = rl_stack["state"] / "train" / "crash"
    for phase in ("rollouts", "update", "export", "reload"):
        done = train_rl(
            rl_stack, "crash", "--updates", "2", "--max-policy-lag", "1", "--resume",
            env={"BCSTACK_RL_CRASH_AT": f"{phase}:2"},
        )  # fmt: skip
        assert done.returncode == -signal.SIGKILL, (phase, done.stdout + done.stderr)
        assert max((m["update"] for m in lines(out / "metrics.jsonl")), default=0) == 1
    resumed_at = time.time()
    done = train_rl(rl_stack, "crash", "--updates", "2", "--max-policy-lag", "1", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    # The workers serve update 2 as this run trained it, not the export a killed run left behind
    # (the export and reload phases' kills each left a whole exports/u000002 of another update 2;
    # the resume prunes it, and `_publish` re-exports rather than reuse it).
    assert (out / "exports" / "u000002" / "SHA256SUMS").stat().st_mtime >= resumed_at
    metrics = lines(out / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2]
    assert metrics[1]["discarded_inflight"] > 0  # the async producer had groups in flight
    trained = [i for row in lines(out / "updates.jsonl") for i in row["episode_ids"]]
    assert len(trained) == len(set(trained)) == 2 * 2 * 2
    assert served_version(rl_stack) == "rl-u2"
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
        ["serve", "worker", "--tokenizer", str(rl_stack["tokenizer"]), "--engine-url", info["engine"]["http"],
         "--retrieval-address", info["retrieval"]["grpc"], "--checkpoint-root", str(state / "train"),
         *setting_flags("worker", SETTINGS),
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
            run = ForkedBcstack(
                ["train", "rl", "--gateway", f"http://127.0.0.1:{gateway_port}", "--judge", rl_stack["judge"],
                 "--workers", f"{info['worker']['http']},http://127.0.0.1:{http}",
                 "--questions", str(rl_stack["questions"]), "--model", str(rl_stack["sft"]),
                 "--ref", str(rl_stack["sft"]), "--out", str(out), "--updates", "2", "--max-policy-lag", "0",
                 *SMALL],
                env={**env, **ONE_THREAD},
            )  # fmt: skip
            wait_until(lambda: lines(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else [],
                       timeout=300, message="the first update")  # fmt: skip
            replica.kill()
            done = run.wait(timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    metrics = lines(out / "metrics.jsonl")
    assert [m["update"] for m in metrics] == [1, 2], (metrics, output)
    assert [m["reload_failed_replicas"] for m in metrics] == [0, 1], (metrics, output)
    assert metrics[1]["graded_episodes"] == 4, (metrics, output)  # every episode ran, on the survivor
    assert f"reload of http://127.0.0.1:{http}" in output


def test_the_settings_line_names_the_loss_aggregation_and_the_tokens_it_sums_over():
    from bcstack.rl.loop import RLConfig, settings_line

    common = dict(
        questions=[{"id": "q1"}, {"id": "q2"}], model=Path("m"), ref=Path("m"), out=Path("o"), gateway="g",
        judge="j", workers=["w"], admin_token="t", worker_budget={"max_tokens": 2941},
    )  # fmt: skip
    line = settings_line(RLConfig(**common, loss_aggregation="token-sum", rollout_top_p=None))
    assert line.startswith("RL settings: 2 questions, 8 group(s) of 8 episodes per update")
    assert "token-sum loss over 2941 tokens, rollout top-p the workers' own," in line
    assert "sample-mean loss, rollout top-p 1," in settings_line(RLConfig(**common))
