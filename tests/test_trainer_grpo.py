"""`bcstack train grpo` (trainer/grpo.py) on records of real episodes, and the update on hand-made samples.

The module fixture starts the local stack with the untrained tiny worker and runs 4 episodes in 2
groups. Those episodes are all wrong (every reward and contribution is 0, so every advantage is 0
and the only gradient is the KL term's, which is 0 while policy == reference): the command is
checked for its bookkeeping there, and the learning signal is checked on samples with hand-set
rewards, and through the grader hook on the stack's records (its grades decide which rise).
"""

from __future__ import annotations

import dataclasses
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from fixtures_pg import pg_server, pg_url  # noqa: F401 (fixtures)
from safetensors.torch import load_file
from typer.testing import CliRunner

from bcstack.stack import down, up
from core.checkpoint import verify_checkpoint
from core.records import EpisodeRecord
from trainer.checkpoint import load_model_state
from trainer.cli import app
from trainer.data import Sample, load_samples
from trainer.grpo import (
    EpisodeGrades,
    GradedEpisode,
    grpo_step,
    load_policy,
    load_reference,
    make_optimizer,
    sample_credit,
    train,
)
from trainer.packing import pack, per_token_logprobs

# This module's stacks fork their services (conftest.forked_services).
pytestmark = pytest.mark.usefixtures("forked_services")

runner = CliRunner()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, toy_kit: dict) -> dict[str, Path]:
    state = tmp_path_factory.mktemp("grpo") / "stack"
    quiet = lambda _line: None  # noqa: E731
    kit = toy_kit["dir"]  # the session's world, tiny model and index (conftest.toy_kit)
    info = up(state, worker="tiny", world=kit / "world", kit=kit / "tiny", index=kit / "idx", say=quiet)
    try:
        gateway = info["services"]["coordinator"]["http"]
        lines = (kit / "world" / "questions.jsonl").read_text().splitlines()
        questions = [json.loads(line) for line in lines]

        def episode(group: int) -> httpx.Response:
            question = questions[group]
            return httpx.post(
                f"{gateway}/v1/episodes",
                json={
                    "question": question["query"],
                    "question_id": str(question["query_id"]),
                    "gold_answer": question["answer"],
                    "group_id": f"group-{group}",
                    "worker_budget": {"max_tokens": 600, "max_turns": 2},
                    "overrides": {"max_branches": 1},
                },
                timeout=120,
            )

        # All four at once: the engine decodes them in one batch (4 s here, where one by one took 19 s).
        with ThreadPoolExecutor(4) as pool:
            for response in pool.map(episode, [0, 0, 1, 1]):
                assert response.status_code == 200, response.text
    finally:
        down(state, say=quiet)
    return {"records": state / "records.sqlite", "tiny": kit / "tiny"}


