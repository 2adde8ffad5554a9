"""Queues kept in Redis (decision 11 with `--redis`): stored before QUEUE_CONFIRM, shared by
every instance on that Redis, surviving a gateway restart.

Keys (built in `cluster/keys.py`; the braces keep one queue's keys in one Redis Cluster slot)
------------------------------------------------------------------------------------------
```text
sgq:{NAME}:msgs       hash  id -> message record (JSON: queue, nonce, target, payload)
sgq:{NAME}:waiting    list  ids in FIFO order
sgq:{NAME}:unacked    zset  id -> ack deadline (unix ms)
sgq:{NAME}:owner      hash  id -> delivery token (node:uuid) of the current delivery
sgq:{NAME}:attempts   hash  id -> deliveries so far
sgq:{NAME}:dead       hash  id -> {"reason", "dead_at"} (the record stays in msgs)
sgq:{NAME}:bytes      int   bytes the queue's messages are charged (--sg-queue-bytes)
sgq:{NAME}:sizes      hash  id -> bytes charged for it (given back when it is acked)
sgq:{NAME}:c:<id>     string a message's claim (TTL): `s:<node>` stored, or `w` withdrawn
sgq:names             set   queue names (for the ack-timeout sweep; an empty queue's goes)
sgq:apps              hash  queue name -> application of the client whose store made it
sgq:bytes             int   bytes all queues are charged (--sg-queue-total-bytes)
sgq:events            pub/sub channel: a queue's name when it has new waiting messages
```
Every move is one Lua script, so two instances never both claim, retry or ack one message.
Requests (QUEUE_REQUEST) stay with the instance the consumer is connected to; an instance
with requests outstanding scans the head of the waiting list (`SCAN_WINDOW` ids) for messages
its consumers match and claims them. Ack deadlines are wall-clock milliseconds (instances do
not share a monotonic clock); any instance's sweep retries expired deliveries, so a delivery
held by a crashed instance comes back after the ack timeout. A consumer that disconnects has
its deliveries retried at once by its own instance.

Budget (issue 33): the byte budget of the in-memory queues holds here too, counted in Redis
so that every instance sees one figure. A message costs its record's length plus
`MESSAGE_OVERHEAD` from its store to its ack (dead letters included). The per-queue bound
(`--sg-queue-bytes`) is checked and charged by the store script, atomically; the total
(`--sg-queue-total-bytes`, `sgq:bytes`, another slot) is checked against this instance's view
(`_write_batch`), refreshed by every sweep, so instances storing at the same moment may pass
it by what they stored since their last sweep. A store for a queue
name that does not exist while `sgq:names` has `--sg-queues-total` names, or while the
storing client's application made `--sg-queues-per-app` of them (`sgq:apps`, set with the
name), is refused; the sweep drops the names of empty queues and their applications. Both
are checked against this instance's view as the total is (exact for its own stores,
refreshed by every sweep). The requests an instance holds are counted like the
in-memory queues (`QueueCounts`, per application and in all). Refusals are op 3
`queue_full` / `too_many_queues`, as in memory.

Stored, or told it was not (issue 35; docs/faults.md)
----------------------------------------------------
A store whose call fails may still land: a cut link delivers what it held when it heals, and
a lost reply hides a store that was made (5 of ~1,250 QUEUEs refused in a 10 s cut were
stored; 127 of 189 in a Redis Cluster failover). So each message carries a claim, as the
tunnel's work queue entries do (`cluster/workqueue.py`, whose `withdraw_claims` this uses):
the store script sets it to `s:<node>` as it stores, atomically, and stores nothing when the
claim is set already. When the store's call fails, the gateway withdraws the message (sets
the claim to `w` unless it is set) before it tells the producer anything, and Redis decides
who came first: withdrawn, op 3 `queue unavailable` (certainly not stored, never delivered);
found stored, QUEUE_CONFIRM; no verdict within `--sg-queue-verdict-timeout` (the withdrawal
is asked again after a pause while Redis fails), op 3 `queue unknown` (it may be stored). A
retried write (redis-py sends it again after a reset) that finds its own claim stores nothing
more and is confirmed. While the cluster knows Redis is down nothing is written (below). The
pump drops a waiting message whose claim says withdrawn (none should be: the store checks
first).

A copy of a store landing after every claim expired must not store either: each store
carries a deadline (the verdict timeout from its first try), in Redis's time (`TIME`, read by
every sweep: this instance's estimate of Redis's clock, off by a round trip, not by another
host's clock), checked by the script against `TIME`; the claims are kept `CLAIM_MARGIN` past
it. A verdict counts only when its reply came within the verdict timeout (a duration here),
before any claim expired. On a Redis Cluster the script runs on the queue's primary, whose
clock may differ from the node that answered `TIME`: the margin covers that skew too.

Held while Redis is down
------------------------
A write tried while the cluster knows Redis is down (`Cluster.redis_up`, the signal the bus
and the tunnel's work queue use: no second opinion here) would wait on its timeouts and may
land later. So it is not tried: the QUEUE is held in memory, unwritten, in arrival order, and
written as usual (with its claim, confirmed or withdrawn as above) once the cluster sees Redis
again (`_hold_until_up` waits on `redis_back`, woken by the cluster). A QUEUE arriving while
others are held is held behind them even when Redis is up again, and the held ones go out
ahead of every later store: holding never reorders a producer's QUEUEs. Every store's
deadline runs from its arrival (`--sg-queue-verdict-timeout`): one still held then is refused
`queue unavailable`, certain since it was never written; one written later keeps what is left
of it (in Redis's time and for its withdrawal's verdict). What is held is bounded in bytes
(`--sg-queue-held-bytes`, a record and `MESSAGE_OVERHEAD` each, as the bus's `QUEUE_LIMIT`
bounds its own backlog): past it a QUEUE is refused at once, `queue unavailable`, logged
once per outage. A producer whose connection closes while its QUEUEs are held still has them
stored: each was accepted, as one already on its way to Redis is (the dialect's store task
does not end with the connection); the producer, never confirmed, may send it again (at
least once, as a lost QUEUE_CONFIRM). `rmb_relay_sg_queue_held_bytes` and
`rmb_relay_sg_queue_held_total{outcome}` show it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError, ResponseError

from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.cluster import keys as cluster_keys
from rmb_relay.cluster.bus import RETRY_DELAY, redis_errors
from rmb_relay.cluster.workqueue import WITHDRAWN, withdraw_claims
from rmb_relay.dialects.singyeong.queues import (
    DEFAULT_HELD_BYTES,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_TOTAL_BYTES,
    DEFAULT_QUEUES_PER_APP,
    DEFAULT_QUEUES_TOTAL,
    DEFAULT_VERDICT_TIMEOUT,
    MAX_REQUESTS_PER_CLIENT,
    MAX_REQUESTS_TOTAL,
    MESSAGE_OVERHEAD,
    Consumer,
    DeadPage,
    Message,
    NotStored,
    QueueCounts,
    RequestCounts,
    StoreUnknown,
    TooManyQueues,
)
from rmb_relay.errors import BudgetExceeded, ClusterUnavailable
from rmb_relay.tasks import STOP_TIMEOUT, cancel_and_wait

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient as Redis  # a server or a Cluster

log = logging.getLogger("rmb_relay.singyeong")

#: waiting ids looked at per pump; a message further back than this behind messages no local
#: consumer matches waits until the head moves (documented limit)
SCAN_WINDOW = 256
NAMES = cluster_keys.SG_QUEUE_NAMES
EVENTS = cluster_keys.SG_QUEUE_EVENTS
TOTAL_BYTES = cluster_keys.SG_QUEUE_BYTES
APPS = cluster_keys.SG_QUEUE_APPS

# KEYS: msgs, waiting, bytes, sizes, claim; ARGV: id, record, size, per-queue limit, claim
# value (ours), claim ms, deadline (Redis unix ms)
# -> {1, held after} stored, {0, held} over the queue's budget (claim withdrawn: a copy landing
# later must not store it), {2, held} stored before (a retried write: not again), {3, 0} the
# claim withdrawn, {4, 0} past its deadline (both: not stored). TIME before a write wants
# effects replication, the default since Redis 5 (asked for before it).
_STORE = """
if redis.replicate_commands then redis.replicate_commands() end
local claim = redis.call('GET', KEYS[5])
if claim == ARGV[5] then return {2, tonumber(redis.call('GET', KEYS[3]) or '0')} end
if claim then return {3, 0} end
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[7]) then
  return {4, 0}
