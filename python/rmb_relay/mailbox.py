"""Mailboxes: where envelopes for an offline session of this relay wait until it connects.

Decision 2 of spec/rmb.md: a message waits until its own deadline (timestamp + expiration),
capped by `--mailbox-ttl`; at most `--mailbox-max` per session. Past that cap the new message
is refused (`MailboxFull`: the sender of a request hears it), where rmb-rs drops the oldest:
a flood from anyone would otherwise evict the mail a twin really waits for (issue 33). On
connect the mailbox is delivered in order before live traffic.

Memory budgets (the in-memory mailbox: it lives in the relay's own heap, so one sender must not
be able to fill it): at most `MailboxBudget.twin_bytes` per destination twin across its
sessions, `total_bytes` in all, `sessions_per_twin` distinct sessions (sids) per twin, and
`source_bytes` for what one source twin has waiting in all mailboxes together, and as much
for what one relay posted (federation, by its address): a share, so one sender or one relay
cannot take the whole budget from everyone else's mail.
An envelope over a budget is refused with `MailboxFull` (the sender of a request gets an error
envelope) instead of displacing older mail. The books are two `ByteBudget`s (budget.py, the
mechanism every in-memory store shares): by destination twin, counting sessions as its items,
and by source twin. Expired envelopes are swept on a timer
of their own, whatever else is configured.

Two implementations behind one interface: `MemoryMailbox` (no Redis: a relay restart loses
it) and `RedisMailbox` (Redis streams under rmb-rs's key names `stream:<twin>[:<sid>]`, entry
field `_` = the raw envelope, so queued messages survive a restart and a replica can deliver
them). Delivery is at-least-once: entries are deleted after they were handed to the connection.
"""

from __future__ import annotations

import abc
import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from rmb_relay._core import scan_envelope
from rmb_relay.budget import BudgetExceeded, ByteBudget
from rmb_relay.clock import Clock, monotonic_clock, nanos, seconds, wall_clock
from rmb_relay.errors import EnvelopeError, MailboxFull, MailboxUnavailable

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient

SessionKey = tuple[int, str | None]
#: a stored envelope: its deadline, its bytes, and the shares (source twin, posting relay) it
#: counts against
_Entry = tuple[int, bytes, tuple[int | str, ...]]

#: rmb-rs's default stream lifetime after the last push (spec/rmb.md §3.2)
DEFAULT_MAILBOX_TTL = 3600
#: rmb-rs's QUEUE_MAXLEN per stream
DEFAULT_MAILBOX_MAX = 10_000
#: in-memory mailbox bytes for one destination twin (all its sessions): 64 envelopes of the
#: largest size, or thousands of ordinary ones; a flood to one twin stops here
DEFAULT_MAILBOX_TWIN_BYTES = 64 << 20
#: in-memory mailbox bytes in all: what offline mail may cost the relay's heap
DEFAULT_MAILBOX_TOTAL_BYTES = 512 << 20
#: in-memory mailbox bytes one source twin has waiting, all destinations together: an eighth
#: of the total, so a flood from one sender leaves the rest for everyone else
DEFAULT_MAILBOX_SOURCE_BYTES = 64 << 20
#: distinct sessions (sids) with mail waiting, per twin: the sid is the sender's choice, so
#: without a cap one sender creates a mailbox per random sid
DEFAULT_MAILBOX_SESSIONS = 64
#: how often expired envelopes are swept out of the in-memory mailbox (seconds)
DEFAULT_SWEEP_INTERVAL = 10.0
#: longest a Redis mailbox operation may take before it counts as failed (seconds): a stalled
#: Redis must not hold a sender's messages, or a login's live traffic, for long
DEFAULT_REDIS_TIMEOUT = 2.0
#: envelope bytes on their way to Redis at once, all senders together; beyond it a store is
#: refused at once (the sender hears "mailbox is unavailable") instead of queueing in the heap
DEFAULT_REDIS_INFLIGHT_BYTES = 32 << 20
#: after an operation timed out, Redis is assumed stalled for this long (seconds): stores and
#: reads fail at once instead of each waiting out its own timeout
REDIS_STALL_BACKOFF = 1.0
#: a mailbox is read this many entries at a time (a Redis stream may hold 10,000 of 1 MiB)
TAKE_PAGE = 256


