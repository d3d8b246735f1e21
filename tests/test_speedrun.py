"""`make speedrun`'s short version: every stage of bcstack/speedrun.py through the live stack on a
world of a few questions — expert collection, gate rows, the copy stage, SFT, three evaluations and
one RL update after SFT — and the report it writes. The full run (about an hour) is a command, not a test;
here SFT's loss falling is the sign that training trained.

The speedrun is a process forked from one that has imported it (tests/stack_util.py `bcstack_forked`),
and so is every process it starts: its three stacks' services and its `bcstack index|records|train`
commands, the same commands as `make speedrun` runs, fork from a forkserver of the speedrun's own
(`forked_children`). As new `python -m bcstack` processes their imports were most of this test's CPU
(160 s of CPU in all, measured with bench/suite_cpu.py); tests/test_eval_stack.py starts a stack's
services as `bcstack up` does outside the tests.
"""

from __future__ import annotations

import json

from stack_util import bcstack_forked

from trainer.sinks import read_metrics


def test_the_speedrun_runs_every_stage_and_reports_three_rows(tmp_path):
    state = tmp_path / "speedrun"
    result = bcstack_forked(
        ["--state", str(state), "--docs", "400",
         "--questions-per-tier", "1", "--train-easy", "12", "--rl-easy", "4", "--train-medium", "0",
         "--train-hard", "0",
         "--hidden-size", "32", "--layers", "1", "--copy-steps", "4", "--sft-epochs", "1", "--sft-batch", "4",
         "--rl-updates", "1", "--rl-minutes", "5", "--rl-groups", "1", "--rl-group-size", "2",
         "--concurrency", "4",
         "--eval-rounds", "2", "--no-rl-dynamic-sampling", "--replicas", "2", "--rl-steps-per-update", "2",
         "--rl-loss-aggregation", "token-sum", "--eval-seed", "3", "--eval-seed-check", "--final"],
        module="bcstack.speedrun", timeout=600, forked_children=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "snippet_words=24" in out  # the observation settings are stated
    # RL asks 4 easy questions that the expert never answered and SFT never saw.
    sft_questions, rl_questions = (
        {
            json.loads(line)["query_id"]
            for line in (state / f"{name}-questions.jsonl").read_text().splitlines()
        }
        for name in ("sft", "rl")
    )
    assert (len(sft_questions), len(rl_questions)) == (12, 4) and not sft_questions & rl_questions
    records = (state / "expert-records.jsonl").read_text().splitlines()
    collected = {json.loads(line)["question_id"] for line in records}
    assert collected == sft_questions
    assert "(75% of rows: toy text)" in out
    kit = json.loads((state / "kit" / "bcstack_model.json").read_text())
    assert kit["tokenizer"]["number_digits"] == 4 and kit["model"]["shape"]["hidden_size"] == 32
    assert "| Untrained tiny |" in out and "| SFT |" in out and "| SFT + RL |" in out
    assert "exact McNemar p" in out

    report = json.loads((state / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["Untrained tiny", "SFT", "SFT + RL"]
    # With --final every evaluation reads the test split, never a dev question (without it: dev).
    assert (report["split"], report["world_seed"], report["train_seed"]) == ("test", 0, 0)
    # Passed on to train rl, whose first line names its recipe.
    assert report["settings"]["args"]["rl_loss_aggregation"] == "token-sum"
    assert "negative advantages x 0, token-sum loss over " in out
    # How each stage's rounds agree: the untrained model had one round (no line), SFT and RL two.
    rounds = [s["round_consistency"]["all"]["rounds"] for s in report["stages"]]
    assert rounds == [1, 2, 2] and "SFT: Over the rounds of each question (up to 2)" in out
    assert "Untrained tiny: Over the rounds" not in out
    assert "evaluating on the test split (questions.jsonl)" in out

    def ids(path):
        return {json.loads(line)["query_id"] for line in path.read_text().splitlines()}

    dev_ids, test_ids = ids(state / "world" / "dev.jsonl"), ids(state / "world" / "questions.jsonl")
    for stage in ("untrained", "sft", "rl", "rl-gold", "rl-other-seeds"):
        judged = ids(state / f"eval-test-{stage}" / "judgements.jsonl")
        assert judged == test_ids and not judged & dev_ids
    assert not list(state.glob("eval-dev-*"))
    # The table's evaluations withheld the gold answer from the workers; the RL model was evaluated
    # once more with it sent, and the report gives the paired difference.
    assert report["worker_gold"] is False and "withheld from the workers" in out
    gold = report["worker_gold_comparison"]
    assert gold["n"] == 6 and gold["baseline"] == "SFT + RL, no gold to workers"
    assert all(set(s["guard"]) == {"bounced", "voided"} for s in report["stages"])
    assert "The gold bit, measured once" in out
    # --eval-seed 3: every evaluation seeded from 3 (common random numbers across the stages); the
    # check evaluated the RL model again with seed 4 and puts the paired tests side by side.
    seeds = {stage: json.loads((state / f"eval-test-{stage}" / "eval.json").read_text())["seed"]
             for stage in ("untrained", "sft", "rl", "rl-gold", "rl-other-seeds")}  # fmt: skip
    assert seeds == {"untrained": 3, "sft": 3, "rl": 3, "rl-gold": 3, "rl-other-seeds": 4}
    coupling = report["seed_coupling"]
    assert (report["eval_seed"], coupling["seed"], coupling["other_seed"]) == (3, 3, 4)
    assert coupling["coupled"]["n"] == coupling["independent"]["n"] == coupling["rl_against_itself"]["n"] == 6
    assert "One seed for both models (--eval-seed 3)" in out
    # --eval-rounds 2: the SFT and RL models answer each question twice, the untrained one once.
    assert [s["total"] for s in report["stages"]] == [3, 6, 6]
    for stage in report["stages"]:
        assert set(stage["tiers"]) == {"easy", "medium", "hard"}
        assert 0 <= stage["wilson_95"][0] <= stage["wilson_95"][1] <= 1
    assert [(p["this"], p["baseline"]) for p in report["paired"]] == [
        ("SFT", "Untrained tiny"),
        ("SFT + RL", "SFT"),
    ]
    sft_vs_untrained, rl_vs_sft = report["paired"]
    assert sft_vs_untrained["n"] == 3 and sft_vs_untrained["by_question"] is None  # round 0 in common
    assert rl_vs_sft["n"] == 6 and rl_vs_sft["by_question"]["questions"] == 3
    assert "By question (3 questions, 2–2 rounds each)" in out
    assert {
        "world",
        "collect",
        "copy",
        "sft",
        "eval untrained",
        "eval sft",
        "rl",
        "eval rl",
        "eval rl, other guard",
        "eval rl, other seeds",
    } <= set(report["seconds"])
    assert (state / "speedrun.png").stat().st_size > 10_000

    # SFT ran on the expert's records and the gate rows, balanced, and exported a serving checkpoint.
    mixture = json.loads((state / "sft" / "mixture.json").read_text())
    assert [s["name"] for s in mixture["sources"]] == ["core", "gate"]
    assert mixture["sources"][0]["rows"] == 12  # every expert episode answered its easy question
    assert (state / "sft" / "serving" / "SHA256SUMS").is_file()
    sft = read_metrics(state / "sft")
    assert len(sft) == mixture["steps"] >= 2
    # From a model that has seen 4 copy steps, every SFT step lowers the loss (8.37, 8.29, 8.25 here):
    # a step that did not train (no gradient, a wrong mask, LR 0) would leave it at ~ln(vocabulary).
    assert sft[-1]["loss"] < sft[0]["loss"] - 0.05, [m["loss"] for m in sft]
    # The report says how SFT fitted and how many RL groups had no advantage, from the runs' metrics.
    signal = report["training_signal"]
    assert signal["sft_steps"] == len(sft) and signal["sft_loss_window"] == 50
    whole = round(sum(m["loss"] for m in sft) / len(sft), 4)  # fewer than 50 steps: both windows
    assert signal["sft_loss_first"] == signal["sft_loss_last"] == whole
    assert len(signal["rl_equal_reward_groups"]) == 1 and "Training signal: SFT loss" in out
    # One RL update through the stack after SFT, the workers reloaded to it (no dynamic sampling: a
    # group of two episodes of this barely trained model may well have equal rewards).
    rl = read_metrics(state / "stack" / "train" / "rl")
    assert [m["update"] for m in rl] == [1] and rl[0]["weight_version"] == "rl-u1"
    assert "for 1 update (at most 5 minutes)" in out  # --rl-updates 1 stopped it, not the minutes
    # --rl-steps-per-update 2 on a one-group update: one mini-batch, so one step.
    assert rl[0]["optimizer_steps"] == 1
    # Every stack of the run had two worker replicas, and RL reloaded both.
    assert "runs 2 worker replicas" in out


def test_rl_questions_are_a_seeded_set_of_easy_and_medium_questions_sft_never_sees(tmp_path):
    import pytest

    from bcstack.speedrun import split_train
    from bcstack.stack import StackError
    from devkit.toyworld.generator import generate_world, write_world

    write_world(
        generate_world(600, 1, questions_per_tier=1, train_easy=20, train_medium=3, train_hard=3), tmp_path
    )
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    ids = lambda qs: [q["query_id"] for q in qs]  # noqa: E731

    sft, rl = split_train(tmp_path, {"easy": 5}, {"easy"}, seed=0)
    assert len(rl) == 5 and {q["data_source"] for q in rl} == {"bc_train_easy"}
    assert sorted(ids(sft) + ids(rl)) == sorted(ids(rows)) and not set(ids(sft)) & set(ids(rl))
    assert split_train(tmp_path, {"easy": 5}, {"easy"}, seed=0) == (sft, rl)  # deterministic
    assert ids(split_train(tmp_path, {"easy": 5}, {"easy"}, seed=1)[1]) != ids(rl)
    # Other tiers in --rl-tiers add their SFT questions; --rl-easy 0 is RL on SFT's easy questions.
    _, with_medium = split_train(tmp_path, {"easy": 5}, {"easy", "medium"}, seed=0)
    medium = [q["query_id"] for q in rows if q["data_source"] == "bc_train_meduim"]
    assert len(medium) == 3 and sorted(ids(with_medium)) == sorted(ids(rl) + medium)
    sft_all, rl_all = split_train(tmp_path, {"easy": 0}, {"easy"}, seed=0)
    assert ids(sft_all) == ids(rows) and len(rl_all) == 20
    with pytest.raises(StackError, match="more than the world's 20 easy"):
        split_train(tmp_path, {"easy": 21}, {"easy"}, seed=0)
    # --rl-medium 2: two medium questions kept for RL alone, and RL no longer asks SFT's medium ones.
    sft_m, rl_m = split_train(tmp_path, {"easy": 5, "medium": 2}, {"easy", "medium"}, seed=0)
    held_medium = [q for q in rl_m if q["data_source"] == "bc_train_meduim"]
    assert len(held_medium) == 2 and set(ids(held_medium)) < set(medium)
    assert [q for q in rl_m if q["data_source"] == "bc_train_easy"] == rl  # easy's sample unchanged
    assert sorted(ids(sft_m) + ids(rl_m)) == sorted(ids(rows)) and not set(ids(sft_m)) & set(ids(rl_m))
    assert split_train(tmp_path, {"easy": 5, "medium": 2}, {"easy"}, seed=0) == (sft, rl)  # not an RL tier
    with pytest.raises(StackError, match="--rl-medium 4 is more than the world's 3 medium"):
        split_train(tmp_path, {"easy": 5, "medium": 4}, {"easy", "medium"}, seed=0)
    # --rl-hard 2 with hard among RL's tiers: two hard questions SFT never sees, the third stays SFT's.
    sft_h, rl_h = split_train(tmp_path, {"easy": 5, "hard": 2}, {"easy", "hard"}, seed=0)
    hard = [q for q in rows if q["data_source"] == "bc_train_hard"]
    held_hard = [q for q in rl_h if q["data_source"] == "bc_train_hard"]
    assert len(hard) == 3 and len(held_hard) == 2 and set(ids(held_hard)) < set(ids(hard))
    assert len([q for q in sft_h if q["data_source"] == "bc_train_hard"]) == 1
    assert sorted(ids(sft_h) + ids(rl_h)) == sorted(ids(rows)) and not set(ids(sft_h)) & set(ids(rl_h))


def test_the_training_signal_reads_sfts_first_and_last_steps_and_rls_equal_reward_groups():
    from bcstack.speedrun import render_table, training_signal

    sft = [{"step": i, "loss": 5.0 if i < 50 else 1.0 if i < 70 else 0.1} for i in range(120)]
    rl = [{"filtered_zero_variance": 22, "zero_variance_groups": 0}, {"filtered_zero_variance": 0,
          "zero_variance_groups": 3}, {"update": 3}]  # fmt: skip
    signal = training_signal(sft, rl)
    assert signal == {"sft_steps": 120, "sft_loss_first": 5.0, "sft_loss_last": 0.1, "sft_loss_window": 50,
                      "rl_equal_reward_groups": [22, 3, 0]}  # fmt: skip
    report = {"stages": [], "paired": [], "training_signal": signal}
    assert render_table(report).splitlines()[-1] == (
        "Training signal: SFT loss 5.0000 over its first 50 steps, 0.1000 over its last (120 steps); "
        "equal-reward groups per RL update: 22, 3, 0"
    )
    assert training_signal([], [])["sft_loss_last"] is None  # no SFT metrics: nothing to say


def test_a_negative_question_count_or_update_budget_is_refused_in_one_line(capsys):
    import pytest

    from bcstack.speedrun import main

    for option in ("--rl-medium", "--rl-updates", "--train-hard", "--rl-hard"):
        with pytest.raises(SystemExit) as exit_info:
            main([option, "-1"])
        assert exit_info.value.code == 2
        assert f"{option} must be 0 or more: -1" in capsys.readouterr().err


def test_the_seed_check_without_a_seed_is_refused_in_one_line(capsys):
    import pytest

    from bcstack.speedrun import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--eval-seed-check", "--eval-seed", "none"])
    assert exit_info.value.code == 2
    assert "--eval-seed-check compares two seed sets: give --eval-seed" in capsys.readouterr().err
