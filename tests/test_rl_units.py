"""The RL loop's pure parts: the sampler's order and resume, ids, weight versions and staleness."""

from __future__ import annotations

import pytest

from bcstack.evaluation.loaders import EvalQuestion
from bcstack.rl.rollouts import GroupRollout, version_index, weight_version
from bcstack.rl.sampler import Group, GroupSampler
from core.records import EpisodeRecord

QUESTIONS = [EvalQuestion(query_id=str(i), query=f"q{i}", answer=f"a{i}", tier=None) for i in range(5)]


def test_the_order_is_a_seeded_permutation_per_pass_and_resumes_where_it_stopped() -> None:
    sampler = GroupSampler(QUESTIONS, seed=3)
    first = [sampler.next().question.query_id for _ in range(12)]
    assert sorted(first[:5]) == sorted(first[5:10]) == [q.query_id for q in QUESTIONS]  # every pass: all
    assert first[:5] != first[5:10]  # each pass is shuffled anew (seed 3)
    again = GroupSampler(QUESTIONS, seed=3)
    half = [again.next().question.query_id for _ in range(7)]
    resumed = GroupSampler.restore(QUESTIONS, again.state())
    assert half + [resumed.next().question.query_id for _ in range(5)] == first
    assert resumed.group(2).question == GroupSampler(QUESTIONS, seed=3).group(2).question
    with pytest.raises(ValueError, match="resume with the same --questions"):
        GroupSampler.restore(QUESTIONS[:4], again.state())


def test_episode_ids_carry_the_run_generation_so_a_resume_never_reuses_one() -> None:
    group = Group(17, QUESTIONS[0])
    assert group.group_id == "g000017"
    assert group.episode_ids("rl-ab", 1, 2) == ["rl-ab.1-g000017-e0", "rl-ab.1-g000017-e1"]
    assert set(group.episode_ids("rl-ab", 2, 8)).isdisjoint(group.episode_ids("rl-ab", 1, 8))


def record(episode_id: str, versions: list[str]) -> EpisodeRecord:
    turns, ids, mask = [], [], []
    for v in versions:
        start = len(ids)
        ids += [1, 2, 3]
        mask += [0, 1, 1]
        turns.append({"prompt_start": start, "gen_start": start + 1, "gen_end": start + 3,
                      "generated_tokens": 2, "weight_version": v})  # fmt: skip
    trajectory = {"token_ids": ids, "loss_mask": mask, "rollout_logprobs": [-0.5] * sum(mask),
                  "turns": turns, "stop_reason": "finish"}  # fmt: skip
    return EpisodeRecord.load({"episode_id": episode_id, "workers": [{"trajectory": trajectory}]})


def test_a_group_is_as_old_as_its_oldest_turn_and_an_unknown_version_is_stale() -> None:
    assert weight_version(4) == "rl-u4" and version_index("rl-u4") == 4 and version_index("default") is None
    g = Group(0, QUESTIONS[0])
    spanning = GroupRollout(g, 5, [record("e0", ["rl-u5", "rl-u6"]), record("e1", ["rl-u6"])])
    assert spanning.oldest_version() == 5
    foreign = GroupRollout(g, 5, [record("e0", ["default"])])
    assert foreign.oldest_version() == -1
    assert GroupRollout(g, 5, []).oldest_version() == 5


def test_zero_variance_is_about_the_trainable_rewards() -> None:
    g = Group(0, QUESTIONS[0])
    assert GroupRollout(g, 0, [], rewards={"a": 1.0, "b": 1.0}).zero_variance
    assert not GroupRollout(g, 0, [], rewards={"a": 1.0, "b": 0.0}).zero_variance


def test_a_config_file_gives_the_settings_and_names_a_misspelt_one(tmp_path) -> None:
    from typer.testing import CliRunner

    from bcstack.cli import app

    config = tmp_path / "rl.yaml"
    config.write_text("max-policy-lag: 0\ngrups: 2\n")
    result = CliRunner().invoke(app, ["train", "rl", "--config", str(config)])
    assert result.exit_code == 2
    assert "unknown setting 'grups'" in result.output and "did you mean groups?" in result.output
    config.write_text("- a list\n")
    result = CliRunner().invoke(app, ["train", "rl", "--config", str(config)])
    assert result.exit_code == 2 and "expected a mapping of option names" in result.output