def stream_key(key: SessionKey) -> str:
    """rmb-rs's per-session stream name: `stream:<twin>` or `stream:<twin>:<sid>`."""
    twin, sid = key
    return f"stream:{twin}" if sid is None else f"stream:{twin}:{sid}"


@dataclass(slots=True)
class Taken:
    """Envelopes read from a mailbox; `ack` removes them once they were written out."""

    envelopes: list[bytes]
    ids: list[bytes] = field(default_factory=list)
    #: the mailbox may hold more than this page: take again after acknowledging it
    more: bool = False


@dataclass(frozen=True, slots=True)
class MailboxBudget:
    """Memory limits of the in-memory mailbox (see the module docstring)."""

    twin_bytes: int = DEFAULT_MAILBOX_TWIN_BYTES
    total_bytes: int = DEFAULT_MAILBOX_TOTAL_BYTES
    sessions_per_twin: int = DEFAULT_MAILBOX_SESSIONS
    source_bytes: int = DEFAULT_MAILBOX_SOURCE_BYTES

    def __post_init__(self) -> None:
        if min(self.twin_bytes, self.total_bytes, self.sessions_per_twin, self.source_bytes) <= 0:
            raise ValueError("mailbox budgets must be positive")


@dataclass(slots=True)
class MailboxStats:
    stored: int = 0
    delivered: int = 0
    expired: int = 0
    dropped_full: int = 0
    #: refused because a memory budget (bytes or sessions) was reached
    refused: int = 0


