"""throttle.py: the bounded auth pool refuses instead of queueing, the failure limiter's
buckets (fake clock), its bounded table, and the IPv6 grouping of per-IP keys."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rmb_relay.errors import ConfigError
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.throttle import (
    Busy,
    FailureLimiter,
    Limited,
    Throttles,
    ThrottleSettings,
    UploadRate,
    WorkPool,
    ip_key,
)
from tests.conftest import WAIT
from tests.helpers import FakeClock


async def test_pool_refuses_past_its_bound_and_runs_the_rest() -> None:
    pool = WorkPool("auth", workers=1, queue=2)
    release = threading.Event()
    started = threading.Event()

    def job(n: int) -> int:
        started.set()
        assert release.wait(WAIT)
        return n

    try:
        jobs = [asyncio.ensure_future(pool.run(job, n)) for n in range(3)]
        assert await asyncio.to_thread(started.wait, WAIT)
        assert (pool.running, pool.waiting) == (1, 2)
        with pytest.raises(Busy) as refused:
            await pool.run(job, 99)
        assert refused.value.status == 503
        assert ("Retry-After", "1") in refused.value.headers
        release.set()
        assert await asyncio.gather(*jobs) == [0, 1, 2]
        assert (pool.pending, pool.refused, pool.completed) == (0, 1, 3)
    finally:
        release.set()
        pool.close()


def test_bucket_allows_a_burst_then_refills_over_the_window() -> None:
    clock = FakeClock()
    limiter = FailureLimiter(burst=3, window=30.0, clock=clock)
    for _ in range(3):
        assert limiter.retry_after("ip:a") is None
        limiter.charge("ip:a")
    wait = limiter.retry_after("ip:a")
    assert wait == pytest.approx(10.0)  # one attempt comes back every 30 / 3 s
    assert limiter.retry_after("ip:b") is None  # keys are independent
    clock.advance(9.9)
    assert limiter.retry_after("ip:a") == pytest.approx(0.1)
    clock.advance(0.1)
    assert limiter.retry_after("ip:a") is None


def test_refund_gives_the_attempt_back_and_forgets_full_buckets() -> None:
    clock = FakeClock()
    limiter = FailureLimiter(burst=2, window=10.0, clock=clock)
    limiter.charge("k")
    limiter.charge("k")
    assert limiter.retry_after("k") is not None
    limiter.refund("k")
    assert limiter.retry_after("k") is None
    limiter.refund("k")
    assert len(limiter) == 0


def test_table_is_bounded_full_buckets_go_first() -> None:
    clock = FakeClock()
    limiter = FailureLimiter(burst=2, window=10.0, max_keys=3, clock=clock)
    limiter.charge("old")  # refills in 5 s
    clock.advance(6)
    for key in ("a", "b", "c"):
        limiter.charge(key)
        limiter.charge(key)
    assert len(limiter) == 3
    assert limiter.evicted == 1
    for key in ("a", "b", "c"):  # the refilled one was forgotten, the limited ones kept
        assert limiter.retry_after(key) is not None
    limiter.charge("d")  # none full: the least recently charged goes
    assert len(limiter) == 3
    assert limiter.retry_after("a") is None


def test_ip_key_groups_ipv6_by_prefix() -> None:
    assert ip_key("203.0.113.7") == "203.0.113.7"
    assert ip_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert ip_key("2001:db8:1:2:aaaa::1") == ip_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert ip_key("2001:db8:1:3::1") != ip_key("2001:db8:1:2::1")
    assert ip_key("2001:db8:1:2::1", 128) == "2001:db8:1:2::1"
    assert ip_key("2001:db8:1:2::1", 48) == "2001:db8:1::/48"
    assert ip_key("fe80::1%eth0") == "fe80::/64"
    assert ip_key("/run/relay.sock") == "/run/relay.sock"


def test_throttles_limit_per_address_and_per_key_without_locking_the_owner_out() -> None:
    clock = FakeClock()
    registry = Registry()
    throttles = Throttles(registry, ThrottleSettings(auth_failures=2), clock=clock)
    try:
        throttles.check("tunnel", "10.0.0.1", "tenant:T")
        throttles.check("tunnel", "10.0.0.1", "tenant:T")
        with pytest.raises(Limited) as refused:
            throttles.check("tunnel", "10.0.0.1", "tenant:T")
        assert refused.value.status == 429
        assert ("Retry-After", "30") in refused.value.headers
        assert "from this address" in refused.value.reason
        # the tenant is out of attempts too, but a clean address still gets its try ...
        fresh = throttles.check("tunnel", "10.0.0.2", "tenant:T")
        # ... and once it has failed, the tenant's limit applies to it
        with pytest.raises(Limited) as by_key:
            throttles.check("tunnel", "10.0.0.2", "tenant:T")
        assert "for this tenant" in by_key.value.reason
        throttles.refund(fresh)  # it was the owner after all
        owner = throttles.check("tunnel", "10.0.0.2", "tenant:T")
        throttles.refund(owner)
        throttled = registry.get("rmb_relay_auth_throttled_total")
        assert throttled.value("tunnel", "ip") == 1
        assert throttled.value("tunnel", "key") == 1
    finally:
        throttles.close()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        ThrottleSettings(ipv6_prefix=129)
    with pytest.raises(ConfigError):
        WorkPool("auth", workers=0, queue=1)
    with pytest.raises(ConfigError):
        FailureLimiter(burst=0)


def test_upload_rate_asks_for_the_wait_of_the_slower_limit_and_counts_it() -> None:
    clock = FakeClock()
    registry = Registry()
    rate = UploadRate(registry, 1 << 20, 4 << 20, clock=clock)  # per IP 1 MiB/s, tenant 4
    burst = (1 << 20) // 4
    assert rate.charge("a", "t", burst) == 0.0, "a quarter second of the rate passes at once"
    wait = rate.charge("a", "t", 1 << 20)  # a second over the address's rate
    assert wait == pytest.approx(1.0, rel=0.01)
    # another address within its own burst: the tenant's 1.5 MiB at 4 MiB/s are 1/8 s over
    assert rate.charge("b", "t", burst) == pytest.approx(0.125, rel=0.01)
    clock.advance(wait)
    assert rate.charge("a", "t", 0) == 0.0, "paid back after the wait"
    assert (rate.pauses.value("ip"), rate.pauses.value("tenant")) == (1, 1)
    assert rate.paused.value("ip") == pytest.approx(1.0, rel=0.01)
    assert rate.paused.value("tenant") == pytest.approx(0.125, rel=0.01)


def test_upload_rate_keys_group_ipv6_by_prefix_and_zero_is_no_limit() -> None:
    registry = Registry()
    rate = UploadRate(registry, 1000, 0, ipv6_prefix=64, clock=FakeClock())
    assert rate.key("2001:db8::1") == rate.key("2001:db8::2") != rate.key("2001:db8:0:1::1")
    assert not UploadRate(Registry(), 0, 0).enabled
    with pytest.raises(ConfigError):
        UploadRate(Registry(), -1, 0)
