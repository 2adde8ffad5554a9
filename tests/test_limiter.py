"""Rate limiters with explicit times (the clock is always a parameter)."""

from __future__ import annotations

import pytest

from rmb_relay._core import ByteNanosLimiter, FixedWindowLimiter


def test_fixed_window_allows_count_then_refuses_until_next_window() -> None:
    limiter = FixedWindowLimiter(2, 1000, 60)
    assert limiter.check(7, 1, 60)
    assert limiter.check(7, 1, 61)
    assert not limiter.check(7, 1, 119)
    assert limiter.check(7, 1, 120)


def test_fixed_window_prunes_finished_windows() -> None:
    limiter = FixedWindowLimiter(2, 1000, 60)
    limiter.check(1, 1, 0)
    limiter.check(2, 1, 0)
    assert len(limiter) == 2
    assert limiter.prune(60) == 2
    assert len(limiter) == 0


def test_fixed_window_refuses_negative_configuration() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        FixedWindowLimiter(-1, 10)


def test_byte_nanos_sbd_defaults() -> None:
    kbps, burst = 1000, 262_144
    limiter = ByteNanosLimiter(8_000_000 // kbps, burst)
    now = 5_000_000_000
    assert limiter.check("::ffff:127.0.0.1", burst, now)
    assert not limiter.check("::ffff:127.0.0.1", 1, now)
    assert limiter.check("::1", 1, now), "another IP has its own bucket"
    # 1000 kbps refills 125 bytes per millisecond
    assert limiter.check("::ffff:127.0.0.1", 100, now + 1_000_000)


def test_byte_nanos_prune_forgets_idle_ips() -> None:
    limiter = ByteNanosLimiter(8000, 1000)
    limiter.check("a", 10, 0)
    assert limiter.prune(5_000_000_000) == 0
    assert limiter.prune(20_000_000_000) == 1