end
local held = tonumber(redis.call('GET', KEYS[3]) or '0')
if held + tonumber(ARGV[3]) > tonumber(ARGV[4]) then
  redis.call('SET', KEYS[5], 'w', 'PX', ARGV[6])
  return {0, held}
end
redis.call('SET', KEYS[5], ARGV[5], 'PX', ARGV[6])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return {1, redis.call('INCRBY', KEYS[3], ARGV[3])}
"""
#: a claim is kept this long past its store's deadline (s): what the estimate of Redis's clock
#: may be off by, with a Redis Cluster's skew between nodes (module docstring)
CLAIM_MARGIN = 30.0
#: a stored message's claim value (+ the node), and the withdrawn one (`cluster/workqueue.py`)
STORED = b"s:"
#: withdrawals asked in one round trip at most
WITHDRAW_BATCH = 256
#: what a withdrawal found (`rmb_relay_sg_queue_withdrawals_total`'s labels, with "dropped": a
#: waiting message the pump found withdrawn)
VERDICTS = ("withdrawn", "stored", "unknown", "dropped")
#: how often held stores look whether the cluster sees Redis again (s; a property read)
#: what became of held stores (`rmb_relay_sg_queue_held_total`'s labels): written once Redis
#: was back, expired (past the verdict timeout, never written), refused (past
#: --sg-queue-held-bytes, at once)
HELD_OUTCOMES = ("written", "expired", "refused")
#: dead letters read from Redis per round trip when listing them
DEAD_CHUNK = 100
#: Redis operations in flight at once (acks, retries, pumps, store batches)
MAX_CONCURRENT = 16
#: how often the sweep looks for expired deliveries when the ack timeout is long (seconds)
MAX_SWEEP_INTERVAL = 1.0

# KEYS: waiting, unacked, msgs, owner, attempts, claim, bytes, sizes; ARGV: id, deadline,
# token -> {record, attempts}; false: not claimed; a number: its store's claim says withdrawn
# (dropped, its bytes given back + 1)
_CLAIM = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  local record = redis.call('HGET', KEYS[3], ARGV[1])
  if not record then return false end
  if redis.call('GET', KEYS[6]) == 'w' then
    redis.call('HDEL', KEYS[3], ARGV[1])
    local size = tonumber(redis.call('HGET', KEYS[8], ARGV[1]) or '0')
    redis.call('HDEL', KEYS[8], ARGV[1])
    if size > 0 then redis.call('DECRBY', KEYS[7], size) end
    return size + 1
  end
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
  redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
  local attempts = redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
  return {record, attempts}
end
return false
"""

# ARGV: id, max attempts, reason, now ms, token ('' = any), deadline bound ('' = none)
_RETRY = """
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score then return 0 end
if ARGV[5] ~= '' and redis.call('HGET', KEYS[4], ARGV[1]) ~= ARGV[5] then return 0 end
if ARGV[6] ~= '' and tonumber(score) > tonumber(ARGV[6]) then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
local attempts = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
if attempts >= tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[6], ARGV[1], cjson.encode({reason=ARGV[3], dead_at=tonumber(ARGV[4])}))
  return 2
end
redis.call('LPUSH', KEYS[1], ARGV[1])
return 1
"""

