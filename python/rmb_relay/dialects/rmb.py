"""The RMB relay dialect: twins log in with a JWT at `GET /?<jwt>` and exchange envelopes.

Theory of operation (spec/rmb.md §1.6, §3.1 and the decisions at its top)
-----------------------------------------------------------------------
Login: the whole query string is the JWT; structure and expiry are checked first, then the twin
is looked up (cached directory) and the signature checked against its account key. A session
is (twin, sid); a newer login with the same key replaces the older connection (1008).

Per message (the fast path, no awaits): the Rust core scans the routing fields straight from
the protobuf bytes; the per-twin limiter runs; source must equal the session; an envelope ping
is answered with a pong; a destination connected to this process gets the received bytes as
they are (never re-encoded). Anything else takes the slow path, one FIFO task per sender: twin
lookup, then the mailbox (a destination of this relay that is offline) or federation (a
destination on another relay). Failures reach the sender as rmb-rs-compatible error envelopes,
and only when the failed envelope was a request.

With no `--domain` the relay is standalone: every twin it knows is its own, so messages for
offline twins wait in the mailbox instead of being federated (rmb-rs would federate them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rmb_relay._core import (
    MSG_PING,
    MSG_REQUEST,
    EnvelopeRouting,
    FixedWindowLimiter,
    HttpRequest,
    RmbScanner,
    WsDecoder,
    WsMessage,
    build_error_envelope,
    build_pong,
    scan_envelope,
)
from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.dialects.base import (
    CloseCode,
    Dialect,
    DialectEntry,
    Peer,
    Routes,
    WebSocketHandler,
)
from rmb_relay.errors import (
    AuthError,
    ConfigError,
    FederationError,
    HttpReject,
    MailboxFull,
    MailboxUnavailable,
    TwinLookupError,
)
from rmb_relay.federation import Federation
from rmb_relay.federation import setup as federation_setup
from rmb_relay.identity import DEFAULT_MAX_TOKEN_LIFETIME, parse_jwt, verify_jwt_signature
from rmb_relay.mailbox import Mailbox, MemoryMailbox, SessionKey
from rmb_relay.switch import Outcome, Switch
from rmb_relay.twins.cache import CachedTwinDirectory

if TYPE_CHECKING:
    from rmb_relay.federation.inbound import InboundFederation
    from rmb_relay.services import Services
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.twins import Twin, TwinDirectory

log = logging.getLogger("rmb_relay.rmb")

#: relay error envelopes live this long (rmb-rs build_error_envelope)
ERROR_ENVELOPE_TTL = 300
#: a drained mailbox is written this many envelopes at a time, waiting for the socket between
DRAIN_BATCH = 256
#: envelopes of one session waiting for the slow path (lookup, mailbox, federation), in bytes:
#: beyond it the relay stops reading the sender's socket until half of it has been routed, so
#: a slow or stalled dependency (a Redis that stopped answering) pushes back on the sender
#: instead of piling its traffic up in the heap
SLOW_SESSION_BYTES = 8 << 20
#: the same for all sessions together; beyond it a message is refused at once ("relay busy"),
#: so many senders together cannot do what one cannot
SLOW_TOTAL_BYTES = 64 << 20
#: a mailbox that could not be read is tried again after this long, doubling up to the max
DRAIN_RETRY = 1.0
DRAIN_RETRY_MAX = 30.0


@dataclass(slots=True)
class RmbSettings:
    """The RMB-specific part of the relay configuration."""

    domains: frozenset[str] = frozenset()
    limit_count: int | None = None
    limit_size: int | None = None
    limit_window: int = 60
    max_token_lifetime: int = DEFAULT_MAX_TOKEN_LIFETIME
    slow_session_bytes: int = SLOW_SESSION_BYTES
    slow_total_bytes: int = SLOW_TOTAL_BYTES

    @property
    def standalone(self) -> bool:
        return not self.domains


class HotCounters:
    """Counters bumped once or twice per relayed message: plain ints, because a metrics
    `Counter.inc` per message cost 19% of the relay's CPU under load (py-spy)."""

    __slots__ = ("bytes_in", "bytes_out", "local", "messages_in", "messages_out")

    def __init__(self) -> None:
        self.messages_in = 0
        self.bytes_in = 0
        self.messages_out = 0
        self.bytes_out = 0
        self.local = 0


