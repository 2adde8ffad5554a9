"""Several relays sharing Redis (decision 8), on the cluster layer (`cluster/`): what RabbitMQ
does for RelayServer.

```text
relay A (client here)                     Redis                        relay B (connector here)
 no local connector of T ── XADD ──▶ rmb:{q:tunnel:T}:work ── XREADGROUP ──▶ hub.submit(job)
                                     (cluster/workqueue.py: one          │ RequestTarget
                                      consumer per relay holding T's      ▼
                                      connectors)                       Deliver
 future ◀── A's bus stream ◀── cluster.send_to_nowait(A, "t:<id>", taken, then the response)
```

- A relay with a connector of the tenant serves the request itself (the "shortcut", on by
  default); only otherwise does the request go to the tenant's work queue, read by every relay
  holding that tenant's connectors through one consumer group, so each request goes to one.
- The answers (`taken`, then the response or a status) go to the origin relay's bus stream
  (`cluster/bus.py`), named `t:<request id>`: batched with everything else for that relay,
  at least once, in order, and reaped like any bus entry if the origin dies (then dropped:
  its client went with it; a response body file it would have adopted is swept later).
- The pickup deadline travels as unix milliseconds: the consuming relay drops a request whose
  deadline has passed, and the origin answers 408 at the deadline unless it was told `taken`.
  So a request is never started after its client got 408, up to the clock skew between hosts.
- A relay that took a request and died: the cluster tells the origin (`on_instance_gone`,
  within `--cluster-ttl`), which answers 503 to every request that relay had taken. A request
  it read but had not yet reported taken is lost with it and answered 408 at its deadline.
- Bodies over the inline limit stay in the body store, which must be one directory shared by
  the relays (RelayServer needs a shared volume too); the relay that reads a file takes over
  its bookkeeping (`adopt`), the one that handed it on lets go (`release`).

Not covered (docs/tunnel.md): manual acknowledge URLs must reach the relay that issued them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rmb_relay.clock import NS, Clock, wall_clock
from rmb_relay.cluster import keys
from rmb_relay.cluster.endpoint import CallbackEndpoint
from rmb_relay.cluster.workqueue import WorkQueues
from rmb_relay.dialects.tunnel.hub import Hub, Job, Outcome
from rmb_relay.dialects.tunnel.wire import ClientRequest, TargetResponse, WireError, decode, encode
from rmb_relay.errors import ClusterUnavailable

if TYPE_CHECKING:
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.tunnel.bodystore import FileBodyStore

log = logging.getLogger("rmb_relay.tunnel")

#: the work queues' topic (`keys.work_key`)
TOPIC = "tunnel"
#: the first byte of an answer on the bus: the rest is the taker's instance id, the response
#: (msgpack), or the status in ASCII
TAKEN, RESPONSE, STATUS = b"k", b"r", b"s"


def waiter_name(request_id: str) -> str:
    """The bus name of the origin's waiter for a request (`Cluster.register_kind`)."""
    return f"{keys.KIND_TUNNEL}:{request_id}"


