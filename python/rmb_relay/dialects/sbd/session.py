"""One SBD connection: handshaking until a valid `ares`, then ready to forward."""

from __future__ import annotations

import base64
import logging
import os
from typing import TYPE_CHECKING, Protocol

from rmb_relay._core import (
    SBD_FORWARD,
    SbdRouting,
    SbdScanner,
    WsDecoder,
    WsMessage,
    sbd_encode_command,
    verify_ed25519,
)
from rmb_relay.dialects.base import CloseCode, Peer, WebSocketHandler
from rmb_relay.dialects.sbd.settings import (
    ARES_LEN,
    CMD_AREQ,
    CMD_ARES,
    CMD_LIDL,
    CMD_SRDY,
    NONCE_LEN,
)

if TYPE_CHECKING:
    from rmb_relay._core import ByteNanosLimiter
    from rmb_relay.clock import Clock
    from rmb_relay.dialects.sbd.metrics import SbdMetrics
    from rmb_relay.dialects.sbd.settings import SbdSettings
    from rmb_relay.switch import Switch

log = logging.getLogger("rmb_relay.sbd")


class SessionHost(Protocol):
    """What a session needs of its dialect (`SbdDialect`): the per-process tables it joins and
    the per-IP bookkeeping it reports to. A protocol, so the dialect imports the session and
    not the other way round."""

    settings: SbdSettings
    clock: Clock
    switch: Switch
    metrics: SbdMetrics
    limiter: ByteNanosLimiter
    sessions: dict[int, SbdSession]
    by_ip: dict[str, set[SbdSession]]
    tokens: dict[str, int]

    def handshake_started(self, session: SbdSession) -> None: ...

    def handshake_done(self, session: SbdSession) -> None: ...

    def send_lbrt(self, session: SbdSession) -> None: ...

    def ip_count_changed(self, ip: str) -> None: ...

    def rate_violation(self, session: SbdSession) -> None: ...


