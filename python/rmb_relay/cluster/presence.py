"""Presence: which instance holds which address, in Redis, kept alive with a TTL.

Claims. The value of a presence key is a *claim*: `<instance>/<n>`, the instance that holds
the address and a number it never gives twice. A connection that registers an address queues
a claim (`SET rmb:{a:<name>}:at <claim> PX ttl GET`); one that goes away queues a release
(delete the key only if it still holds our claim, a one-key script). A worker sends everything
queued in one pipeline, in queue order, so a claim, release and claim of one address (a quick
reconnect) reach Redis in that order. The claim answers the previous claim: when it is another
instance's, that one must close its (older) connection, which the caller tells it over the bus
naming *that claim*. Why a claim and not just the instance: a notice can arrive late (it waited
in a stream, or in the stream of a dead instance that another one takes over), and by then the
receiver may hold the address through a newer connection, its own or a reconnect; a notice
ends only the claim it names (`holds`), so a late one can never close a newer session.

Refresh. Every `ttl/3` (`refresh`) each held key's TTL is renewed with GETEX, which also says
whether it still holds our claim: a key that expired (Redis was unreachable for longer than
the TTL) is set again with NX; a key holding another claim means a newer connection took over
and we missed the notice, so the caller closes ours.

Lookups. `owner(name)` reads the key, remembering the answer for `cache_ttl` (monotonic clock,
injectable) because a busy sender asks for the same few addresses thousands of times a
second. A stale answer is safe: an instance handed a message for an address it no longer
holds looks again with `fresh=True` and passes the message on (or to the mailbox).

Mirrors. A cached answer may be copied elsewhere (the Rust route table's remote routes, which
let the scanner queue a message for its holder inside `feed`): `on_forget(name)` is called
whenever the answer for `name` is dropped or replaced, `on_forget(None)` when every answer is,
and `on_instance_gone(instance)` for every answer naming an instance found gone, so a copy
never outlives what it copies. (An answer that expires needs no call: copies carry its expiry.)
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.cluster import keys
from rmb_relay.cluster.bus import redis_errors
from rmb_relay.cluster.connect import RedisClient
from rmb_relay.errors import ClusterUnavailable

#: the answers remembered at most; over it the cache starts again (addresses churn)
CACHE_MAX = 100_000
#: between the instance and the number of a claim (instance ids may contain it: the number
#: never does, so the last one splits)
CLAIM_SEP = "/"

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Missing(enum.Enum):
    """Not in the cache (`Presence.cached_owner`)."""

    MISSING = "missing"


MISSING = Missing.MISSING


def claim_instance(claim: str) -> str:
    """The instance of a claim (`<instance>/<n>`)."""
    instance, sep, _ = claim.rpartition(CLAIM_SEP)
    return instance if sep else claim


@dataclass(frozen=True, slots=True)
class Refreshed:
    """What a `Presence.refresh` found."""

    #: names another claim holds now (a newer connection elsewhere): close ours
    taken: list[str]
    #: names whose key had expired (Redis out of reach for longer than the TTL) and that we
    #: set again: messages for them may have gone to the mailbox meanwhile, to be drained
    reclaimed: list[str]


@dataclass(slots=True)
class _Op:
    name: str
    #: the claim this op sets (claim) or deletes only if it is still there (release)
    value: str
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
        #: names this instance holds -> its latest claim of each (what `refresh` renews)
        self.held: dict[str, str] = {}
        self._claim_numbers = itertools.count(1)
        self._ops: list[_Op] = []
        self._worker: asyncio.Task[None] | None = None
        #: the last claim of each name still in flight (what `claimed` waits for)
        self._claims: dict[str, asyncio.Future[str | None]] = {}
        self._cache: dict[str, tuple[str | None, int]] = {}
        #: instances known to be gone (set by the reaper): never an owner
        self.dead: set[str] = set()
        #: told when a cached answer is dropped (a name) or all are (None); see the docstring
        self.on_forget: Callable[[str | None], None] = _ignore
        #: told when every answer naming an instance is dropped (it is gone)
        self.on_instance_gone: Callable[[str], None] = _ignore

    # ---- claims and releases ---------------------------------------------------------------

    def claim(self, name: str) -> asyncio.Future[str | None]:
        """Hold `name` with a new claim; the future gives the claim it replaced when that was
        another instance's (None: nobody's, or ours) or raises ClusterUnavailable."""
        value = f"{self.me}{CLAIM_SEP}{next(self._claim_numbers)}"
        self.held[name] = value
        self._uncache(name)
        future = self._queue(name, value, claim=True)
        self._claims[name] = future
        future.add_done_callback(lambda done: self._claim_done(name, done))
        return future

    def _claim_done(self, name: str, future: asyncio.Future[str | None]) -> None:
        if self._claims.get(name) is future:
            del self._claims[name]

    def release(self, name: str) -> asyncio.Future[str | None]:
        """Give up `name` (a no-op in Redis when another claim replaced ours)."""
        value = self.held.pop(name, None)
        self._uncache(name)
        if value is None:  # not held (released already, or another instance took it over)
            future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future
        return self._queue(name, value, claim=False)

    def holds(self, name: str, claim: str) -> bool:
        """Whether `claim` is this instance's current claim of `name` (a notice naming an
        older claim, or another instance's, must not close the connection holding it now)."""
        return self.held.get(name) == claim

    def forget(self, name: str) -> None:
        """Another instance holds `name` now: stop renewing it (its key is theirs)."""
        self.held.pop(name, None)
        self._uncache(name)

    def _uncache(self, name: str) -> None:
        if self._cache.pop(name, None) is not None:
            self.on_forget(name)

    async def claimed(self, name: str) -> None:
        """Wait until the latest claim of `name` reached Redis (raises ClusterUnavailable)."""
        future = self._claims.get(name)
        if future is not None:
            await asyncio.shield(future)

    def _queue(self, name: str, value: str, *, claim: bool) -> asyncio.Future[str | None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str | None] = loop.create_future()
        self._ops.append(_Op(name, value, claim, future))
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
                pipe.set(key, op.value, px=self.ttl_ms, get=True)
            else:
                pipe.eval(_RELEASE, 1, key, op.value)
        try:
            results = await pipe.execute()
        except redis_errors() as err:
            failure = ClusterUnavailable(f"redis: {err}")
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(failure)
                    op.future.exception()  # retrieved: a failed release is not an error
            return
        for op, result in zip(ops, results, strict=True):
            previous = None
            if op.claim and isinstance(result, bytes):
                replaced = result.decode()
                previous = None if claim_instance(replaced) == self.me else replaced
            if not op.future.done():
                op.future.set_result(previous)

    # ---- refresh ---------------------------------------------------------------------------

    async def refresh(self) -> Refreshed:
        """Renew every held name (raises ClusterUnavailable); see `Refreshed`."""
        held = list(self.held.items())
        if not held:
            return Refreshed([], [])
        pipe = self.redis.pipeline(transaction=False)
        for name, _ in held:
            pipe.getex(keys.presence_key(name), px=self.ttl_ms)
        set_again: list[bool] = []
        try:
            values = await pipe.execute()
            lost = [item for item, value in zip(held, values, strict=True) if value is None]
            if lost:  # expired while Redis was out of reach: set again unless someone took it
                pipe = self.redis.pipeline(transaction=False)
                for name, claim in lost:
                    pipe.set(keys.presence_key(name), claim, px=self.ttl_ms, nx=True)
                set_again = [bool(done) for done in await pipe.execute()]
        except redis_errors() as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        # a claim queued meanwhile is newer than what we read: only a name still held by the
        # claim we renewed, and holding another in Redis, was taken over
        taken = [
            name
            for (name, claim), value in zip(held, values, strict=True)
            if value is not None and value.decode() != claim and self.holds(name, claim)
        ]
        reclaimed = []
        for (name, claim), done in zip(lost, set_again, strict=True):
            if done:
                reclaimed.append(name)
            elif self.holds(name, claim):  # expired, and claimed by another connection since
                taken.append(name)
        return Refreshed(taken, reclaimed)

    # ---- lookups ---------------------------------------------------------------------------

    def cached_owner(self, name: str) -> str | Missing | None:
        """What `owner(name)` would answer from its cache without asking Redis, or MISSING
        (saves a busy sender a coroutine per message)."""
        cached = self._cache.get(name)
        if cached is not None and cached[1] > self.clock():
            return cached[0]
        return MISSING

    async def owner(self, name: str, *, fresh: bool = False) -> str | None:
        """The live instance other than this one holding `name`, if any (raises
        ClusterUnavailable)."""
        if not fresh:
            cached = self.cached_owner(name)
            if cached is not MISSING:
                return cached
        now = self.clock()
        try:
            value = await self.redis.get(keys.presence_key(name))
        except redis_errors() as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        holder = claim_instance(value.decode()) if isinstance(value, bytes) else None
        if holder is not None and holder in self.dead:
            # a claim renewed by an instance we gave up: it was only cut off and is back
            # (its liveness key says so); until our next tick sees that, the mailbox would
            # take its messages and nobody would tell it to drain them
            try:
                back = bool(await self.redis.exists(keys.alive_key(holder)))
            except redis_errors() as err:
                raise ClusterUnavailable(f"redis: {err}") from err
            if not back:
                return None
            self.dead.discard(holder)
        if holder == self.me:
            return None
        if holder is not None:  # "nobody" is not remembered: a login must be seen at once
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
                self.on_forget(None)
            previous = self._cache.get(name)
            self._cache[name] = (holder, now + self.cache_ttl)
            if previous is not None and previous[0] != holder:
                self.on_forget(name)
        else:
            self._uncache(name)
        return holder

    def cached_until(self, name: str) -> int:
        """How long (ns, from now) the cached answer for `name` stays fresh; 0: none."""
        cached = self._cache.get(name)
        return 0 if cached is None else max(0, cached[1] - self.clock())

    def instance_gone(self, instance: str) -> None:
        """Never route to `instance` again and drop every cached answer naming it."""
        self.dead.add(instance)
        for name, (holder, _) in list(self._cache.items()):
            if holder == instance:
                del self._cache[name]
        self.on_instance_gone(instance)

    async def close(self) -> None:
        worker = self._worker
        if worker is not None:
            await asyncio.gather(worker, return_exceptions=True)


def _ignore(_: object) -> None:
    pass
