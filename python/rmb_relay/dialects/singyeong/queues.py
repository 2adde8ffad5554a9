"""Queues that never lose a message (decision 11), in memory; `redis_queues.py` persists them.

Theory of operation
-------------------
```text
QUEUE ──store──▶ QUEUE_CONFIRM         (only once the message is stored)
          │
          ▼
      waiting (FIFO) ──a QUEUE_REQUEST from a client its target matches──▶ unacked
          ▲                                                                   │
          │◀──ack timeout / consumer gone (attempt < max)─────────────────────┤
                                                                              │ QUEUE_ACK
      dead letters ◀──ack timeout / consumer gone (attempt = max)─────────────┘──▶ done
          │ POST /api/v1/queues/requeue
          └──────────────────────────▶ waiting (attempts reset)
```
A message goes only to a client that asked (one message per QUEUE_REQUEST) and that its
target query matches; a message no waiting client matches stays where it is, behind nothing:
later messages for other consumers pass it. Every delivery counts an attempt (sent to the
consumer as `attempt`). Time comes in as `now` (monotonic ns) from the dialect's sweep.

Memory budget (issues #12, #13)
-------------------------------
Every message costs its QUEUE frame's size plus `MESSAGE_OVERHEAD` (`Message.size`), plus its
payload's JSON text when that is kept (`Message.payload_json`), against a
`ByteBudget` from the
moment it is admitted (before QUEUE_CONFIRM) until it is acked: waiting, unacked and dead
letters alike, per queue (`--sg-queue-bytes`) and in all (`--sg-queue-total-bytes`). A QUEUE
over either is refused (`admit` raises BudgetExceeded; the sender gets op 3 `queue_full`), so
nothing confirmed is ever dropped to make room. Dead letters have a bound of their own
(`--sg-dead-letter-bytes`, all queues) so that messages nobody can process cannot take the
whole budget unnoticed: a message whose last attempt failed while that bound is reached is
NOT dead-lettered and NOT dropped: it goes to the back of its queue's waiting line (attempts
keep counting) and `dead_refused` counts it, with a log line; requeueing or acking dead
letters makes room again.

Queue count (issue 33)
----------------------
A queue exists while it holds a message or a request. One that does not exist yet is
created by a QUEUE or QUEUE_REQUEST and counted against the application of the client that
named it (`--sg-queues-per-app`) and against all queues (`--sg-queues-total`); beyond
either the frame is refused (`TooManyQueues`, op 3 `too_many_queues`), and a queue that
empties stops counting. An empty queue holding only requests costs no message bytes, so
without this count a stranger could make a queue per QUEUE_REQUEST without end. The
QUEUE_REQUESTs waiting for a message are bounded per client over all queues
(`--sg-queue-requests-per-client`) and in all (`--sg-queue-requests-total`): `RequestCounts`,
op 3 `too many outstanding QUEUE_REQUESTs` beyond.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from rmb_relay._core import SG_MAX_QUEUE_NAME
from rmb_relay.budget import ByteBudget
from rmb_relay.dialects.singyeong.query import Query, parse

log = logging.getLogger("rmb_relay.singyeong")

#: `Queues.new_id`: "xxxxxxxx-xxxx-4xxx-yxxx-" from one uuid4, then a 48-bit counter
_ID_PREFIX = str(uuid.uuid4())[:24]
_id_counter = itertools.count()


def _new_id_prefix() -> None:
    """A forked child must not repeat its parent's ids."""
    global _ID_PREFIX, _id_counter
    _ID_PREFIX = str(uuid.uuid4())[:24]
    _id_counter = itertools.count()


os.register_at_fork(after_in_child=_new_id_prefix)

