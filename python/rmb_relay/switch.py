"""The switch: "give these bytes to that address, wherever it is", for every dialect.

Theory of operation
-------------------
An *address* names a receiver independently of the connection that holds it: an RMB session
`(twin, sid)` or an SBD public key (32 bytes). Connections register the addresses they hold;
the switch keeps

- the route tables (Rust `RouteTable`: address -> connection id). The same table is handed to
  each connection's scanner, so the decoder looks destinations up inside `feed` and the fast
  path needs no Python lookup at all;
- presence (connection id -> `Endpoint`, the dialect's per-connection handler);
- the mailbox (messages for offline sessions, in memory or Redis), drained through
  `Endpoint.deliver` when the session connects.

`deliver(address, frame)` answers with an `Outcome`: delivered to a local connection, queued
in the mailbox, or no route. The cluster (another instance holds the address) and federation
(another relay serves it) plug in here as further routes; a dialect never needs to know which
one carried its message. Federation is `federate(frame, twin)`: the `federation` route
(`federation/`) queues the envelope for one of the twin's relays and answers FEDERATED; with
no route set the relay does not federate and the caller gets a FederationError.

Route records (`--records`): `records` is the process's `Recorder` or None. Each dialect takes
its `Channel` from it and records where it decides a route: on the local fast path the scanner
appends the record inside `feed`, the other routes and every drop call `Channel.add`, and the
federation worker calls it when a remote relay's answer decides the outcome
(telemetry/records.py).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Protocol

from rmb_relay._core import RouteTable
from rmb_relay.errors import FederationError
from rmb_relay.mailbox import Mailbox, MemoryMailbox, SessionKey

if TYPE_CHECKING:
    from rmb_relay.protocols.base import Peer
    from rmb_relay.telemetry.records import Channel, Recorder
    from rmb_relay.twins import Twin

log = logging.getLogger("rmb_relay.switch")

#: an RMB session (twin, sid) or a 32-byte SBD public key
Address = SessionKey | bytes


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    QUEUED = "queued"
    NO_ROUTE = "no route"
    FEDERATED = "federated"


class Endpoint(Protocol):
    """A connection's handler as the switch sees it."""

    @property
    def peer(self) -> Peer: ...

    def deliver(self, frame: bytes) -> None:
        """Write one message to this connection (in order with everything else it receives)."""

    def mail_waiting(self) -> None:
        """Something was queued in the mailbox of an address this endpoint holds (it connected
        while the message was being stored): deliver the mailbox."""


class FederationRoute(Protocol):
    """Delivery through another relay (`federation.Federation`)."""

    async def forward(self, envelope: bytes, twin: Twin) -> None:
        """Accept the raw envelope for one of `twin.relays`; raise FederationError."""


class Switch:
    """Route tables, presence and mailbox of one relay process; see the module docstring."""

    def __init__(self, mailbox: Mailbox | None = None) -> None:
        self.routes = RouteTable()
        self.endpoints: dict[int, Endpoint] = {}
        self.mailbox: Mailbox = mailbox if mailbox is not None else MemoryMailbox()
        #: the route to other relays; None: this relay does not federate
        self.federation: FederationRoute | None = None
        #: route records of this process (off: None)
        self.records: Recorder | None = None

    def record_channel(self, dialect: str) -> Channel | None:
        """The dialect's route-record buffers, or None when recording is off."""
        return None if self.records is None else self.records.channel(dialect)

    # ---- presence --------------------------------------------------------------------------

    def attach(self, endpoint: Endpoint) -> None:
        """The connection exists (handshaking or ready); its addresses come later."""
        self.endpoints[endpoint.peer.id] = endpoint

    def detach(self, endpoint: Endpoint) -> None:
        conn_id = endpoint.peer.id
        if self.endpoints.get(conn_id) is endpoint:
            del self.endpoints[conn_id]

    def endpoint(self, conn_id: int | None) -> Endpoint | None:
        return self.endpoints.get(conn_id) if conn_id is not None else None

    def register_session(self, key: SessionKey, endpoint: Endpoint) -> Endpoint | None:
        """Route `key` to this connection; returns the endpoint it displaced, if any."""
        displaced = self.routes.register_session(key[0], key[1], endpoint.peer.id)
        return self.endpoint(displaced)

    def unregister_session(self, key: SessionKey, endpoint: Endpoint) -> None:
        """Only if `key` still routes to this connection: a replaced connection must not evict
        its successor."""
        self.routes.unregister_session(key[0], key[1], endpoint.peer.id)

    def register_key(self, pubkey: bytes, endpoint: Endpoint) -> Endpoint | None:
        displaced = self.routes.register_pubkey(pubkey, endpoint.peer.id)
        return self.endpoint(displaced)

    def unregister_key(self, pubkey: bytes, endpoint: Endpoint) -> None:
        self.routes.unregister_pubkey(pubkey, endpoint.peer.id)

    def lookup(self, address: Address) -> Endpoint | None:
        """The local endpoint holding the address, if it is connected to this process."""
        if isinstance(address, bytes):
            return self.endpoint(self.routes.lookup_pubkey(address))
        return self.endpoint(self.routes.lookup_session(address[0], address[1]))

    # ---- delivery --------------------------------------------------------------------------

    def deliver_local(self, address: Address, frame: bytes) -> bool:
        endpoint = self.lookup(address)
        if endpoint is None:
            return False
        endpoint.deliver(frame)
        return True

    async def deliver(
        self, address: Address, frame: bytes, *, deadline: int | None = None
    ) -> Outcome:
        """Local connection first; else, for a session address with a `deadline` (unix
        seconds), the mailbox. Raises `MailboxUnavailable` when the mailbox cannot store it.

        This is the path of producers outside a socket read (slow-path tasks, stream
        consumers): a congested receiver is waited for (`Peer.writable`) instead of having its
        write buffer grow; senders inside a read use `deliver_local` and are paused by the
        listener instead."""
        endpoint = self.lookup(address)
        if endpoint is not None:
            await endpoint.peer.writable()
            # it may have gone, or been replaced by a newer connection, while we waited
            endpoint = self.lookup(address)
            if endpoint is not None:
                endpoint.deliver(frame)
                return Outcome.DELIVERED
        if deadline is None or isinstance(address, bytes):
            return Outcome.NO_ROUTE
        await self.mailbox.put(address, frame, deadline)
        # the session may have connected (and drained) while we were storing
        endpoint = self.lookup(address)
        if endpoint is not None:
            endpoint.mail_waiting()
        return Outcome.QUEUED

    async def federate(self, frame: bytes, twin: Twin) -> Outcome:
        """Hand an envelope for a twin served by other relays to the federation route."""
        if self.federation is None:
            relays = ", ".join(sorted(twin.relays or ())) or "none"
            raise FederationError(
                f"destination twin {twin.id} is served by relay(s) {relays}; "
                "this relay does not federate to other relays"
            )
        await self.federation.forward(frame, twin)
        return Outcome.FEDERATED

    @property
    def session_count(self) -> int:
        return self.routes.session_count

    async def close(self) -> None:
        await self.mailbox.close()