class SbdSession(WebSocketHandler):
    """One SBD connection: handshaking until a valid `ares`, then ready."""

    def __init__(
        self, peer: Peer, dialect: SessionHost, pubkey: bytes, ip: str, token: str | None
    ) -> None:
        super().__init__(peer)
        self.dialect = dialect
        self.pubkey = pubkey
        self.ip = ip
        self.token = token
        self.nonce = os.urandom(NONCE_LEN)
        self.ready = False
        self.open = False
        self.last_activity = dialect.clock()
        #: route records (--records): this key as text (the scanner records the hot path)
        self.records = dialect.switch.record_channel("sbd")
        self.record_key = self.key_text if self.records is not None else ""
        #: counted in the dialect's handshaking connections of this IP
        self.handshaking = False
        #: the lbrt value this connection was last told (None: not yet)
        self.lbrt_sent: int | None = None

    def send(self, message: bytes) -> None:
        self.peer.send(message)

    # the switch's Endpoint
    deliver = send

    def mail_waiting(self) -> None:
        """SBD keeps no mailbox: a forward to an absent key is dropped (spec)."""

    def on_open(self) -> None:
        dialect = self.dialect
        self.open = True
        dialect.sessions[self.peer.id] = self
        dialect.switch.attach(self)
        dialect.by_ip.setdefault(self.ip, set()).add(self)
        dialect.handshake_started(self)
        dialect.send_lbrt(self)  # this connection's first lbrt, at once (it precedes srdy)
        dialect.ip_count_changed(self.ip)
        self.send(sbd_encode_command(CMD_AREQ, self.nonce))

    def drop(self, reason: str) -> None:
        """Abort without a close frame (the spec's answer to every violation)."""
        if reason not in ("idle", "rate"):
            self.dialect.metrics.violations.inc(1, reason)
        log.debug("sbd: dropping %s from %s: %s", self.key_text, self.ip, reason)
        self.peer.abort()

    @property
    def key_text(self) -> str:
        return base64.urlsafe_b64encode(self.pubkey).rstrip(b"=").decode()

    def bind_decoder(self, decoder: WsDecoder) -> None:
        """The decoder charges the IP's byte budget, classifies each message, looks up a
        forward's destination and rewrites its header, all inside the one `feed` per read."""
        dialect = self.dialect
        limiter = None if dialect.settings.disable_rate_limit else dialect.limiter
        records = self.records
        # with --records the scan also appends the route record of each forward it routes
        buffer = None if records is None else records.scanner_buffer(dialect.clock)
        # and forwards to a key connected here straight into its connection's outbox
        self.outboxes = outboxes = dialect.switch.outboxes
        self.scanner = SbdScanner(
            dialect.switch.routes, self.pubkey, limiter, self.ip, buffer, outboxes, self.peer.id
        )
        decoder.set_scanner(self.scanner)

    @property
    def active_at(self) -> int:
        """When this connection last sent a message (the fast path's forwards included)."""
        return max(self.last_activity, self.scanner.active_at)

    def on_message(self, message: WsMessage) -> None:
        dialect = self.dialect
        data = message.data  # a forward's header is already the sender's key
        hot = dialect.metrics.hot
        hot.messages_in += 1
        hot.bytes_in += len(data)
        routing: SbdRouting | None = message.routing  # type: ignore[assignment]
        if routing is None or routing.over_limit:
            if self.scanner.over_limit:
                dialect.rate_violation(self)
                self._record_drop(len(data), "rate-limited", "rate")
                self.drop("rate")
            else:
                self._record_drop(len(data), "rejected", "short message")
                self.drop("short message")
            return
        now = dialect.clock()
        self.last_activity = now
        if self.token is not None:
            dialect.tokens[self.token] = now
        if routing.kind == SBD_FORWARD:
            if not self.ready:
                self._record_drop(len(data), "rejected", "forward before handshake")
                self.drop("forward before handshake")
                return
            conn_id = routing.dest_conn_id
            if conn_id is not None:
                target = dialect.switch.endpoints.get(conn_id)
            elif routing.sender_ready:
                target = None  # the key is not connected (or not ready)
            else:  # became ready earlier in this same read: the scan could not look it up
                target = dialect.switch.lookup(routing.peer)
            if target is None:
                cluster = dialect.switch.cluster
                if cluster is not None:  # another instance may hold the key
                    cluster.forward_soon(routing.peer, data)
                    return
                hot.forward_drops += 1
                if self.records is not None:
                    self.records.retract(routing.record)  # gone since the scan recorded it
                    dst = base64.urlsafe_b64encode(routing.peer).rstrip(b"=").decode()
                    self.records.add(
                        self.record_key, dst, len(data), "none", "rejected", "no route"
                    )
                return
            target.deliver(data)
            hot.forwards += 1
            hot.bytes_out += len(data)  # its route record was appended by the scan (--records)
            return
        if routing.tag == CMD_ARES:
            self._on_ares(data, routing.payload)
        # keep, none and any other command: ignored (but charged by the scanner)

    def on_discarded(self, message: WsMessage) -> None:
        """A forward read but never handled (the connection was closing) was not delivered."""
        routing = message.routing
        if self.records is not None and isinstance(routing, SbdRouting):
            self.records.retract(routing.record)

    def _record_drop(self, size: int, outcome: str, reason: str) -> None:
        if self.records is not None:
            self.records.add(self.record_key, None, size, "none", outcome, reason)

    def _on_ares(self, data: bytes, signature: bytes) -> None:
        dialect = self.dialect
        if self.ready:
            self.drop("ares after handshake")
            return
        if len(data) != ARES_LEN or not verify_ed25519(self.pubkey, self.nonce, signature):
            dialect.metrics.auth_failures.inc(1, "bad signature")
            self.drop("bad handshake signature")
            return
        idle = dialect.settings.idle_ms.to_bytes(4, "big")
        self.send(sbd_encode_command(CMD_LIDL, idle))
        self.send(sbd_encode_command(CMD_SRDY))
        # routable in the same step as srdy is queued: nothing can overtake it
        self.ready = self.scanner.ready = True
        dialect.handshake_done(self)
        displaced = dialect.switch.register_key(self.pubkey, self)
        if isinstance(displaced, SbdSession):
            # decision 4: the newest connection takes the routing
            displaced.ready = displaced.scanner.ready = False
            displaced.peer.close(
                CloseCode.NORMAL, "replaced by a newer connection with the same key"
            )

    def on_close(self, code: int | None) -> None:
        if not self.open:
            return
        self.open = False
        dialect = self.dialect
        dialect.sessions.pop(self.peer.id, None)
        dialect.switch.unregister_key(self.pubkey, self)
        dialect.switch.detach(self)
        dialect.handshake_done(self)
        members = dialect.by_ip.get(self.ip)
        if members is not None:
            members.discard(self)
            if members:
                dialect.ip_count_changed(self.ip)
            else:
                del dialect.by_ip[self.ip]