class RmbMetrics:
    """RMB's part of the shared `rmb_relay_*` families (docs/metrics.md), `dialect="rmb"`."""

    def __init__(self, registry: Registry, dialect: RmbDialect) -> None:
        hot = self.hot = HotCounters()
        # each envelope the Rust fast path forwards is one message in, one out and one routed
        # locally; `fast` counts them (switch.py)
        fast = dialect.switch.outboxes
        rmb = {"dialect": "rmb"}
        registry.counter_of(
            "rmb_relay_messages_in_total",
            "Messages received from clients, by dialect",
            lambda: [((), hot.messages_in + fast.rmb_forwards + fast.rmb_crossed)],
            const=rmb,
        )
        registry.counter_of(
            "rmb_relay_bytes_in_total",
            "Message bytes received from clients, by dialect",
            lambda: [((), hot.bytes_in + fast.rmb_bytes + fast.rmb_crossed_bytes)],
            const=rmb,
        )
        registry.counter_of(
            "rmb_relay_messages_out_total",
            "Messages written to clients (RMB: incl. error envelopes and mailbox), by dialect",
            lambda: [((), hot.messages_out + fast.rmb_forwards + fast.rmb_placed)],
            const=rmb,
        )
        registry.counter_of(
            "rmb_relay_bytes_out_total",
            "Message bytes written to clients, by dialect",
            lambda: [((), hot.bytes_out + fast.rmb_bytes + fast.rmb_placed_bytes)],
            const=rmb,
        )
        self.routed_slow: dict[str, int] = {"mailbox": 0, "federation": 0, "cluster": 0}
        registry.counter_of(
            "rmb_relay_messages_routed_total",
            "Messages routed, by dialect and path (local, mailbox, federation)",
            lambda: (
                [(("local",), hot.local + fast.rmb_forwards)]
                # the fast path's envelopes for other instances (rust/crossing.rs) too
                + [
                    ((path,), n + (fast.rmb_crossed if path == "cluster" else 0))
                    for path, n in self.routed_slow.items()
                ]
            ),
            ("path",),
            const=rmb,
        )
        self.errors_sent = registry.counter(
            "rmb_relay_error_replies_total",
            "Error replies sent to senders instead of delivering, by dialect and reason",
            ("reason",),
            const=rmb,
        )
        self.drops = registry.counter(
            "rmb_relay_messages_dropped_total",
            "Messages dropped without delivery, by dialect and reason",
            ("reason",),
            const=rmb,
        )
        self.limited = registry.counter(
            "rmb_relay_messages_rate_limited_total",
            "Messages refused by a rate limiter, by dialect",
            const=rmb,
        )
        self.login_failures = registry.counter(
            "rmb_relay_auth_failures_total",
            "Refused logins, handshakes or tokens, by dialect and reason",
            ("reason",),
            const=rmb,
        )
        self.logins = registry.counter(
            "rmb_relay_logins_total", "Accepted logins, by dialect", const=rmb
        )
        self.replaced = registry.counter(
            "rmb_relay_sessions_replaced_total",
            "Sessions closed because the same identity logged in again, by dialect",
            const=rmb,
        )
        registry.gauge(
            "rmb_relay_sessions",
            "Sessions a dialect holds (RMB: logged in; SBD: handshaking and ready)",
            read=lambda: [((), len(dialect.sessions))],
            const=rmb,
        )
        registry.gauge(
            "rmb_relay_mailbox_depth",
            "Messages waiting in mailboxes for offline sessions",
            read=lambda: [((), dialect.mailbox.depth())],
        )
        registry.counter_of(
            "rmb_relay_mailbox_dropped_total",
            "Messages a mailbox dropped, by reason (full: oldest first; expired)",
            lambda: [
                (("full",), dialect.mailbox.stats.dropped_full),
                (("expired",), dialect.mailbox.stats.expired),
            ],
            ("reason",),
        )
        registry.gauge(
            "rmb_relay_mailbox_bytes",
            "Envelope bytes the relay holds for mailboxes (in memory, or on their way to Redis)",
            read=lambda: [((), dialect.mailbox.held_bytes())],
        )
        registry.counter_of(
            "rmb_relay_mailbox_refused_total",
            "Messages a mailbox refused because a memory budget was reached (the sender of a "
            "request gets an error)",
            lambda: [((), dialect.mailbox.stats.refused)],
        )


class ClusterForward:
    """An envelope queued for another instance's stream (`switch.QueuedForward`): its route
    record is written when Redis answered, once, with how it ended; a refusal goes to the
    sender as an error envelope (and is that one record)."""

    __slots__ = ("dialect", "env", "received", "sender", "size")

    def __init__(
        self,
        dialect: RmbDialect,
        sender: RmbSession,
        env: EnvelopeRouting,
        data: bytes,
        received: int | None,
    ) -> None:
        self.dialect = dialect
        self.sender = sender
        self.env = env
        self.size = len(data)
        self.received = received

    def settled(self, route: str, outcome: str, reason: str | None = None) -> None:
        records = self.dialect.records
        if records is not None:
            env = self.env
            records.add(
                self.sender.twin, env.dest_twin, self.size, route, outcome, reason,
                received=self.received,
            )  # fmt: skip

    def refused(self, err: BaseException) -> None:
        env = self.env
        log.warning("redis unavailable, refusing envelope for %s: %s", env.dest_twin, err)
        self.sender.fail(
            env, "destination unreachable: the relay's redis is unavailable", "redis down",
            self.size, self.received,
        )  # fmt: skip


