"""Replicated tables: each instance publishes entries of its own under a topic, and every
instance keeps a copy of every other live instance's entries.

Used by the 신경 gateway (`dialects/singyeong/cluster.py`): each client's metadata, which
SEND, BROADCAST, selectors, `key` and the HTTP query read locally on every instance (decision
12). A dialect that needs "what every instance has" rather than "who holds this name"
(presence) uses this.

Keys (`keys.py`; one hash tag per topic, so one script touches them together)
----------------------------------------------------------------------------
```text
rmb:{f:<topic>}:i:<id>    hash    instance <id>'s entries: the snapshot a newcomer loads
rmb:{f:<topic>}:members   set     instances with a hash
rmb:{f:<topic>}:log       stream  every change in order: `i` = instance, `b` = a batch (msgpack)
```

Theory of operation
-------------------
- Writing. `set(key, value)` and `delete(key)` queue a change; one flush at a time sends all
  that is queued in one script, which changes our hash and appends the batch to the log
  atomically: the log's order is the order in which the hashes changed.
- Reading. A newcomer runs one script that returns the log's last id and every member's hash
  (one slot, one step), then reads the log (XREAD, blocking) from that id: nothing is missed
  and nothing applied twice, so entries need no versions.
- An instance that dies: the cluster tells us (`Cluster.on_instance_gone`); we drop its
  entries (the listener hears a delete for each) and a script deletes its hash and logs a
  `gone` (each live instance runs it; the later ones find nothing left to do). One that
  leaves cleanly does the same for itself in `close`.
- Redis outage. A write that failed makes the next flush write our whole table again (a
  `replace`); a read that failed makes the reader load the snapshot again and report what
  changed. The copies converge once Redis answers; during an outage they may be stale. An
  instance that was taken for dead while only cut off sees its own `gone` in the log and
  writes its table again; one whose snapshot, loaded again, does not hold its entries as it
  does (a `gone` before the snapshot, or a failover that lost writes) writes it again too.

Limits: the log is trimmed to about `LOG_MAX` entries; only a reader that was cut off falls
that far behind, and it reloads the snapshot anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from rmb_relay.cluster import keys
from rmb_relay.cluster.bus import READ_BLOCK_MS, RETRY_DELAY, redis_errors, stream_entries
from rmb_relay.tasks import STOP_TIMEOUT, cancel_and_wait

if TYPE_CHECKING:
    from rmb_relay.cluster.node import Cluster

log = logging.getLogger("rmb_relay.cluster")

#: log entries kept (approximately): far more than a live reader ever lags behind
LOG_MAX = 100_000
#: log entries per XREAD
READ_COUNT = 256
#: how long a clean leave may take (others drop our entries once we are found dead anyway)
LEAVE_TIMEOUT = 2.0

#: `listener(instance, key, value)`: another instance's entry changed; None = it is gone
Listener = Callable[[str, str, "bytes | None"], None]

SET, DELETE, REPLACE, GONE = "s", "d", "r", "g"

# KEYS: our hash, members, log. ARGV: me, log max, the batch for the log, then the hash's
# changes as triples (op, key, value): s = set, d = delete, x = delete the whole hash first
_WRITE = """
for i = 4, #ARGV, 3 do
  local op = ARGV[i]
  if op == 's' then redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i + 2])
  elseif op == 'd' then redis.call('HDEL', KEYS[1], ARGV[i + 1])
  else redis.call('DEL', KEYS[1]) end