class Mailbox(abc.ABC):
    def __init__(
        self,
        ttl: int = DEFAULT_MAILBOX_TTL,
        max_per_session: int = DEFAULT_MAILBOX_MAX,
        clock: Clock = wall_clock,
    ) -> None:
        self.ttl = ttl
        self.max_per_session = max_per_session
        self.clock = clock
        self.stats = MailboxStats()
        #: told of every envelope lost to expiry, as (session, bytes, reason), for route records
        #: (a full mailbox loses nothing: it refuses the new envelope)
        self.on_loss: Callable[[SessionKey, int, str], None] | None = None

    def _lost(self, key: SessionKey, size: int, reason: str) -> None:
        if self.on_loss is not None:
            self.on_loss(key, size, reason)

    def deadline(self, timestamp: int, expiration: int) -> int:
        """When a stored envelope stops being worth delivering (unix seconds)."""
        now = seconds(self.clock())
        own = timestamp + expiration if timestamp else now + expiration
        return min(own, now + self.ttl)

    @abc.abstractmethod
    async def put(
        self, key: SessionKey, envelope: bytes, deadline: int, *, sender: str | None = None
    ) -> None:
        """Store one envelope; raises MailboxUnavailable if the backend is down, MailboxFull
        over a budget. `sender`: the relay that posted it (federation: its address), which
        has a share of the budget as a source twin does."""

    @abc.abstractmethod
    async def take(self, key: SessionKey) -> Taken:
        """Every unexpired envelope for the session, oldest first; raises MailboxUnavailable."""

    async def ack(self, key: SessionKey, taken: Taken) -> None:  # noqa: B027 - optional hook
        """Remove what `take` returned, after it was written to the connection."""

    @abc.abstractmethod
    def depth(self) -> int:
        """Envelopes waiting in all mailboxes (for the metric; may be approximate)."""

    def held_bytes(self) -> int:
        """Envelope bytes this process holds for the mailbox (stored in memory, or on their way
        to Redis): the figure the memory budgets bound."""
        return 0

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class MemoryMailbox(Mailbox):
    """In-process mailbox for a relay without Redis, within a `MailboxBudget`.

    Expired envelopes are swept every `sweep_interval` seconds of loop time while anything is
    stored (the timer starts with the first `put` and stops when the mailbox is empty); expiry
    itself is judged on `clock`, so tests move time by hand and shorten the interval."""

    def __init__(
        self,
        ttl: int = DEFAULT_MAILBOX_TTL,
        max_per_session: int = DEFAULT_MAILBOX_MAX,
        clock: Clock = wall_clock,
        *,
        budget: MailboxBudget | None = None,
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL,
    ) -> None:
        super().__init__(ttl, max_per_session, clock)
        self.budget = budget if budget is not None else MailboxBudget()
        self.sweep_interval = sweep_interval
        #: per session: (deadline, envelope, the shares it counts against), oldest first
        self._boxes: dict[SessionKey, deque[_Entry]] = {}
        self._depth = 0
        #: per destination twin: bytes stored and sessions with a mailbox (its items)
        self.books = ByteBudget(
            key_bytes=self.budget.twin_bytes,
            total_bytes=self.budget.total_bytes,
            key_count=self.budget.sessions_per_twin,
        )
        #: per source twin, and per posting relay: bytes waiting in all mailboxes (its share)
        self.sources = ByteBudget(
            key_bytes=self.budget.source_bytes, total_bytes=self.budget.total_bytes
        )
        self._sweeper: asyncio.TimerHandle | None = None

    async def put(
        self, key: SessionKey, envelope: bytes, deadline: int, *, sender: str | None = None
    ) -> None:
        twin = key[0]
        size = len(envelope)
        box = self._boxes.get(key)
        if box is not None:
            self._expire(key, box)
            if len(box) >= self.max_per_session:
                self.stats.refused += 1
                raise MailboxFull(
                    f"mailbox of twin {twin} holds {self.max_per_session} messages for this "
                    "session (nothing waiting is dropped for a new one)"
                )
        budget = self.budget
        shares: tuple[int | str, ...] = (_source_twin(envelope),)
        if sender is not None:
            shares += ("relay " + sender,)
        try:
            self.books.take(twin, size, 1 if box is None else 0)
        except BudgetExceeded as err:
            self.stats.refused += 1
            if err.limit == "count":
                text = f"twin {twin} has mail waiting for {budget.sessions_per_twin} sessions"
            elif err.limit == "key":
                text = f"mailbox of twin {twin} is over {budget.twin_bytes} bytes"
            else:
                text = f"mailboxes are over {budget.total_bytes} bytes in all"
            raise MailboxFull(text) from err
        taken: list[int | str] = []
        for share in shares:
            if not self.sources.try_take(share, size):
                for done in taken:
                    self.sources.release(done, size)
                self.books.release(twin, size, 1 if box is None else 0)
                self.stats.refused += 1
                whose = f"twin {share}" if isinstance(share, int) else share
                raise MailboxFull(f"{whose} has over {budget.source_bytes} bytes in mailboxes")
            taken.append(share)
        if box is None:
            box = self._boxes[key] = deque()
        box.append((deadline, envelope, shares))
        self._depth += 1
        self.stats.stored += 1
        self._ensure_sweeper()

    async def take(self, key: SessionKey) -> Taken:
        box = self._boxes.get(key)
        if box is None:
            return Taken([])
        self._forget(key, box)
        now = seconds(self.clock())
        live = [envelope for deadline, envelope, _ in box if deadline > now]
        self.stats.expired += len(box) - len(live)
        if self.on_loss is not None and len(live) < len(box):
            for deadline, envelope, _ in box:
                if deadline <= now:
                    self.on_loss(key, len(envelope), "expired")
        self.stats.delivered += len(live)
        return Taken(live)

    def _pop_oldest(self, twin: int, box: deque[_Entry]) -> int:
        """Drop the oldest envelope; returns its size."""
        _, envelope, shares = box.popleft()
        self._depth -= 1
        self.books.release(twin, len(envelope))
        self._release_shares(shares, len(envelope))
        return len(envelope)

    def _release_shares(self, shares: tuple[int | str, ...], size: int) -> None:
        for share in shares:
            self.sources.release(share, size)

    def _forget(self, key: SessionKey, box: deque[_Entry]) -> None:
        """Remove a whole session's mailbox from the books."""
        del self._boxes[key]
        self._depth -= len(box)
        self.books.release(key[0], sum(len(envelope) for _, envelope, _ in box), 1)
        for _, envelope, shares in box:
            self._release_shares(shares, len(envelope))
        if not self._boxes:
            # a dict never shrinks by deleting: start over so a burst's table is freed too
            self._boxes = {}

    def _expire(self, key: SessionKey, box: deque[_Entry]) -> None:
        now = seconds(self.clock())
        while box and box[0][0] <= now:
            lost = self._pop_oldest(key[0], box)
            self.stats.expired += 1
            self._lost(key, lost, "expired")

    def sweep(self) -> int:
        """Drop expired envelopes of every session; returns how many."""
        now = seconds(self.clock())
        dropped = 0
        for key, box in list(self._boxes.items()):
            if box and all(item[0] > now for item in box):
                continue
            kept = deque(item for item in box if item[0] > now)
            if not kept:
                self._forget(key, box)
            else:
                # the session keeps its mailbox (and its place in the sessions count)
                self._boxes[key] = kept
                self._depth -= len(box) - len(kept)
                self.books.release(key[0], sum(len(e) for d, e, _ in box if d <= now))
                for deadline, envelope, shares in box:
                    if deadline <= now:
                        self._release_shares(shares, len(envelope))
            dropped += len(box) - len(kept)
            if self.on_loss is not None:
                for deadline, envelope, _ in box:
                    if deadline <= now:
                        self.on_loss(key, len(envelope), "expired")
        self.stats.expired += dropped
        return dropped

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.sweep_interval, self._tick)

    def _tick(self) -> None:
        self._sweeper = None
        self.sweep()
        if self._boxes:
            self._ensure_sweeper()

    def depth(self) -> int:
        return self._depth

    def held_bytes(self) -> int:
        return self.books.held

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def _source_twin(envelope: bytes) -> int:
    """Whose share a stored envelope counts against: its source twin (0: a relay's error, or
    bytes the scanner cannot read, which share one key)."""
    try:
        return scan_envelope(envelope).source_twin
    except EnvelopeError:
        return 0