class CrossedForward:
    """An envelope the fast path queued for another instance (rust/crossing.rs), handed back
    by the cluster with its outcome only when that was not "stored" (`Cluster._crossed`):
    the sender is found again by the envelope's source, which the scanner checked was the
    sending session, and told as `ClusterForward` tells it."""

    __slots__ = ("data", "dialect", "env")

    def __init__(self, dialect: RmbDialect, data: bytes) -> None:
        self.dialect = dialect
        self.data = data
        self.env = scan_envelope(data)

    def settled(self, route: str, outcome: str, reason: str | None = None) -> None:
        records = self.dialect.records
        if records is not None:
            env = self.env
            records.add(env.source_twin, env.dest_twin, len(self.data), route, outcome, reason)

    def refused(self, err: BaseException) -> None:
        env = self.env
        log.warning("redis unavailable, refusing envelope for %s: %s", env.dest_twin, err)
        self.dialect.fail_source(
            env, "destination unreachable: the relay's redis is unavailable", "redis down",
            len(self.data),
        )  # fmt: skip


class RmbDialect(Dialect):
    name = "rmb"
    paths = ("/",)

    def __init__(
        self,
        settings: RmbSettings,
        directory: TwinDirectory,
        registry: Registry,
        *,
        switch: Switch | None = None,
        mailbox: Mailbox | None = None,
        federation: Federation | None = None,
        inbound: InboundFederation | None = None,
        max_message: int = 1 << 20,
        clock: Clock = wall_clock,
    ) -> None:
        """`switch` and `directory` are the process's shared ones (closed by their owner);
        without a switch (tests) the dialect makes and owns a private one around `mailbox`
        (default: in memory), and owns the directory too."""
        self.settings = settings
        self.directory = directory
        self._owns_shared = switch is None
        if switch is None:
            switch = Switch(mailbox if mailbox is not None else MemoryMailbox(clock=clock))
        self.switch = switch
        # the deadline of an envelope the scanner queues for another instance (`forward_now`)
        switch.outboxes.mailbox_ttl = self.mailbox.ttl
        #: outbound (the switch's federation route) and inbound `POST /`; None: not served
        self.federation = federation
        self.inbound = inbound
        if federation is not None:
            switch.federation = federation
        self.max_message = max_message
        self.clock = clock
        #: this dialect's connections by id (the switch routes; this counts and closes)
        self.sessions: dict[int, RmbSession] = {}
        self.limiter: FixedWindowLimiter | None = None
        if settings.limit_count is not None and settings.limit_size is not None:
            self.limiter = FixedWindowLimiter(
                settings.limit_count, settings.limit_size, settings.limit_window
            )
        #: envelope bytes waiting in every session's slow-path queue, and their high mark
        self.slow_bytes = 0
        self.slow_bytes_peak = 0
        self.metrics = RmbMetrics(registry, self)
        self._maintenance: asyncio.TimerHandle | None = None
        #: route records (--records), or None
        self.records = switch.record_channel("rmb")
        # the scanners check the rate limit and append the hot path's records inside `feed`,
        # at this reading
        self.scan_clock = clock
        if self.records is not None:
            self.mailbox.on_loss = self._record_loss

    def _record_loss(self, key: SessionKey, size: int, reason: str) -> None:
        assert self.records is not None
        outcome = "expired" if reason == "expired" else "rejected"
        self.records.add(None, key[0], size, "mailbox", outcome, f"mailbox {reason}")

    @property
    def mailbox(self) -> Mailbox:
        return self.switch.mailbox

    # ---- login -----------------------------------------------------------------------------

    async def accept(self, request: HttpRequest, conn: Peer) -> WebSocketHandler:
        self._schedule_maintenance()
        token = request.query
        if not token:
            self._login_failed("missing jwt", conn)
            raise HttpReject(400, "missing jwt")
        try:
            parsed = parse_jwt(token, seconds(self.clock()), self.settings.max_token_lifetime)
        except AuthError as err:
            self._login_failed("expired" if "expired" in err.reason else "invalid jwt", conn)
            raise HttpReject(err.status, err.reason) from None
        twin_id = parsed.claims.twin
        try:
            twin = await self.directory.get(twin_id)
        except TwinLookupError as err:
            # the cause names files and hosts: it goes to the log, the caller gets an id for it
            request_id = secrets.token_hex(6)
            log.warning("twin %d lookup failed (request %s): %s", twin_id, request_id, err)
            self._login_failed("twin lookup failed", conn)
            raise HttpReject(
                500, f"failed to get twin: directory unavailable (request {request_id})"
            ) from None
        if twin is None:
            self._login_failed("unknown twin", conn)
            raise HttpReject(401, f"twin not found {twin_id}")
        try:
            verify_jwt_signature(parsed, twin.account)
        except AuthError as err:
            self._login_failed("bad signature", conn)
            raise HttpReject(err.status, err.reason) from None
        self.metrics.logins.inc()
        return RmbSession(conn, self, twin_id, parsed.claims.sid)

    def _login_failed(self, reason: str, conn: Peer) -> None:
        self.metrics.login_failures.inc(1, reason)
        log.info("refused RMB login from %s: %s", conn.peer_host, reason)

    # ---- routing ---------------------------------------------------------------------------

    def is_ours(self, twin: Twin) -> bool:
        """Whether this relay keeps mail for the twin (it shares a domain, or we're standalone)."""
        if self.settings.standalone:
            return True
        return bool(twin.relays and twin.relays & self.settings.domains)

    def store_deadline(self, env: EnvelopeRouting) -> int | None:
        """Until when the envelope may wait in a mailbox (unix seconds); None for a fail-fast
        one, which is never stored."""
        return None if env.fail_fast else self.mailbox.deadline(env.timestamp, env.expiration)

    def forward_now(
        self, sender: RmbSession, env: EnvelopeRouting, data: bytes, received: int | None
    ) -> bool:
        """The common case of a session held by another instance of this relay, without an
        await: the twin's answer is cached, it is not connected here, and the instance holding
        it is known (`Cluster.forward_nowait`). Does what `route_slow` would and returns True;
        False: nothing was done, call `route_slow`."""
        cluster = self.switch.cluster
        directory = self.directory
        if cluster is None or not isinstance(directory, CachedTwinDirectory):
            return False
        hit, twin = directory.peek(env.dest_twin)
        if not hit or twin is None or not self.is_ours(twin):
            return False  # unknown, no relay info, or another relay's twin: route_slow decides
        key: SessionKey = (env.dest_twin, env.dest_connection)
        if self.switch.lookup(key) is not None:
            return False
        deadline = self.store_deadline(env)
        queued = ClusterForward(self, sender, env, data, received)
        if not cluster.forward_nowait(key, data, deadline, queued):
            return False
        self.metrics.routed_slow["cluster"] += 1
        if self.records is None:
            # the next envelopes for it are queued by the scanner itself (rust/crossing.rs),
            # for as long as both the holder's and the twin's cached answers hold; with route
            # records on they keep this path, which records each at its outcome
            if cluster.crossing_outcome is None:
                cluster.crossing_outcome = self.crossed
            cluster.mirror(key, directory.fresh_for(env.dest_twin), self.clock())
        return True

    def crossed(self, data: bytes) -> CrossedForward:
        """The outcome of an envelope the scanner queued for another instance (`forward_now`)."""
        return CrossedForward(self, data)

    def fail_source(self, env: EnvelopeRouting, reason: str, label: str, size: int) -> None:
        """`RmbSession.fail` for the session that sent `env`, found by its source: the one
        connected now, else its mailbox keeps the error for its next login."""
        key: SessionKey = (env.source_twin, env.source_connection)
        session = self.switch.lookup(key)
        if isinstance(session, RmbSession):
            session.fail(env, reason, label, size)
            return
        records = self.records
        if records is not None:
            records.add(env.source_twin, env.dest_twin or None, size, "none", "rejected", label)
        if env.kind != MSG_REQUEST:
            self.metrics.drops.inc(1, label)
            return
        self.metrics.errors_sent.inc(1, label)
        now = seconds(self.clock())
        error = build_error_envelope(env.uid, reason, now, key[0], key[1])
        deadline = self.mailbox.deadline(now, ERROR_ENVELOPE_TTL)
        asyncio.get_running_loop().create_task(self.store_error(key, error, deadline))

    async def store_error(self, key: SessionKey, error: bytes, deadline: int) -> None:
        """Keep an error envelope for a sender that is not connected, for its next login."""
        try:
            await self.mailbox.put(key, error, deadline)
        except MailboxUnavailable:
            self.metrics.drops.inc(1, "mailbox down")

    async def _federate(
        self,
        sender: RmbSession,
        env: EnvelopeRouting,
        data: bytes,
        twin: Twin,
        size: int,
        received: int | None,
    ) -> None:
        try:
            await self.switch.federate(data, twin)
        except FederationError as err:  # not queued: no remote relay was tried
            sender.fail(env, str(err), "federation", size, received)
            return
        # its route record is written by the federation worker once the outcome is known
        self.metrics.routed_slow["federation"] += 1

    async def route_slow(
        self, sender: RmbSession, env: EnvelopeRouting, data: bytes, received: int | None = None
    ) -> None:
        """Everything that is not a connected local session: lookup, mailbox or federation.
        `received` (clock reading when the envelope arrived) times it for route records."""
        dest, dest_sid = env.dest_twin, env.dest_connection
        size = len(data)
        try:
            twin = await self.directory.get(dest)
        except TwinLookupError as err:
            request_id = secrets.token_hex(6)
            log.warning("twin %d lookup failed (request %s): %s", dest, request_id, err)
            reason = f"failed to get twin: directory unavailable (request {request_id})"
            sender.fail(env, reason, "twin lookup failed", size, received)
            return
        if twin is None:
            sender.fail(env, "unknown twin destination", "unknown twin", size, received)
            return
        if twin.relays is None and not self.settings.standalone:
            sender.fail(env, "relay info is not set for this twin", "no relay info", size, received)
            return
        key: SessionKey = (dest, dest_sid)
        records = self.records
        if not self.is_ours(twin) and self.switch.lookup(key) is None:
            # another relay's twin, not connected here: federated without asking the other
            # instances of this relay, as rmb-rs does (spec §3.1); that presence lookup is a
            # Redis round trip per message (an absent holder is not cached), which capped
            # federation with --redis at ~9,000 msg/s
            await self._federate(sender, env, data, twin, size, received)
            return
        # connected meanwhile, here or on another instance of this relay (cluster); the
        # deadline lets that instance store it if the session left before it got there
        deadline = self.store_deadline(env)
        queued = ClusterForward(self, sender, env, data, received)
        try:
            # for another instance: queued, not waited for (`queued` records how it ended, and
            # tells the sender of a request if Redis refused it)
            outcome = await self.switch.deliver(
                key, data, deadline=deadline, store=False, queued=queued
            )
        except MailboxUnavailable as err:
            queued.refused(err)
            return
        if outcome is Outcome.DELIVERED:
            self.metrics.hot.local += 1
            if records is not None:
                records.add(sender.twin, dest, size, "local", "delivered", received=received)
            return
        if outcome is Outcome.FORWARDED:  # recorded by `queued` once Redis answered
            self.metrics.routed_slow["cluster"] += 1
            return
        if not self.is_ours(twin):
            await self._federate(sender, env, data, twin, size, received)
            return
        if deadline is None:  # fail-fast: never stored
            sender.fail(env, "destination offline", "destination offline", size, received)
            return
        try:
            outcome = await self.switch.deliver(key, data, deadline=deadline)
        except MailboxFull as err:
            log.info("mailbox full, refusing envelope for %s: %s", key, err)
            sender.fail(
                env, "destination offline and its mailbox is full", "mailbox full", size, received
            )
            return
        except MailboxUnavailable as err:
            log.warning("mailbox unavailable, refusing envelope for %s: %s", key, err)
            sender.fail(
                env, "destination offline and the mailbox is unavailable", "mailbox down", size,
                received,
            )  # fmt: skip
            return
        if outcome is Outcome.QUEUED:
            self.metrics.routed_slow["mailbox"] += 1
            if records is not None:
                records.add(sender.twin, dest, size, "mailbox", "queued", received=received)
        elif outcome is Outcome.FORWARDED:
            self.metrics.routed_slow["cluster"] += 1
            if records is not None:
                records.add(sender.twin, dest, size, "cluster", "delivered", received=received)
        else:
            self.metrics.hot.local += 1
            if records is not None:
                records.add(sender.twin, dest, size, "local", "delivered", received=received)

    def add_routes(self, router: Routes) -> None:
        """Federation inbound: other relays POST envelopes for our twins to `/`."""
        if self.inbound is not None:
            router.add("POST", "/", self.inbound.handle)

    # ---- lifecycle -------------------------------------------------------------------------

    def _schedule_maintenance(self) -> None:
        if self._maintenance is None and self.limiter is not None:
            loop = asyncio.get_running_loop()
            self._maintenance = loop.call_later(self.settings.limit_window, self._maintain)

    def _maintain(self) -> None:
        self._maintenance = None
        if self.limiter is not None:
            self.limiter.prune(seconds(self.clock()))
        if self.sessions:
            self._schedule_maintenance()

    async def close(self) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
        if self.federation is not None:
            await self.federation.close()
        if self._owns_shared:
            await self.switch.close()
            await self.directory.close()


