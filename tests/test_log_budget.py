"""log_budget.py: a flood of one log message is cut to its rate, the lines left out are
counted and named on the next line written; errors always pass (record times, no clock)."""

from __future__ import annotations

import logging

import pytest

from rmb_relay import log_budget
from rmb_relay.log_budget import LogBudget


def _record(msg: str, at: float, level: int = logging.INFO) -> logging.LogRecord:
    record = logging.LogRecord("rmb_relay.server", level, __file__, 1, msg, ("10.0.0.1",), None)
    record.created = at
    return record


def test_a_flood_of_one_message_is_cut_to_its_rate() -> None:
    budget = LogBudget(rate=2.0)  # bursts of 20
    before = log_budget.suppressed()
    passed = [budget.filter(_record("refused %s", 100.0)) for _ in range(50)]
    assert passed.count(True) == 20
    assert log_budget.suppressed() - before == 30
    # another message has a budget of its own; errors are never cut
    assert budget.filter(_record("other %s", 100.0))
    assert all(budget.filter(_record("refused %s", 100.0, logging.ERROR)) for _ in range(5))
    # a second later two lines are back; the first says how many were left out
    later = _record("refused %s", 101.0)
    assert budget.filter(later)
    assert later.getMessage() == "refused 10.0.0.1 (30 more like this left out before)"
    again = _record("refused %s", 101.0)
    assert budget.filter(again)
    assert again.getMessage() == "refused 10.0.0.1"
    assert not budget.filter(_record("refused %s", 101.0))


def test_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--log-rate"):
        LogBudget(rate=0)
