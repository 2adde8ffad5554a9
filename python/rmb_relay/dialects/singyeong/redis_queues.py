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
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from rmb_relay.cluster import keys as cluster_keys
from rmb_relay.dialects.singyeong.queues import (
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_TOTAL_BYTES,
    DEFAULT_QUEUES_PER_APP,
    DEFAULT_QUEUES_TOTAL,
    MAX_REQUESTS_PER_CLIENT,
    MAX_REQUESTS_TOTAL,
    MESSAGE_OVERHEAD,
    Consumer,
    DeadPage,
    Message,
    QueueCounts,
    RequestCounts,
    TooManyQueues,
)
from rmb_relay.errors import BudgetExceeded
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

# KEYS: msgs, waiting, bytes, sizes; ARGV: id, record, size, per-queue limit
# -> {1, held after} stored, {0, held} over the queue's budget
_STORE = """
local held = tonumber(redis.call('GET', KEYS[3]) or '0')
if held + tonumber(ARGV[3]) > tonumber(ARGV[4]) then return {0, held} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return {1, redis.call('INCRBY', KEYS[3], ARGV[3])}
"""
#: dead letters read from Redis per round trip when listing them
DEAD_CHUNK = 100
#: Redis operations in flight at once (acks, retries, pumps, store batches)
MAX_CONCURRENT = 16
#: how often the sweep looks for expired deliveries when the ack timeout is long (seconds)
MAX_SWEEP_INTERVAL = 1.0

_CLAIM = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  local record = redis.call('HGET', KEYS[3], ARGV[1])
  if not record then return false end
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
    ) -> None:
        self.redis = redis
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
        self._to_store: list[tuple[Message, str, asyncio.Future[None]]] = []
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
        runs the store scripts."""
        done = asyncio.get_running_loop().create_future()
        self._to_store.append((message, app, done))
        if not self._storing:
            self._storing = True
            self._spawn(self._write_stores())
        await done

    async def _write_stores(self) -> None:
        try:
            while self._to_store:
                batch, self._to_store = self._to_store, []
                try:
                    await self._write_batch(batch)
                except Exception as err:
                    for _, _, done in batch:
                        if not done.done():
                            done.set_exception(err)
        finally:
            self._storing = False

    async def _write_batch(
        self, batch: list[tuple[Message, str, asyncio.Future[None]]], *, retry: bool = True
    ) -> None:
        """One round trip per batch, as one MULTI was before the budget: the bounds are
        checked here against this instance's view (`_total`, `_queue_held`, `_known_names`:
        exact for what it stores itself, refreshed from Redis by every sweep and corrected
        by every store script's answer), then the store scripts check each queue's bytes
        again, atomically, in the same pipeline as the total's INCRBY, the names and the
        events (a message a script refuses is taken off the total again)."""
        writes: list[tuple[Message, asyncio.Future[None], int, str]] = []
        apps: dict[str, str] = {}
        for message, app, done in batch:
            record = json.dumps(
                {
                    "queue": message.queue,
                    "nonce": message.nonce,
                    "target": message.target,
                    "payload": message.payload,
                },
                separators=(",", ":"),
            )
            size = len(record) + MESSAGE_OVERHEAD
            refusal = self._refusal(message.queue, size, app)
            if refusal is not None:
                done.set_exception(refusal)
                continue
            message.size = size
            writes.append((message, done, size, record))
            apps.setdefault(message.queue, self._known_names.get(message.queue, app))
        if not writes:
            return
        cluster = self._on_cluster
        if self._store_sha is None and not cluster:
            self._store_sha = str(await self.redis.script_load(_STORE))
        names = sorted({message.queue for message, _, _, _ in writes})
        async with self.redis.pipeline(transaction=False) as pipe:
            for message, _, size, record in writes:
                keys = _keys(message.queue)
                # a cluster pipeline sends each script whole (EVALSHA is refused there)
                run = pipe.eval if cluster else pipe.evalsha
                run(
                    _STORE if cluster else str(self._store_sha),
                    4,
                    keys["msgs"],
                    keys["waiting"],
                    keys["bytes"],
                    keys["sizes"],
                    message.id,
                    record,
                    size,
                    self.queue_bytes,
                )
            pipe.incrby(TOTAL_BYTES, sum(size for _, _, size, _ in writes))
            for name in names:
                pipe.sadd(NAMES, name)
                pipe.hsetnx(APPS, name, apps[name])
                if not cluster:
                    pipe.publish(EVENTS, name)
            results = await pipe.execute(raise_on_error=False)
        if cluster:  # (refused in a cluster pipeline)
            for name in names:
                try:
                    await self.redis.publish(EVENTS, name)
                except Exception as err:  # stored all the same: as when the pipeline's fails,
                    # a consumer waiting elsewhere hears of it with the next event of the queue
                    log.warning("singyeong queue events: could not publish: %s", err)
        not_stored = 0
        again: list[tuple[Message, str, asyncio.Future[None]]] = []
        for (message, done, size, _), result in zip(writes, results, strict=False):
            if isinstance(result, Exception):
                not_stored += size
                self._forget(message.queue, size)
                if isinstance(result, NoScriptError) and retry:
                    # Redis restarted (its script cache is empty): load it and store again
                    self._store_sha = None
                    again.append((message, apps[message.queue], done))
                else:
                    done.set_exception(result)
                continue
            stored, held = int(result[0]), int(result[1])
            self._queue_held[message.queue] = held
            if stored:
                done.set_result(None)
                continue
            not_stored += size
            self._total -= size
            self._refused["key"] += 1
            done.set_exception(
                BudgetExceeded(
                    "key", key=message.queue, size=size, held=held, allowed=self.queue_bytes
                )
            )
        for result in results[len(writes) :]:
            if isinstance(result, Exception):
                log.warning("singyeong queue store bookkeeping failed: %s", result)
        if not_stored:
            await self.redis.decrby(TOTAL_BYTES, not_stored)
        if again:
            await self._write_batch(again, retry=False)

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
        keys = _keys(name)
        released = int(
            await self._ack(
                keys=[
                    keys["unacked"],
                    keys["owner"],
                    keys["msgs"],
                    keys["attempts"],
                    keys["bytes"],
                    keys["sizes"],
                ],
                args=[message_id],
            )
        )
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
                ],
                args=[message_id, deadline, token],
            )
            if not claimed:
                continue  # another instance took it
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
        tasks = (self._listener, self._sweeper, *self._tasks)
        await asyncio.gather(*(cancel_and_wait(task, STOP_TIMEOUT) for task in tasks))