#: XADD unless the stream is at the cap (-1 then): rmb-rs's MAXLEN drops the oldest instead,
#: which lets a flood evict the mail a twin waits for. One key: fine in a Redis cluster.
_ADD_UNDER_CAP = """
local n = redis.call('XLEN', KEYS[1])
if n >= tonumber(ARGV[3]) then return -1 end
redis.call('XADD', KEYS[1], '*', '_', ARGV[1], 'dl', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return n
"""


class RedisMailbox(Mailbox):
    """Mailbox in Redis streams, compatible with rmb-rs's key layout (field `_` = envelope).

    Each entry also carries `dl` (its deadline) so expiry is per message, not per stream.

    A slow or stalled Redis costs bounded memory and time: every operation is cut off after
    `timeout` seconds (MailboxUnavailable); at most `max_inflight_bytes` of envelopes wait on
    Redis at once (more is refused at once); after a timeout the mailbox is assumed stalled
    for `REDIS_STALL_BACKOFF` seconds (on `monotonic`) and fails at once meanwhile. A refused
    connection fails fast by itself and does not start the back-off.
    """

    def __init__(
        self,
        redis: RedisClient,
        ttl: int = DEFAULT_MAILBOX_TTL,
        max_per_session: int = DEFAULT_MAILBOX_MAX,
        clock: Clock = wall_clock,
        *,
        timeout: float = DEFAULT_REDIS_TIMEOUT,
        max_inflight_bytes: int = DEFAULT_REDIS_INFLIGHT_BYTES,
        monotonic: Clock = monotonic_clock,
    ) -> None:
        super().__init__(ttl, max_per_session, clock)
        self.redis = redis
        self.timeout = timeout
        self.max_inflight_bytes = max_inflight_bytes
        self.monotonic = monotonic
        self._depth_estimate = 0
        self._inflight = 0
        self._stalled_until: int | None = None

    def _check_stall(self) -> None:
        until = self._stalled_until
        if until is not None:
            if self.monotonic() < until:
                raise MailboxUnavailable("redis: stalled (an operation timed out just now)")
            self._stalled_until = None

    def _timed_out(self) -> MailboxUnavailable:
        self._stalled_until = self.monotonic() + nanos(REDIS_STALL_BACKOFF)
        return MailboxUnavailable(f"redis: no answer within {self.timeout:g} s")

    async def put(
        self, key: SessionKey, envelope: bytes, deadline: int, *, sender: str | None = None
    ) -> None:
        """(`sender` has no share here: a session's cap refuses, nothing is evicted.)"""
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        self._check_stall()
        size = len(envelope)
        if self._inflight + size > self.max_inflight_bytes:
            raise MailboxUnavailable(
                f"redis: {self._inflight} bytes already waiting to be stored (busy)"
            )
        name = stream_key(key)
        self._inflight += size
        try:
            async with asyncio.timeout(self.timeout):
                length = await self.redis.eval(
                    _ADD_UNDER_CAP, 1, name, envelope, str(deadline), self.max_per_session, self.ttl
                )
        except (TimeoutError, RedisTimeout):
            raise self._timed_out() from None
        except (RedisError, OSError) as err:
            raise MailboxUnavailable(f"redis: {err}") from err
        finally:
            self._inflight -= size
        if int(length) < 0:
            self.stats.refused += 1
            raise MailboxFull(
                f"mailbox of twin {key[0]} holds {self.max_per_session} messages for this "
                "session (nothing waiting is dropped for a new one)"
            )
        self._depth_estimate += 1
        self.stats.stored += 1

    async def take(self, key: SessionKey) -> Taken:
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        self._check_stall()
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self.redis.xrange(stream_key(key), "-", "+", count=TAKE_PAGE)
            # redis-py's annotation is loose; without decode_responses it is bytes throughout
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], raw)
        except (TimeoutError, RedisTimeout):
            raise self._timed_out() from None
        except (RedisError, OSError) as err:
            raise MailboxUnavailable(f"redis: {err}") from err
        now = seconds(self.clock())
        live: list[bytes] = []
        for _entry_id, fields in entries:
            deadline = fields.get(b"dl")
            if deadline is not None and int(deadline) <= now:
                self.stats.expired += 1
                self._lost(key, len(fields.get(b"_", b"")), "expired")
                continue
            envelope = fields.get(b"_")
            if envelope is not None:
                live.append(envelope)
        self.stats.delivered += len(live)
        return Taken(live, [entry_id for entry_id, _ in entries], more=len(entries) == TAKE_PAGE)

    async def ack(self, key: SessionKey, taken: Taken) -> None:
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        if not taken.ids:
            return
        self._check_stall()
        try:
            async with asyncio.timeout(self.timeout):
                await self.redis.xdel(stream_key(key), *taken.ids)
        except (TimeoutError, RedisTimeout):
            raise self._timed_out() from None
        except (RedisError, OSError) as err:
            raise MailboxUnavailable(f"redis: {err}") from err
        self._depth_estimate = max(0, self._depth_estimate - len(taken.ids))

    def depth(self) -> int:
        return self._depth_estimate

    def held_bytes(self) -> int:
        return self._inflight

    async def close(self) -> None:
        await self.redis.aclose()
