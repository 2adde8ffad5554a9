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
sgq:names             set   queue names (for the ack-timeout sweep)
sgq:events            pub/sub channel: a queue's name when it has new waiting messages
```
Every move is one Lua script, so two instances never both claim, retry or ack one message.
Requests (QUEUE_REQUEST) stay with the instance the consumer is connected to; an instance
with requests outstanding scans the head of the waiting list (`SCAN_WINDOW` ids) for messages
its consumers match and claims them. Ack deadlines are wall-clock milliseconds (instances do
not share a monotonic clock); any instance's sweep retries expired deliveries, so a delivery
held by a crashed instance comes back after the ack timeout. A consumer that disconnects has
its deliveries retried at once by its own instance.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rmb_relay.cluster import keys as cluster_keys
from rmb_relay.dialects.singyeong.queues import Consumer, Message
from rmb_relay.tasks import STOP_TIMEOUT, cancel_and_wait

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient as Redis  # a server or a Cluster

log = logging.getLogger("rmb_relay.singyeong")

#: waiting ids looked at per pump; a message further back than this behind messages no local
#: consumer matches waits until the head moves (documented limit)
SCAN_WINDOW = 256
NAMES = cluster_keys.SG_QUEUE_NAMES
EVENTS = cluster_keys.SG_QUEUE_EVENTS
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

_ACK = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  return 1
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
    ) -> None:
        self.redis = redis
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
        self._to_store: list[tuple[Message, asyncio.Future[None]]] = []
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

    async def store(self, message: Message) -> None:
        """Stored when this returns (the caller confirms after it); raises on a Redis error.
        Every store of a loop turn goes out in one MULTI pipeline on one connection (a burst
        of QUEUEs must not take a pooled connection each)."""
        done = asyncio.get_running_loop().create_future()
        self._to_store.append((message, done))
        if not self._storing:
            self._storing = True
            self._spawn(self._write_stores())
        await done

    async def _write_stores(self) -> None:
        try:
            while self._to_store:
                batch, self._to_store = self._to_store, []
                try:
                    async with self.redis.pipeline(transaction=True) as pipe:
                        names = set()
                        for message, _ in batch:
                            keys = _keys(message.queue)
                            record = json.dumps(
                                {
                                    "queue": message.queue,
                                    "nonce": message.nonce,
                                    "target": message.target,
                                    "payload": message.payload,
                                },
                                separators=(",", ":"),
                            )
                            pipe.hset(keys["msgs"], message.id, record)
                            pipe.rpush(keys["waiting"], message.id)
                            names.add(message.queue)
                        for name in names:
                            pipe.sadd(NAMES, name)
                            pipe.publish(EVENTS, name)
                        await pipe.execute()
                except Exception as err:
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(err)
                    continue
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._storing = False

    def stored(self, message: Message) -> None:
        self.pump(message.queue)

    def request(self, name: str, consumer: Consumer) -> bool:
        self.requests.setdefault(name, deque()).append(consumer)
        self.pump(name)
        return True

    def cancel(self, name: str, consumer: Consumer) -> None:
        waiting = self.requests.get(name)
        if waiting is not None:
            self.requests[name] = deque(c for c in waiting if c is not consumer)
            if not self.requests[name]:
                del self.requests[name]

    def ack(self, name: str, message_id: str) -> bool:
        self.held.pop((name, message_id), None)
        keys = _keys(name)
        self._spawn(
            self._ack(
                keys=[keys["unacked"], keys["owner"], keys["msgs"], keys["attempts"]],
                args=[message_id],
            )
        )
        return True

    def consumer_gone(self, consumer: Consumer) -> None:
        for name in list(self.requests):
            self.cancel(name, consumer)
        for (name, message_id), (holder, token) in list(self.held.items()):
            if holder is consumer:
                del self.held[(name, message_id)]
                self._spawn(self._retry_one(name, message_id, "consumer disconnected", token, ""))

    def sweep(self, now: int) -> None:
        """The dialect's sweep: nothing to do here (expired deliveries have their own loop)."""

    def depth(self) -> tuple[int, int, int]:
        return self._depth

    def held_bytes(self) -> tuple[int, int]:
        """Nothing held in this process's heap: the messages are in Redis."""
        return 0, 0

    def refusals(self) -> dict[str, int]:
        """No memory budget: Redis is the store (its own maxmemory bounds it)."""
        return {}

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
        """Retry every delivery (of any instance) whose ack deadline has passed."""
        waiting = unacked = dead = 0
        for raw in await self.redis.smembers(NAMES):
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
                w, u, d = await pipe.execute()
            waiting, unacked, dead = waiting + w, unacked + u, dead + d
        self._depth = (waiting, unacked, dead)

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
            if not requests:
                del self.requests[name]
            message.attempts = int(claimed[1])
            self.held[(name, message_id)] = (consumer, token)
            consumer.deliver_queued(message)

    # ---- dead letters ----------------------------------------------------------------------

    async def list_dead(self, name: str | None) -> list[dict[str, Any]]:
        names = (
            [name]
            if name is not None
            else [
                n.decode() if isinstance(n, bytes) else str(n)
                for n in await self.redis.smembers(NAMES)
            ]
        )
        out = []
        for queue in names:
            keys = _keys(queue)
            dead = await self.redis.hgetall(keys["dead"])
            for raw_id, raw_info in dead.items():
                message_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
                record = await self.redis.hget(keys["msgs"], message_id)
                attempts = await self.redis.hget(keys["attempts"], message_id)
                if record is None:
                    continue
                info = json.loads(raw_info)
                out.append(
                    {
                        **json.loads(record),
                        "id": message_id,
                        "attempts": int(attempts or 0),
                        "reason": info.get("reason"),
                        "dead_at": info.get("dead_at"),
                    }
                )
        return out

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