#: queue names longer than this are refused (they key memory and Redis); defined in
#: rust/dialects/singyeong/, whose scanner leaves them to Python
MAX_QUEUE_NAME = SG_MAX_QUEUE_NAME
#: outstanding QUEUE_REQUESTs one client may have, all queues together
MAX_REQUESTS_PER_CLIENT = 10_000
#: outstanding QUEUE_REQUESTs of all clients (a deque slot and a count each: ~16 bytes)
MAX_REQUESTS_TOTAL = 1_000_000
#: queues the clients of one application may have created and that still exist
DEFAULT_QUEUES_PER_APP = 1_000
#: queues that may exist at once (an empty Queue with a request costs ~1 KiB)
DEFAULT_QUEUES_TOTAL = 10_000
#: bytes of messages one queue may hold in memory (all states): one consumer's absence stops
#: here, not at the heap's end
DEFAULT_QUEUE_BYTES = 64 << 20
#: bytes of messages all in-memory queues may hold together
DEFAULT_QUEUE_TOTAL_BYTES = 256 << 20
#: bytes of dead letters (all queues) before messages at their last attempt stay in line
DEFAULT_DEAD_LETTER_BYTES = 64 << 20
#: dead letters one `GET /api/v1/queues/dead-letters` answer lists (`--sg-dead-letters-page`)
DEFAULT_DEAD_LETTERS_PAGE = 1000
#: bytes of JSON one such answer may hold besides its first letter (a letter is at most one
#: QUEUE frame, so a page is never empty)
DEAD_PAGE_BYTES = 4 << 20
#: heap bytes a queued message costs besides its frame's size: the Message, its id, decoded
#: target, parsed query and queue entries (tracemalloc, 50,000 messages of 118 wire bytes:
#: 682 heap bytes each), so tiny messages cannot hold five times what the budget says
MESSAGE_OVERHEAD = 560
#: with Redis: how long a QUEUE whose store failed may wait for the verdict of its withdrawal
#: before it is refused `queue unknown` (s; `--sg-queue-verdict-timeout`, redis_queues.py)
DEFAULT_VERDICT_TIMEOUT = 30.0
#: with Redis: bytes of QUEUEs held in memory, unwritten, while the cluster knows Redis is
#: down (`--sg-queue-held-bytes`, redis_queues.py "Held while Redis is down"); as the bus's
#: `QUEUE_LIMIT` bounds what it holds for other instances meanwhile
DEFAULT_HELD_BYTES = 8 << 20


class NotStored(Exception):
    """A QUEUE that is certainly not stored, and never will be (redis_queues.py: never written,
    held while Redis was known down past its verdict timeout or past --sg-queue-held-bytes;
    or its claim withdrawn first): op 3 `queue unavailable`."""


class StoreUnknown(Exception):
    """A QUEUE whose store failed and whose withdrawal got no verdict in time: it may be
    stored (and delivered) or not, and the gateway cannot tell: op 3 `queue unknown`."""


class TooManyQueues(Exception):
    """A new queue beyond `--sg-queues-per-app` (`limit` "per_app") or `--sg-queues-total`
    ("total")."""

    def __init__(self, name: str, limit: str, allowed: int, whose: str) -> None:
        flag = "--sg-queues-per-app" if limit == "per_app" else "--sg-queues-total"
        super().__init__(
            f"queue {name[:64]!r} not created: {whose} already has {allowed} queues ({flag})"
        )
        self.name = name
        self.limit = limit
        self.allowed = allowed


class QueueCounts:
    """How many queues exist, in all and per application of the client that created each:
    the one count of both queue stores (memory here, Redis keeps its own names set)."""

    def __init__(self, per_app: int, total: int) -> None:
        self.per_app = per_app
        self.total = total
        self.by_app: dict[str, int] = {}
        self.count = 0

    def check(self, name: str, app: str) -> None:
        """Raises TooManyQueues if a new queue for `app` does not fit."""
        if self.count >= self.total:
            raise TooManyQueues(name, "total", self.total, "the gateway")
        if self.by_app.get(app, 0) >= self.per_app:
            raise TooManyQueues(name, "per_app", self.per_app, f"application {app[:64]!r}")

    def add(self, app: str) -> None:
        self.by_app[app] = self.by_app.get(app, 0) + 1
        self.count += 1

    def remove(self, app: str) -> None:
        left = self.by_app[app] - 1
        if left:
            self.by_app[app] = left
        else:
            del self.by_app[app]
        self.count -= 1