def grpo(*args: str | Path):
    return runner.invoke(app, ["grpo", *map(str, args)])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_step_on_stack_records_then_resume(stack: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = ("--records", stack["records"], "--model", stack["tiny"], "--ref", stack["tiny"], "--out", out)
    result = grpo(*common)
    assert result.exit_code == 0, result.output
    assert "4 episodes, 4 worker trajectories" in result.stdout and "step 1/1  loss" in result.stdout

    [step] = metrics(out)
    assert step["step"] == 1 and step["samples"] == 4 and step["groups"] == 2 and step["lr"] == 1e-6
    assert all(math.isfinite(step[k]) for k in ("loss", "pg_loss", "kl", "grad_norm", "tokens_per_second"))
    assert step["reward_mean"] == 0.0 and step["advantage_min"] == step["advantage_max"] == 0.0
    assert abs(step["kl"]) < 1e-9  # policy == reference
    # The engine generated with these weights: trainer and engine log-probs agree, TIS weights are ~1.
    assert step["tis_clip_fraction"] == 0.0 and step["logp_rollout_abs_diff"] < 1e-3
    assert step["ratio_mean"] == pytest.approx(1.0) and step["ppo_clip_fraction"] == 0.0

    # Weights moved (weight decay only here: the gradient is 0), and only slightly at LR 1e-6.
    before = load_file(stack["tiny"] / "model.safetensors")
    after = load_model_state(out / "checkpoints" / "step-00000001")
    diffs = [float((after[k] - v).abs().max()) for k, v in before.items()]
    assert max(diffs) > 0 and max(diffs) < 1e-5
    verify_checkpoint(out / "serving")

    again = grpo(*common)
    assert again.exit_code == 2 and "error: " in again.stderr and "--resume" in again.stderr

    resumed = grpo(*common, "--resume", "--steps", "2")
    assert resumed.exit_code == 0, resumed.output
    assert "(step 1)" in resumed.stdout and "step 2/2" in resumed.stdout and "step 1/" not in resumed.stdout
    assert [m["step"] for m in metrics(out)] == [1, 2]
    assert (out / "checkpoints" / "step-00000002").is_dir()
    verify_checkpoint(out / "serving")


def test_one_step_from_the_gateways_postgresql_store(
    stack: dict[str, Path],
    pg_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`--records postgresql://...`: the records are snapshotted to OUT/records.sqlite, then trained on
    as from a file; the password never printed."""
    from core.record_store import SqliteRecordStore, open_record_store

    url = pg_url
    with SqliteRecordStore(stack["records"]) as source, open_record_store(url) as target:
        for record in source.iter_records():
            target.put(record)
    out = tmp_path / "run"
    result = grpo("--records", url, "--model", stack["tiny"], "--ref", stack["tiny"], "--out", out)
    assert result.exit_code == 0, result.output
    assert "4 record(s) from postgresql://bcstack@127.0.0.1:" in result.stdout
    password = url.split("://", 1)[1].split("@")[0].split(":")[1]
    assert password not in result.output
    [step] = metrics(out)
    assert step["samples"] == 4 and step["groups"] == 2
    with SqliteRecordStore(out / "records.sqlite") as snapshot:
        assert snapshot.count() == 4


def test_the_grader_hooks_rewards_decide_which_trajectories_the_step_raises(
    stack: dict[str, Path], tmp_path: Path
) -> None:
    """Two stand-in judges grade the same records opposite ways (the first, then the second episode
    of each group correct): after one step under each, the trajectories that judge rewarded have
    gained log-prob and the others lost it. The records' own rewards are all 0, so only the hook's
    grades can set the direction."""
    samples, _ = load_samples(stack["records"])
    base = load_policy(stack["tiny"])
    before = {s.episode_id: _generated_logprob(base, s) for s in samples}
    first_of_group = {}
    for s in samples:
        first_of_group.setdefault(s.group_id, s.episode_id)
    assert len(first_of_group) == 2 and len(samples) == 4

    for winner in ("first", "second"):

        def grader(record: EpisodeRecord, winner: str = winner) -> EpisodeGrades:
            first = first_of_group[record.group_id] == record.episode_id
            return EpisodeGrades(reward=1.0 if first == (winner == "first") else 0.0, contributions={})

        out = tmp_path / winner
        [step] = train(stack["records"], stack["tiny"], stack["tiny"], out, grader=grader, lr=1e-3)
        assert step["reward_mean"] == 0.5 and step["advantage_max"] > 0 > step["advantage_min"]
        policy = load_policy(stack["tiny"])
        policy.load_state_dict(load_model_state(out / "checkpoints" / "step-00000001"))
        for s in samples:
            rewarded = (first_of_group[s.group_id] == s.episode_id) == (winner == "first")
            change = _generated_logprob(policy, s) - before[s.episode_id]
            assert (change > 0) == rewarded and change != 0, (winner, s.episode_id, rewarded, change)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no records", "no episode records at"),
        ("empty", "no episode records"),
        ("no gold", "have no gold_answer (episodes "),
        ("no model", "not a model folder"),
        ("not json", "not a JSON episode record"),
    ],
)
def test_bad_input_is_one_error_line(stack: dict[str, Path], tmp_path: Path, case: str, message: str) -> None:
    records, model = stack["records"], stack["tiny"]
    if case == "no records":
        records = tmp_path / "missing.jsonl"
    elif case == "empty":
        records = tmp_path / "empty.jsonl"
        records.write_text("")
    elif case == "no gold":
        from core.record_store import SqliteRecordStore

        with SqliteRecordStore(stack["records"]) as store:
            record = store.get(store.list(limit=1)[0]["episode_id"])
        records = tmp_path / "nogold.jsonl"
        records.write_text(json.dumps({**record, "gold_answer": None}) + "\n")
    elif case == "no model":
        model = tmp_path / "nowhere"
    else:
        records = tmp_path / "bad.jsonl"
        records.write_text("{not json\n")
    result = grpo("--records", records, "--model", model, "--ref", stack["tiny"], "--out", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --- the update on hand-made samples ---------------------------------------------------------------


def _generated_logprob(model: torch.nn.Module, sample: Sample) -> float:
    with torch.no_grad():
        logp = per_token_logprobs(model, pack([sample], [0]))[0]
    return float((logp * torch.tensor(sample.loss_mask)).sum())


def test_the_update_raises_the_rewarded_answer_and_lowers_the_other(stack: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack["tiny"])
    policy, ref = load_policy(stack["tiny"]), load_reference(stack["tiny"])
    prompt = tokenizer.encode("In which city was the astronomer born? Answer:")

    def sample(episode: str, answer: str, reward: float) -> Sample:
        generated = tokenizer.encode(f" {answer}")
        draft = Sample(
            token_ids=prompt + generated,
            loss_mask=[0] * len(prompt) + [1] * len(generated),
            rollout_logprobs=[0.0] * (len(prompt) + len(generated)),
            group_id="q",
            episode_id=episode,
            worker_episode_id=f"{episode}.w0",
            question_id="q",
            episode_reward=reward,
            contribution=None,
            weight_versions=(),
        )
        # What the engine would have reported: the model's own log-probs of the generated tokens.
        with torch.no_grad():
            rollout = per_token_logprobs(policy, pack([draft], [0]))[0] * torch.tensor(draft.loss_mask)
        return Sample(**{**draft.__dict__, "rollout_logprobs": rollout.tolist()})

    right, wrong = sample("e1", "Drowouklust harbour city", 1.0), sample("e2", "Paris by the river", 0.0)
    also_wrong = dataclasses.replace(wrong, episode_id="e3", worker_episode_id="e3.w0")
    samples = [right, wrong, also_wrong]
    episodes = [GradedEpisode(s.episode_id, "q", s.episode_reward) for s in samples]
    credit = sample_credit(samples, episodes)
    assert credit[0].advantage > 0 > credit[1].advantage and {c.weight for c in credit} == {1.0}

    before = _generated_logprob(policy, right), _generated_logprob(policy, wrong)
    stats = grpo_step(policy, ref, make_optimizer(policy, lr=1e-3), samples, credit)
    after = _generated_logprob(policy, right), _generated_logprob(policy, wrong)

    assert stats["micro_batches"] == 1 and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert stats["tis_clip_fraction"] == 0.0 and abs(stats["kl"]) < 1e-9
    assert after[0] > before[0] and after[1] < before[1]
    # The reference stays frozen.
    assert _generated_logprob(ref, right) == pytest.approx(before[0], abs=1e-5)

    # Micro-batches of 2 and 1 samples accumulate the same loss and gradient as one batch of 3.
    fresh = load_policy(stack["tiny"])
    budget = len(right) + len(wrong)
    split = grpo_step(fresh, ref, make_optimizer(fresh, lr=1e-3), samples, credit, micro_batch_tokens=budget)
    assert split["micro_batches"] == 2
    for key in ("loss", "pg_loss", "grad_norm"):
        assert split[key] == pytest.approx(stats[key], rel=1e-4), key


def test_an_episode_without_trajectories_still_counts_in_its_group_baseline() -> None:
    lone = Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], "g", "e2", "e2.w0", "q", 0.0, None, ())
    [credit] = sample_credit([lone], [GradedEpisode("e1", "g", 1.0), GradedEpisode("e2", "g", 0.0)])
    # rewards (1, 0): A_episode(e2) = (0 − 0.5) / std(ddof=1) = −0.7071…; advantage = 0.5 · that
    assert credit.advantage == pytest.approx(-0.5 * 0.5 / math.sqrt(0.5), rel=1e-5)


def test_command_line_defaults_are_the_recipe() -> None:
    import typer

    import trainer.grpo as g

    defaults = {p.name: p.default for p in typer.main.get_command(app).commands["grpo"].params}
    # --lr has a default per mode: seed 000's AdamW 1e-6 (g.LR) for episode records, seed 004's
    # 1e-5 with --env (tests/test_specialist_units.py)
    assert defaults["lr"] is None and g.LR == 1e-6
    assert defaults["steps"] == 1 and defaults["grader"] == "rule"
    assert defaults["micro_batch_tokens"] == g.MICRO_BATCH_TOKENS
    assert defaults["groups_per_step"] == g.GROUPS_PER_STEP


# --- several optimizer steps per update ------------------------------------------------------------


def _toy_sample(group: str, episode: str, ids: list[int], reward: float) -> Sample:
    return Sample(ids, [0, 0] + [1] * (len(ids) - 2), [0.0] * len(ids), group, episode, f"{episode}.w0",
                  group, reward, None, ())  # fmt: skip


def test_mini_batches_hold_whole_groups_balanced_by_tokens() -> None:
    from trainer.grpo import GRPOError, mini_batches

    samples = [
        _toy_sample("a", "a1", [1] * 10, 1.0), _toy_sample("b", "b1", [1] * 3, 1.0),
        _toy_sample("a", "a2", [1] * 10, 0.0), _toy_sample("c", "c1", [1] * 4, 0.0),
        _toy_sample("b", "b2", [1] * 3, 0.0), _toy_sample("c", "c2", [1] * 4, 1.0),
    ]  # fmt: skip
    # Group tokens: a 20, b 6, c 8. Largest first to the lightest: a -> 0, c -> 1, b -> 1.
    assert mini_batches(samples, 2) == [[0, 2], [1, 3, 4, 5]]
    assert mini_batches(samples, 1) == [list(range(6))]
    # More mini-batches than groups: one per group, in order of first appearance.
    assert mini_batches(samples, 5) == [[0, 2], [1, 4], [3, 5]]
    with pytest.raises(GRPOError, match="at least 1"):
        mini_batches(samples, 0)


def test_several_steps_per_update_step_once_per_mini_batch_against_the_rollout_policy(toy_kit: dict) -> None:
    tiny = toy_kit["dir"] / "tiny"
    torch.manual_seed(0)
    vocab = load_policy(tiny).config.vocab_size
    samples = []
    for g in range(4):
        for e, reward in enumerate((1.0, 0.0)):
            ids = torch.randint(5, vocab, (24,)).tolist()
            samples.append(_toy_sample(f"g{g}", f"g{g}e{e}", ids, reward))
    ref = load_reference(tiny)
    credit = sample_credit(
        samples, [GradedEpisode(s.episode_id, s.group_id, s.episode_reward) for s in samples]
    )

    one = load_policy(tiny)
    whole = grpo_step(one, ref, make_optimizer(one, lr=1e-3), samples, credit)
    two = load_policy(tiny)
    optimizer = make_optimizer(two, lr=1e-3)
    snapshots: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_post_hook(
        lambda *_: snapshots.append({k: v.detach().clone() for k, v in two.state_dict().items()})
    )
    split = grpo_step(two, ref, optimizer, samples, credit, steps=2)

    assert (whole["optimizer_steps"], split["optimizer_steps"], len(snapshots)) == (1, 2, 2)
    # One step on the whole batch has ratio exactly 1; the second mini-batch is scored against the
    # policy before the first step (logp_old), so its ratio moves off 1.
    assert whole["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(split["ratio_mean"] - 1.0) > 1e-5
    # The first step is a one-step update on the first mini-batch alone.
    from trainer.grpo import mini_batches

    first = [samples[i] for i in mini_batches(samples, 2)[0]]
    alone = load_policy(tiny)
    grpo_step(
        alone, ref, make_optimizer(alone, lr=1e-3), first, [credit[i] for i in mini_batches(samples, 2)[0]]
    )
    for key, value in alone.state_dict().items():
        torch.testing.assert_close(snapshots[0][key], value, rtol=0, atol=1e-6)
    # Both steps count in the update's statistics, weighted like the one-step loss.
    assert split["samples"] == whole["samples"] and split["loss_tokens"] == whole["loss_tokens"]
    assert split["pg_loss"] == pytest.approx(whole["pg_loss"], abs=1e-6)


def test_the_vector_lr_scale_multiplies_the_lr_of_1d_parameters_only(toy_kit: dict) -> None:
    from trainer.grpo import GRPOError, set_lr

    policy = load_policy(toy_kit["dir"] / "tiny")
    optimizer = make_optimizer(policy, lr=1e-4, vector_lr_scale=50.0)
    matrices, vectors = optimizer.param_groups
    assert all(p.dim() >= 2 for p in matrices["params"]) and all(p.dim() == 1 for p in vectors["params"])
    assert (matrices["lr"], vectors["lr"]) == (pytest.approx(1e-4), pytest.approx(5e-3))
    assert (matrices["weight_decay"], vectors["weight_decay"]) == (0.1, 0.0)
    set_lr(optimizer, 2e-5)  # a new LR keeps each group's multiplier
    assert (matrices["lr"], vectors["lr"]) == (pytest.approx(2e-5), pytest.approx(1e-3))
    # One step moves a norm gain by about its group's LR (Adam's first step is lr x sign(g)).
    gain = next(p for n, p in policy.named_parameters() if n.endswith("norm.weight"))
    before = gain.detach().clone()
    gain.grad = torch.ones_like(gain)
    for p in matrices["params"]:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert (before - gain.detach()).abs().max() == pytest.approx(1e-3, rel=1e-3)
    assert make_optimizer(policy, lr=1e-4).param_groups[1]["lr"] == pytest.approx(1e-4)  # default: one LR
    with pytest.raises(GRPOError, match="vector LR scale"):
        make_optimizer(policy, vector_lr_scale=0.0)
