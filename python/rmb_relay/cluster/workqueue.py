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
rmb:{q:<topic>:<name>}:claim:<c> string  an entry's claim (TTL): `t:<instance>` or `w`
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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

Fields = dict[bytes, bytes]
Handler = Callable[[Fields], None]


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
        self._taken = TAKEN + self.me.encode()
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
        or "" when the claim was gone (expired: not known). One round trip; raises
        ClusterUnavailable."""
        pipe = self.redis.pipeline(transaction=False)
        for name, claim, ms in claims:
            key = keys.work_claim_key(self.topic, name, claim)
            pipe.set(key, WITHDRAWN, nx=True, px=ms)
            pipe.get(key)
        try:
            replies = await pipe.execute()
        except redis_errors() as err:
            raise ClusterUnavailable(f"redis: {err}") from err
        verdicts: list[str | None] = []
        for value in replies[1::2]:
            if value == WITHDRAWN:
                verdicts.append(None)
            elif isinstance(value, bytes) and value.startswith(TAKEN):
                verdicts.append(value[len(TAKEN) :].decode(errors="replace"))
            else:
                verdicts.append("")
        return verdicts

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
        return [
            value[len(TAKEN) :].decode(errors="replace")
            if isinstance(value, bytes) and value.startswith(TAKEN)
            else None
            for value in replies
        ]

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
        stream = keys.work_key(self.topic, name)
        while True:
            try:
                await ensure_group(self.redis, stream)
                while True:
                    replies: Any = await self.redis.xreadgroup(
                        keys.GROUP, self.me, {stream: ">"}, count=READ_COUNT, block=READ_BLOCK_MS
                    )
                    for _, entries in stream_entries(replies):
                        # at most once: see the module docstring
                        for fields in await self._claim(name, stream, entries):
                            try:
                                handler(fields)
                            except Exception:
                                log.exception("cluster: work queue %s: handling failed", stream)
            except redis_errors() as err:
                log.warning("cluster: work queue %s: reading failed: %s", stream, err)
                await asyncio.sleep(RETRY_DELAY)

    async def _claim(
        self, name: str, stream: str, entries: list[tuple[bytes, Fields]]
    ) -> list[Fields]:
        """Acknowledge and delete `entries`, and set the claims of those that have one, in one
        round trip: the entries to hand on (claimed here, or without a claim)."""
        ids = [entry_id for entry_id, _ in entries]
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(stream, keys.GROUP, *ids)
        pipe.xdel(stream, *ids)
        claimed: list[int] = []
        for i, (_, fields) in enumerate(entries):
            claim, ms = fields.get(CLAIM_B), fields.get(CLAIM_MS_B)
            if claim is None or ms is None or not ms.isdigit():
                continue
            key = keys.work_claim_key(self.topic, name, claim.decode(errors="replace"))
            pipe.set(key, self._taken, nx=True, px=max(1, int(ms)))
            claimed.append(i)
        replies = await pipe.execute()
        lost = {i for i, won in zip(claimed, replies[2:], strict=True) if not won}
        self.withdrawn += len(lost)
        return [fields for i, (_, fields) in enumerate(entries) if i not in lost]

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
