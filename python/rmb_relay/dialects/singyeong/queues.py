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
"""

from __future__ import annotations

import itertools
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
#: outstanding QUEUE_REQUESTs one client may have on one queue
MAX_REQUESTS_PER_CLIENT = 10_000
#: bytes of messages one queue may hold in memory (all states): one consumer's absence stops
#: here, not at the heap's end
DEFAULT_QUEUE_BYTES = 64 << 20
#: bytes of messages all in-memory queues may hold together
DEFAULT_QUEUE_TOTAL_BYTES = 256 << 20
#: bytes of dead letters (all queues) before messages at their last attempt stay in line
DEFAULT_DEAD_LETTER_BYTES = 64 << 20
#: heap bytes a queued message costs besides its frame's size: the Message, its id, decoded
#: target, parsed query and queue entries (tracemalloc, 50,000 messages of 118 wire bytes:
#: 682 heap bytes each), so tiny messages cannot hold five times what the budget says
MESSAGE_OVERHEAD = 560


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
    waiting: deque[Message] = field(default_factory=deque)
    #: outstanding requests in arrival order (a consumer appears once per request)
    requests: deque[Consumer] = field(default_factory=deque)
    #: how many of `requests` each consumer has (the per-client bound without a count)
    asked: dict[Consumer, int] = field(default_factory=dict)
    #: in delivery order, which is deadline order (one ack timeout, a monotonic clock): the
    #: sweep reads expired deliveries from the front, and an ack leaves nothing behind
    unacked: dict[str, Unacked] = field(default_factory=dict)
    dead: dict[str, DeadLetter] = field(default_factory=dict)

    def withdraw(self, consumer: Consumer) -> None:
        """Every outstanding request of `consumer` goes."""
        if self.asked.pop(consumer, None) is not None:
            self.requests = deque(c for c in self.requests if c is not consumer)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.requests or self.unacked or self.dead)


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

    @staticmethod
    def new_id() -> str:
        """A message id shaped like the public server's uuid4: this process's random prefix
        and a counter (a uuid4 per message cost a getrandom call and a UUID object, 2.7 us).
        Unique across instances and restarts (70 random bits per process), never reused within
        one."""
        return f"{_ID_PREFIX}{next(_id_counter):012x}"

    def queue(self, name: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = Queue(name)
        return queue

    def _tidy(self, queue: Queue) -> None:
        if queue.idle:
            self.queues.pop(queue.name, None)

    # ---- the client's operations -----------------------------------------------------------

    def admit(self, message: Message) -> None:
        """Charge a new message to the budget before it is confirmed; raises BudgetExceeded
        (nothing charged, nothing stored) when its queue or the gateway is full."""
        self.budget.take(message.queue, message.size)

    def stored(self, message: Message) -> None:
        """A message that is stored (so it was confirmed) goes to a waiting request it
        matches, else joins its queue's waiting line."""
        self._offer(self.queue(message.queue), message)

    def request(self, name: str, consumer: Consumer) -> bool:
        """One more message for `consumer`: the oldest waiting one it matches, else the
        request waits. False when it has too many requests outstanding."""
        queue = self.queue(name)
        asked = queue.asked.get(consumer, 0)
        if asked >= MAX_REQUESTS_PER_CLIENT:
            return False
        waiting = queue.waiting
        for index, message in enumerate(waiting):
            query = self._query(message)
            if query is not None and consumer.matches(query):
                if index:
                    del waiting[index]
                else:  # the usual case: the oldest message is for anyone asking
                    waiting.popleft()
                self._deliver(queue, message, consumer)
                return True
        queue.requests.append(consumer)
        queue.asked[consumer] = asked + 1
        return True

    def cancel(self, name: str, consumer: Consumer) -> None:
        queue = self.queues.get(name)
        if queue is None:
            return
        queue.withdraw(consumer)
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

    def refusals(self) -> dict[str, int]:
        """Budget refusals by limit (`key`, `total`: a QUEUE refused; `dead_letters`: a
        message kept in its queue because the dead letters were full), for the metrics."""
        refused = self.budget.refused
        return {"key": refused["key"], "total": refused["total"], "dead_letters": self.dead_refused}

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

    async def store(self, message: Message) -> None:
        """Memory's "store" is the budget's charge (BudgetExceeded when full); `stored` then
        offers the message, as after a Redis write."""
        self.admit(message)

    async def list_dead(self, name: str | None) -> list[dict[str, Any]]:
        return [letter.record() for letter in self.dead_letters(name)]

    async def requeue_dead(self, name: str, ids: list[str] | None) -> int:
        return self.requeue(name, ids)

    async def close(self) -> None:
        pass
