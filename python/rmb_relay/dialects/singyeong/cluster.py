"""Several instances in one cluster form one gateway (decision 12), on the cluster layer
(`cluster/`): every instance keeps a replica of every other instance's clients, so SEND,
BROADCAST, selectors, `key`, QUERY_NODES and the HTTP query run locally over all clients, and
a frame for a client held elsewhere goes to its instance's bus stream.

What the gateway uses of the cluster
------------------------------------
- **Replicas**: a replicated table (`cluster/fanout.py`, topic `sg`) whose entries are this
  instance's clients (key `app\\0client`, value the client's state in JSON). Keys:
  `rmb:{f:sg}:i:<instance>` (hash), `rmb:{f:sg}:members`, `rmb:{f:sg}:log` (`cluster/keys.py`).
  The table's log orders every change, so a replica needs no versions.
- **Liveness**: the cluster's instance id names the node (QUERY_NODES, delivery tokens), and
  its "instance gone" detection (`Cluster.on_instance_gone`, within `--cluster-ttl`) removes
  a dead instance's clients from every replica.
- **Frames to a client elsewhere**: a bus record named `g:<len(app)>:<app><client>`
  (`gateway_name`), sent to the instance the replica names (`Cluster.send_to_nowait`): batched
  with everything else for that instance, at least once, kept in Redis while the receiving
  instance's reader is down, and reaped if it dies (then passed on to whoever holds the name,
  or dropped: its client is gone). Each client's name is claimed in presence so that a
  record for a client that moved follows it. Several receivers on one instance (a BROADCAST)
  share one record, `gm:<instance>`, whose frame lists them (`_ManyEndpoint`): one record, not
  one per receiver. When Redis refuses a record, the sender gets op 3 `invalid` saying so:
  never a silent loss.

Replica bounds (issue 33)
-------------------------
Another instance's clients cost this one memory, and that instance may run with larger
bounds (or be broken): a replica is held to this instance's own per-client bounds
(`--sg-metadata-keys`, `--sg-metadata-bytes`, counted as a local client's are:
`metadata.replica_size`; its ids to `MAX_ID_LENGTH`, its queue names to
`CLIENT_QUEUE_NAMES`) and all replicas together to `--sg-replica-total-bytes`. An entry
beyond them is not kept (a replica held for that client before is dropped, so queries do
not answer with stale metadata), logged and counted (`rmb_relay_sg_refused_total{limit=
"replica_keys"|"replica_bytes"|"replica_total"}`); a raw entry longer than
`max_entry_bytes` is refused before it is parsed. The client is taken again at its next
change within the bounds.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from rmb_relay.cluster import keys
from rmb_relay.cluster.endpoint import NoPeer
from rmb_relay.cluster.fanout import ReplicatedTable
from rmb_relay.dialects.singyeong.clients import Client
from rmb_relay.dialects.singyeong.metadata import replica_size
from rmb_relay.errors import ClusterUnavailable

if TYPE_CHECKING:
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.base import Peer
    from rmb_relay.dialects.singyeong.clients import ClientIndex
    from rmb_relay.dialects.singyeong.settings import SgSettings

log = logging.getLogger("rmb_relay.singyeong")

#: the replicated table's topic (`keys.table_key`)
TOPIC = "sg"

#: `deliver_local(receivers, t, payload, nonce)`
DeliverLocal = Callable[[list[Client], str, Any, Any], None]
#: `failed(error)`: a frame for a client elsewhere was not accepted (told once per SEND)
Failed = Callable[[str], None]
#: `displace_local(client, by)`: an authenticated client elsewhere wants this restricted
#: client's id (session.py `identify`): close it
DisplaceLocal = Callable[[Client, str], None]
#: the `t` of a bus frame asking for `displace_local` (no dispatch type starts with NUL)
DISPLACE = "\0displace"
#: `refused(limit)`: a replica entry refused by a bound (the metric's label)
Refused = Callable[[str], None]
#: the longest client or application id a replica may carry (session.py's MAX_ID_LENGTH)
MAX_REPLICA_ID = 256
#: queue names a replica's `queues` keeps (dialect.py's CLIENT_QUEUE_NAMES)
MAX_REPLICA_QUEUES = 1000


def client_key(app_id: str, client_id: str) -> str:
    return f"{app_id}\0{client_id}"


def gateway_name(app_id: str, client_id: str) -> str:
    """The bus name of a client: the application's length first, so any characters work."""
    return f"{keys.KIND_GATEWAY}:{len(app_id)}:{app_id}{client_id}"


