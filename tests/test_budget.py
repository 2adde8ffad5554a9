"""`ByteBudget` (budget.py): the books every in-memory store keeps, refusing with the limit hit
and charging nothing when it refuses."""

from __future__ import annotations

import pytest

from rmb_relay.budget import BudgetExceeded, ByteBudget


def test_key_budget_refuses_and_charges_nothing() -> None:
    budget = ByteBudget(key_bytes=100, total_bytes=1000)
    budget.take("a", 60)
    with pytest.raises(BudgetExceeded) as info:
        budget.take("a", 41)
    err = info.value
    assert (err.limit, err.key, err.size, err.held, err.allowed) == ("key", "a", 41, 60, 100)
    assert "key budget" in str(err)
    assert "'a'" in str(err)
    assert budget.held == 60
    assert budget.held_by("a") == 60
    assert budget.refused == {"count": 0, "key": 1, "total": 0}
    # exactly up to the limit fits; another key has its own
    budget.take("a", 40)
    budget.take("b", 100)
    assert budget.held == 200


def test_total_budget_spans_keys() -> None:
    budget = ByteBudget(key_bytes=100, total_bytes=150)
    budget.take("a", 100)
    assert not budget.try_take("b", 51)
    with pytest.raises(BudgetExceeded) as info:
        budget.take("b", 51)
    assert (info.value.limit, info.value.held, info.value.allowed) == ("total", 100, 150)
    assert "in all" in str(info.value)
    assert budget.try_take("b", 50)
    assert budget.held == 150


def test_count_is_checked_first_and_only_when_items_are_added() -> None:
    budget = ByteBudget(key_bytes=100, total_bytes=100, key_count=2)
    budget.take(1, 10, 1)
    budget.take(1, 10, 1)
    with pytest.raises(BudgetExceeded) as info:
        budget.take(1, 1000, 1)  # over every limit: the count is named
    assert (info.value.limit, info.value.held, info.value.allowed) == ("count", 2, 2)
    budget.take(1, 10)  # more bytes for an existing item: no count check
    assert budget.count_of(1) == 2


def test_release_forgets_empty_keys_and_refuses_what_is_not_held() -> None:
    budget = ByteBudget(key_bytes=100, total_bytes=1000, key_count=5)
    budget.take("a", 30, 1)
    budget.take("b", 20)
    budget.release("a", 10)
    assert budget.holders() == ["a", "b"]
    assert budget.held_by("a") == 20
    budget.release("a", 20, 1)
    assert budget.holders() == ["b"]
    assert budget.held == 20
    assert len(budget) == 1
    with pytest.raises(ValueError, match="not held"):
        budget.release("b", 21)
    with pytest.raises(ValueError, match="not held"):
        budget.release("c", 1)
    assert budget.held == 20
    budget.release("b", 20)
    assert budget.held == 0
    assert not budget.holders()


def test_budgets_must_be_positive() -> None:
    for kwargs in (
        {"key_bytes": 0, "total_bytes": 1},
        {"key_bytes": 1, "total_bytes": 0},
        {"key_bytes": 1, "total_bytes": 1, "key_count": 0},
    ):
        with pytest.raises(ValueError, match="positive"):
            ByteBudget(**kwargs)  # type: ignore[arg-type]
