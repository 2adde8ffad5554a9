"""Work queues: named Redis streams, each read through one consumer group by the instances that
can do its work, so each entry goes to exactly one of them.

Used by the HTTP tunnel (`dialects/tunnel/scaleout.py`, decision 8): one queue per tenant,
read by the relays holding that tenant's connectors. The answers do not come back this way:
they go to the origin instance's bus (`Cluster.send_to_nowait`).

Keys (`keys.py`; one hash tag per queue)
---------------------------------------
```text
rmb:{q:<topic>:<name>}:work      stream  the entries; group `keys.GROUP`, one consumer per instance
rmb:{q:<topic>:<name>}:holders   set     instances consuming it (`has_consumers`)
rmb:{q:<topic>:<name>}:claim:<c> string  an entry's claim (TTL): `t:<entry id>:<instance>` or `w`
```

Delivery is at most once: an entry is acknowledged (and deleted) as it is read, before it is
handed on, so an instance that dies with entries it read loses them. The tunnel wants that: its
origin answers every request it did not hear back about (504 at its answer deadline, 503 when
the instance that took it dies), and a request must never run twice unasked. A holder that
died stays in the set until `has_consumers` finds its liveness key gone and removes it.

Claims: an entry put with a claim (a name unique to it, and how long the claim is kept) is
handed on only by the consumer that sets its claim key first (`SET NX`, in the round trip that
acknowledges it); its producer may `withdraw` it by setting the same key first. Whoever comes
first decides, in Redis, with no clock compared between hosts: a producer whose write failed,
and may still land (a cut link delivers what it held at the heal), or that heard nothing by a
deadline, learns whether the entry will run before it tells anyone it will not. A copy of the
entry (a write retried after a lost reply) finds the claim set and is dropped too. The claim
outlives both sides' use of it only by its TTL: a copy arriving later still is left to the
consumer's own checks (the tunnel's pickup deadline).

Claims are shared (`add_claims`, `set_claims`, `withdraw_claims`): the 신경 gateway's Redis
queues (`dialects/singyeong/redis_queues.py`) claim each stored message the same way, its
store setting the claim where a consumer does here. A claim is won when the key holds the
caller's own value after its `SET NX`, read back in the same round trip (`GET`): redis-py
sends a command again after a connection reset, and the retried `SET NX` finds the claim its
first try set (a reply lost, not a race lost: 81 of 3,062 tunnel requests were answered 504
under 1% resets when that counted as lost). A consumer's value names the entry it read as
well as itself: a copy of the entry (the producer's XADD sent again) is another entry, and
finding the claim its first copy won, even here, it is dropped, not run twice (30 of 3,058
were, before the entry was named). Only an entry's producer withdraws it, so a `WITHDRAWN`
found is its own. Plain commands in a pipeline, no script: any Redis version, and a Redis
Cluster client splits the pipeline by slot.

Pending entries: an XREADGROUP whose reply is lost (a reset, after which redis-py reads again
on a new connection; a read sent on a cut link reaching Redis at the heal) leaves entries
pending for our consumer that `>` never returns again. The consumer reads its pending entries
(id `0`) at start, after a failed round trip and every `pending_every` (the cluster's
`ttl/3`), as the bus does (43 of 3,064 tunnel requests waited there until their pickup
deadline, 408, under 50 ± 20 ms and 1% resets). Entries whose acknowledging round trip failed
are claimed again from memory first (`_unsure`): the claim read back says whether they are ours.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rmb_relay.clock import Clock, nanos
from rmb_relay.cluster import keys
from rmb_relay.cluster.bus import (
    READ_BLOCK_MS,
    READ_COUNT,
    RETRY_DELAY,
    ensure_group,
    redis_errors,
    stream_entries,
)
from rmb_relay.errors import ClusterUnavailable, WriteUncertain
from rmb_relay.tasks import STOP_TIMEOUT, cancel_and_wait, finish_or_cancel

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient
    from rmb_relay.cluster.node import Cluster

log = logging.getLogger("rmb_relay.cluster")

#: entries kept per queue at most (approximately): a bound on what waits for a consumer
QUEUE_MAX = 100_000
#: how long closing may wait for the holder sets to be updated
LEAVE_TIMEOUT = 2.0
#: an entry's claim fields (its claim's name, how long it is kept in ms), and the values of a
#: claim key: taken (+ the consumer's instance id) or withdrawn by the producer
CLAIM, CLAIM_MS = "claim", "claim_ms"
CLAIM_B, CLAIM_MS_B = CLAIM.encode(), CLAIM_MS.encode()
TAKEN, WITHDRAWN = b"t:", b"w"


def taker(value: bytes | None) -> str | None:
    """The instance a claim's value says took its entry (`t:<entry id>:<instance>`; an older
    relay's `t:<instance>` too), or None (withdrawn, gone, not a taken claim)."""
    if value is None or not value.startswith(TAKEN):
        return None
    text = value[len(TAKEN) :].decode(errors="replace")
    entry, sep, instance = text.partition(":")
    first, dash, second = entry.partition("-")
    if sep and dash and first.isdigit() and second.isdigit():
        return instance
    return text