def parse_gateway_name(name: str) -> tuple[str, str]:
    """(app, client) of a `gateway_name`; raises ValueError."""
    rest = name.partition(":")[2]
    length, sep, ids = rest.partition(":")
    if not sep or not length.isdigit() or int(length) > len(ids):
        raise ValueError(f"bad gateway client name {name!r}")
    return ids[: int(length)], ids[int(length) :]


def _state(client: Client) -> bytes:
    return json.dumps(
        {
            "app_id": client.app_id,
            "client_id": client.client_id,
            "restricted": client.restricted,
            "encoding": client.encoding,
            "socket_ip": client.socket_ip,
            "metadata": client.metadata,
            "types": client.types,
            "queues": sorted(client.queues),
        },
        separators=(",", ":"),
    ).encode()


class _ClientEndpoint:
    """A local client as the bus reader sees it (`switch.Endpoint`)."""

    __slots__ = ("client", "gateway")

    def __init__(self, gateway: SgCluster, client: Client) -> None:
        self.gateway = gateway
        self.client = client

    @property
    def peer(self) -> Peer:
        peer: Peer = self.client.session.peer
        return peer

    def deliver(self, frame: bytes) -> None:
        t, payload, nonce = self.gateway.decode_frame(frame)
        if t == DISPLACE:
            self.gateway.displace_local(self.client, str(payload))
            return
        self.gateway.deliver_local([self.client], t, payload, nonce)

    def mail_waiting(self) -> None:
        return None


class _BatchingPeer(NoPeer):
    """The peer of `_ManyEndpoint`: never congested (its receivers are written to as a local
    BROADCAST's are, without waiting for any one of them), but its batch defers the writes
    as a connection's does (`Peer.batch` covers every connection), so each receiver is
    written once per run of records."""

    __slots__ = ("gateway",)

    def __init__(self, gateway: SgCluster) -> None:
        self.gateway = gateway

    def batch(self) -> AbstractContextManager[None]:  # type: ignore[override]
        for client in self.gateway.index.clients.values():
            if client.node is None and client.session is not None:
                return cast("AbstractContextManager[None]", client.session.peer.batch())
        return contextlib.nullcontext()


class _ManyEndpoint:
    """Several local clients named in one frame (a BROADCAST's receivers on this instance).
    Resolved on whichever instance reads the record (its own, or one taking over a dead
    one's stream): the listed clients connected there get it, the others are gone."""

    __slots__ = ("_peer", "gateway")

    def __init__(self, gateway: SgCluster) -> None:
        self.gateway = gateway
        self._peer = _BatchingPeer(gateway)

    @property
    def peer(self) -> _BatchingPeer:
        return self._peer

    def deliver(self, frame: bytes) -> None:
        gateway = self.gateway
        body = gateway.frame_body(frame)
        receivers = []
        for app_id, client_id in body.get("to", ()):
            client = gateway.index.get(app_id, client_id)
            if client is not None and client.node is None and client.session is not None:
                receivers.append(client)
        if receivers:
            gateway.deliver_local(receivers, str(body["t"]), body.get("p"), body.get("n"))

    def mail_waiting(self) -> None:
        return None


