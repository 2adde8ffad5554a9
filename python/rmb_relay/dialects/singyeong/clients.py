"""Connected clients: `Client`, and `ClientIndex`, which keeps them by `(application, client
id)` and mirrors each into the Rust core's index (`SgIndex`, rust/dialects/singyeong/index.rs),
where every query is matched and every SEND/BROADCAST resolved, for Python and for the fast
path alike. Python keeps the metadata it answers with (QUERY_NODES, the HTTP API, replicas
for the other instances); the core keeps its own copy to match against. Why both, and what
each costs: metadata.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rmb_relay._core import SgIndex

if TYPE_CHECKING:
    from rmb_relay.dialects.singyeong.query import Query


class Client:
    """One identified client: identity, metadata (base keys included) and its types."""

    __slots__ = (
        "app_id",
        "client_id",
        "encoding",
        "handle",
        "metadata",
        "node",
        "queues",
        "receive_updates",
        "restricted",
        "session",
        "socket_ip",
        "sort_key",
        "types",
    )

    def __init__(
        self,
        app_id: str,
        client_id: str,
        *,
        restricted: bool,
        encoding: str,
        socket_ip: str,
        session: Any = None,
    ) -> None:
        self.app_id = app_id
        self.client_id = client_id
        self.sort_key = (app_id, client_id)
        self.restricted = restricted
        self.encoding = encoding
        self.socket_ip = socket_ip
        self.receive_updates = False
        #: the connection's handler (None for a client held by another instance)
        self.session = session
        self.metadata: dict[str, Any] = {}
        self.types: dict[str, str] = {}
        self.queues: set[str] = set()
        #: the instance holding it (None: this one); remote clients are replicas (cluster.py)
        self.node: str | None = None
        #: its number in the core's index while it is in a `ClientIndex` (else 0)
        self.handle = 0

    def describe(self) -> dict[str, Any]:
        """The JSON shape of `/api/v1/query` and QUERY_NODES."""
        return {
            "app_id": self.app_id,
            "client_id": self.client_id,
            "metadata": self.metadata,
            "metadata_types": self.types,
            "queues": sorted(self.queues),
            "socket_ip": self.socket_ip,
        }

    def __repr__(self) -> str:
        return f"Client({self.app_id!r}, {self.client_id!r})"


class ClientIndex:
    """See the module docstring. `core`: the dialect's (its rng's seed, its query limits)."""

    def __init__(self, core: SgIndex | None = None) -> None:
        self.core = core if core is not None else SgIndex(0)
        self.clients: dict[tuple[str, str], Client] = {}
        self.by_app: dict[str, set[Client]] = {}
        self._by_handle: dict[int, Client] = {}
        self._next_handle = 0

    def __len__(self) -> int:
        return len(self.clients)

    def get(self, app_id: str, client_id: str) -> Client | None:
        return self.clients.get((app_id, client_id))

    def add(self, client: Client) -> None:
        """Index `client`; a local one's connection (its session's peer) may be written to
        by the fast path when it speaks JSON."""
        self._next_handle += 1
        client.handle = handle = self._next_handle
        self.clients[client.sort_key] = client
        self._by_handle[handle] = client
        self.by_app.setdefault(client.app_id, set()).add(client)
        session = client.session
        conn = None if session is None else session.peer.id
        json = session is not None and session.encoding.text_frames
        self.core.add(
            handle,
            client.app_id,
            client.client_id,
            client.restricted,
            conn,
            json,
            client.metadata,
            client.types,
        )

    def remove(self, client: Client) -> None:
        if self.clients.get(client.sort_key) is not client:
            return
        del self.clients[client.sort_key]
        del self._by_handle[client.handle]
        self.core.remove(client.handle)
        client.handle = 0
        members = self.by_app.get(client.app_id)
        if members is not None:
            members.discard(client)
            if not members:
                del self.by_app[client.app_id]

    def set_values(self, client: Client, values: dict[str, Any], types: dict[str, str]) -> None:
        """Write metadata values (a shallow merge, later wins), the core's copy too."""
        client.metadata.update(values)
        client.types.update(types)
        if client.handle:
            self.core.set_values(client.handle, values, types)

    def _clients(self, handles: list[int]) -> list[Client]:
        by_handle = self._by_handle
        return [by_handle[h] for h in handles]

    def match(self, query: Query) -> list[Client]:
        """Every client the query matches (restricted ones only if it asks for them)."""
        return self._clients(self.core.matching(query))

    def resolve(self, query: Query, *, broadcast: bool) -> list[Client]:
        """The receivers of a SEND (one) or BROADCAST (all), per decisions 5 and 6."""
        return self._clients(self.core.resolve(query, broadcast))

    def matches(self, query: Query, client: Client) -> bool:
        if client.handle and self._by_handle.get(client.handle) is client:
            return self.core.matches(query, client.handle)
        return query.matches(client)

    def candidate_count(self, query: Query) -> int:
        """How many clients the index reads to match `query` (its narrowing)."""
        return self.core.candidate_count(query)
