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
  (`cluster/bus.py`), named `t:<origin>/<request id>`: batched with everything else for that
  relay, at least once, in order. A relay reaping the origin's stream (given up past the
  presence TTL) keeps them (`--tunnel-answers-held-bytes` at most) and sends them again once
  the origin is alive again (it was cut off, not dead: its clients still wait), until the answer
  deadline; an origin that stays dead loses them with its clients (a response body file it
  would have adopted is swept later).
- Each request carries a claim (`cluster/workqueue.py`): the consuming relay hands it on only
  if it sets the claim first. The origin never refuses a published request on a guess: when
  its XADD failed (it may still land: a cut link delivers what it held when it heals) or its
  pickup deadline passed without word of it (`taken` may be on its way), the hub asks for it
  to be withdrawn (`Effect::Withdraw`), and this module sets the claim for the origin: first
  there, the request never runs and the client gets 503 (or 408 past pickup); else a relay
  took it and its answer comes over the bus. Redis decides who came first: no clocks of two
  hosts are compared. Verdicts count only until `WITHDRAW_GRACE` past the pickup deadline
  (the consumers' claims outlive that by `CLAIM_MARGIN / 2`, measured as durations); without
  one the client gets 504 at its answer deadline, which says the relay cannot tell. While the
  cluster knows Redis is down, nothing is published (503 at once: certainly not sent).
- The pickup deadline also travels as unix milliseconds: a consuming relay that finds it
  passed drops the request and tells the origin 408. It is what guards against a copy of a
  request landing after every claim expired (`CLAIM_MARGIN` past the pickup deadline), up to
  that much clock skew between hosts.
- A relay that took a request and died: the cluster tells the origin (`on_instance_gone`,
  within `--cluster-ttl`), which answers 504 to every request that relay had taken (it may
  have run; a relay only cut off, given up meanwhile, may even still answer it). A request
  it claimed whose `taken` had not reached us yet (batched, lost with it) is found by reading
  the claims of what is still published (`_claimed_by`) and answered 504 too; one it read but
  never claimed stays published for a live consumer, or is withdrawn (503/408) at its deadline.
- Bodies over the inline limit stay in the body store, which must be one directory shared by
  the relays (RelayServer needs a shared volume too); the relay that reads a file takes over
  its bookkeeping (`adopt`), the one that handed it on lets go (`release`).

Not covered (docs/tunnel.md): manual acknowledge URLs must reach the relay that issued them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmb_relay.clock import Clock, nanos, wall_clock
from rmb_relay.cluster import keys
from rmb_relay.cluster.bus import RETRY_DELAY, redis_errors
from rmb_relay.cluster.endpoint import CallbackEndpoint
from rmb_relay.cluster.workqueue import WorkQueues
from rmb_relay.dialects.tunnel.settings import DEFAULT_ANSWERS_HELD_BYTES
from rmb_relay.errors import ClusterUnavailable
from rmb_relay.tasks import STOP_TIMEOUT, cancel_and_wait

if TYPE_CHECKING:
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.tunnel.host import TunnelHost

log = logging.getLogger("rmb_relay.tunnel")

#: the work queues' topic (`keys.work_key`)
TOPIC = "tunnel"
#: the first byte of an answer on the bus (hub.rs): taken (+ the taker's instance id), the
#: connector's `Deliver` in msgpack or JSON, or the relay's own status in ASCII
TAKEN, RESPONSE, RESPONSE_JSON, STATUS = b"k", b"r", b"j", b"s"
#: a request's claim is kept this long past its pickup TTL (s): what a copy of it landing late
#: needs to find it, and what bounds the clock skew the pickup deadline must cover after that
CLAIM_MARGIN = 60.0
#: verdicts of a withdrawal count until this long past the request's pickup deadline (s): a
#: reply later than that might come from a claim gone meanwhile
WITHDRAW_GRACE = CLAIM_MARGIN / 2
#: withdrawals asked in one round trip at most
WITHDRAW_BATCH = 256
#: the pauses between tries to send answers held for a given-up origin again (doubling)
FIRST_DELAY, MAX_DELAY = 0.25, 2.0
#: what a withdrawal found (`rmb_relay_tunnel_withdrawals_total`'s labels, with "dropped": a
#: request read here that its origin had withdrawn first)
VERDICTS = ("withdrawn", "taken", "unknown")


def waiter_name(request_id: str, origin: str) -> str:
    """The bus name of the origin's waiter for a request (`Cluster.register_kind`)."""
    return f"{keys.KIND_TUNNEL}:{origin}/{request_id}"


class RedisBridge:
    def __init__(
        self,
        cluster: Cluster,
        dialect: TunnelHost,
        *,
        request_ttl: float,
        response_timeout: float = 0.0,
        answers_held_bytes: int = DEFAULT_ANSWERS_HELD_BYTES,
        wall: Clock = wall_clock,
    ) -> None:
        """`request_ttl` + `response_timeout`: how long an origin's client may wait (answers
        reaped from its stream are held for it that long, `answers_held_bytes` at most)."""
        self.cluster = cluster
        self.me = cluster.me
        self.hub = dialect.hub
        self.store = dialect.store
        self.ttl = request_ttl
        self.wall = wall
        self.queues = WorkQueues(cluster, TOPIC)
        #: how long a request's claim is kept (ms), told to the consumer with the request
        self.claim_ms = int((request_ttl + CLAIM_MARGIN) * 1000)
        #: connectors here by tenant key (a tenant's queue is consumed while it has some)
        self.connectors: dict[str, int] = {}
        #: requests to withdraw: request id -> (tenant key, until when a verdict counts)
        self._withdrawing: dict[str, tuple[str, int]] = {}
        self._withdrawer: asyncio.Task[None] | None = None
        #: who waits for a verdict itself (a queue-mode request answers only then)
        self._verdicts: dict[str, asyncio.Future[bool | None]] = {}
        self.counts = dict.fromkeys(VERDICTS, 0)
        #: answers reaped from a given-up origin's stream: (origin, name, frame, until)
        self._held: list[tuple[str, str, bytes, int]] = []
        self._held_bytes = 0
        self._held_limit = answers_held_bytes
        self._answers_dropped = 0
        self._span = nanos(request_ttl + response_timeout)
        self._resender: asyncio.Task[None] | None = None
        #: reads of who claimed what a dead instance may have taken (`_claimed_by`)
        self._claim_checks: set[asyncio.Task[None]] = set()
        self.hub.tell = self._tell
        self.hub.withdraw = self._withdraw
        self.hub.withdrawals = self._verdict_counts
        self.hub.answers_held = lambda: (self._held_bytes, self._answers_dropped)
        cluster.register_kind(keys.KIND_TUNNEL, self._resolve)
        cluster.on_instance_gone(self._instance_gone)

    def _verdict_counts(self) -> list[tuple[tuple[str, ...], float]]:
        """`rmb_relay_tunnel_withdrawals_total` (hub.py)."""
        counts = [((verdict,), float(n)) for verdict, n in self.counts.items()]
        return [*counts, (("dropped",), float(self.queues.withdrawn))]

    # ---- origin side -----------------------------------------------------------------------

    async def reachable(self, tenant: str) -> bool:
        """A live relay consumes the tenant's queue (raises ClusterUnavailable)."""
        return await self.queues.has_consumers(tenant)

    async def publish(
        self, request_id: str, message: bytes, pickup: int, stored: str | None
    ) -> None:
        """Hand a request the hub published to whichever relay holds a connector of its
        tenant: its `RequestTarget` msgpack, its pickup deadline (the hub's clock), its stored
        body's name, its claim. Raises ClusterUnavailable (not sent) or WriteUncertain (it may
        still land: withdraw it before refusing it, `hub.core.publish_failed`)."""
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
            "id": request_id,
        }
        await self.queues.put(key, fields, (request_id, self.claim_ms))

    def verdict(self, request_id: str) -> asyncio.Future[bool | None]:
        """A future for the verdict on withdrawing `request_id` (ask before the hub is told to
        withdraw it): True taken, False withdrawn, None unknown."""
        future = asyncio.get_running_loop().create_future()
        self._verdicts[request_id] = future
        return future

    def _withdraw(self, request_id: str, tenant: str, pickup: int) -> None:
        """The hub's `Withdraw`: asked for with others in one round trip, again after a pause
        while Redis fails, until `WITHDRAW_GRACE` past the pickup deadline."""
        self._withdrawing[request_id] = (tenant, pickup + nanos(WITHDRAW_GRACE))
        if self._withdrawer is None:
            self._withdrawer = asyncio.get_running_loop().create_task(self._withdraw_all())

    async def _withdraw_all(self) -> None:
        hub = self.hub
        failing = False
        try:
            while self._withdrawing:
                batch = list(itertools.islice(self._withdrawing.items(), WITHDRAW_BATCH))
                claims = [(tenant, request_id, self.claim_ms) for request_id, (tenant, _) in batch]
                try:
                    verdicts: list[str | None] | None = await self.queues.withdraw(claims)
                except ClusterUnavailable as err:
                    if not failing:  # once per outage
                        log.warning("tunnel: cannot withdraw requests yet: %s", err)
                    failing = True
                    verdicts = None
                now = hub.clock()
                for i, (request_id, (_, until)) in enumerate(batch):
                    if now > until or (verdicts is not None and verdicts[i] == ""):
                        self._decided(request_id, "unknown", None)
                    elif verdicts is None:
                        continue  # asked again after the pause
                    elif (taker := verdicts[i]) is None:
                        self._decided(request_id, "withdrawn", False)
                        hub.core.withdrawn(request_id, now)
                    else:
                        self._decided(request_id, "taken", True)
                        hub.core.taken_by(request_id, taker)
                        if self.cluster.given_up(taker):  # its death was told before this
                            hub.core.instance_gone(taker, now)
                hub.settle()
                if verdicts is None:
                    await asyncio.sleep(RETRY_DELAY)
        finally:
            self._withdrawer = None

    def _decided(self, request_id: str, verdict: str, taken: bool | None) -> None:
        self._withdrawing.pop(request_id, None)
        self.counts[verdict] += 1
        future = self._verdicts.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(taken)

    def _resolve(self, name: str) -> CallbackEndpoint:
        """Every `t:` name resolves: ours, to the hub (an answer for a request nobody waits for
        any more still has its response body file removed); another origin's, found reaping
        its stream, to be held for it (module docstring)."""
        origin, _, request_id = name.partition(":")[2].rpartition("/")
        if origin and origin != self.me:
            return CallbackEndpoint(lambda frame: self._hold(origin, name, frame))
        return CallbackEndpoint(lambda frame: self._on_reply(request_id, frame))

    def _hold(self, origin: str, name: str, frame: bytes) -> None:
        if self._held_bytes + len(frame) > self._held_limit:
            self._answers_dropped += 1
            log.warning(
                "tunnel: an answer reaped for %s is dropped (its client gets 504): %d bytes "
                "held for given-up relays, --tunnel-answers-held-bytes %d",
                origin,
                self._held_bytes,
                self._held_limit,
            )
            return
        self._held.append((origin, name, frame, self.hub.clock() + self._span))
        self._held_bytes += len(frame)
        if self._resender is None:
            self._resender = asyncio.get_running_loop().create_task(self._resend())

    async def _resend(self) -> None:
        """Send the held answers again, in order, once their origin is alive again (a pause
        that grows between tries), until their deadline."""
        delay = FIRST_DELAY
        try:
            while self._held:
                await asyncio.sleep(delay)  # a pause between tries, not a wait for an event
                delay = min(2 * delay, MAX_DELAY)
                now = self.hub.clock()
                held, self._held = self._held, []
                kept = [entry for entry in held if entry[3] > now]
                try:
                    live = await self.cluster.alive(sorted({entry[0] for entry in kept}))
                except redis_errors():
                    live = set()
                again = []
                for origin, name, frame, until in kept:
                    if origin in live:
                        self.cluster.send_to_nowait(
                            origin, name, frame, self._resent(origin, name, frame, until)
                        )
                    else:
                        again.append((origin, name, frame, until))
                self._held = again + self._held
                self._held_bytes = sum(len(entry[2]) for entry in self._held)
        finally:
            self._resender = None

    def _resent(
        self, origin: str, name: str, frame: bytes, until: int
    ) -> Callable[[bool | ClusterUnavailable], None]:
        def outcome(result: bool | ClusterUnavailable) -> None:
            if result is not True:  # its stream not back yet: again later
                self._held.append((origin, name, frame, until))
                self._held_bytes += len(frame)
                if self._resender is None:
                    self._resender = asyncio.get_running_loop().create_task(self._resend())

        return outcome

    def _on_reply(self, request_id: str, frame: bytes) -> None:
        if frame[:1] in (RESPONSE, RESPONSE_JSON):
            owner = self.hub.core.tenant_of(request_id) or ""
            self._adopt(self.store.name("res", request_id), owner)
        hub = self.hub
        hub.core.remote_reply(request_id, frame, hub.clock())
        taker = frame[1:].decode(errors="replace") if frame[:1] == TAKEN else ""
        if taker and self.cluster.given_up(taker):  # read after its death was told
            hub.core.instance_gone(taker, hub.clock())
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
        """The relay that took these requests died: their clients get 504 now (it may have run
        them) rather than waiting for the response timeout. A verdict naming it that comes
        later (a withdraw finding its claim, a `taken` read late) is answered the same way."""
        hub = self.hub
        hub.core.instance_gone(instance, hub.clock())
        hub.settle()
        untaken = [request_id for request_id, taker in hub.core.published() if taker is None]
        if untaken:  # it may have claimed some and died before its `taken` reached us
            task = asyncio.get_running_loop().create_task(self._claimed_by(instance, untaken))
            self._claim_checks.add(task)
            task.add_done_callback(self._claim_checks.discard)

    async def _claimed_by(self, instance: str, request_ids: list[str]) -> None:
        """Which of our published requests the dead `instance` had claimed: those are its
        requests too (504 now), not left waiting for their pickup deadline; the others stay
        published for a live consumer. Redis down: the withdraw at the deadline decides."""
        hub = self.hub
        claims = [(hub.core.tenant_of(r) or "", r) for r in request_ids]
        try:
            takers = await self.queues.takers(claims)
        except ClusterUnavailable:
            return
        now = hub.clock()
        for request_id, taker in zip(request_ids, takers, strict=True):
            if taker == instance:
                hub.core.taken_by(request_id, instance)
        hub.core.instance_gone(instance, now)
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
            request_id = fields.get(b"id", b"").decode(errors="replace")
            if request_id:  # claimed here: its origin cannot withdraw it, so it is told
                self._tell(origin, request_id, STATUS + b"408")
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

        name = waiter_name(request_id, origin)

        def outcome(result: bool | ClusterUnavailable) -> None:
            if result is False:  # given up, maybe only cut off: held for it
                self._hold(origin, name, frame)
            elif result is not True:
                log.warning("tunnel: the answer to request %s was not sent: %s", request_id, result)

        self.cluster.send_to_nowait(origin, name, frame, outcome)

    async def close(self) -> None:
        for task in (self._withdrawer, self._resender):
            if task is not None:
                await cancel_and_wait(task, STOP_TIMEOUT)
        await self.queues.close()


__all__ = ["TOPIC", "RedisBridge", "waiter_name"]
