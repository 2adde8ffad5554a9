"""Mailboxes: where envelopes for an offline session of this relay wait until it connects.

Decision 2 of spec/rmb.md: a message waits until its own deadline (timestamp + expiration),
capped by `--mailbox-ttl`; at most `--mailbox-max` per session, dropping the oldest first (and
counting it). On connect the mailbox is delivered in order before live traffic.

Two implementations behind one interface: `MemoryMailbox` (no Redis: a relay restart loses
it) and `RedisMailbox` (Redis streams under rmb-rs's key names `stream:<twin>[:<sid>]`, entry
field `_` = the raw envelope, so queued messages survive a restart and a replica can deliver
them). Delivery is at-least-once: entries are deleted after they were handed to the connection.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.errors import MailboxUnavailable

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient

SessionKey = tuple[int, str | None]

#: rmb-rs's default stream lifetime after the last push (spec/rmb.md §3.2)
DEFAULT_MAILBOX_TTL = 3600
#: rmb-rs's QUEUE_MAXLEN per stream
DEFAULT_MAILBOX_MAX = 10_000


def stream_key(key: SessionKey) -> str:
    """rmb-rs's per-session stream name: `stream:<twin>` or `stream:<twin>:<sid>`."""
    twin, sid = key
    return f"stream:{twin}" if sid is None else f"stream:{twin}:{sid}"


@dataclass(slots=True)
class Taken:
    """Envelopes read from a mailbox; `ack` removes them once they were written out."""

    envelopes: list[bytes]
    ids: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class MailboxStats:
    stored: int = 0
    delivered: int = 0
    expired: int = 0
    dropped_full: int = 0


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

    def deadline(self, timestamp: int, expiration: int) -> int:
        """When a stored envelope stops being worth delivering (unix seconds)."""
        now = seconds(self.clock())
        own = timestamp + expiration if timestamp else now + expiration
        return min(own, now + self.ttl)

    @abc.abstractmethod
    async def put(self, key: SessionKey, envelope: bytes, deadline: int) -> None:
        """Store one envelope; raises MailboxUnavailable if the backend is down."""

    @abc.abstractmethod
    async def take(self, key: SessionKey) -> Taken:
        """Every unexpired envelope for the session, oldest first; raises MailboxUnavailable."""

    async def ack(self, key: SessionKey, taken: Taken) -> None:  # noqa: B027 - optional hook
        """Remove what `take` returned, after it was written to the connection."""

    @abc.abstractmethod
    def depth(self) -> int:
        """Envelopes waiting in all mailboxes (for the metric; may be approximate)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class MemoryMailbox(Mailbox):
    """In-process mailbox for a relay without Redis."""

    def __init__(
        self,
        ttl: int = DEFAULT_MAILBOX_TTL,
        max_per_session: int = DEFAULT_MAILBOX_MAX,
        clock: Clock = wall_clock,
    ) -> None:
        super().__init__(ttl, max_per_session, clock)
        self._boxes: dict[SessionKey, deque[tuple[int, bytes]]] = {}
        self._depth = 0

    async def put(self, key: SessionKey, envelope: bytes, deadline: int) -> None:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = deque()
        self._expire(box)
        if len(box) >= self.max_per_session:
            box.popleft()
            self._depth -= 1
            self.stats.dropped_full += 1
        box.append((deadline, envelope))
        self._depth += 1
        self.stats.stored += 1

    async def take(self, key: SessionKey) -> Taken:
        box = self._boxes.pop(key, None)
        if not box:
            return Taken([])
        self._depth -= len(box)
        now = seconds(self.clock())
        live = [envelope for deadline, envelope in box if deadline > now]
        self.stats.expired += len(box) - len(live)
        self.stats.delivered += len(live)
        return Taken(live)

    def _expire(self, box: deque[tuple[int, bytes]]) -> None:
        now = seconds(self.clock())
        while box and box[0][0] <= now:
            box.popleft()
            self._depth -= 1
            self.stats.expired += 1

    def sweep(self) -> int:
        """Drop expired envelopes of every session (run periodically); returns how many."""
        before = self._depth
        for key in list(self._boxes):
            box = self._boxes[key]
            now = seconds(self.clock())
            kept = deque(item for item in box if item[0] > now)
            self.stats.expired += len(box) - len(kept)
            self._depth -= len(box) - len(kept)
            if kept:
                self._boxes[key] = kept
            else:
                del self._boxes[key]
        return before - self._depth

    def depth(self) -> int:
        return self._depth


class RedisMailbox(Mailbox):
    """Mailbox in Redis streams, compatible with rmb-rs's key layout (field `_` = envelope).

    Each entry also carries `dl` (its deadline) so expiry is per message, not per stream.
    """

    def __init__(
        self,
        redis: RedisClient,
        ttl: int = DEFAULT_MAILBOX_TTL,
        max_per_session: int = DEFAULT_MAILBOX_MAX,
        clock: Clock = wall_clock,
    ) -> None:
        super().__init__(ttl, max_per_session, clock)
        self.redis = redis
        self._depth_estimate = 0

    async def put(self, key: SessionKey, envelope: bytes, deadline: int) -> None:
        from redis.exceptions import RedisError

        name = stream_key(key)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xlen(name)
                pipe.xadd(name, {"_": envelope, "dl": str(deadline)}, maxlen=self.max_per_session)
                pipe.expire(name, self.ttl)
                length, _, _ = await pipe.execute()
        except (RedisError, OSError) as err:
            raise MailboxUnavailable(f"redis: {err}") from err
        if int(length) >= self.max_per_session:
            self.stats.dropped_full += 1
        else:
            self._depth_estimate += 1
        self.stats.stored += 1

    async def take(self, key: SessionKey) -> Taken:
        from redis.exceptions import RedisError

        try:
            raw = await self.redis.xrange(stream_key(key), "-", "+")
            # redis-py's annotation is loose; without decode_responses it is bytes throughout
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], raw)
        except (RedisError, OSError) as err:
            raise MailboxUnavailable(f"redis: {err}") from err
        now = seconds(self.clock())
        live: list[bytes] = []
        for _entry_id, fields in entries:
            deadline = fields.get(b"dl")
            if deadline is not None and int(deadline) <= now:
                self.stats.expired += 1
                continue
            envelope = fields.get(b"_")
            if envelope is not None:
                live.append(envelope)
        self.stats.delivered += len(live)
        return Taken(live, [entry_id for entry_id, _ in entries])

    async def ack(self, key: SessionKey, taken: Taken) -> None:
        from redis.exceptions import RedisError

        if not taken.ids:
            return
        try:
            await self.redis.xdel(stream_key(key), *taken.ids)
        except (RedisError, OSError) as err:
            raise MailboxUnavailable(f"redis: {err}") from err
        self._depth_estimate = max(0, self._depth_estimate - len(taken.ids))

    def depth(self) -> int:
        return self._depth_estimate

    async def close(self) -> None:
        await self.redis.aclose()