# -> bytes given back + 1 (0: not acked)
_ACK = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  local size = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
  redis.call('HDEL', KEYS[6], ARGV[1])
  if size > 0 then redis.call('DECRBY', KEYS[5], size) end
  return size + 1
end
return 0
"""

_REQUEUE = """
if redis.call('HDEL', KEYS[4], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[3], ARGV[1], 0)
  redis.call('RPUSH', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


_keys = cluster_keys.sg_queue_keys


def claim_key(queue: str, message_id: str) -> str:
    """A message's claim, in its queue's slot (the store script sets it)."""
    return f"sgq:{{{queue}}}:c:{message_id}"


@dataclass(eq=False)
class _Store:
    """A QUEUE on its way to Redis; its producer's task waits on `done`."""

    message: Message
    app: str
    done: asyncio.Future[None]
    #: when it arrived (`RedisQueues.clock`, ns): its verdict timeout runs from here
    arrived: int
    #: while held: the bytes it counts (record + overhead) and its deadline's timer
    size: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Unsure:
    """A message whose store failed, waiting for the verdict of its withdrawal."""

    message: Message
    done: asyncio.Future[None]
    size: int
    app: str
    #: when it arrived (clock ns): its verdict timeout runs from here
    arrived: int
    #: when its verdict timeout ends (the loop's clock)
    timer: asyncio.TimerHandle | None = None


async def _at_once() -> None:
    """`redis_back` without a cluster: Redis is never known down there."""


def _record(message: Message) -> str:
    """A message's record as stored in `sgq:{NAME}:msgs` (its length is what it costs)."""
    return json.dumps(
        {
            "queue": message.queue,
            "nonce": message.nonce,
            "target": message.target,
            "payload": message.payload,
        },
        separators=(",", ":"),
    )


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class RedisQueues:
    """The Redis twin of `queues.Queues` (same methods the dialect calls)."""

    #: expired deliveries are found by this class's own loop, not the dialect's sweep
    busy = False

    def __init__(
        self,
        redis: Redis,
        *,
        node: str,
        ack_timeout_ns: int,
        max_attempts: int,
        wall_ms: Callable[[], int],
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        queue_total_bytes: int = DEFAULT_QUEUE_TOTAL_BYTES,
        queues_per_app: int = DEFAULT_QUEUES_PER_APP,
        queues_total: int = DEFAULT_QUEUES_TOTAL,
        requests_per_client: int = MAX_REQUESTS_PER_CLIENT,
        requests_total: int = MAX_REQUESTS_TOTAL,
        verdict_timeout: float = DEFAULT_VERDICT_TIMEOUT,
        held_bytes: int = DEFAULT_HELD_BYTES,
        redis_up: Callable[[], bool] = lambda: True,
        redis_back: Callable[[], Awaitable[None]] | None = None,
        clock: Clock = monotonic_clock,
    ) -> None:
        """`redis_up`: False while the cluster knows Redis is down (a store is held then,
        unwritten, up to `held_bytes`: module docstring), and `redis_back` returns once it is
        True again (`Cluster.redis_up`, `Cluster.redis_back`); `clock` (monotonic ns) measures
        the stores' verdict timeouts and paces the estimate of Redis's clock."""
        self.redis = redis
        self.redis_up = redis_up
        self.redis_back = redis_back if redis_back is not None else _at_once
        #: acks tried again after a failed Redis call (`_ack_one`)
        self.counts_ack_retries = 0
        self.clock = clock
        self.verdict_timeout = verdict_timeout
        self.held_limit = held_bytes
        #: stores held while Redis is known down, in arrival order, and their bytes
        self._held: deque[_Store] = deque()
        self._held_bytes = 0
        self._holder: asyncio.Task[None] | None = None
        #: the bound was passed in this outage (logged once)
        self._held_full = False
        self.counts_held = dict.fromkeys(HELD_OUTCOMES, 0)
        #: how long a claim is kept (ms): past any store's deadline by `CLAIM_MARGIN`
        self.claim_ms = int((verdict_timeout + CLAIM_MARGIN) * 1000)
        self._stored = STORED + node.encode()
        #: Redis's clock minus ours (ms), from its TIME (`_read_time`); None: not read yet
        self._offset_ms: int | None = None
        #: stores waiting for a withdrawal's verdict, by (queue, id) (module docstring)
        self._withdrawing: dict[tuple[str, str], _Unsure] = {}
        self._withdrawer: asyncio.Task[None] | None = None
        self.counts_by_verdict = dict.fromkeys(VERDICTS, 0)
        self.queue_bytes = queue_bytes
        self.queue_total_bytes = queue_total_bytes
        self.queues_total = queues_total
        self.queues_per_app = queues_per_app
        #: the names this instance holds requests for, per application (module docstring)
        self.counts = QueueCounts(queues_per_app, queues_total)
        self._request_app: dict[str, str] = {}
        #: outstanding requests per consumer and in all (queues.py `RequestCounts`)
        self._outstanding = RequestCounts(requests_per_client, requests_total)
        self._refused = {"key": 0, "total": 0}
        #: this instance's view of what Redis holds (`_write_batch`): bytes of all queues,
        #: per queue, the queue names and their number; refreshed by every sweep
        self._total = 0
        self._queue_held: dict[str, int] = {}
        #: queue name -> the application of the client whose store made it (`sgq:apps`)
        self._known_names: dict[str, str] = {}
        #: how many of `_known_names` each application made
        self._app_names: dict[str, int] = {}
        self._names = 0
        #: names this instance counted as new since the sweep before the last began (their
        #: store may not have reached `sgq:names` when a sweep read it)
        self._fresh: set[str] = set()
        self._store_sha: str | None = None
        #: a Redis Cluster client: its pipelines refuse EVALSHA and PUBLISH (`_write_batch`)
        self._on_cluster = type(redis).__name__ == "RedisCluster"
        self.node = node
        self.ack_timeout_ms = ack_timeout_ns // 1_000_000
        self.max_attempts = max_attempts
        self.wall_ms = wall_ms
        self.requests: dict[str, deque[Consumer]] = {}
        #: deliveries made by this instance: (queue, id) -> (consumer, token)
        self.held: dict[tuple[str, str], tuple[Consumer, str]] = {}
        self._claim = redis.register_script(_CLAIM)
        self._retry = redis.register_script(_RETRY)
        self._ack = redis.register_script(_ACK)
        self._requeue = redis.register_script(_REQUEUE)
        self._pumping: set[str] = set()
        self._again: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._depth = (0, 0, 0)
        self._to_store: list[_Store] = []
        self._limit = asyncio.Semaphore(MAX_CONCURRENT)
        self._storing = False
        #: set when the event listener is subscribed (tests wait for it)
        self.listening = asyncio.Event()

    # ---- background work -------------------------------------------------------------------

    def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._bounded(coro))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _bounded(self, coro: Any) -> Any:
        """At most `MAX_CONCURRENT` Redis operations at once: a burst of acks must not ask the
        shared connection pool for more connections than it has."""
        try:
            async with self._limit:
                return await coro
        finally:
            coro.close()  # a no-op once it ran; quiets one cancelled before it started

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("singyeong redis queue operation failed: %s", task.exception())

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(EVENTS)
                self.listening.set()
                # what arrived while we were not listening
                for name in list(self.requests):
                    self.pump(name)
                async for item in pubsub.listen():
                    if item.get("type") == "message":
                        data = item["data"]
                        name = data.decode() if isinstance(data, bytes) else str(data)
                        if self.requests.get(name):
                            self.pump(name)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # Redis gone: retry, requests stay local meanwhile
                self.listening.clear()
                log.warning("singyeong queue events: %s; resubscribing", err)
                await asyncio.sleep(0.5)

    async def _sweep_loop(self) -> None:
        interval = min(MAX_SWEEP_INTERVAL, self.ack_timeout_ms / 4000)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep_expired(self.wall_ms())
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("singyeong queue sweep: %s", err)

    # ---- the client's operations -----------------------------------------------------------

    async def store(self, message: Message, app: str = "") -> None:
        """Stored when this returns (the caller confirms after it); raises BudgetExceeded or
        TooManyQueues when refused (module docstring), else on a Redis error. Every store of
        a loop turn goes out in one pipeline on one connection (a burst of QUEUEs must not
        take a pooled connection each): one round trip reads the total and the names, one
        runs the store scripts. While Redis is known down, or stores are held, it is held
        (module docstring: "Held while Redis is down")."""
        done = asyncio.get_running_loop().create_future()
        item = _Store(message, app, done, self.clock())
        if self._held or not self.redis_up():
            self._hold([item])
        else:
            self._to_store.append(item)
            self._write_soon()
        await done

    def _write_soon(self) -> None:
        if not self._storing and self._to_store:
            self._storing = True
            self._spawn(self._write_stores())

    async def _write_stores(self) -> None:
        try:
            while self._to_store:
                batch, self._to_store = self._to_store, []
                try:
                    await self._write_batch(batch)
                except Exception as err:
                    for item in batch:
                        if not item.done.done():
                            item.done.set_exception(err)
        finally:
            self._storing = False

    # ---- holding stores while Redis is known down ------------------------------------------

    def _hold(self, items: list[_Store], *, first: bool = False) -> None:
        """Hold `items` (in arrival order) until Redis is back or their deadline; `first`:
        ahead of those held already (a batch that found Redis down: it arrived before them).
        One past `held_limit` is refused at once (module docstring)."""
        loop = asyncio.get_running_loop()
        kept: list[_Store] = []
        for item in items:
            if item.done.done():  # its producer's task was cancelled (the gateway closing)
                continue
            item.size = len(_record(item.message)) + MESSAGE_OVERHEAD
            if self._held_bytes + item.size > self.held_limit:
                self.counts_held["refused"] += 1
                if not self._held_full:
                    self._held_full = True
                    log.warning(
                        "singyeong: QUEUEs held while redis is down reached "
                        "--sg-queue-held-bytes (%d): more are refused at once (queue "
                        "unavailable, not stored) until redis is back",
                        self.held_limit,
                    )
                item.done.set_exception(
                    NotStored("redis is unavailable and --sg-queue-held-bytes is reached")
                )
                continue
            self._held_bytes += item.size
            left = self.verdict_timeout - (self.clock() - item.arrived) / 1e9
            item.timer = loop.call_later(max(0.0, left), self._held_expired, item)
            kept.append(item)
        if first:
            self._held.extendleft(reversed(kept))
        else:
            self._held.extend(kept)
        if self._held and self._holder is None:
            self._holder = loop.create_task(self._hold_until_up())

    def _held_expired(self, item: _Store) -> None:
        """Its verdict timeout ended while held: never written, so certainly not stored."""
        try:
            self._held.remove(item)
        except ValueError:  # released meanwhile
            return
        self._held_bytes -= item.size
        self.counts_held["expired"] += 1
        if not item.done.done():
            item.done.set_exception(
                NotStored(f"redis was unavailable for {self.verdict_timeout:g} s: never written")
            )

    async def _hold_until_up(self) -> None:
        """Once the cluster sees Redis again, the held stores go out, ahead of any later one."""
        try:
            while self._held:
                if not self.redis_up():
                    await self.redis_back()
                    continue
                released, self._held = list(self._held), deque()
                self._held_bytes = 0
                self._held_full = False
                for item in released:
                    if item.timer is not None:
                        item.timer.cancel()
                    item.timer = None
                self.counts_held["written"] += len(released)
                self._to_store.extend(released)
                self._write_soon()
        finally:
            self._holder = None

    def ack_retries(self) -> int:
        """Acks tried again after a failed Redis call (`_ack_one`), for the metrics."""
        return self.counts_ack_retries

    def held_stores(self) -> tuple[int, dict[str, int]]:
        """Bytes held now and what became of held stores (metrics.py)."""
        return self._held_bytes, dict(self.counts_held)

    async def _write_batch(self, batch: list[_Store], *, retry: bool = True) -> None:
        """One round trip per batch, as one MULTI was before the budget: the bounds are
        checked here against this instance's view (`_total`, `_queue_held`, `_known_names`:
        exact for what it stores itself, refreshed from Redis by every sweep and corrected
        by every store script's answer), then the store scripts check each queue's bytes
        again, atomically, in the same pipeline as the total's INCRBY, the names and the
        events (a message a script refuses is taken off the total again). Nothing is written
        while Redis is known to be down (the batch is held, ahead of what was held after it:
        `_hold`); a store whose outcome is not known is withdrawn (`_withdraw_later`; module
        docstring)."""
        if not self.redis_up():  # with the stores after it, which are older than any held
            later, self._to_store = self._to_store, []
            self._hold([*batch, *later], first=True)
            return
        writes: list[tuple[Message, asyncio.Future[None], int, str, str, int]] = []
        apps: dict[str, str] = {}
        for item in batch:
            message, app, done = item.message, item.app, item.done
            if done.done():  # its producer's task was cancelled (the gateway closing)
                continue
            record = _record(message)
            size = len(record) + MESSAGE_OVERHEAD
            refusal = self._refusal(message.queue, size, app)
            if refusal is not None:
                done.set_exception(refusal)
                continue
            message.size = size
            writes.append((message, done, size, record, app, item.arrived))
            apps.setdefault(message.queue, self._known_names.get(message.queue, app))
        if not writes:
            return
        try:
            cluster = self._on_cluster
            if self._store_sha is None and not cluster:
                self._store_sha = str(await self.redis.script_load(_STORE))
            if self._offset_ms is None:
                await self._read_time()
        except Exception:  # nothing written yet: not stored
            for message, _, size, _, _, _ in writes:
                self._forget(message.queue, size)
            raise
        offset_ms = self._offset_ms
        assert offset_ms is not None
        timeout_ms = int(self.verdict_timeout * 1000)
        names = sorted({message.queue for message, _, _, _, _, _ in writes})
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for message, _, size, record, _, arrived in writes:
                    keys = _keys(message.queue)
                    # (in Redis's time: the verdict timeout from its arrival, module docstring)
                    deadline = arrived // 1_000_000 + offset_ms + timeout_ms
                    # a cluster pipeline sends each script whole (EVALSHA is refused there)
                    run = pipe.eval if cluster else pipe.evalsha
                    run(
                        _STORE if cluster else str(self._store_sha),
                        5,
                        keys["msgs"],
                        keys["waiting"],
                        keys["bytes"],
                        keys["sizes"],
                        claim_key(message.queue, message.id),
                        message.id,
                        record,
                        size,
                        self.queue_bytes,
                        self._stored,
                        self.claim_ms,
                        deadline,
                    )
                pipe.incrby(TOTAL_BYTES, sum(size for _, _, size, _, _, _ in writes))
                for name in names:
                    pipe.sadd(NAMES, name)
                    pipe.hsetnx(APPS, name, apps[name])
                    if not cluster:
                        pipe.publish(EVENTS, name)
                results = await pipe.execute(raise_on_error=False)
        except redis_errors() as err:  # any of them may have landed, or may still
            log.warning("singyeong queue store failed, withdrawing: %s", err)
            self._withdraw_later(
                [_Unsure(m, done, size, app, arrived) for m, done, size, _, app, arrived in writes]
            )
            return
        if cluster:  # (refused in a cluster pipeline)
            await self._announce(names, {})
        not_stored = 0
        again: list[_Store] = []
        unsure: list[_Unsure] = []
        for (message, done, size, _, app, arrived), result in zip(writes, results, strict=False):
            if done.done():  # (its producer's task was cancelled meanwhile: the gateway closing)
                done = asyncio.get_running_loop().create_future()
            if isinstance(result, Exception):
                not_stored += size
                if isinstance(result, NoScriptError) and retry:
                    # Redis restarted (its script cache is empty): load it and store again
                    self._forget(message.queue, size)
                    self._store_sha = None
                    again.append(_Store(message, app, done, arrived))
                elif isinstance(result, ResponseError):  # Redis refused it: not run
                    self._forget(message.queue, size)
                    done.set_exception(NotStored(f"redis: {result}"))
                else:  # (a connection failed under it) it may have landed
                    unsure.append(_Unsure(message, done, size, app, arrived))
                continue
            code, held = int(result[0]), int(result[1])
            if code in (1, 2):
                self._queue_held[message.queue] = held
                if code == 2:  # stored by an earlier try; the total was charged again
                    not_stored += size
                done.set_result(None)
                continue
            not_stored += size
            self._total -= size
            if code == 0:
                self._queue_held[message.queue] = held
                self._refused["key"] += 1
                done.set_exception(
                    BudgetExceeded(
                        "key", key=message.queue, size=size, held=held, allowed=self.queue_bytes
                    )
                )
            else:
                self._forget(message.queue, 0)
                why = "withdrawn" if code == 3 else "past its deadline"
                done.set_exception(NotStored(f"the store came too late ({why})"))
        for result in results[len(writes) :]:
            if isinstance(result, Exception):
                log.warning("singyeong queue store bookkeeping failed: %s", result)
        if unsure:
            self._withdraw_later(unsure)
        if not_stored:
            try:
                await self.redis.decrby(TOTAL_BYTES, not_stored)
            except redis_errors() as err:  # the total is read again by the next sweep
                log.warning("singyeong queue budget: could not give back bytes: %s", err)
        if again:
            try:
                await self._write_batch(again, retry=False)
            except Exception as err:  # (not the others': some may wait for a verdict)
                for item in again:
                    if not item.done.done():
                        item.done.set_exception(err)

    async def _read_time(self) -> None:
        """Redis's clock against ours (`_offset_ms`), from the middle of a TIME's round trip."""
        before = self.clock()
        raw: Any = await self.redis.time()
        after = self.clock()
        if isinstance(raw, dict):  # (a cluster client may name the node that answered)
            raw = next(iter(raw.values()))
        seconds, micros = raw
        redis_ms = int(seconds) * 1000 + int(micros) // 1000
        self._offset_ms = redis_ms - (before + after) // 2_000_000

    async def _announce(self, names: list[str], apps: dict[str, str]) -> None:
        """The events of `names` (and with `apps`, their names and applications: for stores
        found made by a withdrawal, whose pipeline failed). An event lost is heard with the
        next event of the queue by a consumer waiting elsewhere."""
        try:
            if apps:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for name in names:
                        pipe.sadd(NAMES, name)
                        pipe.hsetnx(APPS, name, apps[name])
                    await pipe.execute()
            for name in names:
                await self.redis.publish(EVENTS, name)
        except redis_errors() as err:
            log.warning("singyeong queue events: could not publish: %s", err)

    # ---- withdrawing a store that failed ---------------------------------------------------

    def _withdraw_later(self, unsure: list[_Unsure]) -> None:
        """Withdraw these stores before their producers are told anything; without a verdict
        by the verdict timeout (from each one's arrival) they are refused `queue unknown`
        (module docstring)."""
        loop = asyncio.get_running_loop()
        now = self.clock()
        for item in unsure:
            key = (item.message.queue, item.message.id)
            self._withdrawing[key] = item
            left = max(0.0, self.verdict_timeout - (now - item.arrived) / 1e9)
            item.timer = loop.call_later(left, self._no_verdict, key)
        if self._withdrawer is None:
            self._withdrawer = loop.create_task(self._withdraw_all())

    def _no_verdict(self, key: tuple[str, str]) -> None:
        item = self._withdrawing.pop(key, None)
        if item is None or item.done.done():
            return
        self.counts_by_verdict["unknown"] += 1
        item.done.set_exception(
            StoreUnknown(f"no verdict on withdrawing it within {self.verdict_timeout:g} s")
        )

    async def _withdraw_all(self) -> None:
        """Ask for the withdrawals waiting, a batch per round trip, again after a pause while
        Redis fails; each verdict settles its store (stored: confirmed; withdrawn: refused)."""
        failing = False
        try:
            while self._withdrawing:
                batch = list(itertools.islice(self._withdrawing.items(), WITHDRAW_BATCH))
                claims = [(claim_key(queue, mid), self.claim_ms) for (queue, mid), _ in batch]
                try:
                    held: list[bytes | None] | None = await withdraw_claims(self.redis, claims)
                except ClusterUnavailable as err:
                    if not failing:  # once per outage
                        log.warning("singyeong: cannot withdraw failed stores yet: %s", err)
                    failing = True
                    held = None
                if held is None:
                    await asyncio.sleep(RETRY_DELAY)  # a pause between tries
                    continue
                stored: dict[str, str] = {}
                for (key, item), value in zip(batch, held, strict=True):
                    if self._withdrawing.get(key) is not item or item.done.done():
                        continue  # its verdict timeout ended meanwhile
                    del self._withdrawing[key]
                    if item.timer is not None:
                        item.timer.cancel()
                    queue = item.message.queue
                    if value == self._stored:
                        self.counts_by_verdict["stored"] += 1
                        stored.setdefault(queue, self._known_names.get(queue, item.app))
                        item.done.set_result(None)
                    elif value == WITHDRAWN:
                        self.counts_by_verdict["withdrawn"] += 1
                        self._forget(queue, item.size)
                        item.done.set_exception(NotStored("withdrawn: its store never lands"))
                    else:  # the claim gone (not expected within the verdict timeout)
                        self.counts_by_verdict["unknown"] += 1
                        item.done.set_exception(StoreUnknown(f"its claim holds {value!r}"))
                if stored:
                    await self._announce(sorted(stored), stored)
        finally:
            self._withdrawer = None

    def withdrawals(self) -> dict[str, int]:
        """`rmb_relay_sg_queue_withdrawals_total` by verdict (metrics.py)."""
        return dict(self.counts_by_verdict)

    def _refusal(self, name: str, size: int, app: str) -> Exception | None:
        """Why a message of `size` bytes for queue `name` (stored by a client of `app`)
        cannot be stored (this instance's view), or None: then it is counted in that view."""
        new = name not in self._known_names
        if new and self._names >= self.queues_total:
            return TooManyQueues(name, "total", self.queues_total, "the gateway")
        if new and self._app_names.get(app, 0) >= self.queues_per_app:
            return TooManyQueues(name, "per_app", self.queues_per_app, f"application {app[:64]!r}")
        held = self._queue_held.get(name, 0)
        if held + size > self.queue_bytes:
            self._refused["key"] += 1
            return BudgetExceeded("key", key=name, size=size, held=held, allowed=self.queue_bytes)
        if self._total + size > self.queue_total_bytes:
            self._refused["total"] += 1
            return BudgetExceeded(
                "total", key=name, size=size, held=self._total, allowed=self.queue_total_bytes
            )
        if new:
            self._known_names[name] = app
            self._fresh.add(name)
            self._app_names[app] = self._app_names.get(app, 0) + 1
            self._names += 1
        self._queue_held[name] = held + size
        self._total += size
        return None

    def _forget(self, name: str, size: int) -> None:
        """`size` bytes of queue `name` are no longer held (acked, or never stored)."""
        self._total = max(0, self._total - size)
        left = self._queue_held.get(name, 0) - size
        if left > 0:
            self._queue_held[name] = left
        else:
            self._queue_held.pop(name, None)

    def stored(self, message: Message) -> None:
        self.pump(message.queue)

    def request(self, name: str, consumer: Consumer, app: str = "") -> None:
        """Raises TooManyRequests when too many requests are outstanding here, TooManyQueues
        when this instance holds requests for as many queues as it may."""
        self._outstanding.check(consumer)
        waiting = self.requests.get(name)
        if waiting is None:
            self.counts.check(name, app)
            self.counts.add(app)
            self._request_app[name] = app
            waiting = self.requests[name] = deque()
        self._outstanding.add(consumer)
        waiting.append(consumer)
        self.pump(name)

    def _drop_requests(self, name: str) -> None:
        """No request is left for `name`: it stops counting."""
        del self.requests[name]
        self.counts.remove(self._request_app.pop(name, ""))

    def cancel(self, name: str, consumer: Consumer) -> None:
        waiting = self.requests.get(name)
        if waiting is not None:
            kept = deque(c for c in waiting if c is not consumer)
            self._outstanding.done(consumer, len(waiting) - len(kept))
            self.requests[name] = kept
            if not kept:
                self._drop_requests(name)

    def ack(self, name: str, message_id: str) -> bool:
        self.held.pop((name, message_id), None)
        self._spawn(self._ack_one(name, message_id))
        return True

    async def _ack_one(self, name: str, message_id: str) -> None:
        """The ack script, tried again while Redis fails (it is idempotent: a second run finds
        the message gone), until the delivery's ack timeout would pass: an ack lost to a
        failed call (a failover's shard without a primary) delivers the message again."""
        keys = _keys(name)
        ack_keys = [
            keys["unacked"],
            keys["owner"],
            keys["msgs"],
            keys["attempts"],
            keys["bytes"],
            keys["sizes"],
        ]
        give_up = self.clock() + self.ack_timeout_ms * 1_000_000
        while True:
            try:
                released = int(await self._ack(keys=ack_keys, args=[message_id]))
                break
            except redis_errors():
                if self.clock() >= give_up:
                    raise  # logged by `_done`; the message comes again after its timeout
                self.counts_ack_retries += 1
                await self.redis_back()  # at once unless the cluster knows Redis is down
                await asyncio.sleep(RETRY_DELAY)
        if released > 1:
            self._forget(name, released - 1)
            await self.redis.decrby(TOTAL_BYTES, released - 1)

    def consumer_gone(self, consumer: Consumer) -> None:
        for name in list(self.requests):
            self.cancel(name, consumer)
        self._outstanding.gone(consumer)
        for (name, message_id), (holder, token) in list(self.held.items()):
            if holder is consumer:
                del self.held[(name, message_id)]
                self._spawn(self._retry_one(name, message_id, "consumer disconnected", token, ""))

    def sweep(self, now: int) -> None:
        """The dialect's sweep: nothing to do here (expired deliveries have their own loop)."""

    def depth(self) -> tuple[int, int, int]:
        return self._depth

    def held_bytes(self) -> tuple[int, int]:
        """Bytes charged in Redis, all queues, as of the last sweep (dead letters are not
        told apart there)."""
        return self._total, 0

    def refusals(self) -> dict[str, int]:
        """Stores this instance refused by budget (`key`, `total`)."""
        return dict(self._refused)

    def names(self) -> set[str]:
        """The queues this instance holds requests for or knows to exist in Redis."""
        return set(self.requests) | set(self._known_names)

    def queue_count(self) -> int:
        """Queue names in Redis as of the last sweep."""
        return self._names

    # ---- moves -----------------------------------------------------------------------------

    async def _retry_one(
        self, name: str, message_id: str, reason: str, token: str, before: str
    ) -> int:
        keys = _keys(name)
        result = int(
            await self._retry(
                keys=[
                    keys["waiting"],
                    keys["unacked"],
                    keys["msgs"],
                    keys["owner"],
                    keys["attempts"],
                    keys["dead"],
                ],
                args=[message_id, self.max_attempts, reason, self.wall_ms(), token, before],
            )
        )
        if result == 1:
            await self.redis.publish(EVENTS, name)
        return result

    async def sweep_expired(self, now_ms: int) -> None:
        """Retry every delivery (of any instance) whose ack deadline has passed; drop the
        names of queues left empty (a store re-adds its name after writing, and a name is
        put back if a message arrived while it was dropped)."""
        await self._read_time()  # (module docstring: the stores' deadlines)
        waiting = unacked = dead = 0
        fresh, self._fresh = self._fresh, set()
        names = await self.redis.smembers(NAMES)
        known: set[str] = set()
        queue_held: dict[str, int] = {}
        for raw in names:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            keys = _keys(name)
            for raw_id in await self.redis.zrangebyscore(keys["unacked"], "-inf", now_ms):
                message_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
                if await self._retry_one(name, message_id, "ack timeout", "", str(now_ms)):
                    self.held.pop((name, message_id), None)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.llen(keys["waiting"])
                pipe.zcard(keys["unacked"])
                pipe.hlen(keys["dead"])
                pipe.hlen(keys["msgs"])
                pipe.get(keys["bytes"])
                w, u, d, m, held = await pipe.execute()
            waiting, unacked, dead = waiting + w, unacked + u, dead + d
            if not m and not self.requests.get(name):
                await self.redis.srem(NAMES, name)
                if not await self.redis.hlen(keys["msgs"]):
                    await self.redis.hdel(APPS, name)
                    continue
                await self.redis.sadd(NAMES, name)
            known.add(name)
            if held:
                queue_held[name] = int(held)
        self._depth = (waiting, unacked, dead)
        self._total = int(await self.redis.get(TOTAL_BYTES) or 0)
        listed = {n.decode() if isinstance(n, bytes) else str(n) for n in names}
        made_by = {_text(k): _text(v) for k, v in (await self.redis.hgetall(APPS)).items()}
        known_names = {name: made_by.get(name, "") for name in known}
        # names this instance stored meanwhile stay known until a sweep lists them (a name
        # another instance's sweep dropped is not kept: it was not stored here since)
        for name in fresh | self._fresh:
            app = self._known_names.get(name)
            if name not in listed and app is not None:
                known_names[name] = app
        self._known_names = known_names
        self._app_names = {}
        for app in known_names.values():
            self._app_names[app] = self._app_names.get(app, 0) + 1
        self._names = len(known_names)
        self._queue_held = queue_held

    def pump(self, name: str) -> None:
        if name in self._pumping:
            self._again.add(name)
            return
        if not self.requests.get(name):
            return
        self._pumping.add(name)
        self._spawn(self._pump(name))

    async def _pump(self, name: str) -> None:
        try:
            while True:
                self._again.discard(name)
                await self._pump_once(name)
                if name not in self._again:
                    return
        finally:
            self._pumping.discard(name)

    async def _pump_once(self, name: str) -> None:
        keys = _keys(name)
        ids = [
            i.decode() if isinstance(i, bytes) else str(i)
            for i in await self.redis.lrange(keys["waiting"], 0, SCAN_WINDOW - 1)
        ]
        if not ids:
            return
        records = await self.redis.hmget(keys["msgs"], ids)
        for message_id, raw in zip(ids, records, strict=True):
            requests = self.requests.get(name)
            if not requests:
                return
            if raw is None:
                continue
            message = Message.from_record({**json.loads(raw), "id": message_id})
            try:
                query = message.parsed()
            except ValueError:
                continue
            consumer = next((c for c in requests if c.matches(query)), None)
            if consumer is None:
                continue
            token = f"{self.node}:{uuid.uuid4()}"
            deadline = self.wall_ms() + self.ack_timeout_ms
            claimed = await self._claim(
                keys=[
                    keys["waiting"],
                    keys["unacked"],
                    keys["msgs"],
                    keys["owner"],
                    keys["attempts"],
                    claim_key(name, message_id),
                    keys["bytes"],
                    keys["sizes"],
                ],
                args=[message_id, deadline, token],
            )
            if not claimed:
                continue  # another instance took it
            if isinstance(claimed, int):  # withdrawn by its producer: never delivered
                self.counts_by_verdict["dropped"] += 1
                log.warning("singyeong: queue %s: message %s was withdrawn", name, message_id)
                if claimed > 1:
                    self._forget(name, claimed - 1)
                    await self.redis.decrby(TOTAL_BYTES, claimed - 1)
                continue
            requests = self.requests.get(name)
            if not requests or consumer not in requests:
                # the consumer left or cancelled while we claimed: give it straight back
                await self._retry_one(name, message_id, "consumer disconnected", token, "")
                continue
            requests.remove(consumer)
            self._outstanding.done(consumer)
            if not requests:
                self._drop_requests(name)
            message.attempts = int(claimed[1])
            self.held[(name, message_id)] = (consumer, token)
            consumer.deliver_queued(message)

    # ---- dead letters ----------------------------------------------------------------------

    async def list_dead(self, name: str | None, page: DeadPage) -> None:
        """Fill `page` with dead letters (of queue `name`, or all) in (queue, id) order:
        the ids of a queue's dead letters are read (HKEYS), then records in chunks of the
        page's size (one round trip each), until the page is full."""
        if name is not None:
            names = [name]
        else:
            names = sorted(_text(n) for n in await self.redis.smembers(NAMES))
        for queue in names:
            if page.after is not None and queue < page.after[0]:
                continue
            keys = _keys(queue)
            ids = sorted(
                i for i in map(_text, await self.redis.hkeys(keys["dead"])) if page.wanted(queue, i)
            )
            step = min(page.limit, DEAD_CHUNK)
            for start in range(0, len(ids), step):
                chunk = ids[start : start + step]
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hmget(keys["dead"], chunk)
                    pipe.hmget(keys["msgs"], chunk)
                    pipe.hmget(keys["attempts"], chunk)
                    infos, records, attempts = await pipe.execute()
                for message_id, raw_info, record, tries in zip(
                    chunk, infos, records, attempts, strict=True
                ):
                    if record is None or raw_info is None:
                        continue
                    info = json.loads(raw_info)
                    letter = {
                        **json.loads(record),
                        "id": message_id,
                        "attempts": int(tries or 0),
                        "reason": info.get("reason"),
                        "dead_at": info.get("dead_at"),
                    }
                    if not page.add(queue, message_id, letter):
                        return

    async def requeue_dead(self, name: str, ids: list[str] | None) -> int:
        keys = _keys(name)
        if ids is None:
            ids = [
                i.decode() if isinstance(i, bytes) else str(i)
                for i in await self.redis.hkeys(keys["dead"])
            ]
        moved = 0
        for message_id in ids:
            moved += int(
                await self._requeue(
                    keys=[keys["waiting"], keys["msgs"], keys["attempts"], keys["dead"]],
                    args=[message_id],
                )
            )
        if moved:
            await self.redis.publish(EVENTS, name)
        return moved

    async def close(self) -> None:
        # cancelled until they end: redis-py can swallow a cancellation (rmb_relay/tasks.py)
        for item in self._withdrawing.values():
            if item.timer is not None:
                item.timer.cancel()
        for held in self._held:  # never written: not stored (their sessions are closing)
            if held.timer is not None:
                held.timer.cancel()
            if not held.done.done():
                held.done.set_exception(NotStored("the gateway is closing"))
        self._held.clear()
        self._held_bytes = 0
        tasks = (self._listener, self._sweeper, self._withdrawer, self._holder, *self._tasks)
        await asyncio.gather(*(cancel_and_wait(task, STOP_TIMEOUT) for task in tasks))
