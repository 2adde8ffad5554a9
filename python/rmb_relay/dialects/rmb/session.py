"""`RmbSession`: one logged-in (twin, sid) connection: its messages, its slow-path queue, its
mailbox drain."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Protocol

from rmb_relay._core import (
    MSG_PING,
    MSG_REQUEST,
    EnvelopeRouting,
    FixedWindowLimiter,
    RmbScanner,
    WsDecoder,
    WsMessage,
    build_error_envelope,
    build_pong,
)
from rmb_relay.clock import Clock, seconds
from rmb_relay.dialects.base import CloseCode, Peer, WebSocketHandler
from rmb_relay.dialects.rmb.settings import (
    DRAIN_BATCH,
    DRAIN_RETRY,
    DRAIN_RETRY_MAX,
    ERROR_ENVELOPE_TTL,
)
from rmb_relay.errors import MailboxUnavailable
from rmb_relay.federation import Federation
from rmb_relay.mailbox import Mailbox, SessionKey
from rmb_relay.switch import Switch

if TYPE_CHECKING:
    from rmb_relay.dialects.rmb.metrics import RmbMetrics
    from rmb_relay.dialects.rmb.settings import RmbSettings
    from rmb_relay.federation.inbound import InboundFederation
    from rmb_relay.telemetry.records import Channel
    from rmb_relay.twins import Twin


log = logging.getLogger("rmb_relay.rmb")


class SessionHost(Protocol):
    """What a session needs of its dialect (`RmbDialect`). A protocol, so the dialect imports
    the session and not the other way round."""

    settings: RmbSettings
    switch: Switch
    metrics: RmbMetrics
    records: Channel | None
    clock: Clock
    limiter: FixedWindowLimiter | None
    federation: Federation | None
    inbound: InboundFederation | None
    sessions: dict[int, RmbSession]
    slow_bytes: int
    slow_bytes_peak: int

    @property
    def mailbox(self) -> Mailbox: ...

    def is_ours(self, twin: Twin) -> bool: ...

    def forward_now(
        self, sender: RmbSession, env: EnvelopeRouting, data: bytes, received: int | None
    ) -> bool: ...

    async def route_slow(
        self, sender: RmbSession, env: EnvelopeRouting, data: bytes, received: int | None
    ) -> None: ...

    async def store_error(self, key: SessionKey, error: bytes, deadline: int) -> None: ...


class RmbSession(WebSocketHandler):
    """One logged-in (twin, sid) connection."""

    def __init__(self, peer: Peer, dialect: SessionHost, twin: int, sid: str | None) -> None:
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
        self._decoder: WsDecoder | None = None

    def bind_decoder(self, decoder: WsDecoder) -> None:
        # the rate limit, the source check and the destination lookup happen in the codec's
        # feed, which forwards an envelope for a local session that may take it itself (the
        # switch's outboxes); with --records it appends the route record of each message it
        # finds a local destination for
        self._decoder = decoder
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

    @property
    def received(self) -> int:
        """Data messages this session sent, counted by its decoder (the fast path's included)."""
        decoder = self._decoder
        return 0 if decoder is None else decoder.messages_in

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
            dialect.metrics.twins.ended(self.twin, self.received)
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
                # what this session causes here (error envelopes to it) counts against its own
                # output: while it does not read them, its queued envelopes wait, and the
                # queue's bound (`slow_session_bytes`) then stops its reads
                if self.peer.congested:
                    self.dialect.metrics.reply_pauses.inc()
                    await self.peer.writable()
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