end
redis.call('SADD', KEYS[2], ARGV[1])
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'i', ARGV[1], 'b', ARGV[3])
"""

# KEYS: the gone instance's hash, members, log. ARGV: its id, log max, the `gone` batch.
# Only the first instance to get here logs it.
_GONE = """
local had = redis.call('DEL', KEYS[1]) + redis.call('SREM', KEYS[2], ARGV[1])
if had == 0 then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'i', ARGV[1], 'b', ARGV[3])
return 1
"""

# KEYS: log, members. ARGV: the prefix of the members' hashes (same slot: same hash tag).
# Returns the log's last id, then each member and its hash (flat field/value list).
_SNAPSHOT = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local out = {'0-0'}
if #last > 0 then out[1] = last[1][1] end
for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  table.insert(out, member)
  table.insert(out, redis.call('HGETALL', ARGV[1] .. member))
end
return out
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ReplicatedTable:
    """One topic's table; see the module docstring. `start()` before use, `close()` after."""

    def __init__(self, cluster: Cluster, topic: str, listener: Listener) -> None:
        self.cluster = cluster
        self.redis = cluster.redis
        self.me = cluster.me
        self.topic = topic
        self.listener = listener
        #: our entries (what a `replace` writes)
        self.mine: dict[str, bytes] = {}
        #: the other live instances' entries
        self.view: dict[str, dict[str, bytes]] = {}
        #: set once the snapshot is loaded and the log is being read; clear while stale
        self.ready = asyncio.Event()
        self._log = keys.table_log_key(topic)
        self._members = keys.table_members_key(topic)
        self._last = "0-0"
        self._queue: list[tuple[str, str, bytes]] = []
        #: a write failed: the next flush writes the whole table
        self._dirty = False
        self._flusher: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._gone_tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._write = self.redis.register_script(_WRITE)
        self._gone = self.redis.register_script(_GONE)
        self._snapshot = self.redis.register_script(_SNAPSHOT)
        cluster.on_instance_gone(self.instance_gone)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start loading the snapshot, then reading the log; `ready` is set once loaded (a
        Redis that fails is retried, as after an outage)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        """Stop reading and writing; delete our entries and tell the others (bounded)."""
        self._closing = True
        await cancel_and_wait(self._reader, STOP_TIMEOUT)
        await cancel_and_wait(self._flusher, STOP_TIMEOUT)
        for task in list(self._gone_tasks):
            await cancel_and_wait(task, STOP_TIMEOUT)
        try:
            await asyncio.wait_for(self._forget(self.me), LEAVE_TIMEOUT)
        except redis_errors() as err:  # (wait_for's TimeoutError is an OSError)
            log.warning("cluster: could not leave table %s cleanly: %s", self.topic, err)

    # ---- our entries -----------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self.mine[key] = value
        self._queue.append((SET, key, value))
        self._kick()

    def delete(self, key: str) -> None:
        if self.mine.pop(key, None) is not None:
            self._queue.append((DELETE, key, b""))
            self._kick()

    def _kick(self) -> None:
        if self._flusher is None and not self._closing:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while (self._queue or self._dirty) and not self._closing:
                if self._dirty:  # the whole table replaces what a failed write left behind
                    self._queue.clear()
                    self._dirty = False
                    batch = [(REPLACE, "", msgpack.packb(self.mine, use_bin_type=True))]
                    changes: list[bytes | str] = ["x", "", ""]
                    for key, value in self.mine.items():
                        changes += [SET, key, value]
                else:
                    queued, self._queue = self._queue, []
                    batch = queued
                    changes = [part for change in queued for part in change]
                try:
                    await self._write(
                        keys=[keys.table_key(self.topic, self.me), self._members, self._log],
                        args=[
                            self.me,
                            LOG_MAX,
                            msgpack.packb(batch, use_bin_type=True),
                            *changes,
                        ],
                    )
                except redis_errors() as err:
                    log.warning("cluster: table %s: writing failed (%s); retrying", self.topic, err)
                    self._dirty = True
                    await asyncio.sleep(RETRY_DELAY)
        finally:
            self._flusher = None

    # ---- the others' entries ---------------------------------------------------------------

    async def _load(self) -> None:
        """Load every live instance's entries and the log position they belong to; tell the
        listener what differs from what we held."""
        raw: Any = await self._snapshot(
            keys=[self._log, self._members], args=[keys.table_prefix(self.topic)]
        )
        last = _text(raw[0])
        tables: dict[str, dict[str, bytes]] = {}
        for index in range(1, len(raw), 2):
            flat = raw[index + 1]
            tables[_text(raw[index])] = {
                _text(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat), 2)
            }
        ours = tables.pop(self.me, {})
        if ours != self.mine and not self._dirty and not self._closing:
            # lost with a primary that had not replicated it (a Redis Cluster failover), or
            # dropped by an instance that took us for dead while we were not reading: its
            # `gone` came before this snapshot, so `_apply` never sees it
            log.warning(
                "cluster: table %s: ours is not in redis as we hold it; writing it again",
                self.topic,
            )
            self._dirty = True
            self._kick()
        live = await self.cluster.alive(list(tables))
        for instance in [i for i in tables if i not in live]:
            del tables[instance]
            await self._forget(instance)  # died before anyone cleaned up after it
        for instance in set(self.view) - set(tables):
            self._replace(instance, {})
        for instance, entries in tables.items():
            self._replace(instance, entries)
        self._last = last

    async def _read_loop(self) -> None:
        stale = True  # nothing loaded yet
        failing = False
        while not self._closing:
            try:
                if stale:
                    await self._load()
                    stale = False
                    self.ready.set()
                replies: Any = await self.redis.xread(
                    {self._log: self._last}, count=READ_COUNT, block=READ_BLOCK_MS
                )
                if failing:
                    failing = False
                    log.warning("cluster: table %s: reading again", self.topic)
                for _name, entries in stream_entries(replies):
                    for entry_id, fields in entries:
                        self._last = _text(entry_id)
                        self._apply(fields)
            except asyncio.CancelledError:
                raise
            except redis_errors() as err:
                if not failing:
                    failing = True
                    log.warning("cluster: table %s: reading failed (%s)", self.topic, err)
                self.ready.clear()
                stale = True
                await asyncio.sleep(RETRY_DELAY)
            except Exception:
                log.exception("cluster: table %s: a change could not be applied", self.topic)
                await asyncio.sleep(RETRY_DELAY)

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        instance = _text(fields.get(b"i", b""))
        batch = msgpack.unpackb(fields.get(b"b", b"\x90"), raw=False)
        if instance == self.me:
            if any(op == GONE for op, _, _ in batch) and not self._closing:
                log.warning(
                    "cluster: table %s: we were taken for dead; writing it again", self.topic
                )
                self._dirty = True
                self._kick()
            return
        for op, key, value in batch:
            if op == SET:
                self.view.setdefault(instance, {})[key] = value
                self.listener(instance, key, value)
            elif op == DELETE:
                entries = self.view.get(instance)
                if entries is not None and entries.pop(key, None) is not None:
                    self.listener(instance, key, None)
            elif op == REPLACE:
                self._replace(instance, msgpack.unpackb(value, raw=False))
            elif op == GONE:
                self._replace(instance, {})

    def _replace(self, instance: str, entries: dict[str, bytes]) -> None:
        """`instance`'s entries are exactly `entries` now: tell the listener the difference."""
        held = self.view.pop(instance, {})
        if entries:
            self.view[instance] = dict(entries)
        for key in held.keys() - entries.keys():
            self.listener(instance, key, None)
        for key, value in entries.items():
            if held.get(key) != value:
                self.listener(instance, key, value)

    # ---- instances that died ---------------------------------------------------------------

    def instance_gone(self, instance: str) -> None:
        """`Cluster.on_instance_gone`: drop its entries here now, and in Redis."""
        if self._closing:  # the cluster ticks on for a moment after the dialects closed
            return
        self._replace(instance, {})
        task = asyncio.get_running_loop().create_task(self._forget_quietly(instance))
        self._gone_tasks.add(task)
        task.add_done_callback(self._gone_tasks.discard)

    async def _forget_quietly(self, instance: str) -> None:
        try:
            await self._forget(instance)
        except redis_errors() as err:  # the next newcomer's snapshot cleans up after it
            log.warning("cluster: table %s: could not drop %s: %s", self.topic, instance, err)

    async def _forget(self, instance: str) -> None:
        await self._gone(
            keys=[keys.table_key(self.topic, instance), self._members, self._log],
            args=[instance, LOG_MAX, msgpack.packb([(GONE, "", b"")], use_bin_type=True)],
        )