Fields = dict[bytes, bytes]
Handler = Callable[[Fields], None]


def add_claims(pipe: Any, claims: Sequence[tuple[str, bytes, int]]) -> None:
    """Queue on `pipe` (a pipeline of either client), for each (key, value, ms to keep it), a
    `SET NX PX` and a `GET` of the key: two replies per claim, read by `claimed` (module
    docstring)."""
    for key, value, ms in claims:
        pipe.set(key, value, nx=True, px=max(1, ms))
        pipe.get(key)


def claimed(replies: Sequence[Any]) -> list[bytes | None]:
    """What each claim key of `add_claims` holds after its `SET NX` (the caller's own value:
    won, also when a retried `SET NX` found it), from those commands' replies; None: gone
    (expired in between)."""
    return [value if isinstance(value, bytes) else None for value in replies[1::2]]


async def set_claims(
    redis: RedisClient, claims: Sequence[tuple[str, bytes, int]]
) -> list[bytes | None]:
    """`add_claims` in a round trip of its own: what each key holds. Raises
    ClusterUnavailable (then any of them may or may not be set)."""
    pipe = redis.pipeline(transaction=False)
    add_claims(pipe, claims)
    try:
        replies = await pipe.execute()
    except redis_errors() as err:
        raise ClusterUnavailable(f"redis: {err}") from err
    return claimed(replies)


async def withdraw_claims(
    redis: RedisClient, claims: Sequence[tuple[str, int]]
) -> list[bytes | None]:
    """Withdraw each (claim key, ms to keep it): set it to `WITHDRAWN` unless something holds it
    already, in one round trip. What each holds then: `WITHDRAWN` (withdrawn, by this call or
    an earlier try of ours: nobody else withdraws it), the value of whoever came first, or
    None (gone: not known). Raises ClusterUnavailable."""
    return await set_claims(redis, [(key, WITHDRAWN, ms) for key, ms in claims])