class RmbSession(WebSocketHandler):
    """One logged-in (twin, sid) connection."""

    def __init__(self, peer: Peer, dialect: RmbDialect, twin: int, sid: str | None) -> None:
        super().__init__(peer)
        self.dialect = dialect
        self.twin = twin
        self.sid = sid
        self.key: SessionKey = (twin, sid)
        self.open = False
        # mailbox delivery in progress: live traffic waits behind it
        self._draining = False
        self._drain_again = False
        self._held: list[bytes] = []
        # envelopes waiting for the slow path; made by the first one: an empty deque is ~600
        # bytes (a 64-slot block), and most sessions never send one (bench/README.md "Idle
        # connections")
        self._slow: deque[tuple[EnvelopeRouting, bytes, int]] | None = None
        #: route records: the scanner records the hot path; this is the arrival time of the rest
        records = dialect.records
        self._record_clock = dialect.clock if records is None else records.clock
        self._slow_bytes = 0
        self._slow_held = False
        self._slow_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_retry: asyncio.TimerHandle | None = None
        self._drain_delay = DRAIN_RETRY
        self._scanner: RmbScanner | None = None

    def bind_decoder(self, decoder: WsDecoder) -> None:
        # the rate limit, the source check and the destination lookup happen in the codec's
        # feed, which forwards an envelope for a local session that may take it itself (the
        # switch's outboxes); with --records it appends the route record of each message it
        # finds a local destination for
        dialect = self.dialect
        records = dialect.records
        buffer = None if records is None else records.scanner_buffer(dialect.clock)
        self.outboxes = outboxes = dialect.switch.outboxes
        self._scanner = RmbScanner(
            dialect.switch.routes,
            self.twin,
            self.sid,
            buffer,
            dialect.limiter,
            outboxes,
            self.peer.id,
        )
        decoder.set_scanner(self._scanner)

    def on_discarded(self, message: WsMessage) -> None:
        """A message read but never handled (the connection was closing): it was not delivered."""
        records = self.dialect.records
        env = message.routing
        if records is not None and isinstance(env, EnvelopeRouting):
            records.retract(env.record)

    def __repr__(self) -> str:
        return f"<RmbSession {self.twin}{'' if self.sid is None else ':' + self.sid}>"

    # ---- lifecycle -------------------------------------------------------------------------

    def on_open(self) -> None:
        dialect = self.dialect
        switch = dialect.switch
        switch.attach(self)
        displaced = switch.register_session(self.key, self)
        dialect.sessions[self.peer.id] = self
        self.open = True
        if displaced is not None:
            dialect.metrics.replaced.inc()
            log.info("%r replaced by a newer connection from %s", displaced, self.peer.peer_host)
            displaced.peer.close(CloseCode.POLICY, "replaced by a newer connection")
        self.drain_mailbox()

    def on_close(self, code: int | None) -> None:
        self.open = False
        dialect = self.dialect
        if self.peer.id in dialect.sessions:
            dialect.switch.unregister_session(self.key, self)
            dialect.switch.detach(self)
            del dialect.sessions[self.peer.id]
        for task in (self._drain_task, self._slow_task):
            if task is not None and not task.done():
                task.cancel()
        if self._drain_retry is not None:
            self._drain_retry.cancel()
            self._drain_retry = None
        dialect.slow_bytes -= self._slow_bytes
        self._slow_bytes = 0
        if self._slow is not None:
            self._slow.clear()
        if self._held:
            dialect.metrics.drops.inc(len(self._held), "session closed during mailbox delivery")
            self._held.clear()

    # ---- the fast path ---------------------------------------------------------------------

    def on_message(self, message: WsMessage) -> None:
        dialect = self.dialect
        metrics = dialect.metrics
        data = message.data
        if message.is_text:
            metrics.drops.inc(1, "text frame")
            self.peer.close(CloseCode.UNSUPPORTED_DATA, "text frames are not supported")
            return
        hot = metrics.hot
        hot.messages_in += 1
        hot.bytes_in += len(data)
        # scanned by the codec in the same call that decoded the frame
        env: EnvelopeRouting | None = message.routing  # type: ignore[assignment]
        if env is None:
            metrics.drops.inc(1, "invalid envelope")
            log.info("closing %r: invalid envelope: %s", self, message.scan_error)
            self.peer.close(CloseCode.INVALID_PAYLOAD, "invalid envelope")
            return
        if env.limited:  # checked by the scanner (the dialect's limiter), once per envelope
            metrics.limited.inc()
            if dialect.records is not None:
                dialect.records.retract(env.record)  # the scan recorded it as delivered
            self.fail(env, "exceeded rate limits, dropping message", "rate limited", len(data))
            return
        if not env.from_session:
            self.fail(env, "message wrong source", "wrong source", len(data))
            return
        if env.kind == MSG_PING:
            self.deliver(build_pong(data))
            return
        dest = env.dest_twin
        if dest == 0:
            self.fail(env, "message with missing destination", "missing destination", len(data))
            return
        conn_id = env.dest_conn_id  # looked up in the same Rust call that decoded the frame
        if conn_id is not None:
            target = dialect.switch.endpoints.get(conn_id)
            if target is not None:
                target.deliver(data)  # its route record was appended by the scan (--records)
                hot.local += 1
                return
            if dialect.records is not None:  # gone since the scan: the slow path records it
                dialect.records.retract(env.record)
        size = len(data)
        settings = dialect.settings
        if dialect.slow_bytes + size > settings.slow_total_bytes:
            self.fail(env, "relay busy: too many messages waiting to be routed", "relay busy", size)
            return
        self._slow_bytes += size
        dialect.slow_bytes += size
        if dialect.slow_bytes > dialect.slow_bytes_peak:
            dialect.slow_bytes_peak = dialect.slow_bytes
        if self._slow_bytes > settings.slow_session_bytes and not self._slow_held:
            self._slow_held = True
            self.peer.hold_reading(True)  # until _run_slow has routed half of it
        slow = self._slow
        if slow is None:
            slow = self._slow = deque()
        slow.append((env, data, self._record_clock()))
        if self._slow_task is None:
            if self._scanner is not None:  # later envelopes must not overtake these
                self._scanner.set_slow(True)
            self._slow_task = asyncio.get_running_loop().create_task(self._run_slow())

    def deliver(self, envelope: bytes) -> None:
        """Write an envelope to this session (behind any mailbox delivery in progress)."""
        if self._draining:
            self._held.append(envelope)
            return
        hot = self.dialect.metrics.hot
        hot.messages_out += 1
        hot.bytes_out += len(envelope)
        self.peer.send(envelope)

    def fail(
        self,
        env: EnvelopeRouting,
        reason: str,
        label: str,
        size: int = 0,
        received: int | None = None,
    ) -> None:
        """Report a routing failure to the sender, as rmb-rs does: only for requests.
        `size` and `received` (clock reading on arrival) go to the route record."""
        metrics = self.dialect.metrics
        records = self.dialect.records
        if records is not None:
            records.add(
                self.twin,
                env.dest_twin or None,
                size,
                "federation" if label == "federation" else "none",
                "rate-limited" if label == "rate limited" else "rejected",
                label,
                received=received,
            )
        if env.kind != MSG_REQUEST:
            metrics.drops.inc(1, label)
            return
        metrics.errors_sent.inc(1, label)
        error = build_error_envelope(
            env.uid, reason, seconds(self.dialect.clock()), self.twin, self.sid
        )
        if self.open:
            self.deliver(error)
        else:  # the sender left while we were routing: keep the error for its next login
            dialect = self.dialect
            deadline = dialect.mailbox.deadline(seconds(dialect.clock()), ERROR_ENVELOPE_TTL)
            asyncio.get_running_loop().create_task(dialect.store_error(self.key, error, deadline))

    # ---- the slow path ---------------------------------------------------------------------

    async def _run_slow(self) -> None:
        slow = self._slow
        assert slow is not None  # made before this task is started
        settings = self.dialect.settings
        try:
            while slow:
                env, data, received = slow.popleft()
                self._slow_bytes -= len(data)
                self.dialect.slow_bytes -= len(data)
                if self._slow_held and self._slow_bytes <= settings.slow_session_bytes // 2:
                    self._slow_held = False
                    self.peer.hold_reading(False)
                try:
                    if not self.dialect.forward_now(self, env, data, received):
                        await self.dialect.route_slow(self, env, data, received)
                except Exception:
                    log.exception("routing failed for envelope %s from %r", env.uid, self)
                    self.fail(env, "internal relay error", "internal error", len(data), received)
        finally:
            self._slow_task = None
            if self._scanner is not None:
                self._scanner.set_slow(False)

    # ---- mailbox ---------------------------------------------------------------------------

    def mail_waiting(self) -> None:
        self.drain_mailbox()

    def drain_mailbox(self) -> None:
        """Deliver what waits in the mailbox, in order, before any later live traffic."""
        if self._drain_task is not None:
            self._drain_again = True
            return
        self._draining = True
        self._hold_fast(True)  # live traffic waits behind the mailbox (`deliver`)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """Take, write and acknowledge the mailbox page by page. A mailbox that cannot be read
        (Redis down or stalled: each operation is bounded by the mailbox's timeout) releases
        the live traffic held behind it at once, and is tried again later with a back-off."""
        mailbox = self.dialect.mailbox
        failed = False
        try:
            try:  # read only once the cluster knows we hold the session (switch.claimed)
                await self.dialect.switch.claimed(self.key)
            except MailboxUnavailable as err:
                log.warning("could not announce %r to the cluster: %s", self, err)
            while True:
                self._drain_again = False
                try:
                    taken = await mailbox.take(self.key)
                    if taken.envelopes and self.open:
                        await self._write_paced(taken.envelopes)
                        self._record_drained(taken.envelopes)
                    if taken.ids and self.open:
                        await mailbox.ack(self.key, taken)
                except MailboxUnavailable as err:
                    log.warning("could not deliver the mailbox of %r: %s", self, err)
                    failed = True
                    break
                if not self.open or not (taken.more or self._drain_again):
                    break
        finally:
            self._drain_task = None
            self._draining = False
            held, self._held = self._held, []
            if held and self.open:
                self._write_all(held)
            self._hold_fast(False)
        if failed and self.open:
            self._retry_drain()
        else:
            self._drain_delay = DRAIN_RETRY

    def _hold_fast(self, held: bool) -> None:
        """Keep the fast path from forwarding to this session (its messages reach `deliver`)."""
        if self.outboxes is not None:
            self.outboxes.set_held(self.peer.id, held)

    def _record_drained(self, envelopes: list[bytes]) -> None:
        records = self.dialect.records
        if records is not None:
            for envelope in envelopes:
                records.add(None, self.twin, len(envelope), "mailbox", "delivered")

    def _retry_drain(self) -> None:
        if self._drain_retry is not None:
            return
        delay = self._drain_delay
        self._drain_delay = min(delay * 2, DRAIN_RETRY_MAX)

        def retry() -> None:
            self._drain_retry = None
            if self.open:
                self.drain_mailbox()

        self._drain_retry = asyncio.get_running_loop().call_later(delay, retry)

    async def _write_paced(self, envelopes: list[bytes]) -> None:
        """Write a drained mailbox in batches, each after the socket is writable again: a large
        mailbox must not pile up in the transport's buffer (backpressure outside a read)."""
        for start in range(0, len(envelopes), DRAIN_BATCH):
            await self.peer.writable()
            if not self.open:
                return
            self._write_all(envelopes[start : start + DRAIN_BATCH])

    def _write_all(self, envelopes: list[bytes]) -> None:
        hot = self.dialect.metrics.hot
        hot.messages_out += len(envelopes)
        hot.bytes_out += sum(map(len, envelopes))
        self.peer.send_many(envelopes)


# ---- rmb-relay serve ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The RMB flags of `rmb-relay serve` (rmb-rs's names where it has them)."""
    rmb = parser.add_argument_group("RMB relay (GET /?<jwt>)")
    rmb.add_argument(
        "-m",
        "--domain",
        action="append",
        default=[],
        metavar="DOMAIN",
        help=(
            "a domain this relay serves (repeatable); twins whose on-chain relay list shares one "
            "are kept here when offline. None given: standalone, every known twin is local"
        ),
    )
    rmb.add_argument(
        "--limit",
        nargs=2,
        type=int,
        metavar=("COUNT", "SIZE"),
        help="per-twin rate limit: at most COUNT messages and SIZE bytes per --limit-window "
        "(default: no limit)",
    )
    rmb.add_argument(
        "--limit-window",
        type=int,
        default=60,
        metavar="SECONDS",
        help="rate limit window",
    )
    rmb.add_argument(
        "--max-token-lifetime",
        type=int,
        default=DEFAULT_MAX_TOKEN_LIFETIME,
        metavar="SECONDS",
        help="refuse a login JWT still valid for longer than this (exp - now); rmb-peer's "
        "tokens live 300 s",
    )
    federation_setup.add_arguments(parser)


async def build(args: argparse.Namespace, services: Services) -> RmbDialect:
    """The RMB dialect of `rmb-relay serve`, on the process's switch and twin directory."""
    if args.limit is not None and min(args.limit) <= 0:
        raise ConfigError("--limit COUNT SIZE must both be positive")
    if args.limit_window <= 0:
        raise ConfigError("--limit-window must be positive")
    if args.max_token_lifetime <= 0:
        raise ConfigError("--max-token-lifetime must be positive")
    settings = RmbSettings(
        domains=frozenset(args.domain),
        limit_count=args.limit[0] if args.limit else None,
        limit_size=args.limit[1] if args.limit else None,
        limit_window=args.limit_window,
        max_token_lifetime=args.max_token_lifetime,
    )
    directory = services.twin_directory()
    dialect = RmbDialect(
        settings, directory, services.metrics, switch=services.switch, max_message=args.max_message
    )
    outbound, inbound = federation_setup.build(
        args,
        redis=services.redis,
        switch=services.switch,
        registry=services.metrics,
        directory=directory,
        is_ours=dialect.is_ours,
    )
    dialect.federation = services.switch.federation = outbound
    dialect.inbound = inbound
    if services.redis is not None:
        outbound.start()  # take over what a crashed instance left queued
    # without Redis the queue starts empty and the first forward starts the workers: 256
    # parked tasks (~0.4 MB) a relay that never federates does not hold
    return dialect


ENTRY = DialectEntry(
    name="rmb",
    summary="RMB (ThreeFold Reliable Message Bus) twins at GET /?<jwt>",
    add_arguments=add_arguments,
    build=build,
)
