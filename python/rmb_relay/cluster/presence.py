"""Presence: which instance holds which address, in Redis, kept alive with a TTL.

Claims and releases. A connection that registers an address queues a claim
(`SET rmb:{a:<name>}:at <me> EX ttl GET`); one that goes away queues a release (delete the key
only if it still names us, a one-key script). A worker sends everything queued in one pipeline,
in queue order, so a claim, release and claim of one address (a quick reconnect) reach Redis
in that order. The claim answers the previous holder: when it is another instance, that one
must close its (older) connection, which the caller tells it over the bus.

Refresh. Every `ttl/3` (`refresh`) each held key's TTL is renewed with GETEX, which also says
whether it still names us: a key that expired (Redis was unreachable for longer than the TTL)
is set again with NX; a key that names another instance means a newer connection took over
and we missed the notice, so the caller closes ours.

Lookups. `owner(name)` reads the key, remembering the answer for `cache_ttl` (monotonic clock,
injectable) because a busy sender asks for the same few addresses thousands of times a
second. A stale answer is safe: an instance handed a message for an address it no longer
holds looks again with `fresh=True` and passes the message on (or to the mailbox).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.cluster import keys
from rmb_relay.cluster.bus import REDIS_ERRORS
from rmb_relay.cluster.connect import RedisClient
from rmb_relay.errors import ClusterUnavailable

#: the answers remembered at most; over it the cache starts again (addresses churn)
CACHE_MAX = 100_000

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(slots=True)
class _Op:
    name: str
    claim: bool
    future: asyncio.Future[str | None] = field(repr=False)


class Presence:
    """This instance's presence entries; see the module docstring."""

    def __init__(
        self,
        redis: RedisClient,
        me: str,
        ttl: float,
        *,
        cache_ttl: float = 1.0,
        clock: Clock = monotonic_clock,
    ) -> None:
        self.redis = redis
        self.me = me
        self.ttl_ms = max(1, int(ttl * 1000))
        self.cache_ttl = nanos(cache_ttl)
        self.clock = clock
        #: names this instance holds (what `refresh` renews)
        self.held: set[str] = set()
        self._ops: list[_Op] = []
        self._worker: asyncio.Task[None] | None = None
        #: the last claim of each name still in flight (what `claimed` waits for)
        self._claims: dict[str, asyncio.Future[str | None]] = {}
        self._cache: dict[str, tuple[str | None, int]] = {}
        #: instances known to be gone (set by the reaper): never an owner
        self.dead: set[str] = set()

    # ---- claims and releases ---------------------------------------------------------------

    def claim(self, name: str) -> asyncio.Future[str | None]:
        """Hold `name`; the future gives the instance that held it before (None: nobody or us)
        or raises ClusterUnavailable."""
        self.held.add(name)
        self._cache.pop(name, None)
        future = self._queue(name, claim=True)
        self._claims[name] = future
        future.add_done_callback(lambda done: self._claim_done(name, done))
        return future

    def _claim_done(self, name: str, future: asyncio.Future[str | None]) -> None:
        if self._claims.get(name) is future:
            del self._claims[name]

    def release(self, name: str) -> asyncio.Future[str | None]:
        self.held.discard(name)
        self._cache.pop(name, None)
        return self._queue(name, claim=False)

    def forget(self, name: str) -> None:
        """Another instance holds `name` now: stop renewing it (its key is theirs)."""
        self.held.discard(name)
        self._cache.pop(name, None)

    async def claimed(self, name: str) -> None:
        """Wait until the latest claim of `name` reached Redis (raises ClusterUnavailable)."""
        future = self._claims.get(name)
        if future is not None:
            await asyncio.shield(future)

    def _queue(self, name: str, *, claim: bool) -> asyncio.Future[str | None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str | None] = loop.create_future()
        self._ops.append(_Op(name, claim, future))
        if self._worker is None:
            self._worker = loop.create_task(self._work())
        return future

    async def _work(self) -> None:
        try:
            while self._ops:
                ops, self._ops = self._ops, []
                await self._send(ops)
        finally:
            self._worker = None

    async def _send(self, ops: list[_Op]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for op in ops:
            key = keys.presence_key(op.name)
            if op.claim:
                pipe.set(key, self.me, px=self.ttl_ms, get=True)
            else:
                pipe.eval(_RELEASE, 1, key, self.me)
        try:
            results = await pipe.execute()
        except REDIS_ERRORS as err:
            failure = ClusterUnavailable(f"redis: {err}")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(failure)
                    op.future.exception()  # retrieved: a failed release is not an error
            return
        for op, result in zip(ops, results, strict=True):
            previous = None
            if op.claim and isinstance(result, bytes):
                holder = result.decode()
                previous = None if holder == self.me else holder
            if not op.future.done():
                op.future.set_result(previous)

    # ---- refresh ---------------------------------------------------------------------------

    async def refresh(self) -> list[str]:
        """Renew every held name; returns the names another instance holds now (raises
        ClusterUnavailable)."""
        names = list(self.held)
        if not names:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.getex(keys.presence_key(name), px=self.ttl_ms)
        try:
            values = await pipe.execute()
            lost = [name for name, value in zip(names, values, strict=True) if value is None]
            if lost:  # expired while Redis was out of reach: set again unless someone took it
                pipe = self.redis.pipeline(transaction=False)
                for name in lost:
                    pipe.set(keys.presence_key(name), self.me, px=self.ttl_ms, nx=True)
                await pipe.execute()
        except REDIS_ERRORS as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        me = self.me.encode()
        return [
            name
            for name, value in zip(names, values, strict=True)
            if value is not None and value != me and name in self.held
        ]

    # ---- lookups ---------------------------------------------------------------------------

    async def owner(self, name: str, *, fresh: bool = False) -> str | None:
        """The live instance other than this one holding `name`, if any (raises
        ClusterUnavailable)."""
        now = self.clock()
        if not fresh:
            cached = self._cache.get(name)
            if cached is not None and cached[1] > now:
                return cached[0]
        try:
            value = await self.redis.get(keys.presence_key(name))
        except REDIS_ERRORS as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        holder = value.decode() if isinstance(value, bytes) else None
        if holder == self.me or holder in self.dead:
            return None
        if holder is not None:  # "nobody" is not remembered: a login must be seen at once
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[name] = (holder, now + self.cache_ttl)
        return holder

    def forget_owner(self, name: str) -> None:
        self._cache.pop(name, None)

    def instance_gone(self, instance: str) -> None:
        """Never route to `instance` again and drop every cached answer naming it."""
        self.dead.add(instance)
        for name, (holder, _) in list(self._cache.items()):
            if holder == instance:
                del self._cache[name]

    async def close(self) -> None:
        worker = self._worker
        if worker is not None:
            await asyncio.gather(worker, return_exceptions=True)
