"""The ranker (spec/rmb.md §3.4) on a clock moved by hand, and `--ranker-priors` files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rmb_relay.errors import ConfigError
from rmb_relay.federation.priors import load_priors
from rmb_relay.federation.ranker import Ranker
from tests.rmb_fixtures import FakeClock


def test_fewest_recent_failures_first() -> None:
    clock = FakeClock()
    ranker = Ranker(3600, clock=clock)
    for _ in range(3):
        ranker.downvote("bad.example")
    ranker.downvote("meh.example")
    assert ranker.rank(["bad.example", "meh.example", "good.example"]) == [
        "good.example",
        "meh.example",
        "bad.example",
    ]
    assert ranker.rate("bad.example") == 3.0  # failures per hour over a one-hour window


def test_rate_is_per_hour_whatever_the_window() -> None:
    ranker = Ranker(1800, clock=FakeClock())
    ranker.downvote("a")
    assert ranker.rate("a") == 2.0


def test_ties_are_broken_at_random() -> None:
    ranker = Ranker(3600, clock=FakeClock(), rng=random.Random(7))
    orders = {tuple(ranker.rank(["a", "b", "c"])) for _ in range(200)}
    assert len(orders) == 6  # every permutation shows up: equal relays share the load


def test_failures_outside_the_window_are_forgotten() -> None:
    clock = FakeClock()
    ranker = Ranker(60, clock=clock)
    ranker.downvote("a")
    clock.advance(30)
    ranker.downvote("a")
    ranker.downvote("b")
    assert ranker.rank(["a", "b"]) == ["b", "a"]
    clock.advance(31)  # the first failure of a is now older than the window
    assert ranker.failures("a") == 1
    clock.advance(30)  # and now every failure is
    assert (ranker.failures("a"), ranker.failures("b")) == (0, 0)
    assert ranker.snapshot() == {}


def test_priors_order_domains_without_recent_failures() -> None:
    ranker = Ranker(3600, clock=FakeClock(), priors={"flaky": 0.3, "solid": 0.01})
    assert ranker.rank(["flaky", "solid", "unknown"]) == ["unknown", "solid", "flaky"]


def test_live_failures_outrank_priors() -> None:
    ranker = Ranker(3600, clock=FakeClock(), priors={"flaky": 0.3, "solid": 0.01})
    ranker.downvote("solid")
    assert ranker.rank(["solid", "flaky"]) == ["flaky", "solid"]
    assert ranker.snapshot() == {"flaky": (0, 0.0), "solid": (1, 1.0)}


def test_period_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--ranker-period"):
        Ranker(0)


# ---- --ranker-priors -----------------------------------------------------------------------


def test_priors_from_json(tmp_path: Path) -> None:
    path = tmp_path / "priors.json"
    path.write_text(json.dumps({"r1.grid.tf": 0.25, "r2.grid.tf": 0}))
    assert load_priors(path) == {"r1.grid.tf": 0.25, "r2.grid.tf": 0.0}


def test_priors_from_parquet(tmp_path: Path) -> None:
    path = tmp_path / "priors.parquet"
    table = pa.table({"domain": ["r1.grid.tf", "r2.grid.tf"], "failure_rate": [0.5, 0.125]})
    pq.write_table(table, path)
    assert load_priors(path) == {"r1.grid.tf": 0.5, "r2.grid.tf": 0.125}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[1, 2]", "JSON must be an object"),
        (b"not json", "neither Parquet nor JSON"),
        (b'{"r1.grid.tf": "high"}', "is not a number"),
        (b'{"r1.grid.tf": -1}', "is negative"),
        (b'{"r1.grid.tf": true}', "is not a number"),
        (b'{"bad domain!": 0.1}', "bad domain!"),
    ],
)
def test_bad_priors_json_is_a_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "priors.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="--ranker-priors") as caught:
        load_priors(path)
    assert message in str(caught.value)


def test_priors_from_the_analytics_table(tmp_path: Path) -> None:
    """The analytics plane's federation_priors table: remote, attempts, failures, failure_rate."""
    path = tmp_path / "federation_priors.parquet"
    table = pa.table(
        {"remote": ["r1.grid.tf"], "attempts": [8], "failures": [2], "failure_rate": [0.25]}
    )
    pq.write_table(table, path)
    assert load_priors(path) == {"r1.grid.tf": 0.25}


def test_parquet_without_the_columns_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "priors.parquet"
    pq.write_table(pa.table({"relay": ["r1"], "rate": [0.1]}), path)
    with pytest.raises(ConfigError, match="lacks column"):
        load_priors(path)


def test_missing_priors_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_priors(tmp_path / "absent.json")
