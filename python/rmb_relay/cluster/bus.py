"""The bus: each instance's Redis stream, how others write to it and how it is read.

Writing (group commit). `send(instance, record)` queues the encoded record and returns a
future. One flush runs at a time; it takes everything queued, packs the records for each
instance into stream entries of at most `ENTRY_RECORDS` records / `ENTRY_BYTES` bytes and
sends every XADD in one pipeline. What is queued while a flush waits for Redis goes in the
next flush, so a busy relay pays one round trip per batch, not per message, and a quiet one
adds no delay. The future says whether the entry was accepted: True once Redis stored it,
False when the destination's stream no longer exists (XADD NOMKSTREAM: the instance left or
was reaped, the caller routes the message another way), `ClusterUnavailable` when Redis
failed (the message was not accepted). A busy sender that keeps no future per message uses
`send_nowait` with a callback instead, and `room` bounds what it may queue.

Reading. Every stream has one consumer group (`keys.GROUP`). The owner reads new entries
with XREADGROUP BLOCK, hands them to its handler in order (each entry's records as the bytes
`wire.py` lays out, checked: the handler's fast path reads them in Rust), then acknowledges
and deletes them (XACK + XDEL in one pipeline, sent with the next XREADGROUP: one round trip
per read, not two). An entry read but not acknowledged stays pending:
if the owner dies before it finished, a reaper on another instance claims it (`claim_pending`,
XCLAIM) and reroutes its records. So an accepted message is handed on at least once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

from rmb_relay._core import check_bus_records
from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.cluster import keys, wire
from rmb_relay.cluster.connect import RedisClient
from rmb_relay.errors import ClusterUnavailable, MailboxUnavailable
from rmb_relay.lazy_errors import redis_error
from rmb_relay.tasks import cancel_and_wait

log = logging.getLogger("rmb_relay.cluster")

#: records and bytes per stream entry: big enough to amortise a round trip, small enough that
#: one entry never makes a reader hold much memory
ENTRY_RECORDS = 512
ENTRY_BYTES = 1 << 20
#: entries per XREADGROUP
READ_COUNT = 64
#: how long one XREADGROUP blocks before it is repeated (also bounds how long close() waits)
READ_BLOCK_MS = 1000
#: pause after a failed read before the next try, so a Redis outage is not a busy loop
RETRY_DELAY = 0.5
#: how long `close` waits for the reader to stop and for what is being written
CLOSE_TIMEOUT = 2.0
#: bytes queued for other instances' streams (or on their way) above which a sender that
#: does not wait for Redis waits for room (`room`): memory stays bounded when Redis is slow
QUEUE_LIMIT = 8 << 20

Entry = tuple[bytes, list[wire.Record]]
#: told the records of each entry of one read, as their bytes (`wire.py`'s layout, checked)
Handler = Callable[[list[bytes]], Awaitable[None]]
#: what a queued record's sender hears once its batch was written (`Bus.send_nowait`)
Notify = Callable[[bool | ClusterUnavailable], None] | asyncio.Future[bool]


def _settle(notify: Notify, outcome: bool | ClusterUnavailable) -> None:
    if isinstance(notify, asyncio.Future):
        if notify.done():
            return
        if isinstance(outcome, bool):
            notify.set_result(outcome)
        else:
            notify.set_exception(outcome)
        return
    try:
        notify(outcome)
    except Exception:  # one sender's bug must not cost the others their outcome
        log.exception("cluster: a bus sender failed to take its outcome")


@functools.cache
def redis_errors() -> tuple[type[Exception], ...]:
    """What a failed Redis call raises (redis-py's errors; a refused or reset socket; and
    RuntimeError, which uvloop raises for a write on a pooled connection the server reset,
    "unable to perform operation on <TCPTransport closed=True>", and redis-py passes on: a
    Redis Cluster primary that died does that to every connection to it)."""
    return (redis_error(), OSError, RuntimeError)


@functools.cache
def failures() -> tuple[type[Exception], ...]:
    """... and what a failed hand-over raises above it (a mailbox in the same Redis)."""
    return (*redis_errors(), MailboxUnavailable)


async def ensure_group(redis: RedisClient, stream: str) -> None:
    """`stream` and its consumer group (`keys.GROUP`), created if missing (MKSTREAM)."""
    from redis.exceptions import ResponseError

    try:
        await redis.xgroup_create(stream, keys.GROUP, "0", mkstream=True)
    except ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


async def ack_delete(redis: RedisClient, stream: str, ids: list[bytes]) -> None:
    """Acknowledge and delete entries of `stream` read through `keys.GROUP` (one round trip)."""
    if not ids:
        return
    pipe = redis.pipeline(transaction=False)
    pipe.xack(stream, keys.GROUP, *ids)
    pipe.xdel(stream, *ids)
    await pipe.execute()


def stream_entries(raw: Any) -> list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """An XREAD/XREADGROUP reply as (stream, entries) pairs, whichever protocol answered
    (without decode_responses: a list of pairs with RESP2, a dict with RESP3; None: nothing)."""
    if not raw:
        return []
    return list(raw.items() if isinstance(raw, dict) else raw)


class Bus:
    """This instance's end of the bus; see the module docstring."""

    def __init__(
        self, redis: RedisClient, me: str, handler: Handler, *, clock: Clock = monotonic_clock
    ) -> None:
        self.redis = redis
        self.me = me
        self.handler = handler
        self._queued: dict[str, list[tuple[bytes, Notify]]] = {}
        #: bytes of records queued or being written, and the event senders wait on for room
        #: (a queued piece may hold many records: a crossing batch of the fast path)
        self._queued_bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self._flusher: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        #: entries the reader handled and has not acknowledged yet (with its next read)
        self._handled: list[bytes] = []
        #: set by `close`: the reader stops at its next turn even if it lost its cancellation
        self._closing = False
        #: told False when `full` starts and True when it ends (a fast path that queues
        #: without asking `full` per message stops and starts with it)
        self.on_room: Callable[[bool], None] = lambda room: None
        #: called with the error when a read fails and with None when reading works again
        self.on_health: Callable[[BaseException | None], None] = lambda err: None
        #: called when our stream was found gone and made again (reaped while we were cut
        #: off: messages for our addresses went elsewhere meanwhile, the mailbox among them)
        self.on_recreated: Callable[[], None] = lambda: None
        #: how often (ns) the reader looks at entries pending for us it did not read itself
        #: (`_read_loop`); None: only after a failure
        self.pending_every: int | None = None
        self.clock = clock
        self.sent_entries = 0
        self.bad_entries = 0

    # ---- writing ---------------------------------------------------------------------------

    def send(self, instance: str, record: bytes) -> asyncio.Future[bool]:
        """Queue an encoded record for `instance`'s stream; see the module docstring."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.send_nowait(instance, record, future)
        return future

    def send_nowait(self, instance: str, record: bytes, notify: Notify) -> None:
        """`send` for a caller that keeps no future per record: `notify(outcome)` is called
        once its batch was written, with True (stored), False (that stream is gone) or the
        `ClusterUnavailable` Redis failed with. (A future is also accepted, and settled.)"""
        self._queued.setdefault(instance, []).append((record, notify))
        self._queued_bytes += len(record)
        if self._queued_bytes > QUEUE_LIMIT and self._room.is_set():
            self._room.clear()
            self.on_room(False)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    @property
    def full(self) -> bool:
        """More than `QUEUE_LIMIT` bytes are queued or being written (`room` would wait)."""
        return not self._room.is_set()

    async def room(self) -> None:
        """Wait while more than `QUEUE_LIMIT` bytes are queued or being written."""
        if not self._room.is_set():
            await self._room.wait()

    async def _flush(self) -> None:
        try:
            while self._queued:
                queued, self._queued = self._queued, {}
                try:
                    await self._write(queued)
                finally:
                    self._queued_bytes -= sum(
                        len(record) for items in queued.values() for record, _ in items
                    )
                    if self._queued_bytes <= QUEUE_LIMIT and not self._room.is_set():
                        self._room.set()
                        self.on_room(True)
        finally:
            self._flusher = None

    async def _write(self, queued: dict[str, list[tuple[bytes, Notify]]]) -> None:
        batches: list[list[Notify]] = []
        pipe = self.redis.pipeline(transaction=False)
        for instance, items in queued.items():
            stream = keys.bus_key(instance)
            parts: list[bytes] = []
            waiting: list[Notify] = []
            size = 0
            for record, notify in items:
                if parts and (len(parts) >= ENTRY_RECORDS or size + len(record) > ENTRY_BYTES):
                    pipe.xadd(stream, {b"m": b"".join(parts)}, nomkstream=True)
                    batches.append(waiting)
                    parts, waiting, size = [], [], 0
                parts.append(record)
                waiting.append(notify)
                size += len(record)
            pipe.xadd(stream, {b"m": b"".join(parts)}, nomkstream=True)
            batches.append(waiting)
        try:
            results = await pipe.execute()
        except redis_errors() as err:
            failure = ClusterUnavailable(f"redis: {err}")
            for waiting in batches:
                for notify in waiting:
                    _settle(notify, failure)
            return
        self.sent_entries += len(batches)
        for waiting, result in zip(batches, results, strict=True):
            stored = result is not None
            for notify in waiting:
                _settle(notify, stored)

    # ---- reading ---------------------------------------------------------------------------

    async def create(self) -> None:
        """This instance's stream and group (MKSTREAM), and its entry in the instance set."""
        await self.ensure_group(self.me)
        await self.redis.sadd(keys.INSTANCES_KEY, self.me)

    async def ensure_group(self, instance: str) -> None:
        await ensure_group(self.redis, keys.bus_key(instance))

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        from redis.exceptions import ResponseError

        stream = keys.bus_key(self.me)
        healthy = True
        # after a failure, entries we read but could not acknowledge are still pending for us
        # (XREADGROUP ">" never returns them again): hand them on first, then read new ones.
        # Also every `pending_every`: a read sent on a link that was cut reaches Redis when
        # the link heals, long after we gave up on it, and Redis hands *its* entries to us
        # (pending, never seen by us): without a look at what is pending they would wait
        # there forever (messages silently lost)
        recover = False
        looked = self.clock()
        while not self._closing:
            every = self.pending_every
            if every is not None and self.clock() - looked >= every:
                recover = True
            try:
                if recover:
                    looked = self.clock()
                    if self._handled:  # handled before the failure: not to be handed on again
                        await self.ack(stream, self._handled)
                        self._handled = []
                    entries = await self.read_raw(stream, pending=True)
                    recover = bool(entries)
                else:
                    entries = await self.read_raw(stream, block=READ_BLOCK_MS, ack=self._handled)
                    self._handled = []
                if not healthy:
                    healthy = True
                    self.on_health(None)
                if entries:
                    await self._handle(stream, entries)
            except asyncio.CancelledError:
                raise
            except ResponseError as err:
                if "NOGROUP" in str(err):  # reaped while we were stalled: start over
                    self._handled = []  # (gone with the stream)
                    log.warning("cluster: our bus stream %s was gone; recreating it", stream)
                    await self._retry(self.create)
                    self.on_recreated()
                    continue
                healthy = await self._failed(err, healthy)
                recover = True
            except failures() as err:
                # not acknowledged: handed on again once Redis answers (at least once)
                healthy = await self._failed(err, healthy)
                recover = True
            except Exception:
                log.exception("cluster: handling bus entries failed")
                await asyncio.sleep(RETRY_DELAY)

    async def _failed(self, err: BaseException, healthy: bool) -> bool:
        """Report the first failure of an outage; pause so an outage is not a busy loop."""
        if healthy:
            self.on_health(err)
        await asyncio.sleep(RETRY_DELAY)
        return False

    async def _retry(self, action: Callable[[], Awaitable[None]]) -> None:
        try:
            await action()
        except redis_errors() as err:
            self.on_health(err)
            await asyncio.sleep(RETRY_DELAY)

    async def read(
        self, stream: str, *, block: int | None = None, pending: bool = False
    ) -> list[Entry]:
        """New entries of `stream` for this instance's consumer, or with `pending` those it
        read before and has not acknowledged (raises Redis errors)."""
        items = await self._read(stream, block, pending)
        return [(entry_id, self._decode(stream, entry_id, fields)) for entry_id, fields in items]

    async def read_raw(
        self,
        stream: str,
        *,
        block: int | None = None,
        pending: bool = False,
        ack: list[bytes] | None = None,
    ) -> list[tuple[bytes, bytes]]:
        """`read`, each entry's records left as their checked bytes (a malformed entry's are
        empty: logged and counted, then acknowledged like any). `ack`: entries handled
        before, acknowledged and deleted first in the same round trip."""
        items = await self._read(stream, block, pending, ack)
        return [(entry_id, self._check(stream, entry_id, fields)) for entry_id, fields in items]

    async def _read(
        self, stream: str, block: int | None, pending: bool, ack: list[bytes] | None = None
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        streams: dict[Any, Any] = {stream: "0" if pending else ">"}
        block = None if pending else block
        if ack:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(stream, keys.GROUP, *ack)
            pipe.xdel(stream, *ack)
            pipe.xreadgroup(keys.GROUP, self.me, streams, count=READ_COUNT, block=block)
            raw = (await pipe.execute())[-1]
        else:
            raw = await self.redis.xreadgroup(
                keys.GROUP, self.me, streams, count=READ_COUNT, block=block
            )
        return [item for _name, items in stream_entries(raw) for item in items]

    async def orphaned_consumers(self, stream: str) -> list[str]:
        """Consumers other than this instance with entries of `stream` read but not
        acknowledged (candidates for `claim_pending`; the caller checks which are dead)."""
        summary: Any = await self.redis.xpending(stream, keys.GROUP)
        names = []
        for consumer in summary.get("consumers") or ():
            name = consumer["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != self.me and int(consumer["pending"]):
                names.append(name)
        return names

    async def claim_pending(self, stream: str, consumer: str) -> list[Entry]:
        """Entries `consumer` (a dead instance) read and never acknowledged, now ours.

        Only a dead consumer's: a live one may still be handling them (a slow reaper), and
        taking them would deliver them twice. Two reapers racing for the same entries: XCLAIM
        with the least idle time we saw is a compare-and-set (the first claim resets an
        entry's idle time, so the second finds it too fresh and skips it)."""
        pending: Any = await self.redis.xpending_range(
            stream, keys.GROUP, min="-", max="+", count=READ_COUNT, consumername=consumer
        )
        if not pending:
            return []
        ids = [item["message_id"] for item in pending]
        min_idle = min(int(item["time_since_delivered"]) for item in pending)
        raw: Any = await self.redis.xclaim(
            stream, keys.GROUP, self.me, min_idle_time=min_idle, message_ids=ids
        )
        items = cast(list[tuple[bytes, dict[bytes, bytes] | None]], raw or [])
        return [
            (entry_id, self._decode(stream, entry_id, fields or {})) for entry_id, fields in items
        ]

    def _decode(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes]
    ) -> list[wire.Record]:
        # an entry the Rust check passed decodes; a malformed one is b"" (no records)
        return wire.decode(self._check(stream, entry_id, fields))

    def _check(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes]) -> bytes:
        """The entry's records, or b"" (counted and logged) when they are malformed: checked
        whole in Rust, as `wire.decode` would refuse them."""
        data = fields.get(b"m", b"")
        try:
            check_bus_records(data)
        except ValueError as err:
            self.bad_entries += 1
            log.error("cluster: skipping malformed bus entry %s of %s: %s", entry_id, stream, err)
            return b""
        return data

    async def _handle(self, stream: str, entries: list[tuple[bytes, bytes]]) -> None:
        records = [data for _entry_id, data in entries if data]
        if records:  # one call for the whole read: its messages go out in as few writes
            await self.handler(records)
        # acknowledged with the next read (or by `close`)
        self._handled = [entry_id for entry_id, _ in entries]

    async def ack(self, stream: str, ids: list[bytes]) -> None:
        """Acknowledge and delete handled entries (one round trip)."""
        await ack_delete(self.redis, stream, ids)

    async def close(self) -> None:
        """Stop reading; wait for what is being written. Both bounded by `CLOSE_TIMEOUT`
        (a cancelled reader can lose its cancellation inside redis-py: `tasks.py`)."""
        self._closing = True
        await cancel_and_wait(self._reader, CLOSE_TIMEOUT)
        self._reader = None
        handled, self._handled = self._handled, []
        if handled:  # (acknowledging twice is harmless: the read may have done it)
            try:
                await asyncio.wait_for(self.ack(keys.bus_key(self.me), handled), CLOSE_TIMEOUT)
            except failures() as err:  # (wait_for's TimeoutError is an OSError)
                log.warning("cluster: could not acknowledge handled entries: %s", err)
        flusher = self._flusher
        if flusher is not None:
            await asyncio.wait([flusher], timeout=CLOSE_TIMEOUT)