class WorkQueues:
    """The work queues of one topic on this instance; see the module docstring."""

    def __init__(self, cluster: Cluster, topic: str) -> None:
        self.cluster = cluster
        self.redis = cluster.redis
        self.me = cluster.me
        self.topic = topic
        self._consumers: dict[str, asyncio.Task[None]] = {}
        #: holder-set updates, written in order by one task: (name, joined)
        self._holders: list[tuple[str, bool]] = []
        self._writer: asyncio.Task[None] | None = None
        self._stopped: set[asyncio.Task[None]] = set()
        self._me = self.me.encode()
        self.clock: Clock = cluster.clock
        #: how often (ns) a consumer reads the entries pending for it (module docstring)
        self.pending_every = nanos(cluster.ttl / 3)
        #: entries read here and dropped: their producer withdrew them first
        self.withdrawn = 0

    # ---- producing -------------------------------------------------------------------------

    async def put(
        self, name: str, fields: dict[str, bytes | str], claim: tuple[str, int] | None = None
    ) -> None:
        """Append one entry to queue `name`, with `claim` (its name, how long it is kept in ms:
        module docstring). Raises ClusterUnavailable when Redis is known to be down (nothing
        was sent), WriteUncertain when the write failed (it may still land)."""
        if not self.cluster.redis_up:
            raise ClusterUnavailable("redis is unavailable")
        entry: dict[Any, Any] = fields
        if claim is not None:
            entry = {**fields, CLAIM: claim[0], CLAIM_MS: str(claim[1])}
        try:
            await self.redis.xadd(
                keys.work_key(self.topic, name), entry, maxlen=QUEUE_MAX, approximate=True
            )
        except redis_errors() as err:
            raise WriteUncertain(f"redis: {err}") from err

    async def withdraw(self, claims: list[tuple[str, str, int]]) -> list[str | None]:
        """For each (queue name, claim, ms to keep it): None when it is withdrawn here (no
        consumer took it; none will while the claim is kept), else the instance that took it,
        or "" when the claim was gone (expired: not known). One round trip
        (`withdraw_claims`); raises ClusterUnavailable."""
        held = await withdraw_claims(
            self.redis,
            [(keys.work_claim_key(self.topic, name, claim), ms) for name, claim, ms in claims],
        )
        return [None if value == WITHDRAWN else (taker(value) or "") for value in held]

    async def takers(self, claims: list[tuple[str, str]]) -> list[str | None]:
        """For each (queue name, claim): the instance that took it, or None (not taken yet,
        withdrawn, or expired). Reads only: a consumer may still take an untaken one. One
        round trip; raises ClusterUnavailable."""
        pipe = self.redis.pipeline(transaction=False)
        for name, claim in claims:
            pipe.get(keys.work_claim_key(self.topic, name, claim))
        try:
            replies = await pipe.execute()
        except redis_errors() as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        return [taker(value if isinstance(value, bytes) else None) for value in replies]

    async def has_consumers(self, name: str) -> bool:
        """Whether a live instance consumes `name` (raises ClusterUnavailable). Holders found
        dead are removed on the way."""
        if name in self._consumers:
            return True
        key = keys.work_holders_key(self.topic, name)
        try:
            holders = [
                member.decode() if isinstance(member, bytes) else str(member)
                for member in await self.redis.smembers(key)
            ]
            if not holders:
                return False
            live = await self.cluster.alive(holders)
            dead = [holder for holder in holders if holder not in live]
            if dead:
                await self.redis.srem(key, *dead)
        except redis_errors() as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        return bool(live)

    # ---- consuming -------------------------------------------------------------------------

    def consuming(self, name: str) -> bool:
        return name in self._consumers

    def consume(self, name: str, handler: Handler) -> None:
        """Start reading queue `name`, handing each entry to `handler` (in order)."""
        if name in self._consumers:
            return
        loop = asyncio.get_running_loop()
        self._consumers[name] = loop.create_task(self._consume(name, handler))
        self._update_holders(name, True)

    def stop(self, name: str) -> None:
        """Stop reading queue `name` (what was read is handled; the rest waits for others)."""
        task = self._consumers.pop(name, None)
        if task is None:
            return
        task.cancel()
        self._stopped.add(task)
        task.add_done_callback(self._stopped.discard)
        self._update_holders(name, False)

    async def _consume(self, name: str, handler: Handler) -> None:
        """Read and hand on `name`'s entries: its pending ones first (at start, after a
        failure, every `pending_every`), then new ones (module docstring)."""
        stream = keys.work_key(self.topic, name)
        grouped = False
        recover = True  # at start: what a run of ours before read and never acknowledged
        looked = self.clock()
        #: entries read whose claiming round trip failed: claimed again before anything else
        unsure: list[tuple[bytes, Fields]] = []
        while True:
            try:
                if not grouped:
                    await ensure_group(self.redis, stream)
                    grouped = True
                if unsure:
                    entries, unsure = unsure, []
                elif recover or self.clock() - looked >= self.pending_every:
                    looked = self.clock()
                    entries = await self._read(stream, "0")
                    recover = bool(entries)  # (a page of them: read on until none is left)
                else:
                    entries = await self._read(stream, ">")
                if not entries:
                    continue
                try:
                    # at most once: see the module docstring
                    taken = await self._claim(name, stream, entries)
                except redis_errors():
                    unsure = entries
                    raise
                for fields in taken:
                    try:
                        handler(fields)
                    except Exception:
                        log.exception("cluster: work queue %s: handling failed", stream)
            except redis_errors() as err:
                log.warning("cluster: work queue %s: reading failed: %s", stream, err)
                grouped = False
                recover = True
                await asyncio.sleep(RETRY_DELAY)

    async def _read(self, stream: str, start: str) -> list[tuple[bytes, Fields]]:
        """New entries (`>`, blocking up to `READ_BLOCK_MS`) or those pending for us (`0`)."""
        block = READ_BLOCK_MS if start == ">" else None
        replies: Any = await self.redis.xreadgroup(
            keys.GROUP, self.me, {stream: start}, count=READ_COUNT, block=block
        )
        return [entry for _, entries in stream_entries(replies) for entry in entries]

    async def _claim(
        self, name: str, stream: str, entries: list[tuple[bytes, Fields]]
    ) -> list[Fields]:
        """Acknowledge and delete `entries`, and set the claims of those that have one, in one
        round trip: the entries to hand on (claimed here, or without a claim). An entry
        pending with its fields gone (deleted) is only acknowledged."""
        ids = [entry_id for entry_id, _ in entries]
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(stream, keys.GROUP, *ids)
        pipe.xdel(stream, *ids)
        claims: list[tuple[str, bytes, int]] = []
        with_claim: list[int] = []
        for i, (entry_id, fields) in enumerate(entries):
            claim, ms = (fields.get(CLAIM_B), fields.get(CLAIM_MS_B)) if fields else (None, None)
            if claim is None or ms is None or not ms.isdigit():
                continue
            key = keys.work_claim_key(self.topic, name, claim.decode(errors="replace"))
            claims.append((key, TAKEN + entry_id + b":" + self._me, int(ms)))
            with_claim.append(i)
        add_claims(pipe, claims)
        replies = await pipe.execute()
        held = claimed(replies[2:])
        # ours: set by this round trip, or by an earlier try of it whose reply was lost (a
        # copy of the entry, another id, is not)
        lost = {
            i
            for i, (_, ours, _), value in zip(with_claim, claims, held, strict=True)
            if value != ours
        }
        self.withdrawn += len(lost)
        return [fields for i, (_, fields) in enumerate(entries) if fields and i not in lost]

    def _update_holders(self, name: str, joined: bool) -> None:
        self._holders.append((name, joined))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_holders())

    async def _write_holders(self) -> None:
        try:
            while self._holders:
                updates, self._holders = self._holders, []
                pipe = self.redis.pipeline(transaction=False)
                for name, joined in updates:
                    key = keys.work_holders_key(self.topic, name)
                    if joined:
                        pipe.sadd(key, self.me)
                    else:
                        pipe.srem(key, self.me)
                try:
                    await pipe.execute()
                except redis_errors() as err:
                    # a holder missing from the set makes a `require_connection` check fail
                    # early; a stale one is removed once it is found dead
                    log.warning(
                        "cluster: work queues %s: updating holders failed: %s", self.topic, err
                    )
        finally:
            self._writer = None

    async def close(self) -> None:
        """Stop every consumer and leave the holder sets (bounded)."""
        for name in list(self._consumers):
            self.stop(name)
        for task in list(self._stopped):
            await cancel_and_wait(task, STOP_TIMEOUT)
        await finish_or_cancel(self._writer, LEAVE_TIMEOUT, STOP_TIMEOUT)
