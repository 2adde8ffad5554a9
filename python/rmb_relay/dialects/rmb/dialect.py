"""`RmbDialect`: logins, and routing what the fast path hands up (the package docstring says
how)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rmb_relay._core import (
    MSG_REQUEST,
    EnvelopeRouting,
    FixedWindowLimiter,
    HttpRequest,
    build_error_envelope,
)
from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.dialects.base import Dialect, Peer, Routes, WebSocketHandler
from rmb_relay.dialects.rmb.forward import ClusterForward, CrossedForward
from rmb_relay.dialects.rmb.later import Later
from rmb_relay.dialects.rmb.metrics import RmbMetrics
from rmb_relay.dialects.rmb.session import RmbSession
from rmb_relay.dialects.rmb.settings import ERROR_ENVELOPE_TTL, RmbSettings
from rmb_relay.errors import (
    AuthError,
    FederationError,
    HttpReject,
    MailboxFull,
    MailboxUnavailable,
    TwinLookupError,
)
from rmb_relay.federation import Federation
from rmb_relay.identity import parse_jwt, verify_jwt_signature
from rmb_relay.mailbox import Mailbox, MemoryMailbox, SessionKey
from rmb_relay.switch import Outcome, Switch
from rmb_relay.throttle import Throttles
from rmb_relay.twins.cache import CachedTwinDirectory

if TYPE_CHECKING:
    from rmb_relay.federation.inbound import InboundFederation
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.twins import Twin, TwinDirectory


log = logging.getLogger("rmb_relay.rmb")


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
        throttles: Throttles | None = None,
    ) -> None:
        """`switch` and `directory` are the process's shared ones (closed by their owner);
        without a switch (tests) the dialect makes and owns a private one around `mailbox`
        (default: in memory), and owns the directory too. `throttles`: the process's
        failed-login limiter (throttle.py; default: one of the dialect's own)."""
        self.settings = settings
        self.throttles = throttles if throttles is not None else Throttles(registry)
        self.directory = directory
        self._owns_shared = switch is None
        if switch is None:
            switch = Switch(mailbox if mailbox is not None else MemoryMailbox(clock=clock))
        self.switch = switch
        # the deadline of an envelope the scanner queues for another instance (`forward_now`)
        switch.outboxes.store_ttl = self.mailbox.ttl
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
        #: responses that could not reach another instance, tried again (later.py)
        self.later: Later[RmbSession] = Later(
            self.route_slow,
            clock,
            lambda: self.metrics.drops.inc(1, "redis down"),
            settings.retry_hold_bytes,
        )
        self.metrics = RmbMetrics(registry, self, settings.metrics_max_twins)
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
        # a failed login costs a parse, maybe a twin lookup and a signature check: one address
        # gets --auth-failures of them, then 429 before any (throttle.py); a signature has
        # nothing to guess, so only failures are charged and honest logins at once all pass
        keys = self.throttles.check("rmb", conn.peer_host, secret=False)
        try:
            return await self._authenticate(request, conn)
        except HttpReject:
            self.throttles.failed(keys)
            raise

    async def _authenticate(self, request: HttpRequest, conn: Peer) -> RmbSession:
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

    def live_received(self) -> Iterator[tuple[int, int]]:
        """(twin, data messages received) of every live session (read at scrape)."""
        for session in self.sessions.values():
            yield session.twin, session.received

    def open_surfaces(self) -> list[str]:
        inbound = self.inbound
        if inbound is None:
            return []
        if inbound.verify:
            return ["federation POST / (any relay may post; envelopes must be signed)"]
        return ["federation POST / UNSIGNED envelopes accepted (--no-verify-federated)"]

    def _login_failed(self, reason: str, conn: Peer) -> None:
        self.metrics.login_failures.inc(1, reason)
        log.info("refused RMB login from %s: %s", conn.peer_host, reason)

    # ---- routing ---------------------------------------------------------------------------

    def is_ours(self, twin: Twin) -> bool:
        """Whether this relay keeps mail for the twin (it shares a domain, or we're standalone)."""
        if self.settings.standalone:
            return True
        return bool(twin.relays and twin.relays & self.settings.domains)

    def serves_federated(self, twin: Twin) -> bool:
        """Whether another relay may post envelopes for the twin here (`POST /`): its relay
        list shares one of our domains; on a standalone relay (no `--domain`), which cannot
        know its own name, only a twin that names no relay at all (one of the local
        directory's), never one whose relays are elsewhere."""
        if self.settings.standalone:
            return not twin.relays
        return self.is_ours(twin)

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
        queued = ClusterForward(self.records, sender, env, data, received, self.later.hold)
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
        return CrossedForward(self.records, self.fail_source, data, self.hold_crossed)

    def hold_crossed(self, env: EnvelopeRouting, data: bytes) -> bool:
        """`Later.hold` for an envelope the fast path queued, its sender found by its source
        (False when that session is gone: dropped and counted, as before)."""
        session = self.switch.lookup((env.source_twin, env.source_connection))
        return isinstance(session, RmbSession) and self.later.hold(session, env, data)

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
        queued = ClusterForward(self.records, sender, env, data, received, self.later.hold)
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
        await self.later.close()
        if self._maintenance is not None:
            self._maintenance.cancel()
        if self.federation is not None:
            await self.federation.close()
        if self._owns_shared:
            await self.switch.close()
            await self.directory.close()
