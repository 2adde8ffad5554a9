"""The TTL cache in front of a twin directory: single-flight, TTLs on a fake clock, bounds,
invalidation, cancellation and errors."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from rmb_relay.errors import ConfigError, TwinLookupError
from rmb_relay.twins import Twin, TwinDirectory
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT


def twin(twin_id: int, version: int = 0) -> Twin:
    key = hashlib.sha256(f"{twin_id}/{version}".encode()).digest()
    return Twin(twin_id, key, frozenset({"r1.example"}), None)


class Clock:
    """Monotonic nanoseconds (`rmb_relay.clock`); the test moves `now`, in seconds."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> int:
        return round(self.now * 1_000_000_000)


class CountingBackend(TwinDirectory):
    """Counts calls per id; each call waits for `gate` (open unless a test closes it)."""

    def __init__(self, twins: dict[int, Twin] | None = None) -> None:
        self.twins = dict(twins if twins is not None else {i: twin(i) for i in range(1, 100)})
        self.calls: dict[int, int] = {}
        self.running = 0
        self.max_running = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None
        self.closed = False

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    async def get(self, twin_id: int) -> Twin | None:
        self.calls[twin_id] = self.calls.get(twin_id, 0) + 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        if self.fail is not None:
            raise self.fail
        return self.twins.get(twin_id)

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def backend() -> CountingBackend:
    return CountingBackend()


async def settle() -> None:
    """Let every ready task run until it blocks (on the gate or on a result)."""
    for _ in range(5):
        await asyncio.sleep(0)


# ---- single-flight -------------------------------------------------------------------------


async def test_concurrent_gets_of_one_id_share_one_backend_call(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    lookups = [asyncio.create_task(cache.get(5)) for _ in range(50)]
    await settle()
    assert backend.calls == {5: 1}
    assert backend.running == 1
    backend.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*lookups), WAIT)
    assert backend.calls == {5: 1}
    assert all(result is results[0] for result in results)
    assert results[0] == twin(5)


async def test_different_ids_are_looked_up_concurrently(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    lookups = [asyncio.create_task(cache.get(i)) for i in (1, 2, 3, 1, 2, 3)]
    await settle()
    assert backend.max_running == 3
    backend.gate.set()
    assert (
        await asyncio.wait_for(asyncio.gather(*lookups), WAIT)
        == [
            twin(1),
            twin(2),
            twin(3),
        ]
        * 2
    )
    assert backend.calls == {1: 1, 2: 1, 3: 1}


async def test_a_backend_error_reaches_every_waiter_and_is_not_cached(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    backend.fail = TwinLookupError("backend down")
    lookups = [asyncio.create_task(cache.get(5)) for _ in range(3)]
    await settle()
    backend.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*lookups, return_exceptions=True), WAIT)
    assert [str(r) for r in results] == ["backend down"] * 3
    assert all(isinstance(r, TwinLookupError) for r in results)
    assert backend.calls == {5: 1}
    backend.fail = None
    assert await cache.get(5) == twin(5)  # the failure was not remembered
    assert backend.calls == {5: 2}


