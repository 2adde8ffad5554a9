"""A TTL cache with single-flight lookups in front of any twin directory.

Why single-flight: a burst of messages to one not-yet-cached twin must cost one backend lookup,
not one per message. Concurrent `get`s of the same id share one future; a backend error reaches
every waiter and is not cached (the next call tries again). "No such twin" is cached for a
shorter `negative_ttl`, so a twin added with `rmb-relay twins add` shows up quickly.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from rmb_relay.twins import Twin, TwinDirectory

#: a bound on memory: about 100 bytes a twin
DEFAULT_MAX_ENTRIES = 100_000


class CachedTwinDirectory(TwinDirectory):
    def __init__(
        self,
        backend: TwinDirectory,
        ttl: float = 60.0,
        negative_ttl: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.backend = backend
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self.clock = clock
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[float, Twin | None]] = OrderedDict()
        self._inflight: dict[int, asyncio.Future[Twin | None]] = {}
        self.lookups = 0  # backend calls, for tests and metrics

    async def get(self, twin_id: int) -> Twin | None:
        entry = self._entries.get(twin_id)
        if entry is not None and entry[0] > self.clock():
            return entry[1]
        inflight = self._inflight.get(twin_id)
        if inflight is not None:
            return await asyncio.shield(inflight)
        future: asyncio.Future[Twin | None] = asyncio.get_running_loop().create_future()
        self._inflight[twin_id] = future
        try:
            self.lookups += 1
            twin = await self.backend.get(twin_id)
        except BaseException as err:
            future.set_exception(err)
            future.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            del self._inflight[twin_id]
        ttl = self.ttl if twin is not None else self.negative_ttl
        if ttl > 0:
            self._entries[twin_id] = (self.clock() + ttl, twin)
            self._entries.move_to_end(twin_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        future.set_result(twin)
        return twin

    def invalidate(self, twin_id: int) -> None:
        self._entries.pop(twin_id, None)

    async def close(self) -> None:
        await self.backend.close()