class RedisBridge:
    def __init__(
        self,
        cluster: Cluster,
        hub: Hub,
        store: FileBodyStore,
        *,
        request_ttl: float,
        wall: Clock = wall_clock,
    ) -> None:
        self.cluster = cluster
        self.me = cluster.me
        self.hub = hub
        self.store = store
        self.ttl = request_ttl
        self.wall = wall
        self.queues = WorkQueues(cluster, TOPIC)
        #: this relay's clients' jobs handed to other relays, by request id
        self.remote: dict[str, Job] = {}
        #: request id -> the relay that took it (told by its `taken`)
        self.taken_by: dict[str, str] = {}
        cluster.register_kind(keys.KIND_TUNNEL, self._resolve)
        cluster.on_instance_gone(self._instance_gone)

    # ---- origin side -----------------------------------------------------------------------

    async def reachable(self, tenant: str) -> bool:
        """A live relay consumes the tenant's queue (raises ClusterUnavailable)."""
        return await self.queues.has_consumers(tenant)

    async def publish(self, job: Job) -> None:
        """Hand a job to whichever relay holds a connector of its tenant. Raises
        ClusterUnavailable (not accepted)."""
        deadline_ms = (self.wall() + (job.deadline - self.hub.clock())) // 1_000_000
        fields: dict[str, bytes | str] = {
            "req": encode(job.request, True),
            "deadline": str(deadline_ms),
            "limit": str(job.limit),
            "body": job.body_name or "",
            "from": self.me,
        }
        self.remote[job.request_id] = job
        try:
            await self.queues.put(job.tenant, fields)
        except BaseException:
            self.remote.pop(job.request_id, None)
            raise
        delay = max(0.0, (job.deadline - self.hub.clock()) / NS)
        job.timer = asyncio.get_running_loop().call_later(delay, self._expire, job)

    def _expire(self, job: Job) -> None:
        job.timer = None
        if job.connector is None and self.remote.pop(job.request_id, None) is job:
            self.taken_by.pop(job.request_id, None)
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

    def _resolve(self, name: str) -> CallbackEndpoint:
        """Every `t:` name resolves, here and on a relay reaping our stream: an answer for a
        request nobody waits for any more still has its response body file removed."""
        request_id = name.partition(":")[2]
        return CallbackEndpoint(lambda frame: self._on_reply(request_id, frame))

    def _on_reply(self, request_id: str, frame: bytes) -> None:
        kind, body = frame[:1], frame[1:]
        job = self.remote.get(request_id)
        if kind == TAKEN:
            if job is None:
                return
            if job.future is None:  # queue mode: nobody waits for more; let go of it now
                del self.remote[request_id]
                self._finish(job, 202)
                return
            self.taken_by[request_id] = body.decode(errors="replace")
            if job.timer is not None:
                job.timer.cancel()
                job.timer = None
            return
        self.remote.pop(request_id, None)
        self.taken_by.pop(request_id, None)
        outcome: Outcome
        if kind == RESPONSE:
            try:
                outcome = decode(body, True, (TargetResponse,))
            except WireError as err:
                log.warning("tunnel: malformed response on the bus: %s", err)
                return
            if outcome.outsourced:
                self.store.adopt(self.store.name("res", request_id), outcome.body_size)
        else:
            try:
                outcome = int(body or b"503")
            except ValueError:
                outcome = 503
        if job is None:
            if isinstance(outcome, TargetResponse) and outcome.outsourced:
                self.store.remove(self.store.name("res", request_id))
            return
        self._finish(job, outcome)

    def _instance_gone(self, instance: str) -> None:
        """The relay that took these requests died: their clients get 503 now rather than
        waiting for the response timeout."""
        for request_id, taker in list(self.taken_by.items()):
            if taker != instance:
                continue
            del self.taken_by[request_id]
            job = self.remote.pop(request_id, None)
            if job is not None:
                log.warning(
                    "tunnel: relay %s died with request %s; answering 503", taker, request_id
                )
                self._finish(job, 503)

    # ---- consuming side --------------------------------------------------------------------

    def consuming(self, tenant: str) -> bool:
        return self.queues.consuming(tenant)

    def tenant_joined(self, tenant: str) -> None:
        """The first connector of `tenant` on this relay: consume its queue."""
        self.queues.consume(tenant, lambda fields: self._take(tenant, fields))

    def tenant_left(self, tenant: str) -> None:
        self.queues.stop(tenant)

    def _take(self, tenant: str, fields: dict[bytes, bytes]) -> None:
        try:
            request = decode(fields[b"req"], True, (ClientRequest,))
            deadline_ms = int(fields[b"deadline"])
            limit = int(fields.get(b"limit", b"0"))
            origin = fields[b"from"].decode()
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
        future: asyncio.Future[Outcome] | None = None
        if not request.discard_connector_response:
            future = asyncio.get_running_loop().create_future()
        request_id = request.request_id
        job = Job(
            request,
            tenant,
            self.hub.clock() + remaining,
            future,
            limit=limit,
            body_name=body,
            on_sent=lambda j: self._tell(origin, request_id, TAKEN + self.me.encode()),
        )
        if future is not None:
            future.add_done_callback(lambda f: self._reply(origin, request_id, f))
        self.hub.submit(job)

    def _reply(self, origin: str, request_id: str, future: asyncio.Future[Outcome]) -> None:
        if future.cancelled():
            return
        outcome = future.result()
        if isinstance(outcome, TargetResponse):
            if outcome.outsourced:
                self.store.release(self.store.name("res", request_id))
            self._tell(origin, request_id, RESPONSE + encode(outcome, True))
        else:
            self._tell(origin, request_id, STATUS + str(outcome).encode())

    def _tell(self, origin: str, request_id: str, frame: bytes) -> None:
        """To the origin's bus, in order with everything else for it (`taken` first)."""

        def outcome(result: bool | ClusterUnavailable) -> None:
            if result is not True:
                why = "its relay is gone" if result is False else str(result)
                log.warning("tunnel: the answer to request %s was not sent: %s", request_id, why)

        self.cluster.send_to_nowait(origin, waiter_name(request_id), frame, outcome)

    async def close(self) -> None:
        await self.queues.close()
        for job in list(self.remote.values()):
            self._finish(job, 503)
        self.remote.clear()
        self.taken_by.clear()


__all__ = ["TOPIC", "RedisBridge", "waiter_name"]
