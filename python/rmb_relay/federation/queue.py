"""The outbound federation queue: envelopes accepted for another relay, until they are posted,
refused for good, or expire.

Theory of operation
-------------------
An item is *held* from `put` until `done`: ready (waiting for a worker), in flight (a worker is
posting it) or waiting out a retry backoff (`retry` puts it back after a delay without holding
a worker). Workers call `get_many` (every ready item, up to a limit), then `done(_many)` or
`retry` for each.

`MemoryQueue` (no Redis): a bounded deque; `put` refuses when `max_held` items are held, so a
remote that is down cannot eat the relay's memory (the sender gets an error envelope). A
process that dies loses what it held.

`RedisQueue` (`--redis`): rmb-rs's stream `relay.federation.stream` (entry field `msg` = the raw
envelope) read through the consumer group `federation`, one consumer per relay instance. What
an instance reads stays in the group's pending list (PEL) under its name until it is done with
it (then `XACK` + `XDEL`: unlike rmb-rs the stream does not grow forever). Two loops keep
ownership right:

- while an instance holds an entry (in flight or waiting to retry) it re-claims it for itself
  every `claim_idle / 3` (`XCLAIM ... JUSTID`, which does not count as a delivery), so its idle
  time stays low and nobody else takes it;
- every instance runs `XAUTOCLAIM` for entries idle longer than `claim_idle`: those belong to a
  consumer that stopped refreshing them, i.e. an instance that crashed or hangs. The claimer
  processes them as new. An entry can thus be posted twice (the hung instance wakes up): at
  least once, never lost while Redis keeps it.

Consumers that hold nothing and have been idle for a long time (dead instances) are removed
from the group by the claim loop, so the group does not collect names forever.

`put` does not wait for Redis: the envelopes put while one batch of XADDs is out go in the next
one (one script call, `ADD_ALL`: one command, one reply and one round trip for all of them;
a redis-py pipeline would parse one reply per envelope), and `put` returns at once unless
`ADD_AHEAD` envelopes are already waiting to be added (then it waits for its own, which slows
the senders down while Redis is slow). Waiting for each XADD held every sender's slow path for
a round trip per envelope: ~7,000 msg/s between two relays. So an envelope is in Redis a
round trip after `put` returns; if the process dies meanwhile it is lost, like anything else
still in its slow path. When a batch fails, the putters that waited get FederationError and
`on_unstored` is told of the others (the outbound tells the senders of requests). (A script
that fails half-way, e.g. Redis out of memory, may have added some of them: those are posted
and their senders were told they were not, the at-least-once side.)
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rmb_relay.errors import FederationError
from rmb_relay.tasks import STOP_TIMEOUT, cancel_and_wait

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient as Redis  # a server or a Cluster

log = logging.getLogger("rmb_relay.federation")

#: rmb-rs's names (spec/rmb.md §3.3), so a relay can share a Redis with rmb-rs relays
STREAM_KEY = "relay.federation.stream"
GROUP = "federation"
FIELD = b"msg"
#: without Redis, at most this many envelopes are held for other relays
DEFAULT_MAX_HELD = 100_000
#: an entry a consumer has not refreshed for this long is taken over by another instance
DEFAULT_CLAIM_IDLE = 30.0
#: entries read from the stream per XREADGROUP / XAUTOCLAIM
READ_COUNT = 1000
#: entries one instance holds at most (read, not yet done)
DEFAULT_PREFETCH = 4000
#: envelopes waiting for the next batch of XADDs before `put` waits for its own
ADD_AHEAD = 2000
#: one script call adds this many entries at most (Redis runs it without serving others)
ADD_CHUNK = 1000
#: XADD of every envelope in ARGV[2..] (field ARGV[1]) to KEYS[1]: one command and one reply
#: for a batch (a redis-py pipeline parses one reply per entry: ~30% of the relay's CPU)
ADD_ALL = """
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i])
end
return #ARGV - 1
"""
#: a consumer with nothing pending and idle this many claim periods is removed from the group
DEAD_CONSUMER_PERIODS = 20


@dataclass(slots=True)
class Item:
    """One envelope held by the queue."""

    data: bytes
    #: the stream entry id (Redis only)
    id: bytes | None = None
    #: posting rounds that failed so far (drives the backoff)
    attempts: int = 0
    #: when it was queued (wall clock, ns), for its route record's time inside the relay;
    #: a Redis entry's id holds the time Redis added it (ms)
    queued: int | None = None
    #: the remote relay posted to last (its route record's `remote` if it expires)
    remote: str | None = None


class OutboundQueue(abc.ABC):
    """See the module docstring."""

    def __init__(self) -> None:
        self._ready: deque[Item] = deque()
        #: workers waiting for items, woken one at a time (`get_many`)
        self._waiters: deque[asyncio.Future[None]] = deque()
        #: a worker was woken and has not taken its items yet
        self._waking = False
        self._timers: set[asyncio.TimerHandle] = set()
        self.closed = False
        #: entries taken over from a stalled or dead instance (Redis only)
        self.claimed = 0
        #: told of envelopes `put` took but could not keep (Redis only): (envelopes, why)
        self.on_unstored: Callable[[list[bytes], str], None] | None = None

    @abc.abstractmethod
    async def put(self, data: bytes, queued: int | None = None) -> None:
        """Hold one envelope (`queued`: the wall clock now, for route records); raises
        FederationError when it cannot (full, Redis down)."""

    async def get_many(self, limit: int) -> list[Item]:
        """Every item ready now, up to `limit`; waits for the first one only.

        One waiting worker at a time is woken, and it runs a loop iteration later: what
        arrives meanwhile (a socket read's worth of envelopes) is taken by that worker in one
        go instead of one envelope per woken worker. What it leaves wakes the next one."""
        ready = self._ready
        while not ready:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._waking = False
                    self._wake()  # woken as we were cancelled: pass it on
                else:
                    self._waiters.remove(waiter)
                raise
            self._waking = False
        if len(ready) <= limit:
            items = list(ready)
            ready.clear()
        else:
            items = [ready.popleft() for _ in range(limit)]
            self._wake()
        return items

    def ready(self) -> int:
        """Items waiting for a worker."""
        return len(self._ready)

    def oldest_queued(self) -> int | None:
        """When the longest-waiting item waiting for a worker was queued (wall ns), if known
        (/monitor/federation's queue age)."""
        return min((i.queued for i in self._ready if i.queued is not None), default=None)

    def _push(self, item: Item) -> None:
        self._ready.append(item)
        self._wake()

    def _wake(self) -> None:
        """Wake one waiting worker, unless one is woken already and has not run yet."""
        if self._waking:
            return
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._waking = True
                return

    def retry(self, item: Item, delay: float) -> None:
        """Make `item` ready again after `delay` seconds; it stays held meanwhile."""
        loop = asyncio.get_running_loop()

        def again() -> None:
            self._timers.discard(handle)
            if not self.closed:
                self._push(item)

        handle = loop.call_later(delay, again)
        self._timers.add(handle)

    @abc.abstractmethod
    async def done_many(self, items: list[Item]) -> None:
        """The items are finished (posted, refused for good, or expired): forget them."""

    @abc.abstractmethod
    def depth(self) -> int:
        """Items held by this process."""

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start background work (on the running loop)."""

    async def close(self) -> None:
        self.closed = True
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()


class MemoryQueue(OutboundQueue):
    """In-process and bounded; see the module docstring."""

    def __init__(self, max_held: int = DEFAULT_MAX_HELD) -> None:
        super().__init__()
        if max_held < 1:
            raise FederationError("the federation queue must hold at least 1 envelope")
        self.max_held = max_held
        self.held = 0

    async def put(self, data: bytes, queued: int | None = None) -> None:
        if self.held >= self.max_held:
            raise FederationError(
                f"federation queue full ({self.max_held} envelopes waiting for other relays)"
            )
        self.held += 1
        self._push(Item(data, queued=queued))

    async def done_many(self, items: list[Item]) -> None:
        self.held -= len(items)

    def depth(self) -> int:
        return self.held


def _entry_time(entry_id: bytes | str) -> int | None:
    """When Redis added a stream entry (ns since the epoch): its id is `<ms>-<sequence>`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    try:
        return int(text.split("-", 1)[0]) * 1_000_000
    except ValueError:
        return None


def consumer_name() -> str:
    """Unique per process and start: a restarted instance must not inherit a dead one's name
    blindly (its entries are claimed through the idle rule instead)."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class RedisQueue(OutboundQueue):
    """A Redis stream read through a consumer group; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        *,
        consumer: str | None = None,
        claim_idle: float = DEFAULT_CLAIM_IDLE,
        prefetch: int = DEFAULT_PREFETCH,
        key: str = STREAM_KEY,
    ) -> None:
        super().__init__()
        if not claim_idle > 0:
            raise FederationError("--federation-claim-idle must be positive")
        self.redis = redis
        self.key = key
        self.consumer = consumer or consumer_name()
        self.claim_idle_ms = max(1, int(claim_idle * 1000))
        self.prefetch = prefetch
        #: entry id -> item, for everything this instance holds
        self.held: dict[bytes, Item] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._room = asyncio.Event()
        self._room.set()
        #: envelopes waiting to be added to the stream, each with the future of a putter
        #: that waits for it (None: nobody waits; a failure goes to `on_unstored`)
        self._adding: list[tuple[bytes, asyncio.Future[None] | None]] = []
        self._adder: asyncio.Task[None] | None = None
        self._add_all = redis.register_script(ADD_ALL)

    def start(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_loop(), name="federation-read"),
            loop.create_task(self._claim_loop(), name="federation-claim"),
        ]

    async def put(self, data: bytes, queued: int | None = None) -> None:
        """Queue the envelope for the next batch of XADDs (see the module docstring); waits for
        it only while `ADD_AHEAD` are waiting already. `queued` is not kept: the entry id holds
        the time (Redis's clock), whichever instance posts it."""
        del queued
        if self.closed:
            raise FederationError("federation queue closed")
        loop = asyncio.get_running_loop()
        added: asyncio.Future[None] | None = None
        if len(self._adding) >= ADD_AHEAD:
            added = loop.create_future()
        self._adding.append((data, added))
        if self._adder is None:
            self._adder = loop.create_task(self._add(), name="federation-xadd")
        if added is not None:
            await added

    async def _add(self) -> None:
        from redis.exceptions import RedisError

        try:
            while self._adding:
                batch, self._adding = self._adding, []
                for start in range(0, len(batch), ADD_CHUNK):
                    chunk = batch[start : start + ADD_CHUNK]
                    try:
                        await self._add_all(keys=[self.key], args=[FIELD, *(d for d, _ in chunk)])
                    except (RedisError, OSError) as err:
                        self._unstored(batch[start:], f"federation queue unavailable: {err}")
                        break
                    except asyncio.CancelledError:
                        self._unstored(batch[start:], "federation queue closed")
                        raise
                    for _, added in chunk:
                        if added is not None and not added.done():
                            added.set_result(None)
        finally:
            self._adder = None

    def _unstored(self, batch: list[tuple[bytes, asyncio.Future[None] | None]], why: str) -> None:
        log.warning("%d envelopes for other relays could not be queued: %s", len(batch), why)
        error = FederationError(why)
        untold = []
        for data, added in batch:
            if added is None:
                untold.append(data)
            elif not added.done():
                added.set_exception(error)
        if untold and self.on_unstored is not None:
            self.on_unstored(untold, why)

    async def done_many(self, items: list[Item]) -> None:
        """One round trip for all of them (XACK and XDEL take many ids)."""
        from redis.exceptions import RedisError

        ids = []
        for item in items:
            assert item.id is not None
            self.held.pop(item.id, None)
            ids.append(item.id)
        if len(self.held) < self.prefetch:
            self._room.set()
        if not ids:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(self.key, GROUP, *ids)
                pipe.xdel(self.key, *ids)
                await pipe.execute()
        except (RedisError, OSError) as err:
            # still pending: another instance (or this one) will claim and post them again
            log.warning("could not acknowledge %d federation entries: %s", len(ids), err)

    def depth(self) -> int:
        return len(self.held)

    def _take(self, entries: list[Any]) -> int:
        """Hold and queue entries read or claimed (id, {field: value}); returns how many."""
        taken = 0
        for entry_id, fields in entries:
            if entry_id in self.held or not fields:
                continue  # already ours, or deleted meanwhile
            data = fields.get(FIELD)
            if data is None:
                log.warning("federation entry %r has no %r field; dropped", entry_id, FIELD)
                continue
            item = Item(data, entry_id, queued=_entry_time(entry_id))
            self.held[entry_id] = item
            self._push(item)
            taken += 1
        if len(self.held) >= self.prefetch:
            self._room.clear()
        return taken

    async def _ensure_group(self) -> None:
        from redis.exceptions import ResponseError

        try:
            await self.redis.xgroup_create(self.key, GROUP, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def _read_loop(self) -> None:
        from redis.exceptions import RedisError, ResponseError

        while not self.closed:
            try:
                await self._ensure_group()
                while not self.closed:
                    await self._room.wait()
                    reply: Any = await self.redis.xreadgroup(
                        GROUP, self.consumer, {self.key: ">"}, count=READ_COUNT, block=1000
                    )
                    for _, entries in reply or ():
                        self._take(entries)
            except ResponseError as err:
                if "NOGROUP" not in str(err):
                    log.warning("federation stream read failed: %s", err)
                    await asyncio.sleep(1.0)
            except (RedisError, OSError) as err:
                log.warning("federation stream read failed: %s", err)
                await asyncio.sleep(1.0)

    async def _claim_loop(self) -> None:
        from redis.exceptions import RedisError

        period = self.claim_idle_ms / 3000
        while not self.closed:
            await asyncio.sleep(period)
            try:
                await self._ensure_group()
                await self._refresh()
                await self._claim()
                await self._forget_dead(period)
            except (RedisError, OSError) as err:
                log.warning("federation claim loop: %s", err)

    async def _refresh(self) -> None:
        """Re-claim what we hold so its idle time stays under claim_idle."""
        ids: list[Any] = list(self.held)
        for start in range(0, len(ids), 500):
            await self.redis.xclaim(
                self.key, GROUP, self.consumer, 0, ids[start : start + 500], justid=True
            )

    async def _claim(self) -> None:
        """Take over entries another consumer stopped refreshing (a dead instance's)."""
        cursor: bytes | str = "0-0"
        while not self.closed and len(self.held) < self.prefetch:
            reply: Any = await self.redis.xautoclaim(
                self.key, GROUP, self.consumer, self.claim_idle_ms, cursor, count=READ_COUNT
            )
            cursor, entries = reply[0], reply[1]
            taken = self._take(entries)
            if taken:
                self.claimed += taken
                log.info("claimed %d federation entries of a stalled instance", taken)
            if cursor in (b"0-0", "0-0"):
                break

    async def _forget_dead(self, period: float) -> None:
        dead_ms = int(period * 1000 * DEAD_CONSUMER_PERIODS) + self.claim_idle_ms
        for info in await self.redis.xinfo_consumers(self.key, GROUP):
            raw = info.get("name")
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name == self.consumer or info.get("pending", 0) or info.get("idle", 0) < dead_ms:
                continue
            await self.redis.xgroup_delconsumer(self.key, GROUP, name)

    async def close(self) -> None:
        await super().close()
        self._room.set()
        if self._adder is not None:
            # what was put goes into the stream still (another instance posts it), or its
            # senders hear that it failed (Redis bounds each try with its socket timeout)
            await self._adder
        # cancelled until they end: redis-py can swallow a cancellation (rmb_relay/tasks.py)
        await asyncio.gather(*(cancel_and_wait(task, STOP_TIMEOUT) for task in self._tasks))
        self._tasks = []