class SgCluster:
    def __init__(
        self,
        cluster: Cluster,
        index: ClientIndex,
        deliver_local: DeliverLocal,
        displace_local: DisplaceLocal | None = None,
        settings: SgSettings | None = None,
        refused: Refused | None = None,
    ) -> None:
        """`settings`: the bounds replicas are held to (module docstring; the defaults
        without it); `refused(limit)` counts an entry refused by one."""
        from rmb_relay.dialects.singyeong.settings import SgSettings

        self.settings = settings if settings is not None else SgSettings()
        self.refused: Refused = refused or (lambda limit: None)
        #: bytes of every replica held (`replica_size`), and per (node, key)
        self.replica_bytes = 0
        self._replica_sizes: dict[tuple[str, str], int] = {}
        self.cluster = cluster
        self.node = cluster.me
        self.index = index
        self.deliver_local = deliver_local
        self.displace_local: DisplaceLocal = displace_local or (lambda client, by: None)
        self.table = ReplicatedTable(cluster, TOPIC, self._on_change)
        self.ready = self.table.ready
        #: the last frame decoded on the receiving side (a BROADCAST brings one per receiver)
        self._decoded: tuple[bytes, dict[str, Any]] | None = None
        cluster.register_kind(keys.KIND_GATEWAY, self._resolve)
        self._many = _ManyEndpoint(self)
        cluster.register_kind(keys.KIND_GATEWAY_MANY, lambda name: self._many)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.table.start()

    async def close(self) -> None:
        """Leave the table (the others drop our clients at once); the cluster gives up our
        presence claims when it leaves, after the dialects closed."""
        await self.table.close()

    # ---- local changes out -----------------------------------------------------------------

    def joined(self, client: Client) -> None:
        self.table.set(client_key(client.app_id, client.client_id), _state(client))
        self.cluster.claim_name(gateway_name(client.app_id, client.client_id))

    def changed(self, client: Client) -> None:
        self.table.set(client_key(client.app_id, client.client_id), _state(client))

    def left(self, client: Client) -> None:
        self.table.delete(client_key(client.app_id, client.client_id))
        self.cluster.release_name(gateway_name(client.app_id, client.client_id))

    def forward(
        self, receivers: list[Client], t: str, payload: Any, nonce: Any, failed: Failed
    ) -> None:
        """Frames for clients held by other instances: one bus record per instance (per
        receiver when it holds one: its name follows it if it moves). `failed(reason)` is
        called once if any was not accepted."""
        by_node: dict[str, list[Client]] = {}
        for client in receivers:
            assert client.node is not None
            by_node.setdefault(client.node, []).append(client)
        frame = b""
        told = False

        def outcome(result: bool | ClusterUnavailable) -> None:
            nonlocal told
            if result is True or told:
                return
            told = True
            if result is False:  # the stream was gone: nothing was stored
                failed("unreachable: the receiver's instance left; the message was not delivered")
            else:
                # a write whose reply was lost may have landed (a cut link delivers it at the
                # heal): the sender is told it cannot know, never "not delivered"
                failed(
                    "unreachable: the gateway's redis is unavailable; the message may or may not "
                    "have been delivered"
                )

        for node, clients in by_node.items():
            if len(clients) == 1:
                if not frame:  # encoded once for every single-receiver record
                    body = {"t": t, "p": payload, "n": nonce}
                    frame = json.dumps(body, separators=(",", ":")).encode()
                client = clients[0]
                name = gateway_name(client.app_id, client.client_id)
                self.cluster.send_to_nowait(node, name, frame, outcome)
                continue
            to = [[client.app_id, client.client_id] for client in clients]
            many = json.dumps({"t": t, "p": payload, "n": nonce, "to": to}, separators=(",", ":"))
            name = f"{keys.KIND_GATEWAY_MANY}:{node}"
            self.cluster.send_to_nowait(node, name, many.encode(), outcome)

    def displace(self, client: Client, by: str) -> None:
        """Ask the instance holding restricted `client` to close it: an authenticated client
        (from address `by`) wants its id. At most once delivered; the answer is the table
        change when it leaves."""
        assert client.node is not None
        frame = json.dumps({"t": DISPLACE, "p": by, "n": None}, separators=(",", ":")).encode()
        name = gateway_name(client.app_id, client.client_id)
        self.cluster.send_to_nowait(client.node, name, frame, lambda result: None)

    # ---- remote changes and frames in ------------------------------------------------------

    def frame_body(self, frame: bytes) -> dict[str, Any]:
        """The bus frame parsed (the last one is kept: a SEND to several clients of one
        instance hands the same frame to each)."""
        cached = self._decoded
        if cached is not None and cached[0] == frame:
            return cached[1]
        body: dict[str, Any] = json.loads(frame)
        self._decoded = (frame, body)
        return body

    def decode_frame(self, frame: bytes) -> tuple[str, Any, Any]:
        body = self.frame_body(frame)
        return str(body["t"]), body.get("p"), body.get("n")

    def _resolve(self, name: str) -> _ClientEndpoint | None:
        app_id, client_id = parse_gateway_name(name)
        client = self.index.get(app_id, client_id)
        if client is None or client.node is not None or client.session is None:
            return None
        if client.session.closing:
            return None
        return _ClientEndpoint(self, client)

    @property
    def max_entry_bytes(self) -> int:
        """The longest raw replica entry parsed: what a client within this instance's bounds
        can take as JSON (its metadata escaped at worst 6 bytes a byte, queue names, ids)."""
        return 6 * self.settings.metadata_bytes + MAX_REPLICA_QUEUES * 1536 + 65536

    def _drop_replica(self, node: str, key: str, existing: Client | None) -> None:
        if existing is not None and existing.node == node:
            self.index.remove(existing)
        size = self._replica_sizes.pop((node, key), 0)
        self.replica_bytes -= size

    def _refuse(self, node: str, key: str, existing: Client | None, limit: str, why: str) -> None:
        self._drop_replica(node, key, existing)
        self.refused(f"replica_{limit}")
        log.warning("singyeong: a client replica from instance %s not kept: %s", node[:64], why)

    def _on_change(self, node: str, key: str, value: bytes | None) -> None:
        app_id, _, client_id = key.partition("\0")
        existing = self.index.get(app_id, client_id)
        if value is None:
            self._drop_replica(node, key, existing)
            return
        if existing is not None and existing.node != node:
            return  # ours, or another instance's (a duplicate being refused)
        if len(value) > self.max_entry_bytes:
            self._refuse(node, key, existing, "bytes", f"an entry of {len(value)} bytes")
            return
        state = json.loads(value)
        settings = self.settings
        metadata = state.get("metadata")
        types = state.get("types")
        if (
            not isinstance(metadata, dict)
            or not isinstance(types, dict)
            or len(app_id) > MAX_REPLICA_ID
            or len(client_id) > MAX_REPLICA_ID
        ):
            self._refuse(node, key, existing, "bytes", "malformed, or ids over 256 characters")
            return
        keys_held, size = replica_size(metadata)
        if keys_held > settings.metadata_keys:
            self._refuse(node, key, existing, "keys", f"{keys_held} keys (--sg-metadata-keys)")
            return
        if size > settings.metadata_bytes:
            self._refuse(node, key, existing, "bytes", f"{size} bytes (--sg-metadata-bytes)")
            return
        old = self._replica_sizes.get((node, key), 0)
        if self.replica_bytes - old + size > settings.replica_total_bytes:
            self._refuse(
                node,
                key,
                existing,
                "total",
                f"all replicas would hold {self.replica_bytes - old + size} bytes "
                "(--sg-replica-total-bytes)",
            )
            return
        if existing is not None:
            self.index.remove(existing)
        self._replica_sizes[(node, key)] = size
        self.replica_bytes += size - old
        client = Client(
            state["app_id"],
            state["client_id"],
            restricted=state["restricted"],
            encoding=state["encoding"],
            socket_ip=state["socket_ip"],
        )
        client.node = node
        client.types.update(types)
        client.metadata.update(metadata)
        queues = state.get("queues")
        if isinstance(queues, list):
            client.queues.update(q for q in queues[:MAX_REPLICA_QUEUES] if isinstance(q, str))
        self.index.add(client)