class TooManyRequests(Exception):
    """A QUEUE_REQUEST beyond `--sg-queue-requests-per-client` (`limit` "client") or
    `--sg-queue-requests-total` ("total")."""

    def __init__(self, limit: str, allowed: int) -> None:
        whose = "this client has" if limit == "client" else "all clients have"
        flag = (
            "--sg-queue-requests-per-client" if limit == "client" else "--sg-queue-requests-total"
        )
        super().__init__(f"{whose} {allowed} QUEUE_REQUESTs outstanding ({flag})")
        self.limit = limit
        self.allowed = allowed


class RequestCounts:
    """Outstanding QUEUE_REQUESTs per consumer and in all: the one count of both queue
    stores. `check` before a request waits, `add` when it does, `done` when requests are
    answered or withdrawn, `gone` when the consumer leaves."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        self.by_consumer: dict[Consumer, int] = {}
        self.count = 0

    def check(self, consumer: Consumer) -> None:
        if self.by_consumer.get(consumer, 0) >= self.per_client:
            raise TooManyRequests("client", self.per_client)
        if self.count >= self.total:
            raise TooManyRequests("total", self.total)

    def add(self, consumer: Consumer) -> None:
        self.by_consumer[consumer] = self.by_consumer.get(consumer, 0) + 1
        self.count += 1

    def done(self, consumer: Consumer, count: int = 1) -> None:
        had = self.by_consumer.get(consumer, 0)
        count = min(count, had)
        if had - count:
            self.by_consumer[consumer] = had - count
        else:
            self.by_consumer.pop(consumer, None)
        self.count -= count

    def gone(self, consumer: Consumer) -> None:
        self.count -= self.by_consumer.pop(consumer, 0)


class Consumer(Protocol):
    """A session as the queues see it."""

    def matches(self, query: Query) -> bool: ...

    def deliver_queued(self, message: Message) -> None: ...


@dataclass(slots=True)
class Message:
    id: str
    queue: str
    nonce: Any
    target: Any
    payload: Any
    attempts: int = 0
    query: Query | None = None
    #: bytes charged to the memory budget (the QUEUE frame's size + MESSAGE_OVERHEAD, + the
    #: length of `payload_json` when kept)
    size: int = 0
    #: the payload's JSON text when it arrived exactly as the encoder writes it (read by the
    #: scanner): a JSON consumer's QUEUE dispatch copies it instead of encoding again
    payload_json: str | None = None

    def parsed(self) -> Query:
        if self.query is None:
            self.query = parse(self.target)
        return self.query

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "nonce": self.nonce,
            "target": self.target,
            "payload": self.payload,
            "attempts": self.attempts,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Message:
        return cls(
            record["id"],
            record["queue"],
            record.get("nonce"),
            record["target"],
            record.get("payload"),
            int(record.get("attempts", 0)),
        )


@dataclass(slots=True)
class DeadLetter:
    message: Message
    reason: str
    dead_at_ms: int

    def record(self) -> dict[str, Any]:
        return {**self.message.record(), "reason": self.reason, "dead_at": self.dead_at_ms}


@dataclass(slots=True)
class Unacked:
    message: Message
    consumer: Consumer
    deadline: int


@dataclass
class Queue:
    name: str
    #: the application of the client that created it (`QueueCounts`)
    app: str = ""
    waiting: deque[Message] = field(default_factory=deque)
    #: outstanding requests in arrival order (a consumer appears once per request)
    requests: deque[Consumer] = field(default_factory=deque)
    #: how many of `requests` each consumer has (the per-client bound without a count)
    asked: dict[Consumer, int] = field(default_factory=dict)
    #: in delivery order, which is deadline order (one ack timeout, a monotonic clock): the
    #: sweep reads expired deliveries from the front, and an ack leaves nothing behind
    unacked: dict[str, Unacked] = field(default_factory=dict)
    dead: dict[str, DeadLetter] = field(default_factory=dict)

    def withdraw(self, consumer: Consumer) -> int:
        """Every outstanding request of `consumer` goes; how many there were."""
        asked = self.asked.pop(consumer, 0)
        if asked:
            self.requests = deque(c for c in self.requests if c is not consumer)
        return asked

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.requests or self.unacked or self.dead)


def dead_cursor(queue: str, message_id: str) -> str:
    """The `after` of the next page: the last letter listed (the queue's length first, so a
    name may hold any character). Letters are listed in (queue, id) order, so a cursor whose
    letter was requeued since still says where to go on."""
    return f"{len(queue)}:{queue}{message_id}"


def parse_dead_cursor(text: str) -> tuple[str, str]:
    """(queue, id) of a `dead_cursor`; raises ValueError."""
    length, sep, rest = text.partition(":")
    if not sep or not length.isdigit() or int(length) > len(rest):
        raise ValueError(f"after: not a cursor this gateway gave: {text[:64]!r}")
    return rest[: int(length)], rest[int(length) :]


class DeadPage:
    """One page of the dead-letter listing (both stores): letters in (queue, id) order after
    `after`, at most `limit` of them and `max_bytes` of JSON (at least one). `add` returns
    False once the page is full; `cursor` then names the last letter taken, where the next
    page starts. One answer costs the gateway a page, whatever the dead letters hold."""

    __slots__ = ("_last", "after", "cursor", "limit", "max_bytes", "parts", "size")

    def __init__(self, after: str | None, limit: int, max_bytes: int = DEAD_PAGE_BYTES) -> None:
        self.after = parse_dead_cursor(after) if after else None
        self.limit = limit
        self.max_bytes = max_bytes
        self.parts: list[bytes] = []
        self.size = 0
        #: set when letters are left out: the `after` of the next page
        self.cursor: str | None = None
        self._last: tuple[str, str] | None = None

    def wanted(self, queue: str, message_id: str) -> bool:
        """Whether a letter at this position comes after the cursor."""
        return self.after is None or (queue, message_id) > self.after

    def add(self, queue: str, message_id: str, record: dict[str, Any]) -> bool:
        """Take a letter (in order); False when the page is full (the letter is left out)."""
        if self.cursor is not None:
            return False
        data = json.dumps(record, separators=(",", ":")).encode()
        if self.parts and (len(self.parts) >= self.limit or self.size + len(data) > self.max_bytes):
            assert self._last is not None
            self.cursor = dead_cursor(*self._last)
            return False
        self.parts.append(data)
        self.size += len(data) + 1
        self._last = (queue, message_id)
        return True

    def body(self) -> bytes:
        """The page as a JSON list (the listing's shape without paging)."""
        return b"[" + b",".join(self.parts) + b"]"


class QueueEvents(Protocol):
    """What the queues tell the persistence layer (memory: nothing; Redis: every move)."""

    def delivered(self, message: Message, deadline: int) -> None: ...

    def acked(self, message: Message) -> None: ...

    def requeued(self, message: Message) -> None: ...

    def dead(self, letter: DeadLetter) -> None: ...


class _NoEvents:
    def delivered(self, message: Message, deadline: int) -> None:
        pass

    def acked(self, message: Message) -> None:
        pass

    def requeued(self, message: Message) -> None:
        pass

    def dead(self, letter: DeadLetter) -> None:
        pass


class Queues:
    """Every queue of this gateway; see the module docstring."""

    def __init__(
        self,
        *,
        ack_timeout_ns: int,
        max_attempts: int,
        clock: Callable[[], int],
        wall_ms: Callable[[], int],
        events: QueueEvents | None = None,
        budget: ByteBudget | None = None,
        dead_letter_bytes: int = DEFAULT_DEAD_LETTER_BYTES,
        queues_per_app: int = DEFAULT_QUEUES_PER_APP,
        queues_total: int = DEFAULT_QUEUES_TOTAL,
        requests_per_client: int = MAX_REQUESTS_PER_CLIENT,
        requests_total: int = MAX_REQUESTS_TOTAL,
    ) -> None:
        self.ack_timeout_ns = ack_timeout_ns
        self.max_attempts = max_attempts
        self.clock = clock
        self.wall_ms = wall_ms
        self.events: QueueEvents = events if events is not None else _NoEvents()
        self.queues: dict[str, Queue] = {}
        #: bytes of every message held (module docstring), keyed by queue name
        self.budget = (
            budget
            if budget is not None
            else ByteBudget(key_bytes=DEFAULT_QUEUE_BYTES, total_bytes=DEFAULT_QUEUE_TOTAL_BYTES)
        )
        #: the dead letters' own bound (all queues: key and total are the same figure)
        self.dead_budget = ByteBudget(key_bytes=dead_letter_bytes, total_bytes=dead_letter_bytes)
        #: messages at their last attempt kept in line because the dead letters were full
        self.dead_refused = 0
        #: queues that exist, in all and per application (module docstring)
        self.counts = QueueCounts(queues_per_app, queues_total)
        #: outstanding requests per consumer and in all (module docstring)
        self.outstanding = RequestCounts(requests_per_client, requests_total)

    @staticmethod
    def new_id() -> str:
        """A message id shaped like the public server's uuid4: this process's random prefix
        and a counter (a uuid4 per message cost a getrandom call and a UUID object, 2.7 us).
        Unique across instances and restarts (70 random bits per process), never reused within
        one."""
        return f"{_ID_PREFIX}{next(_id_counter):012x}"

    def queue(self, name: str, app: str = "") -> Queue:
        """The queue `name`, created (for `app`) if it does not exist: raises TooManyQueues
        if that is beyond the counts."""
        queue = self.queues.get(name)
        if queue is None:
            self.counts.check(name, app)
            queue = self.queues[name] = Queue(name, app)
            self.counts.add(app)
        return queue

    def _tidy(self, queue: Queue) -> None:
        if queue.idle and self.queues.pop(queue.name, None) is not None:
            self.counts.remove(queue.app)

    # ---- the client's operations -----------------------------------------------------------

    def admit(self, message: Message, app: str = "") -> None:
        """Charge a new message to the budget before it is confirmed, and make its queue
        (for `app`) if it has none; raises TooManyQueues or BudgetExceeded (nothing charged,
        nothing stored, no queue made) when the queue cannot be made or is full."""
        if message.queue not in self.queues:
            self.counts.check(message.queue, app)
        self.budget.take(message.queue, message.size)
        self.queue(message.queue, app)

    def stored(self, message: Message) -> None:
        """A message that is stored (so it was confirmed) goes to a waiting request it
        matches, else joins its queue's waiting line."""
        self._offer(self.queue(message.queue), message)

    def request(self, name: str, consumer: Consumer, app: str = "") -> None:
        """One more message for `consumer`: the oldest waiting one it matches, else the
        request waits. Raises TooManyRequests when too many are outstanding, TooManyQueues
        when `name` does not exist and cannot be made for `app`."""
        self.outstanding.check(consumer)
        queue = self.queue(name, app)
        asked = queue.asked.get(consumer, 0)
        waiting = queue.waiting
        for index, message in enumerate(waiting):
            query = self._query(message)
            if query is not None and consumer.matches(query):
                if index:
                    del waiting[index]
                else:  # the usual case: the oldest message is for anyone asking
                    waiting.popleft()
                self._deliver(queue, message, consumer)
                return
        queue.requests.append(consumer)
        queue.asked[consumer] = asked + 1
        self.outstanding.add(consumer)

    def cancel(self, name: str, consumer: Consumer) -> None:
        queue = self.queues.get(name)
        if queue is None:
            return
        self.outstanding.done(consumer, queue.withdraw(consumer))
        self._tidy(queue)

    def ack(self, name: str, message_id: str) -> bool:
        queue = self.queues.get(name)
        if queue is None:
            return False
        entry = queue.unacked.pop(message_id, None)
        if entry is None:
            return False
        self._release(entry.message)
        self.events.acked(entry.message)
        self._tidy(queue)
        return True

    def consumer_gone(self, consumer: Consumer) -> None:
        """Its requests are withdrawn and what it holds unacked goes back (an attempt spent)."""
        self.outstanding.gone(consumer)
        for queue in list(self.queues.values()):
            queue.withdraw(consumer)
            held = [m_id for m_id, entry in queue.unacked.items() if entry.consumer is consumer]
            for message_id in held:
                entry = queue.unacked.pop(message_id)
                self._retry(queue, entry.message, "consumer disconnected")
            self._tidy(queue)

    # ---- delivery --------------------------------------------------------------------------

    def _offer(self, queue: Queue, message: Message, *, front: bool = False) -> None:
        consumer = self._consumer_for(queue, message)
        if consumer is not None:
            self._deliver(queue, message, consumer)
        elif front:
            queue.waiting.appendleft(message)
        else:
            queue.waiting.append(message)

    @staticmethod
    def _query(message: Message) -> Query | None:
        try:
            return message.parsed()
        except ValueError:
            return None  # checked when queued; a stored record from elsewhere may still be bad

    def pump(self, name: str) -> None:
        """Give waiting messages to matching outstanding requests, oldest message first: the
        full pass, for when a consumer's metadata changed. (Arrivals of messages and requests
        keep the invariant "no waiting message matches an outstanding request" cheaply: a new
        message is tried against the requests, a new request against the waiting messages.)"""
        queue = self.queues.get(name)
        if queue is None:
            return
        if queue.requests and queue.waiting:
            kept: deque[Message] = deque()
            waiting = queue.waiting
            while waiting and queue.requests:
                message = waiting.popleft()
                consumer = self._consumer_for(queue, message)
                if consumer is None:
                    kept.append(message)
                    continue
                self._deliver(queue, message, consumer)
            kept.extend(waiting)
            queue.waiting = kept
        self._tidy(queue)

    def _consumer_for(self, queue: Queue, message: Message) -> Consumer | None:
        query = self._query(message)
        if query is None:
            return None
        for index, consumer in enumerate(queue.requests):
            if consumer.matches(query):
                del queue.requests[index]
                asked = queue.asked
                left = asked[consumer] - 1
                if left:
                    asked[consumer] = left
                else:
                    del asked[consumer]
                self.outstanding.done(consumer)
                return consumer
        return None

    def _deliver(self, queue: Queue, message: Message, consumer: Consumer) -> None:
        message.attempts += 1
        deadline = self.clock() + self.ack_timeout_ns
        queue.unacked[message.id] = Unacked(message, consumer, deadline)
        self.events.delivered(message, deadline)
        consumer.deliver_queued(message)

    def _release(self, message: Message) -> None:
        if message.size:
            self.budget.release(message.queue, message.size)

    def _retry(self, queue: Queue, message: Message, reason: str) -> None:
        if message.attempts >= self.max_attempts:
            if self.dead_budget.try_take(message.queue, message.size):
                letter = DeadLetter(message, reason, self.wall_ms())
                queue.dead[message.id] = letter
                self.events.dead(letter)
                return
            # the dead letters are full: keep it (at the back, so it does not hold up the
            # line), tell the operator; nothing confirmed is dropped
            self.dead_refused += 1
            log.warning(
                "singyeong: queue %s: message %s failed %d attempts (%s) but the dead letters "
                "are over %d bytes: it stays in the queue; requeue or drain dead letters",
                queue.name,
                message.id,
                message.attempts,
                reason,
                self.dead_budget.total_bytes,
            )
            self.events.requeued(message)
            self._offer(queue, message)
            return
        self.events.requeued(message)
        self._offer(queue, message, front=True)

    def sweep(self, now: int) -> None:
        """Ack timeouts: each expired delivery is retried or becomes a dead letter. A queue's
        deliveries are in deadline order (`Queue.unacked`), so the expired ones are a prefix;
        they are taken before any is retried (a retry may deliver again, at the end)."""
        for queue in list(self.queues.values()):
            unacked = queue.unacked
            expired: list[str] = []
            for message_id, entry in unacked.items():
                if entry.deadline > now:
                    break
                expired.append(message_id)
            if not expired:
                continue
            for message_id in expired:
                self._retry(queue, unacked.pop(message_id).message, "ack timeout")
            self._tidy(queue)

    # ---- dead letters ----------------------------------------------------------------------

    def dead_letters(self, name: str | None = None) -> Iterator[DeadLetter]:
        for queue in list(self.queues.values()):
            if name is None or queue.name == name:
                yield from queue.dead.values()

    def requeue(self, name: str, ids: list[str] | None = None) -> int:
        """Dead letters back into their queue with a fresh attempt count; how many moved."""
        queue = self.queues.get(name)
        if queue is None:
            return 0
        chosen = list(queue.dead) if ids is None else [i for i in ids if i in queue.dead]
        for message_id in chosen:
            message = queue.dead.pop(message_id).message
            if message.size:
                self.dead_budget.release(message.queue, message.size)
            message.attempts = 0
            self.events.requeued(message)
            self._offer(queue, message)
        self._tidy(queue)
        return len(chosen)

    def held_bytes(self) -> tuple[int, int]:
        """(bytes held in all states, of which in dead letters), for the metrics."""
        return self.budget.held, self.dead_budget.held

    def withdrawals(self) -> dict[str, int]:
        """None in memory: a store here cannot fail halfway (redis_queues.py has them)."""
        return {}

    def held_stores(self) -> tuple[int, dict[str, int]]:
        """None in memory: a store here never waits for Redis (redis_queues.py holds them)."""
        return 0, {}

    def ack_retries(self) -> int:
        """None in memory: an ack here cannot fail (redis_queues.py tries again)."""
        return 0

    def refusals(self) -> dict[str, int]:
        """Budget refusals by limit (`key`, `total`: a QUEUE refused; `dead_letters`: a
        message kept in its queue because the dead letters were full), for the metrics."""
        refused = self.budget.refused
        return {"key": refused["key"], "total": refused["total"], "dead_letters": self.dead_refused}

    def queue_count(self) -> int:
        return self.counts.count

    def names(self) -> set[str]:
        """The queues that exist."""
        return set(self.queues)

    def depth(self) -> tuple[int, int, int]:
        """(waiting, unacked, dead letters) over every queue, for the metrics."""
        waiting = unacked = dead = 0
        for queue in self.queues.values():
            waiting += len(queue.waiting)
            unacked += len(queue.unacked)
            dead += len(queue.dead)
        return waiting, unacked, dead

    # ---- the interface the dialect and the HTTP API share with `RedisQueues` --------------

    @property
    def busy(self) -> bool:
        """Something may time out: the dialect's sweep must keep running."""
        return bool(self.queues)

    async def store(self, message: Message, app: str = "") -> None:
        """Memory's "store" is the budget's charge (BudgetExceeded when full); `stored` then
        offers the message, as after a Redis write."""
        self.admit(message, app)

    async def list_dead(self, name: str | None, page: DeadPage) -> None:
        """Fill `page` with dead letters (of queue `name`, or all) in (queue, id) order."""
        names = sorted(n for n in self.queues if name is None or n == name)
        for queue_name in names:
            if page.after is not None and queue_name < page.after[0]:
                continue
            dead = self.queues[queue_name].dead
            for message_id in sorted(i for i in dead if page.wanted(queue_name, i)):
                if not page.add(queue_name, message_id, dead[message_id].record()):
                    return

    async def requeue_dead(self, name: str, ids: list[str] | None) -> int:
        return self.requeue(name, ids)

    async def close(self) -> None:
        pass
