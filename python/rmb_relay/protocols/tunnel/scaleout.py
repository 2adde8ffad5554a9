"""Several relays on one Redis (decision 8): Redis streams in the role RabbitMQ plays for
RelayServer.

```text
relay A (client here)                    Redis                         relay B (connector here)
 no local connector of T ── XADD ──▶ tunnel:req:{T} ── XREADGROUP ──▶ hub.submit(job)
                                     (group "tunnel", one consumer       │ RequestTarget
                                      per relay holding T's connectors)  ▼
 future ◀── XREAD ── tunnel:res:{A} ◀── XADD "taken", then "res" ── Deliver
```

- A relay with a connector of the tenant serves the request itself (the "shortcut", on by
  default); only otherwise is it published to the tenant's stream, read by every relay that
  holds connectors of that tenant through one consumer group, so each request goes to one.
- The pickup deadline travels as unix milliseconds: the consuming relay drops a request whose
  deadline has passed, and the origin answers 408 at the deadline unless it was told `taken`.
  So a request is never started after its client got 408, up to the clock skew between hosts.
- Bodies over the inline limit stay in the body store, which must be one directory shared by
  the relays (RelayServer needs a shared volume too); the relay that reads a file takes over
  its bookkeeping (`adopt`), the one that handed it on lets go (`release`).
- Each relay writes to Redis from one task, so `taken` always precedes `res` for a request.

Not covered (docs/tunnel.md): a relay that dies with requests it consumed loses them (entries
are acknowledged when consumed); manual acknowledge URLs must reach the relay that issued them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError, ResponseError

from rmb_relay.clock import NS, Clock, wall_clock
from rmb_relay.protocols.tunnel.hub import Hub, Job, Outcome
from rmb_relay.protocols.tunnel.wire import ClientRequest, TargetResponse, WireError, decode, encode

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient as Redis  # a server or a Cluster
    from rmb_relay.protocols.tunnel.bodystore import FileBodyStore

log = logging.getLogger("rmb_relay.tunnel")

GROUP = "tunnel"
#: entries kept per tenant stream at most (approximately): a bound on what waits for connectors
STREAM_MAX = 100_000
#: XREAD/XREADGROUP block this long (ms) so that cancellation is noticed
BLOCK_MS = 1000
#: a relay's response stream outlives it by this long (s), then Redis drops it
RESPONSE_STREAM_TTL = 3600


def request_stream(tenant: str) -> str:
    return f"tunnel:req:{tenant}"


def response_stream(origin: str) -> str:
    return f"tunnel:res:{origin}"


def presence_key(tenant: str) -> str:
    return f"tunnel:connected:{tenant}"


class RedisBridge:
    def __init__(
        self,
        redis: Redis,
        hub: Hub,
        store: FileBodyStore,
        *,
        request_ttl: float,
        wall: Clock = wall_clock,
    ) -> None:
        self.redis = redis
        self.hub = hub
        self.store = store
        self.origin = hub.origin_id
        self.ttl = request_ttl
        self.wall = wall
        #: this relay's clients' jobs handed to Redis, by request id
        self.remote: dict[str, Job] = {}
        self._consumers: dict[str, asyncio.Task[None]] = {}
        self._outbox: asyncio.Queue[tuple[str, dict[str, bytes | str], int | None]] = (
            asyncio.Queue()
        )
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read()), loop.create_task(self._write())]

    # ---- origin side -----------------------------------------------------------------------

    async def reachable(self, tenant: str) -> bool:
        return bool(await self.redis.scard(presence_key(tenant)))

    async def publish(self, job: Job) -> None:
        """Hand a job to whichever relay holds a connector of its tenant. Raises RedisError."""
        self.start()
        deadline_ms = (self.wall() + (job.deadline - self.hub.clock())) // 1_000_000
        fields: dict[Any, Any] = {
            "req": encode(job.request, True),
            "deadline": str(deadline_ms),
            "limit": str(job.limit),
            "body": job.body_name or "",
        }
        self.remote[job.request_id] = job
        try:
            await self.redis.xadd(
                request_stream(job.tenant), fields, maxlen=STREAM_MAX, approximate=True
            )
        except BaseException:
            self.remote.pop(job.request_id, None)
            raise
        delay = max(0.0, (job.deadline - self.hub.clock()) / NS)
        job.timer = asyncio.get_running_loop().call_later(delay, self._expire, job)

    def _expire(self, job: Job) -> None:
        job.timer = None
        if job.connector is None and self.remote.pop(job.request_id, None) is job:
            self.hub.metrics.expired.inc()
            self._finish(job, 408)

    def _finish(self, job: Job, outcome: Outcome) -> None:
        if job.future is not None and not job.future.done():
            job.future.set_result(outcome)
        elif isinstance(outcome, TargetResponse) and outcome.outsourced:
            self.store.remove(self.store.name("res", outcome.request_id))
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if job.body_name is not None:
            self.store.release(job.body_name)  # the consuming relay removes it

    async def _read(self) -> None:
        stream = response_stream(self.origin)
        # from the start, not "$": the stream is this process's own (its origin id is new), and
        # "$" would miss an answer written before this task's first XREAD reached Redis (the
        # first request after start-up, when the consuming relay is quick and this one loaded)
        last = "0-0"
        while True:
            try:
                replies: Any = await self.redis.xread({stream: last}, count=256, block=BLOCK_MS)
            except RedisError as err:
                log.warning("tunnel: reading %s failed: %s", stream, err)
                await asyncio.sleep(1.0)
                continue
            for _, entries in replies or ():
                for entry_id, fields in entries:
                    last = entry_id
                    self._on_reply(fields)

    def _on_reply(self, fields: dict[bytes, bytes]) -> None:
        kind = fields.get(b"kind")
        request_id = fields.get(b"id", b"").decode()
        job = self.remote.get(request_id)
        if kind == b"taken":
            if job is not None and job.timer is not None:
                job.timer.cancel()
                job.timer = None
            return
        self.remote.pop(request_id, None)
        outcome: Outcome
        if kind == b"res":
            try:
                outcome = decode(fields[b"data"], True, (TargetResponse,))
            except (WireError, KeyError) as err:
                log.warning("tunnel: malformed response on the bus: %s", err)
                return
            if outcome.outsourced:
                self.store.adopt(self.store.name("res", request_id), outcome.body_size)
        else:
            outcome = int(fields.get(b"status", b"503"))
        if job is None:
            if isinstance(outcome, TargetResponse) and outcome.outsourced:
                self.store.remove(self.store.name("res", request_id))
            return
        self._finish(job, outcome)

    # ---- consuming side --------------------------------------------------------------------

    def tenant_joined(self, tenant: str) -> None:
        """The first connector of `tenant` on this relay: consume its stream."""
        self.start()
        if tenant not in self._consumers:
            loop = asyncio.get_running_loop()
            self._consumers[tenant] = loop.create_task(self._consume(tenant))
        self._outbox.put_nowait(("+presence", {"tenant": tenant}, None))

    def tenant_left(self, tenant: str) -> None:
        task = self._consumers.pop(tenant, None)
        if task is not None:
            task.cancel()
        self._outbox.put_nowait(("-presence", {"tenant": tenant}, None))

    async def _consume(self, tenant: str) -> None:
        stream = request_stream(tenant)
        while True:
            try:
                with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
                    await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
                while True:
                    replies: Any = await self.redis.xreadgroup(
                        GROUP, self.origin, {stream: ">"}, count=64, block=BLOCK_MS
                    )
                    for _, entries in replies or ():
                        ids = [entry_id for entry_id, _ in entries]
                        async with self.redis.pipeline(transaction=False) as pipe:
                            pipe.xack(stream, GROUP, *ids)
                            pipe.xdel(stream, *ids)
                            await pipe.execute()
                        for _, fields in entries:
                            self._take(tenant, fields)
            except RedisError as err:
                log.warning("tunnel: consuming %s failed: %s", stream, err)
                await asyncio.sleep(1.0)

    def _take(self, tenant: str, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode(fields[b"req"], True, (ClientRequest,))
            deadline_ms = int(fields[b"deadline"])
            limit = int(fields.get(b"limit", b"0"))
        except (WireError, KeyError, ValueError) as err:
            log.warning("tunnel: malformed request on the bus: %s", err)
            return
        remaining = deadline_ms * 1_000_000 - self.wall()
        body = fields.get(b"body", b"").decode() or None
        if remaining <= 0:
            if body is not None:
                self.store.remove(body)  # expired: nobody will fetch it
            return
        if body is not None:
            self.store.adopt(body, request.body_size)
        origin = request.request_origin_id
        future: asyncio.Future[Outcome] | None = None
        if not request.discard_connector_response:
            future = asyncio.get_running_loop().create_future()
        job = Job(
            request,
            tenant,
            self.hub.clock() + remaining,
            future,
            limit=limit,
            body_name=body,
            on_sent=lambda j: self._tell(origin, {"kind": "taken", "id": j.request_id}),
        )
        if future is not None:
            future.add_done_callback(lambda f: self._reply(origin, request.request_id, f))
        self.hub.submit(job)

    def _reply(self, origin: str, request_id: str, future: asyncio.Future[Outcome]) -> None:
        if future.cancelled():
            return
        outcome = future.result()
        if isinstance(outcome, TargetResponse):
            if outcome.outsourced:
                self.store.release(self.store.name("res", request_id))
            self._tell(origin, {"kind": "res", "id": request_id, "data": encode(outcome, True)})
        else:
            self._tell(origin, {"kind": "status", "id": request_id, "status": str(outcome)})

    def _tell(self, origin: str, fields: dict[str, bytes | str]) -> None:
        self._outbox.put_nowait((response_stream(origin), fields, RESPONSE_STREAM_TTL))

    async def _write(self) -> None:
        """The one writer: keeps this relay's messages to Redis in order."""
        while True:
            stream, fields, ttl = await self._outbox.get()
            try:
                await self._write_one(stream, fields, ttl)
            finally:
                self._outbox.task_done()

    async def _write_one(
        self, stream: str, fields: dict[str, bytes | str], ttl: int | None
    ) -> None:
        try:
            if stream in ("+presence", "-presence"):
                key = presence_key(str(fields["tenant"]))
                if stream == "+presence":
                    await self.redis.sadd(key, self.origin)
                else:
                    await self.redis.srem(key, self.origin)
            else:
                async with self.redis.pipeline(transaction=False) as pipe:
                    entry: dict[Any, Any] = dict(fields)
                    pipe.xadd(stream, entry)
                    if ttl is not None:
                        pipe.expire(stream, ttl)
                    await pipe.execute()
        except RedisError as err:
            log.warning("tunnel: writing to %s failed: %s", stream, err)

    async def close(self) -> None:
        for tenant in list(self._consumers):
            self.tenant_left(tenant)
        # let the presence removals out before stopping the writer (bounded)
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox.join(), 2.0)
        for task in self._tasks:
            task.cancel()
        for job in list(self.remote.values()):
            self._finish(job, 503)
        self.remote.clear()
