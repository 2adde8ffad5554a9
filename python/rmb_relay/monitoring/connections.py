"""`/monitor/connections`: every open connection, one row each, sorted, filtered and paged.

A row: `id`, `dialect` (`http` for a connection not upgraded), `identity` (identity.py) and
`who` (its text), `remote` (host:port), `age` and `idle` (seconds since it opened and since it
last read or wrote), `msgs_in`, `bytes_in`, `msgs_out`, `bytes_out`, `pending` (bytes waiting
to be written: the transport's buffer and the outbox), `congested` (its transport is over the
write high-water mark), `paused` (its reading is paused: a receiver it sent to is congested,
or its dialect holds it).

Query: `sort` (any numeric or text field of a row; `-` before it or `order=desc` for
descending; numbers sort descending by default, text ascending), `dialect` (comma-separated),
`who` (a substring of the identity text, case-insensitive), `congested=1`, `paused=1`,
`limit` (rows per page, default 100, at most `MAX_PAGE`; `all`: as many as a page may hold)
and either `offset` or `cursor` (the `next` of the previous page: the page after its last row
in the same order, stable while connections come and go). Only the sort key is computed for
every connection; whole rows only for the page.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rmb_relay.clock import NS
from rmb_relay.monitoring.identity import identity_of, who

if TYPE_CHECKING:
    from rmb_relay.server.http_connection import HttpConnection
    from rmb_relay.server.ws_connection import WebSocketConnection

    Conn = HttpConnection | WebSocketConnection

#: rows per page unless `limit` says otherwise
DEFAULT_LIMIT = 100
#: rows one answer holds at most (`limit=all` included): what one request may cost the relay
#: (~4 ms of its loop and ~350 KB of JSON per 1,000 rows, docs/monitoring.md), whoever asks
MAX_PAGE = 10_000

SortValue = int | float | str


def _remote(conn: Conn) -> str:
    host = conn.peer_host
    return f"[{host}]:{conn.peer_port}" if ":" in host else f"{host}:{conn.peer_port}"


def _keys(now: int) -> dict[str, Callable[[Conn], SortValue]]:
    """The sort key of each sortable field (computed for every connection: keep them cheap)."""
    return {
        "id": lambda c: c.conn_id,
        "dialect": lambda c: c.dialect_name,
        "who": lambda c: who(identity_of(c)),
        "remote": _remote,
        "age": lambda c: (now - c.opened_at) / NS,
        "idle": lambda c: (now - c.last_active) / NS,
        "msgs_in": lambda c: c.traffic()[0],
        "bytes_in": lambda c: c.traffic()[1],
        "msgs_out": lambda c: c.traffic()[2],
        "bytes_out": lambda c: c.traffic()[3],
        "pending": lambda c: c.write_waiting(),
        "congested": lambda c: int(c.congested),
        "paused": lambda c: int(c.reading_paused),
    }


SORT_FIELDS = tuple(_keys(0))
TEXT_FIELDS = frozenset(("dialect", "who", "remote"))


def row(conn: Conn, now: int) -> dict[str, Any]:
    """One connection's row (module docstring)."""
    msgs_in, bytes_in, msgs_out, bytes_out = conn.traffic()
    identity = identity_of(conn)
    return {
        "id": conn.conn_id,
        "dialect": conn.dialect_name,
        "identity": identity,
        "who": who(identity),
        "remote": _remote(conn),
        "age": round((now - conn.opened_at) / NS, 3),
        "idle": round((now - conn.last_active) / NS, 3),
        "msgs_in": msgs_in,
        "bytes_in": bytes_in,
        "msgs_out": msgs_out,
        "bytes_out": bytes_out,
        "pending": conn.write_waiting(),
        "congested": conn.congested,
        "paused": conn.reading_paused,
    }


class QueryError(ValueError):
    """A listing query the relay cannot answer: the client's mistake (400)."""


