"""WorkerBudget at the exact boundaries of seed 001's limits (24,576 / 40 / 4,096 / 40,960)."""

from __future__ import annotations

import pytest

from core.budget import BudgetLimits, StopReason, TurnGrant, WorkerBudget


def test_seed_defaults():
    lim = BudgetLimits()
    assert (lim.max_tokens, lim.max_turns, lim.max_new_tokens_per_turn, lim.context_length) == (
        24_576,
        40,
        4_096,
        40_960,
    )


def test_max_new_tokens_is_min_of_cap_and_budget_left():
    b = WorkerBudget()
    assert b.start(1_000) is None
    assert b.before_turn() == TurnGrant(4_096)
    b.add_generation(4_096)
    assert b.add_observation(15_000) is None
    # used 20,096; left 4,480 > cap
    assert b.before_turn() == TurnGrant(4_096)
    assert b.add_observation(384) is None  # used 20,480; left exactly 4,096
    assert b.before_turn() == TurnGrant(4_096)
    assert b.add_observation(1) is None  # left 4,095 < cap
    assert b.before_turn() == TurnGrant(4_095)


def test_budget_spent_exactly_stops_with_budget():
    b = WorkerBudget()
    b.start(576)
    for _ in range(5):
        grant = b.before_turn()
        assert isinstance(grant, TurnGrant)
        b.add_generation(grant.max_new_tokens, grant)
        b.add_observation(0)
    assert b.tokens_used == 576 + 5 * 4_096 == 21_056
    grant = b.before_turn()
    assert grant == TurnGrant(3_520)
    b.add_generation(3_520, grant)
    assert b.tokens_used == 24_576
    assert b.before_turn() is StopReason.BUDGET


def test_observation_that_overflows_is_refused_and_not_counted():
    b = WorkerBudget()
    b.start(20_000)
    b.add_generation(4_000)
    assert b.add_observation(576) is None  # exactly at the budget: fits
    assert b.tokens_used == 24_576
    b2 = WorkerBudget()
    b2.start(20_000)
    b2.add_generation(4_000)
    assert b2.add_observation(577) is StopReason.BUDGET
    assert b2.tokens_used == 24_000  # the refused observation is not part of the trajectory


def test_turn_limit_41st_turn_never_starts():
    b = WorkerBudget()
    b.start(10)
    for _ in range(40):
        assert isinstance(b.before_turn(), TurnGrant)
        b.add_generation(1)
        b.add_observation(1)
    assert b.turns == 40
    assert b.before_turn() is StopReason.TURNS


def test_turns_reported_before_budget_when_both_bind():
    b = WorkerBudget(BudgetLimits(max_tokens=100, max_turns=1))
    b.start(10)
    b.add_generation(90)
    assert b.before_turn() is StopReason.TURNS


def test_context_limit_when_it_is_tighter_than_the_budget():
    b = WorkerBudget(BudgetLimits(max_tokens=50_000, context_length=40_960))
    b.start(36_000)
    assert b.before_turn() == TurnGrant(4_096)
    b.add_generation(4_096)
    assert b.add_observation(864) is None  # 40,960 exactly
    assert b.before_turn() is StopReason.CONTEXT
    b2 = WorkerBudget(BudgetLimits(max_tokens=50_000, context_length=40_960))
    b2.start(40_000)
    assert b2.before_turn() == TurnGrant(960)
    assert b2.add_observation(961) is StopReason.CONTEXT


def test_prompt_alone_over_a_limit():
    assert WorkerBudget().start(24_576) is StopReason.BUDGET
    assert WorkerBudget().start(24_575) is None
    assert WorkerBudget(BudgetLimits(max_tokens=99_999)).start(40_960) is StopReason.CONTEXT


def test_generation_beyond_the_grant_is_refused():
    b = WorkerBudget()
    b.start(24_000)
    grant = b.before_turn()
    assert grant == TurnGrant(576)
    with pytest.raises(ValueError, match="granted"):
        b.add_generation(577, grant)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_limits_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="positive integer"):
        BudgetLimits(max_tokens=bad)


def test_overrides():
    lim = BudgetLimits().with_overrides(max_turns=3, max_tokens=None)
    assert lim.max_turns == 3 and lim.max_tokens == 24_576
    with pytest.raises(ValueError, match="unknown"):
        BudgetLimits().with_overrides(tokens=5)
    with pytest.raises(ValueError):
        BudgetLimits().with_overrides(max_turns=0)


def test_negative_counts_are_refused():
    b = WorkerBudget()
    for fn in (b.start, b.add_generation, b.add_observation):
        with pytest.raises(ValueError):
            fn(-1)
