"""Several relays sharing Redis (decision 8), on the cluster layer (`cluster/`): what RabbitMQ
does for RelayServer.

```text
relay A (client here)                     Redis                        relay B (connector here)
 no local connector of T ── XADD ──▶ rmb:{q:tunnel:T}:work ── XREADGROUP ──▶ hub.take_remote
                                     (cluster/workqueue.py: one          │ RequestTarget
                                      consumer per relay holding T's      ▼
                                      connectors)                       Deliver
 hub ◀──── A's bus stream ◀── cluster.send_to_nowait(A, "t:<id>", taken, then the response)
```

- A relay with a connector of the tenant serves the request itself (the "shortcut", on by
  default); only otherwise does the request go to the tenant's work queue, read by every relay
  holding that tenant's connectors through one consumer group, so each request goes to one.
- Both ends are the hub's (hub.rs: published and taken jobs, their deadlines, the frames);
  this module moves its frames and the request over Redis.
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

import logging
from typing import TYPE_CHECKING

from rmb_relay.clock import Clock, wall_clock
from rmb_relay.cluster import keys
from rmb_relay.cluster.endpoint import CallbackEndpoint
from rmb_relay.cluster.workqueue import WorkQueues
from rmb_relay.errors import ClusterUnavailable

if TYPE_CHECKING:
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.tunnel.host import TunnelHost

log = logging.getLogger("rmb_relay.tunnel")

#: the work queues' topic (`keys.work_key`)
TOPIC = "tunnel"
#: the first byte of an answer on the bus (hub.rs): taken (+ the taker's instance id), the
#: connector's `Deliver` in msgpack or JSON, or the relay's own status in ASCII
TAKEN, RESPONSE, RESPONSE_JSON, STATUS = b"k", b"r", b"j", b"s"


def waiter_name(request_id: str) -> str:
    """The bus name of the origin's waiter for a request (`Cluster.register_kind`)."""
    return f"{keys.KIND_TUNNEL}:{request_id}"


class RedisBridge:
    def __init__(
        self,
        cluster: Cluster,
        dialect: TunnelHost,
        *,
        request_ttl: float,
        wall: Clock = wall_clock,
    ) -> None:
        self.cluster = cluster
        self.me = cluster.me
        self.hub = dialect.hub
        self.store = dialect.store
        self.ttl = request_ttl
        self.wall = wall
        self.queues = WorkQueues(cluster, TOPIC)
        #: connectors here by tenant key (a tenant's queue is consumed while it has some)
        self.connectors: dict[str, int] = {}
        self.hub.tell = self._tell
        cluster.register_kind(keys.KIND_TUNNEL, self._resolve)
        cluster.on_instance_gone(self._instance_gone)

    # ---- origin side -----------------------------------------------------------------------

    async def reachable(self, tenant: str) -> bool:
        """A live relay consumes the tenant's queue (raises ClusterUnavailable)."""
        return await self.queues.has_consumers(tenant)

    async def publish(
        self, request_id: str, message: bytes, pickup: int, stored: str | None
    ) -> None:
        """Hand a request the hub published to whichever relay holds a connector of its
        tenant: its `RequestTarget` msgpack, its pickup deadline (the hub's clock), its stored
        body's name. Raises ClusterUnavailable (not accepted)."""
        hub = self.hub
        key = hub.core.tenant_of(request_id)
        if key is None:
            raise ClusterUnavailable("the request is gone")
        deadline_ms = (self.wall() + (pickup - hub.clock())) // 1_000_000
        fields: dict[str, bytes | str] = {
            "req": message,
            "deadline": str(deadline_ms),
            "body": stored or "",
            "from": self.me,
        }
        await self.queues.put(key, fields)

    def _resolve(self, name: str) -> CallbackEndpoint:
        """Every `t:` name resolves, here and on a relay reaping our stream: an answer for a
        request nobody waits for any more still has its response body file removed."""
        request_id = name.partition(":")[2]
        return CallbackEndpoint(lambda frame: self._on_reply(request_id, frame))

    def _on_reply(self, request_id: str, frame: bytes) -> None:
        if frame[:1] in (RESPONSE, RESPONSE_JSON):
            owner = self.hub.core.tenant_of(request_id) or ""
            self._adopt(self.store.name("res", request_id), owner)
        hub = self.hub
        hub.core.remote_reply(request_id, frame, hub.clock())
        hub.settle()

    def _adopt(self, name: str, owner: str) -> None:
        """A body file another relay wrote into the shared store is ours to track now (and
        to remove when its request is over)."""
        try:
            size = self.store.path(name).stat().st_size
        except (OSError, ValueError):  # gone already, or not a body file's name
            return
        self.store.adopt(name, size, owner)

    def _instance_gone(self, instance: str) -> None:
        """The relay that took these requests died: their clients get 503 now rather than
        waiting for the response timeout."""
        hub = self.hub
        hub.core.instance_gone(instance, hub.clock())
        hub.settle()

    # ---- consuming side --------------------------------------------------------------------

    def consuming(self, tenant: str) -> bool:
        return self.queues.consuming(tenant)

    def connector_joined(self, tenant: str) -> None:
        """A connector of `tenant` here: its first one starts consuming the tenant's queue."""
        count = self.connectors.get(tenant, 0)
        self.connectors[tenant] = count + 1
        if count == 0:
            self.queues.consume(tenant, lambda fields: self._take(tenant, fields))

    def connector_left(self, tenant: str) -> None:
        count = self.connectors.get(tenant, 0) - 1
        if count > 0:
            self.connectors[tenant] = count
            return
        self.connectors.pop(tenant, None)
        self.queues.stop(tenant)

    def _take(self, tenant: str, fields: dict[bytes, bytes]) -> None:
        try:
            message = fields[b"req"]
            deadline_ms = int(fields[b"deadline"])
            origin = fields[b"from"].decode()
        except (KeyError, ValueError, UnicodeDecodeError) as err:
            log.warning("tunnel: malformed request on the bus: %s", err)
            return
        remaining = deadline_ms * 1_000_000 - self.wall()
        body = fields.get(b"body", b"").decode(errors="replace") or None
        if remaining <= 0:
            if body is not None:
                self.store.remove(body)  # expired: nobody will fetch it
            return
        if body is not None:
            self._adopt(body, tenant)
        hub = self.hub
        now = hub.clock()
        if not hub.core.take_remote(tenant, message, now + remaining, origin, body, now):
            log.warning("tunnel: malformed request on the bus from %s", origin)
            if body is not None:
                self.store.remove(body)
        hub.settle()

    def _tell(self, origin: str, request_id: str, frame: bytes) -> None:
        """To the origin's bus, in order with everything else for it (`taken` first)."""
        if frame[:1] in (RESPONSE, RESPONSE_JSON):
            self.store.release(self.store.name("res", request_id))  # the origin adopts it

        def outcome(result: bool | ClusterUnavailable) -> None:
            if result is not True:
                why = "its relay is gone" if result is False else str(result)
                log.warning("tunnel: the answer to request %s was not sent: %s", request_id, why)

        self.cluster.send_to_nowait(origin, waiter_name(request_id), frame, outcome)

    async def close(self) -> None:
        await self.queues.close()


__all__ = ["TOPIC", "RedisBridge", "waiter_name"]
