"""A TTL cache with single-flight lookups in front of any twin directory.

Why a cache: every login and every message to a twin that is not connected here needs the
twin, and the backend is a file read (SQLite) or a network round trip (tfchain).

Why single-flight: a burst of messages to one not-yet-cached twin must cost one backend lookup,
not one per message. The first `get` of an id starts one lookup task; every `get` of that id
while it runs awaits the same task. The task is not owned by any caller, so a caller that is
cancelled (its connection went away) neither cancels the lookup for the others nor turns their
answer into a CancelledError. A backend error reaches every waiter and is not cached: the next
`get` tries again.

Why a separate `negative_ttl`: "no such twin" is cached too (else an unknown destination would
hit the backend on every message), but only briefly, so a twin just added with
`rmb-relay twins add` (or registered on chain) can log in within seconds.

Why a stale answer when the backend fails: a chain node that is slow or unreachable must
not stop a relay from serving twins it knew a moment ago (a reply to a twin whose entry just
expired would be dropped, its requester never told). A found twin whose entry expired less
than `stale_ttl` ago is answered when its lookup fails, and the failure is logged once per
outage; a twin never seen, or seen longer ago, still gets the error. What that risks is bounded
by `stale_ttl`: a key or relay changed on chain meanwhile is seen that much later.

Why evict oldest-inserted rather than least-recently-used: entries expire in insertion order,
so the oldest entry is the next to go stale anyway, and a hit then costs a dict lookup and no
reordering.

Time comes from `clock` (monotonic nanoseconds, `clock.py`) so tests drive expiry without
sleeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.errors import ConfigError, TwinLookupError
from rmb_relay.twins import Twin, TwinDirectory

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_NEGATIVE_TTL",
    "DEFAULT_STALE_TTL",
    "DEFAULT_TTL",
    "CachedTwinDirectory",
]

log = logging.getLogger("rmb_relay.twins")

#: seconds a found twin is served from memory; a key or relay change shows up after this
DEFAULT_TTL = 60.0
#: seconds "no such twin" is remembered; short so new twins can log in quickly
DEFAULT_NEGATIVE_TTL = 5.0
#: seconds past its expiry a found twin is still answered while the backend fails
DEFAULT_STALE_TTL = 600.0
#: a bound on memory (a Twin with one relay is a few hundred bytes): about 30-50 MB when full
DEFAULT_MAX_ENTRIES = 100_000


class CachedTwinDirectory(TwinDirectory):
    """`TwinDirectory` in front of another one: cached, single-flighted, bounded.

    `lookups` counts backend calls and `hits` answers from memory (for tests and metrics).
    """

    def __init__(
        self,
        backend: TwinDirectory,
        ttl: float = DEFAULT_TTL,
        negative_ttl: float = DEFAULT_NEGATIVE_TTL,
        clock: Clock = monotonic_clock,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        stale_ttl: float = DEFAULT_STALE_TTL,
    ) -> None:
        if ttl < 0 or negative_ttl < 0:
            raise ConfigError("twin cache TTLs must be >= 0 seconds (0 disables caching)")
        if max_entries < 1:
            raise ConfigError("twin cache size must be at least 1 entry")
        self.backend = backend
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self.clock = clock
        self.max_entries = max_entries
        self.stale_ttl = nanos(max(0.0, stale_ttl))
        #: set while the backend fails and stale answers are served (logged once)
        self._serving_stale = False
        self.stale_hits = 0
        #: id -> (expires at, twin or None); insertion order = age, for eviction; an expired
        #: entry stays (until replaced or evicted) as the stale answer for a failed lookup
        self._entries: OrderedDict[int, tuple[float, Twin | None]] = OrderedDict()
        #: id -> the one lookup running for it
        self._inflight: dict[int, asyncio.Task[Twin | None]] = {}
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, twin_id: int) -> tuple[bool, Twin | None]:
        """(True, twin or None) when a fresh answer is cached, else (False, None): a caller
        on a per-message path answers from memory without an await, and calls `get` only on
        a miss."""
        entry = self._entries.get(twin_id)
        if entry is not None and entry[0] > self.clock():
            self.hits += 1
            return True, entry[1]
        return False, None

    def fresh_for(self, twin_id: int) -> int:
        """How long (ns, from now) the cached answer for the twin stays fresh; 0: none (what
        a copy of a decision made on `peek` may live)."""
        entry = self._entries.get(twin_id)
        return 0 if entry is None else max(0, int(entry[0]) - self.clock())

    async def get(self, twin_id: int) -> Twin | None:
        entry = self._entries.get(twin_id)
        if entry is not None and entry[0] > self.clock():
            self.hits += 1
            return entry[1]
        task = self._inflight.get(twin_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._lookup(twin_id), name=f"twin-lookup-{twin_id}"
            )
            task.add_done_callback(_consume_exception)
            self._inflight[twin_id] = task
        # shield: cancelling this caller must not cancel the lookup the others are waiting on
        return await asyncio.shield(task)

    async def _lookup(self, twin_id: int) -> Twin | None:
        this = asyncio.current_task()
        self.lookups += 1
        try:
            twin = await self.backend.get(twin_id)
            self._serving_stale = False
        except TwinLookupError as err:
            stale = self._stale(twin_id)
            if stale is None:
                raise
            self.stale_hits += 1
            if not self._serving_stale:
                self._serving_stale = True
                log.warning(
                    "twin directory failing (%s); answering twins it knew up to %.0f s ago "
                    "until it answers again",
                    err,
                    self.stale_ttl / 1e9,
                )
            return stale
        finally:
            # invalidate() during the lookup detaches it: its answer goes to the callers
            # already waiting but is not stored, since it may predate the change
            current = self._inflight.get(twin_id) is this
            if current:
                del self._inflight[twin_id]
        if current:
            self._store(twin_id, twin)
        return twin

    def _stale(self, twin_id: int) -> Twin | None:
        """The found twin whose entry expired less than `stale_ttl` ago, if any."""
        entry = self._entries.get(twin_id)
        if entry is None or entry[1] is None or entry[0] + self.stale_ttl <= self.clock():
            return None
        return entry[1]

    def _store(self, twin_id: int, twin: Twin | None) -> None:
        ttl = self.ttl if twin is not None else self.negative_ttl
        if ttl <= 0:
            return
        entries = self._entries
        entries.pop(twin_id, None)  # re-insert at the young end
        entries[twin_id] = (self.clock() + nanos(ttl), twin)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def put(self, twin: Twin) -> None:
        """Store a twin known to be current (a chain event carried it), replacing what is
        cached; a lookup already running for it is detached, as by `invalidate`."""
        self._inflight.pop(twin.id, None)
        self._store(twin.id, twin)

    def invalidate(self, twin_id: int) -> None:
        """Forget one twin (e.g. a chain event says it changed): the next `get` asks the
        backend, even if a lookup started before this call is still running."""
        self._entries.pop(twin_id, None)
        self._inflight.pop(twin_id, None)

    def clear(self) -> None:
        """Forget every twin (e.g. after missing too many chain blocks to catch up)."""
        self._entries.clear()
        self._inflight.clear()

    async def close(self) -> None:
        """Stop running lookups, then close the backend."""
        tasks = list(self._inflight.values())
        self._inflight.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.backend.close()


def _consume_exception(task: asyncio.Task[Twin | None]) -> None:
    """Mark a failed lookup's exception as seen: when every caller was cancelled, nobody else
    retrieves it, and asyncio would log "Task exception was never retrieved"."""
    if not task.cancelled():
        task.exception()
