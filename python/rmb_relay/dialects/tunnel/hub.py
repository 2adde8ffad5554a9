"""The relay's side of the tunnel, around its one hub (`_core.TunnelHub`,
rust/dialects/tunnel/hub.rs): every decision about a tunnelled request is made there — the
route, the tenant and token checks, the memory budget, queues, connector choice, concurrency
limits, acknowledgement modes, redelivery, the pickup and answer deadlines, request ids — for
requests the Rust core reads whole from the client's socket and for the ones Python reads
first (client.py) alike. This module does what the hub cannot, being sans-I/O:

- the fast path's Python face (`HttpFastPath`): a client's read goes to `TunnelHub.feed`, and
  the connectors' outboxes it wrote into are written once at the end of the loop turn (or
  after `PIPELINE` requests, so a connector starts on the first ones while the relay reads the
  rest);
- the hub's effects after each call: answers for Python tasks (futures), answers Python writes
  for fast-path clients (errors close the connection; a stored body streams), frames for other
  relays and published requests to withdraw (scaleout.py), body files to remove;
- one timer at the hub's next deadline, entropy for request ids, metrics and route records
  read from the hub at scrape and flush;
- `ConnectorSession`, a connector's websocket: its messages go to the hub (inside the decoder's
  `feed` through `TunnelScanner` when they need nothing of Python, else from `on_message`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import platform
import secrets
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmb_relay import __version__
from rmb_relay._core import TunnelHub, TunnelScanner
from rmb_relay.clock import NS, Clock, monotonic_clock, nanos, wall_clock
from rmb_relay.dialects.base import CloseCode, HttpResponse, WebSocketHandler
from rmb_relay.dialects.tunnel.wire import ErrorMessage, TenantConfig, encode

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest, HttpStreamParser, Outboxes, WsDecoder, WsMessage
    from rmb_relay.dialects.base import FastPathClient, HttpEvent, Peer
    from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
    from rmb_relay.dialects.tunnel.settings import TunnelSettings
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.telemetry.record_process import FullRecord
    from rmb_relay.telemetry.records import Channel

log = logging.getLogger("rmb_relay.tunnel")

# the kinds of `TunnelHub.step`'s answers and of its effects (rust/dialects/tunnel/hub.rs)
REFUSE, LOAD, VERIFY, REACH, BODY, HELD, ACCEPTED, PUBLISH = range(8)
RESOLVE, ANSWER, TELL, REMOVE, REMOVE_RESPONSE, WITHDRAW = range(6)

#: a job's outcome: (status, the relay's reason or None, the connector's fields, its inline
#: body, the size of a stored body or None, the request id)
Outcome = tuple[int, str | None, list[tuple[str, str]] | None, bytes | None, int | None, str | None]

#: random bytes fetched at once for request ids and acknowledge tokens; fetched again below
#: an eighth
ENTROPY = 16 * 4096
#: requests taken from reads in one loop turn after which the connectors' outboxes are written
#: at once instead of at the turn's end (two cores, four busy processes in the benchmark: 1 KiB
#: x 64 went from a median of 25,551 to 29,377 req/s with it). A request per wakeup never
#: reaches it.
PIPELINE = 8
#: a deadline this close (ns) counts as passed: timers fire to the millisecond
SLACK = 1_000_000
#: the tenant (and target) label of every series unless --tunnel-tenant-labels
ANONYMOUS = "*"
_MACHINE = platform.node()


def status_response(status: int, reason: str) -> HttpResponse:
    return HttpResponse(status, reason.encode() + b"\n")


class Hub:
    """The hub, its effects, its timer and its metrics (module docstring)."""

    def __init__(
        self,
        settings: TunnelSettings,
        store: FileBodyStore,
        registry: Registry,
        outboxes: Outboxes,
        *,
        instance: str,
        clustered: bool,
        clock: Clock = monotonic_clock,
        wall: Clock = wall_clock,
    ) -> None:
        """`instance`: this relay's id on the cluster's bus; `clustered`: relays share Redis
        (a tenant with no connector here goes to them)."""
        self.origin_id = str(uuid.uuid4())
        self.settings = settings
        self.store = store
        self.outboxes = outboxes
        self.clock = clock
        self.wall = wall
        ttl = nanos(settings.request_ttl)
        self.core = TunnelHub(
            outboxes,
            self.origin_id,
            instance,
            ttl=ttl,
            span=ttl + nanos(settings.response_timeout),
            inline_limit=settings.inline_limit,
            default_limit=settings.max_concurrent,
            default_ack_mode=settings.ack_mode,
            least_inflight=settings.balance == "least-inflight",
            require_connection=settings.require_connection,
            shortcut=settings.shortcut,
            clustered=clustered,
            tenant_bytes=settings.tenant_bytes,
            total_bytes=settings.total_bytes,
            tenant_ttl=nanos(settings.tenant_cache_ttl),
            tenant_max=settings.tenant_cache_max,
            machine=_MACHINE,
            version=__version__,
        )
        self.core.refill(os.urandom(ENTROPY))
        self.config = TenantConfig(
            keep_alive_interval=settings.keep_alive,
            reconnect_minimum_delay=settings.reconnect_min,
            reconnect_maximum_delay=settings.reconnect_max,
        )
        #: Python tasks waiting for an answer, by the token the hub knows them by
        self.waiting: dict[int, asyncio.Future[Outcome]] = {}
        self._tokens = itertools.count(1)
        #: sends a frame to another relay's waiter (instance, request id, frame): scaleout.py
        self.tell: Callable[[str, str, bytes], None] | None = None
        #: withdraws a published request (request id, tenant key, pickup deadline): scaleout.py
        self.withdraw: Callable[[str, str, int], None] | None = None
        #: the withdrawals' counts by verdict (scaleout.py's, with a cluster)
        self.withdrawals: Callable[[], list[tuple[tuple[str, ...], float]]] = lambda: []
        #: bytes of answers held for a given-up origin, and answers dropped past that bound
        #: (scaleout.py's, with a cluster)
        self.answers_held: Callable[[], tuple[int, int]] = lambda: (0, 0)
        #: every connected connector's session, by connection id
        self.sessions: dict[int, ConnectorSession] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._flush_pending = False
        self._taken = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None
        self._register(registry)

    def _register(self, registry: Registry) -> None:
        core = self.core
        const = {"dialect": "tunnel"}
        named = self.settings.tenant_labels

        def requests() -> list[tuple[tuple[str, ...], float]]:
            if named:
                return [(labels, n) for labels, n in core.requests()]
            by_status: dict[tuple[str, ...], float] = {}
            for (_, _, status), n in core.requests():
                key = (ANONYMOUS, ANONYMOUS, status)
                by_status[key] = by_status.get(key, 0) + n
            return list(by_status.items())

        self.requests = registry.counter_of(
            "rmb_relay_tunnel_requests_total",
            "Tunnel requests answered, by tenant, target and status (tenant and target are "
            f"{ANONYMOUS!r} unless --tunnel-tenant-labels: names are the tenants' business)",
            requests,
            ("tenant", "target", "status"),
            const=const,
        )
        self.expired = registry.counter_of(
            "rmb_relay_tunnel_expired_total",
            "Tunnel requests dropped because no connector took them within the request TTL",
            lambda: [((), core.expired)],
            const=const,
        )
        self.redelivered = registry.counter_of(
            "rmb_relay_tunnel_redelivered_total",
            "Unacknowledged tunnel requests queued again after their connector went away",
            lambda: [((), core.redelivered)],
            const=const,
        )
        self.refused = registry.counter_of(
            "rmb_relay_tunnel_refused_total",
            "Tunnel requests refused with 503 at the memory budget, by the limit hit "
            "(tenant: --tunnel-tenant-bytes, total: --tunnel-total-bytes)",
            lambda: [(("tenant",), core.refused[0]), (("total",), core.refused[1])],
            ("limit",),
            const=const,
        )
        self.fast_path = registry.counter_of(
            "rmb_relay_tunnel_fast_path_total",
            "Client requests the hub took whole from the client's read (outcome taken), or "
            "left to Python and why (request: not whole in one read, HEAD, Expect, a body over "
            "the inline limit; tenant, auth: not known yet; no connector, cluster, queued, "
            "budget, entropy)",
            lambda: [((outcome,), n) for outcome, n in core.fast_path()],
            ("outcome",),
            const=const,
        )
        registry.counter_of(
            "rmb_relay_tunnel_withdrawals_total",
            "Published tunnel requests this relay withdrew before refusing them, by verdict "
            "(withdrawn: refused, never run; taken: another relay had taken it; unknown: no "
            "verdict in time, answered 504), and requests read here that their origin had "
            "withdrawn first (dropped)",
            lambda: self.withdrawals(),
            ("verdict",),
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_answers_held_bytes",
            "Bytes of tunnel answers held for a relay the cluster gave up (sent again once it "
            "is back, until the client's deadline); bounded by --tunnel-answers-held-bytes",
            read=lambda: [((), self.answers_held()[0])],
            const=const,
        )
        registry.counter_of(
            "rmb_relay_tunnel_answers_dropped_total",
            "Tunnel answers for a given-up relay dropped because --tunnel-answers-held-bytes "
            "were held (their clients get 504 at their deadline)",
            lambda: [((), self.answers_held()[1])],
            const=const,
        )
        registry.add_read("rmb_relay_http_requests_total", core.http_answers)
        gauges = (
            ("rmb_relay_tunnel_inflight", "Tunnel requests a connector holds, by tenant", 2),
            ("rmb_relay_tunnel_queued", "Tunnel requests waiting for a connector, by tenant", 3),
            ("rmb_relay_tunnel_connectors", "Connected tunnel connectors, by tenant", 4),
            (
                "rmb_relay_tunnel_held_bytes",
                "In-memory bytes (inline body, URL, headers) of tunnel requests this relay "
                "holds until answered, by tenant; bounded by --tunnel-tenant-bytes and "
                "--tunnel-total-bytes",
                5,
            ),
        )
        for name, text, column in gauges:
            registry.gauge(name, text, ("tenant",), read=self._gauge(column), const=const)
        #: what Python counts itself
        self.bad_messages = registry.counter(
            "rmb_relay_tunnel_bad_messages_total",
            "Connector messages refused as malformed or naming unknown requests",
            const=const,
        )
        self.swept = registry.counter(
            "rmb_relay_tunnel_body_files_swept_total",
            "Orphaned body files the sweeper removed",
            const=const,
        )
        self.revoked = registry.counter(
            "rmb_relay_tunnel_connectors_revoked_total",
            "Connectors closed because their tenant was removed or its secret changed",
            const=const,
        )
        self.auth_failures = registry.counter(
            "rmb_relay_auth_failures_total",
            "Refused logins, handshakes or tokens, by dialect and reason",
            ("reason",),
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_body_store_bytes",
            "Bytes held in the tunnel's body store",
            read=lambda: [((), self.store.held)],
            const=const,
        )
        registry.counter_of(
            "rmb_relay_tunnel_bodies_refused_total",
            "Bodies answered 413: over --tunnel-max-body (body), --tunnel-tenant-disk (tenant) "
            "or --tunnel-total-disk (total)",
            lambda: [((limit,), n) for limit, n in self.store.refused.items()],
            ("limit",),
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_tenants_cached",
            "Tenant lookups the tunnel keeps (found or not), at most --tunnel-tenant-cache",
            read=lambda: [((), core.tenants_cached)],
            const=const,
        )

    def _gauge(self, column: int) -> Callable[[], list[tuple[tuple[str, ...], float]]]:
        """A per-tenant gauge's read: column `column` of the hub's tenant gauges, labelled
        with the tenant's stored name, as the requests counter is (the hub names it)."""
        core = self.core

        def read() -> list[tuple[tuple[str, ...], float]]:
            if self.settings.tenant_labels:
                return [((g[1],), float(g[column])) for g in core.tenant_gauges()]
            return [((ANONYMOUS,), float(sum(int(g[column]) for g in core.tenant_gauges())))]

        return read

    def record_into(self, channel: Channel) -> None:
        """Route records (`--records`): the hub keeps them, the channel takes them at its
        flush, moved into its clock."""
        self.core.recording = True

        def take() -> list[FullRecord]:
            taken = self.core.take_records()
            if not taken:
                return []
            offset = channel.clock() - self.clock()
            return [
                (
                    time + offset,
                    None,
                    dst,
                    size,
                    route,
                    outcome,
                    reason,
                    max(0, time - started),
                    None,
                )
                for time, dst, size, route, outcome, reason, started in taken
            ]

        channel.add_source(take)

    # ---- the fast path (HttpFastPath) --------------------------------------------------------

    def feed(
        self, conn: FastPathClient, parser: HttpStreamParser, data: bytes
    ) -> list[HttpEvent] | None:
        """A client's read: None when the hub took its request, else the parser's events."""
        events = self.core.feed(parser, data, conn.conn_id, conn, self.clock(), self.wall() // NS)
        if events is None:
            self._taken += 1
            if self._taken >= PIPELINE:
                self._flush()
            else:
                self.settle()
        return events

    def client_done(self, conn: FastPathClient) -> None:
        self.core.client_done(conn.conn_id)

    def closed(self, conn: FastPathClient, pending: bool) -> None:
        if pending:
            self.core.abandon_client(conn.conn_id)
            self.settle()
        self.outboxes.remove(conn.conn_id)

    # ---- after every call: effects, output, the timer ----------------------------------------

    def settle(self) -> None:
        """The hub was called: its effects now; its output and its timer at the end of this
        loop turn (once per turn)."""
        if self.core.has_effects:
            self._run(self.core.take_effects())
        if not self._flush_pending:
            self._flush_pending = True
            loop = self.loop
            if loop is None:
                loop = self.loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """The outboxes the hub wrote into since the last flush, each written once; entropy
        topped up; the timer armed for the next deadline."""
        self._flush_pending = False
        self._taken = 0
        for conn, data in self.outboxes.drain():
            conn.write_taken(data)
        core = self.core
        if core.ids_left < ENTROPY // 16 // 8:
            core.refill(os.urandom(ENTROPY))
        due = core.next_deadline
        if due is not None and (self._timer_at is None or due < self._timer_at):
            self._arm(due)

    def _arm(self, due: int) -> None:
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = loop.call_later(max(0.0, (due - self.clock()) / NS), self._deadline)

    def _deadline(self) -> None:
        self._timer = None
        self._timer_at = None
        self.core.expire(self.clock(), SLACK)
        self.settle()

    def _run(self, effects: list[tuple[object, ...]]) -> None:
        for effect in effects:
            kind = effect[0]
            if kind == RESOLVE:
                _, token, outcome = effect
                future = self.waiting.pop(token, None)  # type: ignore[call-overload]
                if future is not None and not future.done():
                    future.set_result(outcome)
            elif kind == ANSWER:
                _, conn, request, outcome = effect
                self._answer_client(conn, request, outcome)  # type: ignore[arg-type]
            elif kind == TELL:
                _, instance, request_id, frame = effect
                if self.tell is not None:
                    self.tell(instance, request_id, frame)  # type: ignore[arg-type]
            elif kind == REMOVE:
                self.store.remove(effect[1])  # type: ignore[arg-type]
            elif kind == WITHDRAW:
                _, request_id, tenant, pickup = effect
                if self.withdraw is not None:
                    self.withdraw(request_id, tenant, pickup)  # type: ignore[arg-type]
            else:  # REMOVE_RESPONSE
                self.store.remove(self.store.name("res", effect[1]))  # type: ignore[arg-type]

    def _answer_client(
        self, conn: FastPathClient, request: HttpRequest | None, outcome: Outcome
    ) -> None:
        """A fast-path client's answer Python writes: the relay's own statuses close the
        connection, the connector's answers are sent as a handler's are."""
        reason = outcome[1]
        try:
            response = self.response(outcome)
        except Exception:  # (it runs inside someone else's read: cost this client only)
            log.exception("tunnel: the answer to a request could not be built")
            response = HttpResponse(500, b"internal server error")
        if reason is not None or request is None:
            conn.fast_answer(response, request.method if request is not None else "")
        else:
            conn.adopt_fast(request, response)

    def response(self, outcome: Outcome) -> HttpResponse:
        """The client's answer for a job's outcome."""
        status, reason, headers, body, stored, request_id = outcome
        if reason is not None:
            return status_response(status, reason)
        fields = tuple(headers or ())
        if stored is not None and request_id is not None:
            store = self.store
            return HttpResponse(
                status,
                headers=fields,
                stream=store.read(store.name("res", request_id), remove=True),
                length=stored,
            )
        return HttpResponse(status, body or b"", headers=fields)

    # ---- the Python side's tasks ---------------------------------------------------------------

    def waiter(self) -> tuple[int, asyncio.Future[Outcome]]:
        """A token for `TunnelHub.step` and the future its answer resolves."""
        token = next(self._tokens)
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.waiting[token] = future
        return token, future

    def abandon(self, token: int) -> None:
        """The task stopped waiting (its client went away)."""
        if self.waiting.pop(token, None) is not None:
            self.core.abandon_task(token)
            self.settle()

    def now(self) -> tuple[int, int]:
        """(the hub's clock in ns, the tokens' in unix seconds)."""
        return self.clock(), self.wall() // NS

    def queued(self, key: str | None = None) -> int:
        """Requests waiting for a connector (of the tenant `key`, else of all)."""
        return sum(g[3] for g in self.core.tenant_gauges() if key is None or g[0] == key)

    def inflight(self, key: str) -> int:
        """The tenant's requests its connectors here hold."""
        return sum(g[2] for g in self.core.tenant_gauges() if g[0] == key)

    def connectors_of(self, key: str) -> list[ConnectorSession]:
        """The tenant's connectors connected here."""
        return [s for s in self.sessions.values() if s.tenant == key]

    def manual_acknowledge(self, request_id: str, token: str) -> bool:
        acked = self.core.acknowledge_manual(request_id, token)
        self.settle()
        return acked

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for session in list(self.sessions.values()):
            session.peer.close(CloseCode.GOING_AWAY, "relay shutting down")
        self.core.close(self.clock())
        if self.core.has_effects:
            self._run(self.core.take_effects())


class ConnectorSession(WebSocketHandler):
    """One connector's websocket: its messages go to the hub."""

    def __init__(self, peer: Peer, hub: Hub, tenant: str, tenant_name: str, binary: bool) -> None:
        super().__init__(peer)
        self.hub = hub
        #: the tenant's key (upper case) and name as stored
        self.tenant = tenant
        self.tenant_name = tenant_name
        self.binary = binary
        self.connection_id = secrets.token_hex(8)
        #: the fingerprint of the tenant's secret when it attached (tokens.fingerprint)
        self.secret: str | None = None
        #: closed because its tenant was removed or re-keyed (the close is under way)
        self.revoked = False
        #: the hub's messages go into the switch's outboxes (`bind_decoder`)
        self.outboxes = hub.outboxes
        #: told of the tenant key when this connector joins and leaves (scaleout.py)
        self.on_joined: Callable[[str], None] | None = None
        self.on_left: Callable[[str], None] | None = None

    def bind_decoder(self, decoder: WsDecoder) -> None:
        """The decoder hands this connector's messages to the hub inside its `feed` (one Rust
        call per read); the ones that need Python reach `on_message`."""
        decoder.set_scanner(TunnelScanner(self.hub.core, self.peer.id, self.binary))

    def _send(self, message: TenantConfig | ErrorMessage) -> None:
        data = encode(message, self.binary)
        if self.binary:
            self.peer.send(data)
        else:
            self.peer.send_text(data)

    def on_open(self) -> None:
        hub = self.hub
        self._send(hub.config)
        hub.sessions[self.peer.id] = self
        log.info("connector %s of %s joined", self.connection_id, self.tenant_name)
        hub.core.add_connector(self.tenant, self.peer.id, self.binary, hub.clock())
        hub.settle()
        if self.on_joined is not None:
            self.on_joined(self.tenant)

    def on_message(self, message: WsMessage) -> None:
        hub = self.hub
        if message.is_text == self.binary:
            want = "binary (msgpack)" if self.binary else "text (JSON)"
            refused: str | None = f"this connection speaks {want} frames"
        else:
            refused = hub.core.connector_message(
                self.peer.id, message.data, self.binary, hub.clock()
            )
        hub.settle()
        if refused is not None:
            hub.bad_messages.inc()
            log.info("connector %s of %s: %s", self.connection_id, self.tenant_name, refused)
            self._send(ErrorMessage(refused))

    def on_close(self, code: int | None) -> None:
        hub = self.hub
        hub.sessions.pop(self.peer.id, None)
        log.info("connector %s of %s left", self.connection_id, self.tenant_name)
        hub.core.remove_connector(self.peer.id, hub.clock())
        hub.settle()
        if self.on_left is not None:
            self.on_left(self.tenant)
