"""The relay's side of the tunnel: requests waiting for a connector, requests in flight, and
their acknowledgements.

Theory of operation
-------------------
A client request becomes a `Job` and waits in its tenant's queue until a connector of that
tenant has room (`pump`). Each job has a pickup deadline (`--tunnel-request-ttl`): a job still
queued at its deadline is answered 408 and dropped, and one found expired when a connector frees
up is dropped then, so nothing is executed after its client was told it expired (RelayServer
runs such requests late; decision 4). The connector is also told how long it has left
(`expiresIn`) and refuses work it receives too late.

Sending a job to a connector moves it into that connector's `inflight` until its `Deliver`.
Acknowledgement modes (decision 6, spec §11):

| mode | the job is safe (no redelivery) once |
|---|---|
| 0 Disabled | it was sent |
| 1 ConnectorReceived | the connector acknowledged receiving it (body fetched, target found) |
| 2 ConnectorFinished | the connector acknowledged after the target answered |
| 3 Manual | someone POSTed its acknowledge URL (which carries a random token) |

A connector that goes away puts its unacknowledged jobs back at the head of their queue (at
least once: the target may see them twice); an acknowledged job in flight whose connector went
away is answered 503. A job is forgotten once it is answered and safe; its request body file
goes with it.

Several connectors of one tenant share its jobs, round robin or least in flight first, and at
most `max_concurrent` of a tenant's jobs are in flight at once on this relay (decision 7).

Memory budget (issues #12, #13): from `submit` until it is forgotten, a job's in-memory bytes
(`held_size`: inline body, URL, headers, the objects around them; an outsourced body is on
disk) count against a
`ByteBudget` per tenant (`--tunnel-tenant-bytes`) and in all (`--tunnel-total-bytes`), so
requests waiting for a connector that never comes, and queue-mode requests, cannot fill the
heap. A job over it is not kept: `admit` raises BudgetExceeded (the client gets 503 with the
limit named, before anything is queued), and one arriving from the other relays is answered 503
at once; either way nothing is executed later.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rmb_relay.budget import BudgetExceeded, ByteBudget
from rmb_relay.clock import NS, Clock, monotonic_clock, nanos
from rmb_relay.dialects.base import CloseCode, Peer, WebSocketHandler
from rmb_relay.dialects.tunnel.wire import (
    AcknowledgeRequest,
    ClientRequest,
    ErrorMessage,
    TargetResponse,
    TenantConfig,
    WireError,
    decode,
    encode,
)

if TYPE_CHECKING:
    from rmb_relay._core import WsDecoder, WsMessage
    from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
    from rmb_relay.dialects.tunnel.metrics import TunnelMetrics
    from rmb_relay.dialects.tunnel.native import NativeExpress

log = logging.getLogger("rmb_relay.tunnel")

#: a job's outcome when there is no target response: the status the client gets
Outcome = TargetResponse | int

#: bytes waiting requests of one tenant may hold in this relay's memory (4096 requests with
#: the largest inline body): a tenant whose connector is away stops here
DEFAULT_TENANT_BYTES = 64 << 20
#: bytes waiting requests of all tenants may hold together
DEFAULT_TOTAL_BYTES = 256 << 20


#: heap bytes a job costs besides its inline body, URL and header text: the Job, its
#: ClientRequest, header dict and lists, future and timer (tracemalloc, 20,000 jobs with four
#: headers: 1,423 bytes each, of which 94 were body/URL/header text)
JOB_OVERHEAD = 1330


def held_size(request: ClientRequest) -> int:
    """What a job costs the memory budget: its inline body, URL and headers plus the fixed
    `JOB_OVERHEAD` (an outsourced body is in the body store, on disk)."""
    size = JOB_OVERHEAD + len(request.body_content or b"") + len(request.url)
    for name, values in request.http_headers.items():
        # map, not a generator: this runs for every header of every request
        size += len(name) * len(values) + sum(map(len, values))
    return size


#: the answer to a connector's `Acknowledge` of a request in manual mode
MANUAL_ONLY = "Acknowledge: this request is acknowledged by its URL (manual mode)"


def refusal_reason(err: BudgetExceeded, tenant_name: str) -> str:
    """The 503 body for a request over the budget: which limit, and that nothing will run."""
    if err.limit == "total":
        whose = "all tenants"
        knob = "--tunnel-total-bytes"
    else:
        whose = f"tenant {tenant_name}"
        knob = "--tunnel-tenant-bytes"
    return (
        f"relay busy: requests of {whose} waiting here hold {err.held} bytes, "
        f"{err.size} more would pass the {err.allowed}-byte limit ({knob}); "
        "the request was not queued and will not be executed"
    )


class Waiter(Protocol):
    """Who waits for a job's outcome: the client task's future, or an express reply
    (express.py), which writes the answer as soon as it is set."""

    def done(self) -> bool: ...

    def set_result(self, result: Outcome, /) -> None: ...


@dataclass(eq=False, slots=True)
class Job:
    request: ClientRequest
    #: the tenant's lookup key (upper case)
    tenant: str
    #: pickup deadline (hub clock, ns)
    deadline: int
    #: the client's answer; None when nobody waits (queue mode)
    future: Waiter | None
    limit: int = 0
    #: request body file in the body store, when outsourced
    body_name: str | None = None
    ack_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    connector: ConnectorSession | None = None
    acked: bool = False
    answered: bool = False
    attempts: int = 0
    timer: asyncio.TimerHandle | None = None
    #: called when a connector takes the job (scale-out: tells the origin relay)
    on_sent: Callable[[Job], None] | None = None
    #: bytes charged to the hub's memory budget; None until admitted
    held: int | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def waiting(self) -> bool:
        return self.future is not None and not self.future.done()


class ConnectorSession(WebSocketHandler):
    """One connector's websocket: decodes its messages and hands them to the hub."""

    def __init__(self, peer: Peer, hub: Hub, tenant: str, tenant_name: str, binary: bool) -> None:
        super().__init__(peer)
        self.hub = hub
        self.tenant = tenant
        self.tenant_name = tenant_name
        self.binary = binary
        self.connection_id = secrets.token_hex(8)
        #: messages of this loop turn, written together (one syscall for many requests)
        self._outbox: list[bytes] = []
        #: jobs sent to this connector and not delivered yet
        self.inflight: dict[str, Job] = {}
        #: jobs sent to this connector and not acknowledged yet (modes 1-3)
        self.unacked: dict[str, Job] = {}
        self.open = False
        #: the loop this connection lives on (asyncio.get_running_loop costs a getpid call)
        self._loop = asyncio.get_running_loop()
        #: answers a `Deliver` of the express path natively (express.deliver_native: True
        #: when it did); None: every message takes `on_message`'s Python path
        self.native: Callable[[ConnectorSession, bytes], bool] | None = None

    def send_message(self, message: ClientRequest | TenantConfig | ErrorMessage) -> None:
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(encode(message, self.binary))

    def send_encoded(self, data: bytes) -> None:
        """`send_message` for a message already encoded in this connection's format."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(data)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        peer = self.peer
        if not peer.is_open:
            return
        if self.binary:
            peer.send_many(outbox)
            return
        with peer.batch():  # JSON text frames: one write too
            for data in outbox:
                peer.send_text(data)

    def bind_decoder(self, decoder: WsDecoder) -> None:
        """With the native express table, the decoder answers this connector's `Deliver`s
        for the table's jobs inside its `feed` (one Rust call per read, not a Python call per
        message); the rest reach `on_message`."""
        native = self.hub.native
        if native is not None and self.outboxes is not None:
            decoder.set_scanner(native.scanner(self))

    def on_open(self) -> None:
        self.open = True
        self.send_message(self.hub.tenant_config())
        self.hub.connector_joined(self)

    def on_message(self, message: WsMessage) -> None:
        table = self.hub.native
        if (
            table is not None
            and message.scan_error is None  # (else the scanner offered it to the table)
            and message.is_text != self.binary
            and table.deliver(self, message.data)
        ):
            return
        native = self.native
        if native is not None and message.is_text != self.binary and native(self, message.data):
            return
        try:
            if message.is_text == self.binary:
                want = "binary (msgpack)" if self.binary else "text (JSON)"
                raise WireError(f"this connection speaks {want} frames")
            decoded = decode(message.data, self.binary, (TargetResponse, AcknowledgeRequest))
            if isinstance(decoded, TargetResponse):
                self.hub.deliver(self, decoded)
            elif isinstance(decoded, AcknowledgeRequest):
                self.hub.acknowledge(self, decoded)
        except WireError as err:
            self.hub.metrics.bad_messages.inc()
            log.info("connector %s of %s: %s", self.connection_id, self.tenant_name, err)
            self.send_message(ErrorMessage(str(err)))

    def on_close(self, code: int | None) -> None:
        self.open = False
        self.hub.connector_left(self)


class Hub:
    def __init__(
        self,
        *,
        origin_id: str,
        store: FileBodyStore,
        metrics: TunnelMetrics,
        request_ttl: float,
        balance: str,
        default_limit: int,
        config: TenantConfig,
        clock: Clock = monotonic_clock,
        budget: ByteBudget | None = None,
    ) -> None:
        self.origin_id = origin_id
        self.store = store
        self.metrics = metrics
        self.ttl = nanos(request_ttl)
        self.least_inflight = balance == "least-inflight"
        self.default_limit = default_limit
        self.config = config
        self.clock = clock
        self.connectors: dict[str, list[ConnectorSession]] = {}
        self.pending: dict[str, collections.deque[Job]] = {}
        #: every job not yet forgotten, by request id
        self.jobs: dict[str, Job] = {}
        self._next: dict[str, int] = {}
        #: in-memory bytes of the jobs not yet forgotten, by tenant (module docstring)
        self.budget = (
            budget
            if budget is not None
            else ByteBudget(key_bytes=DEFAULT_TENANT_BYTES, total_bytes=DEFAULT_TOTAL_BYTES)
        )
        #: the native express table (native.py), whose jobs count with the hub's
        self.native: NativeExpress | None = None
        #: told when a tenant gets its first connector here, and when it loses its last
        self.on_tenant_joined: Callable[[str], None] | None = None
        self.on_tenant_left: Callable[[str], None] | None = None

    def tenant_config(self) -> TenantConfig:
        return self.config

    # ---- connectors ------------------------------------------------------------------------

    def has_connector(self, tenant: str) -> bool:
        return bool(self.connectors.get(tenant))

    def connector_count(self) -> int:
        return sum(len(group) for group in self.connectors.values())

    def connector_joined(self, connector: ConnectorSession) -> None:
        group = self.connectors.setdefault(connector.tenant, [])
        group.append(connector)
        if len(group) == 1 and self.on_tenant_joined is not None:
            self.on_tenant_joined(connector.tenant)
        log.info("connector %s of %s joined", connector.connection_id, connector.tenant_name)
        if self.native is not None:
            self.native.connector_joined(connector)
        self.pump(connector.tenant)

    def connector_left(self, connector: ConnectorSession) -> None:
        group = self.connectors.get(connector.tenant, [])
        if connector in group:
            group.remove(connector)
        left = not group and self.connectors.pop(connector.tenant, None) is not None
        if left and self.on_tenant_left is not None:
            self.on_tenant_left(connector.tenant)
        log.info("connector %s of %s left", connector.connection_id, connector.tenant_name)
        if self.native is not None:
            self.native.connector_left(connector)
        redeliver = list(connector.unacked.values())
        for job in connector.inflight.values():
            if job.acked:
                self._answer(job, 503)  # the connector took it for good and is gone
                self._forget(job)
        connector.inflight.clear()
        connector.unacked.clear()
        for job in reversed(redeliver):
            self.redeliver(job)
        self.pump(connector.tenant)

    # ---- jobs ------------------------------------------------------------------------------

    def admit_sized(self, job: Job, size: int) -> None:
        """`admit` with `held_size(job.request)` worked out by the caller (the express path's
        Rust call counts the header text as it builds the headers)."""
        if job.held is None:
            self.budget.take(job.tenant, size)
            job.held = size

    def admit(self, job: Job) -> None:
        """Charge the job to the memory budget, or raise BudgetExceeded (nothing kept)."""
        if job.held is None:
            size = held_size(job.request)
            self.budget.take(job.tenant, size)
            job.held = size

    def submit(self, job: Job) -> None:
        """Queue the job (admitted here if the caller did not): a job over the memory budget
        is answered 503 at once and forgotten, never run (one from another relay: the
        client's own relay refused nothing, so this is where it is told)."""
        if not self._admitted(job, "refused"):
            return
        self.jobs[job.request_id] = job
        self.pending.setdefault(job.tenant, collections.deque()).append(job)
        self.pump(job.tenant)
        # the expiry timer only for a job left in the queue: most jobs go out at once, and a
        # timer armed then cancelled per request is two heap operations for nothing
        if job.connector is None and self.jobs.get(job.request_id) is job:
            delay = max(0.0, (job.deadline - self.clock()) / NS)
            job.timer = asyncio.get_running_loop().call_later(delay, self._expire_if_queued, job)

    def _admitted(self, job: Job, refused: str) -> bool:
        """`admit` (if the caller did not); False when over the budget: the job is then
        answered 503 and forgotten, the reason logged after what became of it (`refused`)."""
        if job.held is not None:
            return True
        try:
            self.admit(job)
        except BudgetExceeded as err:
            log.warning(
                "tunnel: request %s of %s %s: %s",
                job.request_id,
                job.request.tenant_name,
                refused,
                refusal_reason(err, job.request.tenant_name),
            )
            self._answer(job, 503)
            self._forget(job)
            return False
        return True

    def send_now(
        self, job: Job, connector: ConnectorSession, now: int, message: bytes | None
    ) -> None:
        """`submit` for an admitted job its caller found room for (express.py: its tenant has
        nothing queued and is under its limit; `connector` from `pick`): what `pump` would do
        with it at once, without the trip through the queue. `message`: the job's request as
        `_send` would encode it for `connector` at `now`, encoded by the caller (or None)."""
        self.jobs[job.request_id] = job
        self._send(job, connector, now, message)
        if self.native is not None:
            self._tell_native(job.tenant)

    def redeliver(self, job: Job) -> None:
        """A job its connector took and left without acknowledging (the hub's, or the native
        table's, native.py): first in its tenant's queue to be sent again, admitted to the
        memory budget again if it left it (over it, its client is answered 503 and it is
        dropped). The caller pumps the queue."""
        if not self._admitted(job, "not sent again"):
            return
        job.connector = None
        self.jobs[job.request_id] = job
        self.metrics.redelivered.inc()
        self.pending.setdefault(job.tenant, collections.deque()).appendleft(job)

    def new_deadline(self) -> int:
        return self.clock() + self.ttl

    def inflight(self, tenant: str) -> int:
        here = sum(len(c.inflight) for c in self.connectors.get(tenant, ()))
        return here if self.native is None else here + self.native.inflight(tenant)

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant key of a job in flight here, the native table's included (a connector
        uploads a response body before its `Deliver`)."""
        job = self.jobs.get(request_id)
        if job is not None:
            return job.tenant
        return None if self.native is None else self.native.table.tenant_of(request_id)

    def queued(self) -> int:
        return sum(len(queue) for queue in self.pending.values())

    def pump(self, tenant: str) -> None:
        """Send queued jobs of `tenant` to its connectors while they have room; the native
        table is told what is left (it counts the hub's jobs with its own)."""
        self._pump(tenant)
        if self.native is not None:
            self._tell_native(tenant)

    def _tell_native(self, tenant: str) -> None:
        assert self.native is not None
        self.native.outside(tenant, bool(self.pending.get(tenant)), self.connectors.get(tenant))

    def _pump(self, tenant: str) -> None:
        queue = self.pending.get(tenant)
        group = self.connectors.get(tenant)
        while queue and group:
            job = queue[0]
            limit = self.limit_of(job.limit)
            if limit and self.inflight(tenant) >= limit:
                return
            queue.popleft()
            now = self.clock()
            if now >= job.deadline:
                self._expire(job)
                continue
            self._send(job, self.pick(tenant, group), now)
        if queue is not None and not queue:
            self.pending.pop(tenant, None)

    def limit_of(self, max_concurrent: int) -> int:
        """A tenant's limit of jobs in flight here: its own (`max_concurrent`), else the
        relay's (`--tunnel-max-concurrent`); 0: none."""
        return max_concurrent or self.default_limit

    def pick(self, tenant: str, group: list[ConnectorSession]) -> ConnectorSession:
        """The connector of `group` (the tenant's here) the next job goes to."""
        if self.least_inflight:
            native = self.native
            if native is None:
                return min(group, key=lambda c: len(c.inflight))
            table = native.table
            return min(group, key=lambda c: len(c.inflight) + table.connector_inflight(c.peer.id))
        index = self._next.get(tenant, 0) % len(group)
        self._next[tenant] = index + 1
        return group[index]

    def _send(
        self, job: Job, connector: ConnectorSession, now: int, message: bytes | None = None
    ) -> None:
        request = job.request
        request.expires_in = max(1, (job.deadline - now) // 1_000_000)
        request.acknowledge_origin_id = self.origin_id
        if request.acknowledge_mode == 3:
            request.acknowledge_url = (
                f"/tunnel/acknowledge/{self.origin_id}/{request.request_id}/{job.ack_token}"
            )
        job.connector = connector
        job.attempts += 1
        connector.inflight[job.request_id] = job
        if request.acknowledge_mode == 0:
            job.acked = True
        else:
            connector.unacked[job.request_id] = job
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if message is None:
            connector.send_message(request)
        else:
            connector.send_encoded(message)
        if job.on_sent is not None:
            job.on_sent(job)

    def _expire_if_queued(self, job: Job) -> None:
        job.timer = None
        if job.connector is None and self.jobs.get(job.request_id) is job:
            queue = self.pending.get(job.tenant)
            if queue is not None and job in queue:
                queue.remove(job)
            self._expire(job)
            self.pump(job.tenant)  # (an empty queue leaves `pending`)

    def _expire(self, job: Job) -> None:
        self.metrics.expired.inc()
        log.info("request %s expired before a connector took it", job.request_id)
        self._answer(job, 408)
        self._forget(job)

    def _answer(self, job: Job, outcome: Outcome) -> None:
        job.answered = True
        if job.future is not None and not job.future.done():
            job.future.set_result(outcome)

    def _forget(self, job: Job) -> None:
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]
        if job.held is not None:
            self.budget.release(job.tenant, job.held)
            job.held = None
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if job.body_name is not None:
            self.store.remove(job.body_name)

    def abandon(self, job: Job) -> None:
        """The client stopped waiting (went away, or timed out). A queued job is dropped; one a
        connector holds runs on, and its answer is discarded."""
        if job.connector is None and self.jobs.get(job.request_id) is job:
            queue = self.pending.get(job.tenant)
            if queue is not None and job in queue:
                queue.remove(job)
            self._forget(job)
            self.pump(job.tenant)  # (an empty queue leaves `pending`)

    def deliver(self, connector: ConnectorSession, response: TargetResponse) -> None:
        job = self.jobs.get(response.request_id)
        if job is None and self.native is not None:
            job = self.native.adopt(connector, response.request_id)
        if job is None or job.tenant != connector.tenant:
            self._drop_response_body(response)
            raise WireError(f"Deliver: unknown request id {response.request_id!r}")
        connector.inflight.pop(job.request_id, None)
        try:
            if job.waiting:
                self._answer(job, response)
            else:
                self._drop_response_body(response)
                job.answered = True
        finally:  # a waiter that raised (it runs the express path's answer) leaks no job
            if job.acked:
                self._forget(job)
            self.pump(job.tenant)

    def delivered(self, connector: ConnectorSession, job: Job) -> None:
        """`deliver`'s bookkeeping for a job whose waiter the native path answered."""
        connector.inflight.pop(job.request_id, None)
        job.answered = True
        if job.acked:
            self._forget(job)
        self.pump(job.tenant)

    def _drop_response_body(self, response: TargetResponse) -> None:
        if response.outsourced:
            self.store.remove(self.store.name("res", response.request_id))

    def acknowledge(self, connector: ConnectorSession, ack: AcknowledgeRequest) -> None:
        job = self.jobs.get(ack.request_id)
        native = self.native
        if job is None and native is not None:
            if native.table.acknowledge(ack.request_id, connector.peer.id):
                return  # (the scanner takes the table's; one it did not see comes here)
            if native.table.ack_mode_of(ack.request_id) == 3:
                raise WireError(MANUAL_ONLY)
        if job is None or job.tenant != connector.tenant:
            raise WireError(f"Acknowledge: unknown request id {ack.request_id!r}")
        if job.request.acknowledge_mode == 3:
            raise WireError(MANUAL_ONLY)
        self._acked(job, ack.remove_request_body_content)

    def manual_acknowledge(self, request_id: str, token: str) -> bool:
        """The manual acknowledge URL was called; False for an unknown id or a wrong token."""
        job = self.jobs.get(request_id)
        if job is None and self.native is not None:
            return self.native.table.acknowledge_manual(request_id, token)
        if job is None or job.request.acknowledge_mode != 3 or job.connector is None:
            return False
        if not secrets.compare_digest(job.ack_token, token):
            return False
        self._acked(job, True)
        return True

    def _acked(self, job: Job, remove_body: bool) -> None:
        job.acked = True
        connector = job.connector
        if connector is not None:
            connector.unacked.pop(job.request_id, None)
        if remove_body and job.body_name is not None:
            self.store.remove(job.body_name)
            job.body_name = None
        if connector is None or job.request_id not in connector.inflight:
            self._forget(job)  # delivered already

    def close(self) -> None:
        for group in list(self.connectors.values()):
            for connector in list(group):
                connector.peer.close(CloseCode.GOING_AWAY, "relay shutting down")
        for job in list(self.jobs.values()):
            self._answer(job, 503)
            self._forget(job)
        self.pending.clear()