@dataclass(frozen=True, slots=True)
class Query:
    sort: str = "id"
    descending: bool = False
    dialects: frozenset[str] | None = None
    who: str | None = None
    congested: bool = False
    paused: bool = False
    limit: int = DEFAULT_LIMIT
    offset: int = 0
    #: (sort value, id) of the row the previous page ended with
    after: tuple[SortValue, int] | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Query:
        """From the query string's parameters; QueryError names what is wrong."""
        sort = params.get("sort", "id")
        descending = sort.startswith("-")
        sort = sort.lstrip("-")
        if sort not in SORT_FIELDS:
            raise QueryError(f"sort: {sort!r} is none of {', '.join(SORT_FIELDS)}")
        order = params.get("order")
        if order is not None:
            if order not in ("asc", "desc"):
                raise QueryError("order: asc or desc")
            descending = order == "desc"
        elif not descending and sort not in TEXT_FIELDS and sort != "id":
            descending = True  # the biggest first: what an operator looks for
        dialects = params.get("dialect")
        raw_limit = params.get("limit", str(DEFAULT_LIMIT))
        if raw_limit == "all":
            limit = MAX_PAGE
        else:
            limit = _non_negative("limit", raw_limit)
            if not 0 < limit <= MAX_PAGE:
                raise QueryError(f"limit: 1 to {MAX_PAGE} rows a page, or all (that many)")
        after = None
        cursor = params.get("cursor")
        if cursor:
            after = _decode_cursor(cursor)
        return cls(
            sort=sort,
            descending=descending,
            dialects=frozenset(d for d in dialects.split(",") if d) if dialects else None,
            who=params.get("who", "").lower() or None,
            congested=_flag(params.get("congested")),
            paused=_flag(params.get("paused")),
            limit=limit,
            offset=_non_negative("offset", params.get("offset", "0")),
            after=after,
        )


def _non_negative(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise QueryError(f"{name}: a whole number, got {text!r}") from None
    if value < 0:
        raise QueryError(f"{name}: must not be negative")
    return value


def _flag(text: str | None) -> bool:
    return text is not None and text not in ("", "0", "false", "no")


def _encode_cursor(value: SortValue, conn_id: int) -> str:
    return base64.urlsafe_b64encode(json.dumps([value, conn_id]).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[SortValue, int]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value, conn_id = json.loads(raw)
    except (ValueError, TypeError):
        raise QueryError("cursor: not a cursor this relay gave") from None
    if not isinstance(conn_id, int) or not isinstance(value, int | float | str):
        raise QueryError("cursor: not a cursor this relay gave")
    return value, conn_id


def listing(conns: Iterable[Conn], query: Query, now: int) -> dict[str, Any]:
    """The page `query` asks for: {total (matching), offset, limit, sort, order, next
    (cursor of the next page, or null), connections (rows)}."""
    selected = list(conns)
    if query.dialects is not None:
        selected = [c for c in selected if c.dialect_name in query.dialects]
    if query.congested:
        selected = [c for c in selected if c.congested]
    if query.paused:
        selected = [c for c in selected if c.reading_paused]
    if query.who is not None:
        needle = query.who
        selected = [c for c in selected if needle in who(identity_of(c)).lower()]
    key = _keys(now)[query.sort]
    keyed = [(key(c), c.conn_id, c) for c in selected]
    # one order for all pages: the field, then the id (ascending, whatever the field's order)
    if query.descending:
        keyed.sort(key=lambda k: k[1])
        keyed.sort(key=lambda k: k[0], reverse=True)
    else:
        keyed.sort(key=lambda k: (k[0], k[1]))
    total = len(keyed)
    start = query.offset
    if query.after is not None:
        start = _after(keyed, query.after, query.descending)
    end = min(total, start + query.limit)
    page = keyed[start:end]
    last = page[-1] if page else None
    return {
        "total": total,
        "offset": start,
        "limit": query.limit,
        "sort": query.sort,
        "order": "desc" if query.descending else "asc",
        "next": _encode_cursor(last[0], last[1]) if last is not None and end < total else None,
        "connections": [row(c, now) for _, _, c in page],
    }


def _after(
    keyed: list[tuple[SortValue, int, Conn]], after: tuple[SortValue, int], desc: bool
) -> int:
    """The index of the first row that comes after `after` in the listing's order."""
    value: Any = after[0]
    conn_id = after[1]
    lo, hi = 0, len(keyed)
    while lo < hi:  # binary search on (value, id) in the listing's order
        mid = (lo + hi) // 2
        v: Any = keyed[mid][0]
        i = keyed[mid][1]
        try:
            at_or_before = (
                (v > value or (v == value and i <= conn_id))
                if desc
                else (v < value or (v == value and i <= conn_id))
            )
        except TypeError:
            raise QueryError("cursor: from a listing sorted by another field") from None
        if at_or_before:
            lo = mid + 1
        else:
            hi = mid
    return lo
