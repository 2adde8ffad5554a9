"""Connected clients and the indices a query starts from (issue #12, point 4).

`ClientIndex` keeps every identified client of this instance three ways:

- by `(application, client id)`, for duplicate checks and the HTTP API;
- by application, so `"application": "api"` never looks at other applications' clients;
- by top-level metadata key and scalar value (`key -> value -> clients`), so a top-level
  `$eq` (or `$in`) condition starts from the clients holding that value;
- by top-level key in numeric order (`SortedNumbers`), so a range (`$gt $gte $lt $lte` on
  one key, intersected) starts from the slice of clients inside it.

`match(query)` takes the smallest of the candidate sets the query's hints and application
name, then runs the compiled predicate (`query.py`) on those only. A query with neither scans
every client: the price of a question that names nothing indexable.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rmb_relay.dialects.singyeong.metadata import version_key

if TYPE_CHECKING:
    from rmb_relay.dialects.singyeong.query import Query


class Client:
    """One identified client: identity, metadata (base keys included) and its types."""

    __slots__ = (
        "app_id",
        "client_id",
        "encoding",
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


IndexKey = tuple[str, Any]


def index_key(value: Any, kind: str | None) -> IndexKey | None:
    """The bucket of a stored scalar: booleans, numbers (1 and 1.0 share one), strings, and
    versions by semver precedence; None for values that are not indexed (lists, maps, NaN)."""
    if kind == "version":
        parsed = version_key(value)
        return ("v", parsed) if parsed is not None else None
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return None if isinstance(value, float) and math.isnan(value) else ("n", value)
    if isinstance(value, str):
        return ("s", value)
    return None


def lookup_keys(value: Any) -> list[IndexKey]:
    """The buckets an incoming `$eq` value may find its equals in (a string may be a version)."""
    key = index_key(value, None)
    if key is None:
        return []
    keys = [key]
    if isinstance(value, str):
        parsed = version_key(value)
        if parsed is not None:
            keys.append(("v", parsed))
    return keys


class SortedNumbers:
    """The clients holding a number under one key, in value order, so a range condition
    (`$gt`, `$lte`, ...) reads a slice instead of scanning. Insert and remove are O(n) list
    moves (memmove, fast for tens of thousands); lookups are two bisections."""

    __slots__ = ("clients", "values")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.clients: list[Client] = []

    def add(self, value: float, client: Client) -> None:
        at = bisect.bisect_right(self.values, value)
        self.values.insert(at, value)
        self.clients.insert(at, client)

    def remove(self, value: float, client: Client) -> None:
        at = bisect.bisect_left(self.values, value)
        end = bisect.bisect_right(self.values, value)
        for i in range(at, end):
            if self.clients[i] is client:
                del self.values[i]
                del self.clients[i]
                return

    def between(self, low: float, low_in: bool, high: float, high_in: bool) -> list[Client]:
        values = self.values
        start = (bisect.bisect_left if low_in else bisect.bisect_right)(values, low)
        stop = (bisect.bisect_right if high_in else bisect.bisect_left)(values, high)
        return self.clients[start:stop] if start < stop else []


def _numeric(value: Any, kind: str | None) -> bool:
    return (
        kind != "version"
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value == value
    )


class ClientIndex:
    """See the module docstring."""

    def __init__(self) -> None:
        self.clients: dict[tuple[str, str], Client] = {}
        self.by_app: dict[str, set[Client]] = {}
        self.by_value: dict[str, dict[IndexKey, set[Client]]] = {}
        self.by_number: dict[str, SortedNumbers] = {}

    def __len__(self) -> int:
        return len(self.clients)

    def get(self, app_id: str, client_id: str) -> Client | None:
        return self.clients.get((app_id, client_id))

    def add(self, client: Client) -> None:
        self.clients[client.sort_key] = client
        self.by_app.setdefault(client.app_id, set()).add(client)
        for key, value in client.metadata.items():
            self._index(client, key, value)

    def remove(self, client: Client) -> None:
        if self.clients.get(client.sort_key) is not client:
            return
        del self.clients[client.sort_key]
        members = self.by_app.get(client.app_id)
        if members is not None:
            members.discard(client)
            if not members:
                del self.by_app[client.app_id]
        for key, value in client.metadata.items():
            self._unindex(client, key, value)

    def set_values(self, client: Client, values: dict[str, Any], types: dict[str, str]) -> None:
        """Write metadata values (a shallow merge, later wins), keeping the indices in step."""
        indexed = self.clients.get(client.sort_key) is client
        metadata = client.metadata
        for key, value in values.items():
            if indexed and key in metadata:
                self._unindex(client, key, metadata[key])
            metadata[key] = value
            kind = types.get(key)
            if kind is not None:
                client.types[key] = kind
            if indexed:
                self._index(client, key, value)

    def _index(self, client: Client, key: str, value: Any) -> None:
        kind = client.types.get(key)
        if _numeric(value, kind):
            numbers = self.by_number.get(key)
            if numbers is None:
                numbers = self.by_number[key] = SortedNumbers()
            numbers.add(value, client)
        bucket = index_key(value, kind)
        if bucket is not None:
            self.by_value.setdefault(key, {}).setdefault(bucket, set()).add(client)

    def _unindex(self, client: Client, key: str, value: Any) -> None:
        kind = client.types.get(key)
        if _numeric(value, kind):
            numbers = self.by_number.get(key)
            if numbers is not None:
                numbers.remove(value, client)
                if not numbers.values:
                    del self.by_number[key]
        bucket = index_key(value, kind)
        if bucket is None:
            return
        values = self.by_value.get(key)
        if values is None:
            return
        members = values.get(bucket)
        if members is None:
            return
        members.discard(client)
        if not members:
            del values[bucket]
            if not values:
                del self.by_value[key]

    def candidates(self, query: Query) -> Iterable[Client]:
        """The smallest set the query's application and index hints allow."""
        return self._candidates(query)[0]

    def _candidates(self, query: Query) -> tuple[Iterable[Client], bool]:
        """`candidates`, and whether they are a hint's buckets (for `Query.exact`)."""
        best: Iterable[Client] | None = None
        hinted = False
        size = len(self.clients)
        if query.application is not None:
            members = self.by_app.get(query.application)
            if members is None:
                return (), False
            best, size = members, len(members)
        for key, values in query.hints:
            buckets = self.by_value.get(key)
            if buckets is None:
                return (), False
            found: set[Client] = set()
            for value in values:
                for bucket in lookup_keys(value):
                    members = buckets.get(bucket)
                    if members:
                        found = found | members if found else members
            if not found:
                return (), False
            if len(found) < size:
                best, size, hinted = found, len(found), True
        for key, low, low_in, high, high_in in query.ranges:
            numbers = self.by_number.get(key)
            if numbers is None:
                return (), False
            inside = numbers.between(low, low_in, high, high_in)
            if not inside:
                return (), False
            if len(inside) < size:
                best, size, hinted = inside, len(inside), False
        return (self.clients.values(), False) if best is None else (best, hinted)

    def match(self, query: Query) -> list[Client]:
        """Every local client the query matches (restricted ones only if it asks for them)."""
        application = query.application
        restricted = query.restricted
        predicate = query.predicate
        candidates, hinted = self._candidates(query)
        if hinted and query.exact:
            predicate = None
        out = []
        for client in candidates:
            if application is not None and client.app_id != application:
                continue
            if client.restricted and not restricted:
                continue
            if predicate is None or predicate(client.metadata, client.types):
                out.append(client)
        return out