async def test_a_cancelled_waiter_does_not_disturb_the_others(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    first = asyncio.create_task(cache.get(5))  # the caller that started the lookup
    second = asyncio.create_task(cache.get(5))
    third = asyncio.create_task(cache.get(5))
    await settle()
    first.cancel()
    second.cancel()
    await settle()
    assert first.cancelled()
    assert second.cancelled()
    backend.gate.set()
    assert await asyncio.wait_for(third, WAIT) == twin(5)
    assert backend.calls == {5: 1}
    assert await cache.get(5) == twin(5)  # and the answer was cached
    assert backend.calls == {5: 1}


async def test_a_lookup_nobody_waits_for_any_more_still_fills_the_cache(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    caller = asyncio.create_task(cache.get(5))
    await settle()
    caller.cancel()
    await settle()
    backend.gate.set()
    await settle()
    assert await cache.get(5) == twin(5)
    assert backend.calls == {5: 1}


async def test_a_failed_lookup_with_no_waiters_left_logs_nothing(
    backend: CountingBackend, clock: Clock
) -> None:
    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    backend.fail = TwinLookupError("backend down")
    caller = asyncio.create_task(cache.get(5))
    await settle()
    caller.cancel()
    await settle()
    backend.gate.set()
    await settle()
    del caller
    gc.collect()
    assert reported == []  # no "Task exception was never retrieved"


# ---- TTLs ----------------------------------------------------------------------------------


async def test_found_twins_are_served_from_memory_until_ttl(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, ttl=60, negative_ttl=5, clock=clock)
    assert await cache.get(5) == twin(5)
    backend.twins[5] = twin(5, version=1)  # changed in the backend
    clock.now += 59.9
    assert await cache.get(5) == twin(5)  # still the cached one
    assert (backend.calls, cache.hits, cache.lookups) == ({5: 1}, 1, 1)
    clock.now += 0.1
    assert await cache.get(5) == twin(5, version=1)
    assert backend.calls == {5: 2}


async def test_unknown_twins_are_remembered_only_for_negative_ttl(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, ttl=60, negative_ttl=5, clock=clock)
    assert await cache.get(500) is None
    backend.twins[500] = twin(500)  # e.g. `rmb-relay twins add` meanwhile
    clock.now += 4.9
    assert await cache.get(500) is None
    assert backend.calls == {500: 1}
    clock.now += 0.1
    assert await cache.get(500) == twin(500)
    assert backend.calls == {500: 2}


async def test_zero_ttls_cache_nothing_but_still_single_flight(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, ttl=0, negative_ttl=0, clock=clock)
    await cache.get(5)
    await cache.get(5)
    await cache.get(500)
    await cache.get(500)
    assert backend.calls == {5: 2, 500: 2}
    assert len(cache) == 0
    backend.gate.clear()
    lookups = [asyncio.create_task(cache.get(5)) for _ in range(10)]
    await settle()
    backend.gate.set()
    await asyncio.wait_for(asyncio.gather(*lookups), WAIT)
    assert backend.calls == {5: 3, 500: 2}


@pytest.mark.parametrize(
    "kwargs", [{"ttl": -1}, {"negative_ttl": -0.5}, {"max_entries": 0}], ids=str
)
def test_nonsense_settings_are_config_errors(
    backend: CountingBackend, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError):
        CachedTwinDirectory(backend, **kwargs)


# ---- bounds and invalidation ---------------------------------------------------------------


async def test_size_is_bounded_by_evicting_the_oldest_entry(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock, max_entries=3)
    for twin_id in (1, 2, 3, 4):
        await cache.get(twin_id)
    assert len(cache) == 3
    for twin_id in (2, 3, 4):
        await cache.get(twin_id)
    assert backend.total == 4  # 2, 3, 4 were hits
    await cache.get(1)  # evicted: asked again, and now the youngest
    assert backend.calls[1] == 2
    await cache.get(3)
    await cache.get(4)
    await cache.get(1)
    assert backend.total == 5
    await cache.get(2)  # 2 was the oldest when 1 came back
    assert backend.calls[2] == 2


async def test_an_expired_entry_refetched_becomes_the_youngest(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, ttl=10, clock=clock, max_entries=2)
    await cache.get(1)
    clock.now += 5
    await cache.get(2)
    clock.now += 6  # 1 expired, 2 not
    await cache.get(1)
    await cache.get(3)  # evicts 2, the oldest now
    await cache.get(1)
    assert backend.calls == {1: 2, 2: 1, 3: 1}
    await cache.get(2)
    assert backend.calls[2] == 2


async def test_invalidate_forgets_one_twin(backend: CountingBackend, clock: Clock) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    await cache.get(1)
    await cache.get(2)
    backend.twins[1] = twin(1, version=1)
    cache.invalidate(1)
    cache.invalidate(99)  # unknown ids are fine
    assert await cache.get(1) == twin(1, version=1)
    assert await cache.get(2) == twin(2)
    assert backend.calls == {1: 2, 2: 1}


async def test_invalidate_during_a_lookup_keeps_its_stale_answer_out_of_the_cache(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    before = asyncio.create_task(cache.get(1))
    await settle()
    backend.twins[1] = twin(1, version=1)  # the change lands while the lookup runs...
    cache.invalidate(1)  # ...and is announced
    after = asyncio.create_task(cache.get(1))  # must not join the older lookup
    await settle()
    assert backend.calls == {1: 2}
    backend.gate.set()
    await asyncio.wait_for(asyncio.gather(before, after), WAIT)
    assert await cache.get(1) == twin(1, version=1)
    assert backend.calls == {1: 2}


async def test_clear_forgets_every_twin(backend: CountingBackend, clock: Clock) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    for twin_id in (1, 2, 500):
        await cache.get(twin_id)
    cache.clear()
    assert len(cache) == 0
    for twin_id in (1, 2, 500):
        await cache.get(twin_id)
    assert backend.calls == {1: 2, 2: 2, 500: 2}


async def test_close_stops_running_lookups_and_closes_the_backend(
    backend: CountingBackend, clock: Clock
) -> None:
    cache = CachedTwinDirectory(backend, clock=clock)
    backend.gate.clear()
    waiter = asyncio.create_task(cache.get(1))
    await settle()
    await asyncio.wait_for(cache.close(), WAIT)
    assert backend.closed
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, WAIT)


# ---- with the real SQLite backend ----------------------------------------------------------


async def test_a_twin_added_to_the_file_logs_in_after_the_negative_ttl(
    tmp_path: Path, clock: Clock
) -> None:
    path = tmp_path / "twins.sqlite3"
    cache = CachedTwinDirectory(SqliteTwinDirectory(path), negative_ttl=5, clock=clock)
    try:
        assert await cache.get(7) is None
        other = sqlite3.connect(path)  # another writer, as `rmb-relay twins add` is
        with other:
            other.execute(
                "INSERT INTO twins (id, account, relays) VALUES (7, ?, 'r.example')",
                (twin(7).account,),
            )
        other.close()
        assert await cache.get(7) is None
        clock.now += 5
        found = await cache.get(7)
        assert found is not None
        assert found.relays == frozenset({"r.example"})
    finally:
        await cache.close()


async def test_a_failing_backend_is_answered_from_entries_expired_less_than_stale_ttl(
    backend: CountingBackend, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A chain node slow or unreachable must not cost the relay the twins it knew a moment
    ago (docs/faults.md, scenario f): a found twin is answered up to `stale_ttl` past its
    expiry while lookups fail, logged once; never-seen twins, unknown ones and older entries
    still get the error; a lookup that works again replaces the stale answer."""
    cache = CachedTwinDirectory(backend, ttl=60, negative_ttl=5, clock=clock, stale_ttl=600)
    assert await cache.get(5) == twin(5)
    assert await cache.get(500) is None  # unknown: remembered as such, never served stale
    backend.fail = TwinLookupError("chain down")
    clock.now += 60 + 599
    with caplog.at_level("WARNING", logger="rmb_relay.twins"):
        assert await cache.get(5) == twin(5)
        assert await cache.get(5) == twin(5)
    assert cache.stale_hits == 2
    assert sum("answering twins it knew" in r.getMessage() for r in caplog.records) == 1
    for missing in (6, 500):
        with pytest.raises(TwinLookupError):
            await cache.get(missing)
    clock.now += 1  # 600 s past its expiry: too old
    with pytest.raises(TwinLookupError):
        await cache.get(5)
    backend.fail = None
    backend.twins[5] = twin(5, version=1)
    assert await cache.get(5) == twin(5, version=1)
