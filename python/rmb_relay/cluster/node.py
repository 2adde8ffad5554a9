"""`Cluster`: this instance's membership of a relay service whose instances share Redis.

Theory of operation
-------------------
Each instance has an id (`--instance-id`, unique per process), a liveness key renewed every
`ttl/3` and a bus stream (`bus.py`). Addresses its connections hold are claimed in presence
(`presence.py`). The switch asks the cluster, after its local route table and before the
mailbox, whether another instance holds an address (`forward`); if so the message goes to
that instance's stream and its reader writes it to the connection there.

Races are closed by checking again on the far side, never by locks:
- an instance handed a message for an address it no longer holds looks the address up again
  and passes the message on (at most `wire.MAX_HOPS` times) or stores it in the mailbox;
- after a message is stored in a mailbox, presence is read again: when the address was
  claimed meanwhile, its holder is told to drain the mailbox (a `MAIL` record). The holder
  claims before it drains (`claimed`), so one of the two always sees the other;
- a newer login elsewhere makes the claim answer the previous claim, whose instance is told
  to close its connection (a `DISPLACED` record naming that claim), as one process does for a
  duplicate login. It does so only while that claim is still its current one (`handle`): the
  notice may arrive after the address was claimed again (a reconnect), or be read from a dead
  instance's stream by the instance taking it over, which may hold the address itself now.

An instance that dies stops renewing its keys. Its presence entries expire after `ttl`, so its
clients' next messages go to the mailbox or to wherever they reconnect; every tick each live
instance looks for instances whose liveness key is gone and *reaps* their streams: entries
nobody read and entries a dead consumer read but never acknowledged (XCLAIM) are routed again
like any message, then the stream is deleted once it has stayed empty for two TTLs (senders
never recreate it: XADD NOMKSTREAM). Nothing accepted into Redis is lost; see docs/cluster.md for
what can be delivered twice.

The fast path crosses too. A dialect that has checked everything but the holder for an
address (RMB: the twin is ours, not connected here) asks `mirror` to copy the presence
cache's answer into the Rust route table as a remote route. The scanner then queues that
address's messages as bus records for the holder inside `feed` (rust/crossing.rs); after the
read the switch's outboxes hand the batches to `_crossed_batches`, which queues each as one
piece of that instance's next XADD and keeps its bytes until Redis answered: stored, each
record counts as sent; refused or gone, each record is handed back to the dialect
(`crossing_outcome(frame)`, the same `QueuedForward` a message of the slow path has) and
refused or routed again exactly as one queued by `forward` would be. A mirrored route is
dropped with the cache answer it copies (`Presence.on_forget`, `on_instance_gone`), stops at
its expiry, and is not used while the bus is full (`Bus.on_room`) or the instance leaves.

Other dialects (the gateway, the tunnel) whose receivers are not in the switch's route table
use the same machinery through `register_kind`, the `*_name` methods, `send_to_nowait` and
`on_instance_gone` (docs/cluster.md); `fanout.py` and `workqueue.py` are built on it for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rmb_relay.clock import Clock, monotonic_clock, nanos, seconds, wall_clock
from rmb_relay.cluster import keys, wire
from rmb_relay.cluster.bus import CLOSE_TIMEOUT, Bus, failures
from rmb_relay.cluster.connect import RedisClient
from rmb_relay.cluster.presence import CACHE_MAX, Missing, Presence, claim_instance
from rmb_relay.contract import CloseCode
from rmb_relay.errors import ClusterUnavailable
from rmb_relay.tasks import cancel_and_wait, finish_or_cancel

if TYPE_CHECKING:
    from rmb_relay.switch import Address, Endpoint, QueuedForward, Switch
    from rmb_relay.telemetry.metrics import Registry

log = logging.getLogger("rmb_relay.cluster")

#: presence and liveness live this long without renewal; renewed every third of it
DEFAULT_TTL = 15.0
#: how long an answer "X is held by instance I" is reused without asking Redis
DEFAULT_CACHE_TTL = 1.0
#: batches of entries one tick takes from a dead instance (the rest at the next tick)
REAP_ROUNDS = 100
#: bytes of messages written to local connections in one output batch before their
#: congestion is looked at again (`_deliver_run`)
RUN_BYTES = 1 << 20
#: messages reaped from a given-up instance's stream that nobody else can take (no mailbox:
#: not RMB), kept for that instance in case it was only cut off, at most this many bytes in
#: all and this long (s): its clients may still be connected to it (`_hold_for`)
HELD_BYTES = 4 << 20
HOLD_FOR = 300.0
#: how long a clean leave may take (releasing presence, handing our stream's entries on):
#: what it does not finish, the others do once our keys expire, so a relay that stops never
#: waits longer on a slow Redis
LEAVE_TIMEOUT = 2.0

Resolver = Callable[[str], "Endpoint | None"]
#: told the id of an instance found dead (`Cluster.on_instance_gone`)
GoneListener = Callable[[str], None]
#: what a `send_to_nowait` sender hears once the batch was written: True (stored), False (that
#: instance's stream is gone: it left or was reaped) or the `ClusterUnavailable` Redis raised
SendOutcome = Callable[[bool | ClusterUnavailable], None]
#: how a queued forward ended (route, outcome, reason) by where `_pass_on` took its message
_SETTLED = {
    "passed": ("cluster", "delivered", None),
    "stored": ("mailbox", "queued", None),
    "dropped": ("none", "rejected", "no route"),
}

#: delete a reaped stream only if it is (still) empty, in one step
_DELETE_IF_EMPTY = """
if redis.call('XLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
"""
#: give the reaper lock back only if it is still ours (it may have expired and been taken)
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def default_instance_id() -> str:
    """Host, process and a random part: unique even when a pid is reused after a restart."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ClusterCounters:
    __slots__ = ("bad_names", "dropped", "passed_on", "received", "sent", "stored")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.passed_on = 0
        self.stored = 0
        self.dropped = 0
        self.bad_names = 0


class Cluster:
    """See the module docstring. `start()` before use, `close()` after the listener stopped."""

    def __init__(
        self,
        redis: RedisClient,
        switch: Switch,
        *,
        instance_id: str | None = None,
        ttl: float = DEFAULT_TTL,
        cache_ttl: float = DEFAULT_CACHE_TTL,
        clock: Clock = monotonic_clock,
        wall: Clock = wall_clock,
        registry: Registry | None = None,
        held_bytes: int = HELD_BYTES,
    ) -> None:
        if ttl <= 0:
            raise ValueError("cluster TTL must be positive")
        self.redis = redis
        self.switch = switch
        self.me = instance_id or default_instance_id()
        self.ttl = ttl
        self.clock = clock
        self.wall = wall
        self.presence = Presence(redis, self.me, ttl, cache_ttl=cache_ttl, clock=clock)
        self.bus = Bus(redis, self.me, self._on_entries, clock=clock)
        self.bus.on_health = self._health
        self.bus.on_recreated = self._stream_recreated
        self.bus.pending_every = nanos(ttl / 3)
        self.counters = ClusterCounters()
        self._kinds: dict[str, Resolver] = {}
        #: instance -> when (clock) we first saw it dead
        self._dead_since: dict[str, int] = {}
        self._ticker: asyncio.Task[None] | None = None
        #: set by `close`: the ticker stops at its next turn even if it lost its cancellation
        self._closing = False
        self._redis_down = False
        #: set while Redis is not known down (`redis_back` waits on it)
        self._redis_reachable = asyncio.Event()
        self._redis_reachable.set()
        #: instance given up -> messages reaped from its stream for it (`_hold_for`), with
        #: when (clock) each stops being kept, and their bytes in all
        self._held: dict[str, deque[tuple[wire.Record, int]]] = {}
        self.held_bytes = 0
        #: the most `_held` keeps (--cluster-held-bytes)
        self.held_limit = held_bytes
        #: when (clock) we last came back from an outage: for one TTL after it we give no
        #: instance up (`tick`)
        self._resumed_at: int | None = None
        #: Redis failed since the last tick that reached it: the next one drains every
        #: mailbox held here (`tick`)
        self._resync = False
        self.live_instances = 1
        self._soon: deque[tuple[Address, bytes]] = deque()
        self._soon_task: asyncio.Task[None] | None = None
        #: parsed address names (a busy receiver sees the same few again and again)
        self._addresses: dict[str, Address] = {}
        #: work started by callbacks (`_spawn`)
        self._tasks: set[asyncio.Task[None]] = set()
        self._gone_listeners: list[GoneListener] = []
        #: dead instances the listeners were told about (told once per death)
        self._gone_told: set[str] = set()
        #: instances numbered for the Rust route table's remote routes and crossing batches
        self._instances: list[str] = []
        self._instance_numbers: dict[str, int] = {}
        #: the `QueuedForward` of a record the fast path queued (`mirror`), from its frame:
        #: set by the dialect that mirrors routes
        self.crossing_outcome: Callable[[bytes], QueuedForward] | None = None
        self.presence.on_forget = self._unmirror
        self.presence.on_instance_gone = self._unmirror_instance
        self.bus.on_room = self._bus_room
        switch.outboxes.set_crossing_sink(self._crossed_batches)
        if registry is not None:
            self._register_metrics(registry)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Create our stream, announce liveness, start reading and ticking (raises the Redis
        error when Redis is unreachable: the caller refuses to start)."""
        await self.bus.create()
        await self._announce()
        self.bus.start()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        self.switch.outboxes.crossing_open = not self.bus.full
        log.info("cluster: instance %s joined (presence TTL %ss)", self.me, self.ttl)

    async def close(self) -> None:
        """Leave: stop ticking and reading, give up presence, hand our unread entries on and
        delete our keys, so nothing waits for a TTL after a clean shutdown. Bounded: every
        step has a time limit (`bus.CLOSE_TIMEOUT`, `LEAVE_TIMEOUT`), and a task that lost
        its cancellation is cancelled again (`tasks.py`)."""
        self._closing = True
        self.switch.outboxes.crossing_open = False
        self.switch.routes.clear_remote()
        await cancel_and_wait(self._ticker, CLOSE_TIMEOUT)
        await finish_or_cancel(self._soon_task, CLOSE_TIMEOUT, CLOSE_TIMEOUT)
        await self.bus.close()
        for task in list(self._tasks):
            await cancel_and_wait(task, CLOSE_TIMEOUT)
        leave = asyncio.get_running_loop().create_task(self._leave())
        if not await finish_or_cancel(leave, LEAVE_TIMEOUT, CLOSE_TIMEOUT):
            log.warning(
                "cluster: leaving took over %.1f s; the others take over the rest once our "
                "keys expire",
                LEAVE_TIMEOUT,
            )
        log.info("cluster: instance %s left", self.me)

    async def _leave(self) -> None:
        for name in list(self.presence.held):
            self.presence.release(name)
        await self.presence.close()
        try:
            await self.redis.delete(keys.alive_key(self.me))
            self.presence.dead.add(self.me)  # our own entries now go elsewhere
            await self.reap(self.me, leaving=True)
        except failures() as err:
            log.warning("cluster: could not leave cleanly (others reap us later): %s", err)

    # ---- the switch's side -----------------------------------------------------------------

    def claim(self, address: Address) -> None:
        """A local connection now holds `address` (called by the switch)."""
        self.claim_name(keys.address_name(address))

    def release(self, address: Address) -> None:
        """No local connection holds `address` any more (called by the switch)."""
        self.release_name(keys.address_name(address))

    async def claimed(self, address: Address) -> None:
        """Wait until our claim of `address` is in Redis (before reading its mailbox)."""
        await self.presence.claimed(keys.address_name(address))

    async def forward(
        self,
        address: Address,
        frame: bytes,
        deadline: int | None,
        queued: QueuedForward | None = None,
    ) -> bool:
        """Hand `frame` to the instance holding `address`; False when none does (raises
        ClusterUnavailable when presence cannot be read: not accepted).

        Without `queued`, True means Redis took it. With it, True means it is queued for
        that instance's stream, written with the next batch: the caller goes on at once (one
        XADD carries what many senders queued meanwhile, where waiting for each would cost a
        round trip per message), and waits only while the bus holds too much (`Bus.room`).
        If the batch then finds that instance's stream gone, the message is routed again
        (`_pass_on`). Either way `queued` hears how it ended (`QueuedForward`)."""
        name = keys.address_name(address)
        if queued is None:
            return await self.send_name(name, frame, deadline)
        if self._queue_if_known(name, frame, deadline, queued):
            return True
        await self.bus.room()
        owner = await self.presence.owner(name)
        if owner is None:
            return False
        self._queue(owner, name, frame, deadline, queued)
        return True

    def forward_nowait(
        self,
        address: Address,
        frame: bytes,
        deadline: int | None,
        queued: QueuedForward,
    ) -> bool:
        """`forward` with `queued` when it needs no await: the holder's answer is cached
        and the bus has room. False: not queued, call `forward` (the caller's per-message path
        saves its coroutines in the common case)."""
        return self._queue_if_known(keys.address_name(address), frame, deadline, queued)

    def mirror(self, address: Address, fresh_for: int, now: int) -> bool:
        """Copy the cached "`address` is held by instance I" into the Rust route table, for
        the scanner to queue its messages itself (module docstring). `fresh_for` (ns) bounds
        how long the caller's own checks hold (its twin cache's answer); `now` is the scan
        clock's reading the route's expiry is counted from. Only RMB session addresses;
        False when nothing was mirrored."""
        if self._closing or isinstance(address, bytes):
            return False
        name = keys.address_name(address)
        owner = self.presence.cached_owner(name)
        if not isinstance(owner, str):
            return False
        fresh = min(self.presence.cached_until(name), fresh_for)
        if fresh <= 0:
            return False
        number = self._instance_numbers.get(owner)
        if number is None:
            number = self._instance_numbers[owner] = len(self._instances)
            self._instances.append(owner)
        twin, sid = address
        self.switch.routes.set_remote(twin, sid, number, name.encode(), now, now + fresh)
        return True

    def _unmirror(self, name: str | None) -> None:
        routes = self.switch.routes
        if name is None:
            routes.clear_remote()
        elif name.startswith("r:"):
            try:
                address = keys.parse_address_name(name)
            except ValueError:
                return
            if not isinstance(address, bytes):
                routes.forget_remote(address[0], address[1])

    def _unmirror_instance(self, instance: str) -> None:
        number = self._instance_numbers.get(instance)
        if number is not None:
            self.switch.routes.forget_instance(number)

    def _bus_room(self, room: bool) -> None:
        self.switch.outboxes.crossing_open = room and not self._closing

    def _crossed_batches(self, batches: list[tuple[int, bytes, int]]) -> None:
        """Records the fast path queued for other instances during a read (`mirror`): each
        batch is one piece of its instance's next XADD."""
        for number, records, count in batches:
            instance = self._instances[number]
            self.bus.send_nowait(
                instance, records, functools.partial(self._crossed, instance, records, count)
            )

    def _crossed(
        self, instance: str, records: bytes, count: int, outcome: bool | ClusterUnavailable
    ) -> None:
        """The XADD that carried a crossing batch was answered: as `_queued` for each of its
        records (stored: sent; gone: routed again; refused: its sender is told)."""
        if outcome is True:
            self.counters.sent += count
            return
        make = self.crossing_outcome
        if outcome is False:
            self.presence.instance_gone(instance)
        for record in wire.decode(records):
            if make is None:  # nobody to tell: only counted
                self.counters.dropped += 1
                continue
            queued = make(record.frame)
            if outcome is False:
                self._spawn(self._route_again(record, queued))
            else:
                queued.refused(outcome)

    def _queue_if_known(
        self, name: str, frame: bytes, deadline: int | None, queued: QueuedForward
    ) -> bool:
        owner = self.presence.cached_owner(name)
        if isinstance(owner, Missing) or owner is None or self.bus.full:
            return False
        self._queue(owner, name, frame, deadline, queued)
        return True

    def _queue(
        self, owner: str, name: str, frame: bytes, deadline: int | None, queued: QueuedForward
    ) -> None:
        record = wire.encode_message(name, frame, deadline or 0)
        self.bus.send_nowait(
            owner, record, functools.partial(self._queued, owner, name, frame, deadline, queued)
        )

    def _queued(
        self,
        owner: str,
        name: str,
        frame: bytes,
        deadline: int | None,
        queued: QueuedForward,
        outcome: bool | ClusterUnavailable,
    ) -> None:
        """The batch that carried a `forward` with `queued` was written (or not)."""
        if outcome is True:
            self.counters.sent += 1
            queued.settled("cluster", "delivered")
        elif outcome is False:  # its stream is gone: it left or was reaped
            self.presence.instance_gone(owner)
            record = wire.Record(wire.MESSAGE, name, frame, deadline or 0)
            self._spawn(self._route_again(record, queued))
        else:
            queued.refused(outcome)

    async def _route_again(self, record: wire.Record, queued: QueuedForward) -> None:
        try:
            where = await self._pass_on(record)
        except failures() as err:
            queued.refused(err)
            return
        queued.settled(*_SETTLED[where])

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on its own; kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forward_soon(self, address: Address, frame: bytes) -> None:
        """`forward` for a sender inside a socket read (SBD): queued in order, never stored
        in a mailbox, dropped (and counted) when no instance holds the address."""
        self._soon.append((address, frame))
        if self._soon_task is None:
            self._soon_task = asyncio.get_running_loop().create_task(self._forward_queued())

    async def _forward_queued(self) -> None:
        queued = self._soon
        try:
            while queued:
                address, frame = queued.popleft()
                name = keys.address_name(address)
                try:
                    owner = await self.presence.owner(name)
                except ClusterUnavailable:
                    owner = None
                if owner is None:
                    self.counters.dropped += 1
                    continue
                record = wire.encode(wire.Record(wire.MESSAGE, name, frame))
                # not awaited: the bus keeps the order, and waiting would cost a round trip
                # per message
                self.bus.send(owner, record).add_done_callback(self._sent_soon)
        finally:
            self._soon_task = None

    def _sent_soon(self, future: asyncio.Future[bool]) -> None:
        if not future.cancelled() and future.exception() is None and future.result():
            self.counters.sent += 1
        else:
            self.counters.dropped += 1

    async def mail_stored(self, address: Address) -> None:
        """A message for `address` was just stored in the mailbox: if another instance holds
        it now, tell that one to drain."""
        name = keys.address_name(address)
        owner = await self.presence.owner(name, fresh=True)
        if owner is not None:
            await self.bus.send(owner, wire.encode(wire.Record(wire.MAIL, name)))

    # ---- the generic API (docs/cluster.md) -------------------------------------------------

    def on_instance_gone(self, listener: GoneListener) -> None:
        """Call `listener(instance)` once when a tick finds that another instance died (its
        liveness key expired), before its stream is taken over. Not called for an instance
        that left cleanly (it cleaned up after itself) nor for this one. The dialects drop
        what they kept about it: the gateway its clients, the tunnel the requests it took."""
        self._gone_listeners.append(listener)

    def given_up(self, instance: str) -> bool:
        """Whether `instance` was found dead (its listeners told) and has not come back: a
        verdict naming it arriving after that must be treated as the death it reports."""
        return instance != self.me and instance in self._gone_told

    def _tell_gone(self, instance: str) -> None:
        if instance == self.me or instance in self._gone_told:
            return
        self._gone_told.add(instance)
        for listener in list(self._gone_listeners):
            try:
                listener(instance)
            except Exception:  # one dialect's bug must not stop the reaping
                log.exception("cluster: an instance-gone listener failed")

    @property
    def redis_up(self) -> bool:
        """False from the first failed Redis call of an outage (the bus's read, a tick) until
        one succeeds again: writes tried meanwhile would wait on their timeouts and may land
        later, so callers that must not guess refuse without trying."""
        return not self._redis_down

    async def redis_back(self) -> None:
        """Return once `redis_up` is True (at once when it is): what waits for Redis to be
        back (the 신경 gateway's held QUEUEs) wakes when the cluster sees it, not by polling."""
        await self._redis_reachable.wait()

    async def alive(self, instances: list[str]) -> set[str]:
        """Which of `instances` are alive now (this one always is). Raises Redis errors."""
        others = [i for i in instances if i != self.me]
        pipe = self.redis.pipeline(transaction=False)
        for other in others:
            pipe.exists(keys.alive_key(other))
        flags = await pipe.execute() if others else []
        live = {i for i, flag in zip(others, flags, strict=True) if flag}
        return live | ({self.me} & set(instances))

    def register_kind(self, kind: str, resolve: Resolver) -> None:
        """Route names `<kind>:...` to `resolve(name)`, the local endpoint holding it or None."""
        if kind in (keys.KIND_RMB, keys.KIND_SBD) or not kind.isalnum():
            raise ValueError(f"cluster address kind {kind!r} is taken or not alphanumeric")
        self._kinds[kind] = resolve

    def claim_name(self, name: str) -> None:
        future = self.presence.claim(name)
        future.add_done_callback(lambda done: self._claim_answered(name, done))

    def release_name(self, name: str) -> None:
        self.presence.release(name)

    async def send_name(self, name: str, frame: bytes, deadline: int | None) -> bool:
        """Hand `frame` to the instance holding `name`; False when none does (raises
        ClusterUnavailable)."""
        owner = await self.presence.owner(name)
        if owner is None:
            return False
        record = wire.encode(wire.Record(wire.MESSAGE, name, frame, deadline or 0))
        if await self.bus.send(owner, record):
            self.counters.sent += 1
            return True
        self.presence.instance_gone(owner)  # its stream is gone: it left or was reaped
        return False

    def send_to_nowait(
        self, instance: str, name: str, frame: bytes, outcome: SendOutcome | None = None
    ) -> None:
        """Queue `frame` for `name` on a known `instance` (the dialect knows where the receiver
        is: the gateway from its replicas, the tunnel from the request), for its stream's next
        batch, without a presence lookup. `outcome` hears how the batch went; without it a
        failure is only counted. On the far side `resolve(name)` finds the receiver; when it
        does not, the message is passed on to whoever claims `name` or dropped."""
        record = wire.encode_message(name, frame, 0)

        def settled(result: bool | ClusterUnavailable) -> None:
            if result is True:
                self.counters.sent += 1
            else:
                self.counters.dropped += 1
                if result is False:
                    self.presence.instance_gone(instance)  # it left or was reaped
            if outcome is not None:
                outcome(result)

        self.bus.send_nowait(instance, record, settled)

    def _claim_answered(self, name: str, future: asyncio.Future[str | None]) -> None:
        if future.cancelled():
            return
        err = future.exception()
        if err is not None:
            # the next refresh sets it again; until then messages for it go to the mailbox
            log.warning("cluster: could not claim %s: %s", name, err)
            return
        previous = future.result()
        if previous is None:
            return
        holder = claim_instance(previous)
        if holder not in self.presence.dead:
            # names the claim it ends: see `handle`
            record = wire.Record(wire.DISPLACED, name, previous.encode())
            notice = self.bus.send(holder, wire.encode(record))
            notice.add_done_callback(_ignore_result)

    # ---- the bus's side --------------------------------------------------------------------

    def resolve(self, name: str) -> Endpoint | None:
        """The local endpoint holding `name` (raises ValueError for a malformed name)."""
        address = self._addresses.get(name)
        if address is None:
            custom = self._kinds.get(keys.name_kind(name))
            if custom is not None:
                return custom(name)
            address = keys.parse_address_name(name)
            if len(self._addresses) >= CACHE_MAX:  # names churn: start again
                self._addresses.clear()
            self._addresses[name] = address
        return self.switch.lookup(address)

    async def _on_entries(self, entries: list[bytes]) -> None:
        """The entries of one bus read (their records' bytes), in order. Messages for RMB
        sessions connected here that can take them now are written by Rust straight into
        their outboxes (`Outboxes.place_records`: no record object, no Python call per
        message), at most `RUN_BYTES` between writes (so congestion is seen); at the first
        record Rust does not place (a congested or held receiver, an address not held here, a
        notice, another kind of name) the rest of that entry takes the Python path
        (`_on_records`), as every record did before."""
        switch = self.switch
        outboxes, routes = switch.outboxes, switch.routes
        for data in entries:
            offset, end = 0, len(data)
            while offset < end:
                offset, placed = outboxes.place_records(routes, data, offset, RUN_BYTES)
                if placed:
                    self.counters.received += placed
                    switch.write_placed()
                    continue
                await self._on_records(wire.decode_from(data, offset))
                break

    async def _on_records(self, records: list[wire.Record]) -> None:
        """The records of one bus read, in order. Runs of messages for local connections that
        can take them now are delivered without waiting, in one output batch (`_deliver_run`);
        the rest (a congested receiver, an address not held here, a notice) go through
        `handle`, which may wait."""
        index, count = 0, len(records)
        while index < count:
            index = self._deliver_run(records, index)
            if index < count:
                await self.handle(records[index])
                index += 1

    def _deliver_run(self, records: list[wire.Record], index: int) -> int:
        """Deliver `records[index:]` while each is a message for a local endpoint that is not
        congested, at most `RUN_BYTES` of them, each connection written once at the end (its
        congestion is only known then); returns the index of the first record left."""
        count = len(records)
        size = 0
        with contextlib.ExitStack() as batch:
            while index < count and size < RUN_BYTES:
                record = records[index]
                if record.kind != wire.MESSAGE:
                    break
                try:
                    endpoint = self.resolve(record.name)
                except ValueError:
                    break  # `handle` counts and logs it
                if endpoint is None or endpoint.peer.congested:
                    break
                if not size:
                    batch.enter_context(endpoint.peer.batch())
                endpoint.deliver(record.frame)
                self.counters.received += 1
                size += len(record.frame) + 1
                index += 1
        return index

    async def handle(self, record: wire.Record, *, reaped_from: str | None = None) -> None:
        """One record from a bus stream (ours, or `reaped_from`'s, a dead instance's being
        reaped)."""
        try:
            endpoint = self.resolve(record.name)
        except ValueError as err:
            self.counters.bad_names += 1
            log.error("cluster: dropping a record with a bad address: %s", err)
            return
        if record.kind == wire.MESSAGE:
            if endpoint is not None:
                await endpoint.peer.writable()
                endpoint = self.resolve(record.name)  # it may have gone while we waited
            if endpoint is not None:
                endpoint.deliver(record.frame)
                self.counters.received += 1
            else:
                await self._pass_on(record, reaped_from)
        elif record.kind == wire.DISPLACED:
            # only when the claim it ends is still our current one: a notice that waited (in
            # our stream, or in a dead instance's stream we are taking over) must not close a
            # connection that claimed the address after it, here or anywhere
            if not self.presence.holds(record.name, record.frame.decode(errors="replace")):
                log.debug("cluster: ignoring a stale notice for %s", record.name)
                return
            self.presence.forget(record.name)
            if endpoint is not None:
                code = CloseCode.NORMAL if record.name.startswith("s:") else CloseCode.POLICY
                log.info("cluster: %s logged in on another instance; closing ours", record.name)
                endpoint.peer.close(code, "replaced by a newer connection")
        elif endpoint is not None:  # MAIL
            endpoint.mail_waiting()

    async def _pass_on(self, record: wire.Record, reaped_from: str | None = None) -> str:
        """A message for an address not held here: to its holder, else its mailbox, else (one
        reaped from a given-up instance's stream) held for that instance. Returns where it
        went: `passed` (another instance), `stored` (the mailbox or held) or `dropped`."""
        name = record.name
        if record.hops < wire.MAX_HOPS:
            owner = await self.presence.owner(name, fresh=True)
            if owner is not None:
                passed = replace(record, hops=record.hops + 1)
                if await self.bus.send(owner, wire.encode(passed)):
                    self.counters.passed_on += 1
                    return "passed"
                self.presence.instance_gone(owner)
        if record.deadline > seconds(self.wall()) and keys.name_kind(name) == keys.KIND_RMB:
            address = keys.parse_address_name(name)
            assert not isinstance(address, bytes)
            await self.switch.mailbox.put(address, record.frame, record.deadline)
            self.counters.stored += 1
            endpoint = self.resolve(name)  # connected while we stored
            if endpoint is not None:
                endpoint.mail_waiting()
            else:
                await self.mail_stored(address)
            return "stored"
        if reaped_from is not None and self._hold_for(reaped_from, record):
            return "stored"
        self.counters.dropped += 1
        log.debug("cluster: %s is held nowhere; dropping a message for it", name)
        return "dropped"

    def _hold_for(self, instance: str, record: wire.Record) -> bool:
        """Keep `record`, reaped from `instance`'s stream with nobody to take it, for
        `instance`: given up past the TTL, it may only have been cut off, its clients still
        connected to it (a 신경 client, an SBD key: no mailbox, and the sender was told it was
        accepted). Sent to it again once it is alive (`_send_held`); False when over the
        bound."""
        size = len(record.frame)
        if self.held_bytes + size > self.held_limit:
            return False
        held = self._held.setdefault(instance, deque())
        held.append((record, self.clock() + nanos(HOLD_FOR)))
        self.held_bytes += size
        return True

    def _expire_held(self) -> None:
        """Drop (and count) what `_hold_for` kept past `HOLD_FOR`: its instance is not back."""
        now = self.clock()
        for instance, held in list(self._held.items()):
            while held and held[0][1] <= now:
                record, _ = held.popleft()
                self.held_bytes -= len(record.frame)
                self.counters.dropped += 1
            if not held:
                del self._held[instance]

    async def _send_held(self, instance: str) -> None:
        """What `_hold_for` kept for `instance`, alive again, onto its stream (in order); what
        expired meanwhile is dropped and counted. Kept for the next tick while its stream is
        not there yet (it makes it again on its way back)."""
        held = self._held.get(instance)
        now = self.clock()
        while held:
            record, until = held[0]
            if until > now and not await self.bus.send(instance, wire.encode(record)):
                return
            held.popleft()
            self.held_bytes -= len(record.frame)
            if until > now:
                self.counters.passed_on += 1
            else:
                self.counters.dropped += 1
        self._held.pop(instance, None)

    # ---- liveness and reaping --------------------------------------------------------------

    async def _tick_loop(self) -> None:
        interval = self.ttl / 3
        while not self._closing:
            await asyncio.sleep(interval)
            if self._closing:
                break
            try:
                await self.tick()
            except failures() as err:
                self._health(err)
            except Exception:
                log.exception("cluster: maintenance failed")

    async def _announce(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(keys.alive_key(self.me), b"1", px=int(self.ttl * 1000))
        pipe.sadd(keys.INSTANCES_KEY, self.me)
        await pipe.execute()

    async def tick(self) -> None:
        """Renew our liveness and presence; reap instances that died. Runs every `ttl/3`;
        tests call it directly (with the injected clock). Raises Redis errors."""
        await self._announce()
        self._health(None)
        resync, self._resync = self._resync, False
        try:
            refreshed = await self.presence.refresh()
        except ClusterUnavailable:
            self._resync = True
            raise
        for name in refreshed.taken:
            self.presence.forget(name)
            endpoint = self.resolve(name)
            if endpoint is not None:
                log.info("cluster: %s is held by another instance now; closing ours", name)
                endpoint.peer.close(CloseCode.POLICY, "replaced by a newer connection")
        # after an outage, messages for what we hold may wait in the mailbox: stored by
        # another instance that found our presence expired or gave us up (and took over our
        # stream), with nobody left to tell us. Our claims are in Redis again now (`refresh`),
        # so whatever is stored from here on finds us and tells us (`mail_stored`): drain once
        self._drain_held(list(self.presence.held) if resync else refreshed.reclaimed)
        members = [
            member.decode() if isinstance(member, bytes) else str(member)
            for member in await self.redis.smembers(keys.INSTANCES_KEY)
        ]
        others = [member for member in members if member != self.me]
        live = await self.alive(others)
        self.live_instances = 1 + len(live)
        # back from an outage of our own, we cannot tell an instance that died from one the
        # same outage cut off (a Redis Cluster shard without a primary fails every instance's
        # calls), whose liveness key expired meanwhile: it renews the key within a tick of
        # the outage's end, so we wait one TTL before giving any up. Taking a live one for
        # dead reaps its stream, and what waits there for its 신경 clients is dropped unseen
        # (a failover lost 82 SENDs so), its tunnel requests answered 504
        judging = self._resumed_at is None or self.clock() - self._resumed_at >= nanos(self.ttl)
        for other in others:
            if other in live:
                self.presence.dead.discard(other)
                self._dead_since.pop(other, None)
                self._gone_told.discard(other)  # back (it was only cut off): told again next time
                if other in self._held:
                    await self._send_held(other)
            elif judging:
                await self.reap(other)
        self._expire_held()

    def _drain_held(self, names: list[str]) -> None:
        """Tell the local endpoints holding `names` to read their mailbox."""
        drained = 0
        for name in names:
            try:
                endpoint = self.resolve(name)
            except ValueError:
                continue
            if endpoint is not None:
                endpoint.mail_waiting()
                drained += 1
        if drained:
            log.info("cluster: %d addresses held here read their mailbox after an outage", drained)

    def _stream_recreated(self) -> None:
        self._resync = True

    async def reap(self, instance: str, *, leaving: bool = False) -> None:
        """Route again every entry of a dead instance's stream; delete the stream once it has
        stayed empty for two TTLs (or at once when we are the one `leaving`).

        Each round takes: entries we read from it before and did not finish (a round that
        failed), entries its dead consumers read and never acknowledged (the instance itself,
        or a reaper that died), and unread entries. Never a live consumer's: another live
        reaper may be working on them, and taking them would deliver them twice. A lock key
        with the TTL keeps a second reaper from doing the same work meanwhile; correctness
        does not rest on it (consumer groups hand each entry to one reader)."""
        from redis.exceptions import ResponseError

        now = self.clock()
        first = self._dead_since.setdefault(instance, now)
        if instance not in self.presence.dead:
            log.warning("cluster: instance %s is gone; taking over its pending messages", instance)
            self.presence.instance_gone(instance)
        if not leaving:
            self._tell_gone(instance)
        stream = keys.bus_key(instance)
        lock = keys.reaper_key(instance)
        if not await self.redis.set(lock, self.me, px=int(self.ttl * 1000), nx=True):
            return  # another instance is reaping it
        try:
            orphans = await self._dead_consumers(stream)
            for _ in range(REAP_ROUNDS):
                entries = await self.bus.read(stream, pending=True)
                for consumer in orphans:
                    entries += await self.bus.claim_pending(stream, consumer)
                entries += await self.bus.read(stream)
                if not entries:
                    break
                for _entry_id, records in entries:
                    for record in records:
                        await self.handle(record, reaped_from=None if leaving else instance)
                await self.bus.ack(stream, [entry_id for entry_id, _ in entries])
            expired = leaving or now - first >= nanos(2 * self.ttl)
            # one script: a writer's XADD between a check and a DEL would be lost with it
            if expired and await self.redis.eval(_DELETE_IF_EMPTY, 1, stream):
                await self.redis.srem(keys.INSTANCES_KEY, instance)
                self._dead_since.pop(instance, None)
        except ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            await self.redis.srem(keys.INSTANCES_KEY, instance)  # already deleted
        finally:
            await self.redis.eval(_RELEASE_LOCK, 1, lock, self.me)

    async def _dead_consumers(self, stream: str) -> list[str]:
        """The consumers of `stream` holding unacknowledged entries whose instance is dead."""
        consumers = await self.bus.orphaned_consumers(stream)
        if not consumers:
            return []
        live = await self.alive(consumers)
        return [name for name in consumers if name not in live]

    def _health(self, err: BaseException | None) -> None:
        if err is not None:
            self._resync = True  # the next tick that reaches Redis drains (`tick`)
        if err is None:
            if self._redis_down:
                self._redis_down = False
                self._redis_reachable.set()
                self._resumed_at = self.clock()
                log.warning("cluster: redis is reachable again; instance %s resumes", self.me)
            return
        if not self._redis_down:
            self._redis_down = True
            self._redis_reachable.clear()
            log.error(
                "cluster: redis unavailable (%s); messages for other instances are refused "
                "with an error until it is back; nothing already accepted is lost",
                err,
            )

    # ---- metrics ---------------------------------------------------------------------------

    def _register_metrics(self, registry: Registry) -> None:
        counters = self.counters
        registry.counter_of(
            "rmb_relay_cluster_messages_total",
            "Messages through the cluster bus, by event (sent to another instance, received "
            "and written here, passed on, stored in a mailbox, dropped)",
            lambda: [
                (("sent",), counters.sent),
                (("received",), counters.received),
                (("passed_on",), counters.passed_on),
                (("stored",), counters.stored),
                (("dropped",), counters.dropped),
            ],
            ("event",),
        )
        registry.gauge(
            "rmb_relay_cluster_held_bytes",
            "Bytes of messages reaped from given-up instances' streams, kept for them in case "
            "they were only cut off (at most --cluster-held-bytes; past it dropped and counted "
            'in rmb_relay_cluster_messages_total{event="dropped"})',
            read=lambda: [((), self.held_bytes)],
        )
        registry.gauge(
            "rmb_relay_cluster_presence",
            "Addresses this instance holds in the shared presence",
            read=lambda: [((), len(self.presence.held))],
        )
        registry.gauge(
            "rmb_relay_cluster_instances",
            "Live instances of this relay service seen at the last tick (this one included)",
            read=lambda: [((), self.live_instances)],
        )
        registry.gauge(
            "rmb_relay_cluster_redis_up",
            "1 while the cluster's Redis answers, 0 during an outage",
            read=lambda: [((), 0 if self._redis_down else 1)],
        )


def _ignore_result(future: asyncio.Future[bool]) -> None:
    if not future.cancelled():
        future.exception()  # a lost notice is repaired by the holder's next refresh


__all__ = ["DEFAULT_CACHE_TTL", "DEFAULT_TTL", "Cluster", "ClusterUnavailable"]
