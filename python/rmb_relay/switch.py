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
- the outboxes (Rust `Outboxes`: connection id -> pending output). The scanners of RMB, SBD
  and 신경 JSON connections hold them too, so a message for a local connection that may take
  it is framed straight into its outbox inside `feed` (the fast path, counted in `Outboxes`;
  the 신경 gateway's SEND/BROADCAST DISPATCHes, rust/dialects/singyeong/, counted in its
  `SgIndex`); anything else (offline, another instance, a receiver that is congested or held)
  reaches the dialect;
- the mailbox (messages for offline sessions, in memory or Redis), drained through
  `Endpoint.deliver` when the session connects.

`deliver(address, frame)` answers with an `Outcome`: delivered to a local connection, forwarded
to the instance of this relay service that holds it (the cluster, `cluster/`, when relay
processes share Redis), queued in the mailbox, or no route. Federation (another relay serves
it) plugs in as a further route; a dialect never needs to know which one carried its message.
With a cluster, registering and unregistering an address also claims and releases it in the
shared presence.
Federation is `federate(frame, twin)`: the `federation` route
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rmb_relay._core import Outboxes, RouteTable
from rmb_relay.errors import FederationError
from rmb_relay.mailbox import Mailbox, MemoryMailbox, SessionKey

if TYPE_CHECKING:
    from rmb_relay.contract import Peer
    from rmb_relay.telemetry.records import Channel, Recorder
    from rmb_relay.twins import Twin

log = logging.getLogger("rmb_relay.switch")

#: an RMB session (twin, sid) or a 32-byte SBD public key
Address = SessionKey | bytes


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    FORWARDED = "forwarded"
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


class QueuedForward(Protocol):
    """Told how a message queued for another instance's stream ended (`Cluster.forward`
    with `queued`): the sender went on at once, so its bookkeeping (the error envelope of a
    refused request, the message's one route record) happens here, at the outcome."""

    def settled(self, route: str, outcome: str, reason: str | None = None) -> None:
        """It ended as route `cluster` (Redis took it), or, its holder gone, `mailbox` /
        `none` (stored, or dropped for `reason`) after it was routed again."""

    def refused(self, err: BaseException) -> None:
        """Redis refused it: it was not accepted."""


class ClusterRoute(Protocol):
    """The switch's view of `cluster.Cluster` (other instances sharing Redis)."""

    def claim(self, address: Address) -> None: ...

    def release(self, address: Address) -> None: ...

    async def claimed(self, address: Address) -> None: ...

    async def forward(
        self,
        address: Address,
        frame: bytes,
        deadline: int | None,
        queued: QueuedForward | None = None,
    ) -> bool: ...

    def forward_nowait(
        self,
        address: Address,
        frame: bytes,
        deadline: int | None,
        queued: QueuedForward,
    ) -> bool: ...

    def forward_soon(self, address: Address, frame: bytes) -> None: ...

    #: the outcome of an envelope the scanner queued for another instance, from its bytes
    crossing_outcome: Callable[[bytes], QueuedForward] | None

    def mirror(self, address: Address, fresh_for: int, now: int) -> bool: ...

    async def mail_stored(self, address: Address) -> None: ...

    async def close(self) -> None: ...


class FederationRoute(Protocol):
    """Delivery through another relay (`federation.Federation`)."""

    async def forward(self, envelope: bytes, twin: Twin) -> None:
        """Accept the raw envelope for one of `twin.relays`; raise FederationError."""


class Switch:
    """Route tables, presence and mailbox of one relay process; see the module docstring."""

    def __init__(self, mailbox: Mailbox | None = None) -> None:
        self.routes = RouteTable()
        self.outboxes = Outboxes()
        self.endpoints: dict[int, Endpoint] = {}
        self.mailbox: Mailbox = mailbox if mailbox is not None else MemoryMailbox()
        #: other instances of this relay service, when they share Redis (set by Services)
        self.cluster: ClusterRoute | None = None
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
        if self.cluster is not None:
            self.cluster.claim(key)
        return self.endpoint(displaced)

    def unregister_session(self, key: SessionKey, endpoint: Endpoint) -> None:
        """Only if `key` still routes to this connection: a replaced connection must not evict
        its successor."""
        self.routes.unregister_session(key[0], key[1], endpoint.peer.id)
        if self.cluster is not None and self.routes.lookup_session(key[0], key[1]) is None:
            self.cluster.release(key)

    def register_key(self, pubkey: bytes, endpoint: Endpoint) -> Endpoint | None:
        displaced = self.routes.register_pubkey(pubkey, endpoint.peer.id)
        if self.cluster is not None:
            self.cluster.claim(pubkey)
        return self.endpoint(displaced)

    def unregister_key(self, pubkey: bytes, endpoint: Endpoint) -> None:
        self.routes.unregister_pubkey(pubkey, endpoint.peer.id)
        if self.cluster is not None and self.routes.lookup_pubkey(pubkey) is None:
            self.cluster.release(pubkey)

    def lookup(self, address: Address) -> Endpoint | None:
        """The local endpoint holding the address, if it is connected to this process."""
        if isinstance(address, bytes):
            return self.endpoint(self.routes.lookup_pubkey(address))
        return self.endpoint(self.routes.lookup_session(address[0], address[1]))

    # ---- delivery --------------------------------------------------------------------------

    def write_placed(self) -> None:
        """Write out what Rust put into the outboxes outside a socket read (the cluster's
        bus records, `Outboxes.place_records`): each connection written to once."""
        for conn, data in self.outboxes.drain():
            conn.write_taken(data)

    def deliver_local(self, address: Address, frame: bytes) -> bool:
        endpoint = self.lookup(address)
        if endpoint is None:
            return False
        endpoint.deliver(frame)
        return True

    async def claimed(self, address: Address) -> None:
        """Wait until the cluster knows this instance holds `address` (at once without a
        cluster): a mailbox is read only after that, so a message stored meanwhile by another
        instance is announced to us. Raises `ClusterUnavailable`."""
        if self.cluster is not None:
            await self.cluster.claimed(address)

    async def deliver(
        self,
        address: Address,
        frame: bytes,
        *,
        deadline: int | None = None,
        store: bool = True,
        queued: QueuedForward | None = None,
        sender: str | None = None,
    ) -> Outcome:
        """Local connection first; else the instance holding it (cluster); else, for a session
        address with a `deadline` (unix seconds) and `store`, the mailbox. The deadline also
        travels with a forwarded message, for the far instance to store it if its holder left
        meanwhile. Raises `MailboxUnavailable` (or its `ClusterUnavailable`) when Redis cannot
        take the message. With `queued`, a message for another instance is only queued for
        its stream (FORWARDED at once; `Cluster.forward`), and `queued` hears how it ended.
        `sender`: the relay that posted it (federation), whose share of the mailbox a stored
        message counts against (`Mailbox.put`).

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
        cluster = self.cluster
        if cluster is not None and await cluster.forward(address, frame, deadline, queued):
            return Outcome.FORWARDED
        if deadline is None or not store or isinstance(address, bytes):
            return Outcome.NO_ROUTE
        await self.mailbox.put(address, frame, deadline, sender=sender)
        # the session may have connected (and drained) while we were storing
        endpoint = self.lookup(address)
        if endpoint is not None:
            endpoint.mail_waiting()
        elif cluster is not None:  # ... here or on another instance
            await cluster.mail_stored(address)
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
        if self.cluster is not None:
            await self.cluster.close()
        await self.mailbox.close()
