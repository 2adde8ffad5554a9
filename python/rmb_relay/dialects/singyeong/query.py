"""Queries (spec §7, decisions 3-6): parsing both forms into a predicate, and the selectors.

A query object has `application`, `restricted`, `key`, `droppable`, `optional`, `ops` and
`selector`. `ops` is a list (implicit AND) of conditions in either form (decision 3):

```text
seed form    {"region": {"$eq": "eu"}}     {"load": {"$and": [{"$gt": 1}, {"$lt": 5}]}}
             {"$or": [{"a": {"$eq": 1}}, {"b": {"$eq": 2}}]}       (a key starting with "/"
             is a path: {"/a/b/0": {"$eq": 1}})
path form    {"path": "/a/b/0", "op": "$eq", "to": {"value": V}}
             {"path": "/a", "op": "$gt", "to": {"path": "/b", "default": 0}}
             {"op": "$and" | "$or" | "$nor", "with": [...]}
```

Semantics (decision 4, the documented ones without the public server's bugs)
----------------------------------------------------------------------------
- A path walks maps by key and lists by index; a segment indexes only where the value is a
  list, so keys may contain digits. Version semantics apply to a top-level key of type
  `version`.
- A client missing the path matches `$ne` and `$nin` and nothing else (MongoDB).
- `$eq`/`$ne` compare values of one kind (booleans, numbers with 1 == 1.0, strings, lists,
  maps); values of different kinds are unequal. `$gt $gte $lt $lte` order numbers, strings
  and (type `version`) semver; across kinds they are false, never an error.
- `$in`/`$nin`: the client's value is (not) one of the given list. `$contains`/`$ncontains`:
  the given value is (not) an element of the client's list, or a key of its map; on other
  kinds both are false.
- Anything malformed raises `QueryError` with the reason (op 3 `invalid` for the sender).

Each condition compiles to a closure `(metadata, types) -> bool`; the top-level `$eq`/`$in`
conditions on one key also become index hints (`Query.hints`) so `index.py` can start from the
clients holding that value instead of scanning every client.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rmb_relay.dialects.singyeong.metadata import version_key

if TYPE_CHECKING:
    from rmb_relay.dialects.singyeong.clients import Client

Metadata = dict[str, Any]
Types = dict[str, str]
Predicate = Callable[[Metadata, Types], bool]

#: deeper nesting of logical operators is refused (no recursion exhaustion)
MAX_DEPTH = 32
#: more conditions than this in one query are refused
MAX_CONDITIONS = 1024

COMPARISONS = frozenset(
    ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$contains", "$ncontains")
)
LOGICAL = frozenset(("$and", "$or", "$nor"))
SELECTORS = frozenset(("$min", "$max", "$avg"))

_MISSING: Any = object()


class QueryError(ValueError):
    """A query the gateway cannot run; the message says why (sent back as op 3)."""


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int | float):
        return "n"
    if isinstance(value, str):
        return "s"
    if isinstance(value, list):
        return "l"
    if isinstance(value, dict):
        return "m"
    return "z"


def _equal(a: Any, b: Any, version: bool) -> bool:
    if version:
        ka, kb = version_key(a), version_key(b)
        if ka is not None and kb is not None:
            return ka == kb
    return _kind(a) == _kind(b) and bool(a == b)


def _order(a: Any, b: Any, version: bool) -> int | None:
    """-1/0/1 comparing a to b, or None when they are not ordered against each other."""
    if version:
        ka, kb = version_key(a), version_key(b)
        if ka is None or kb is None:
            return None
        return (ka > kb) - (ka < kb)
    kind = _kind(a)
    if kind != _kind(b) or kind not in ("n", "s"):
        return None
    if kind == "n" and (math.isnan(a) or math.isnan(b)):
        return None
    return int(a > b) - int(a < b)


def parse_path(path: Any) -> tuple[str, ...]:
    if not isinstance(path, str) or not path.startswith("/") or len(path) < 2:
        raise QueryError(f"path must be a non-empty string starting with '/', got {path!r}")
    return tuple(path[1:].split("/"))


def _resolve(metadata: Metadata, segments: tuple[str, ...]) -> Any:
    value: Any = metadata
    for segment in segments:
        if isinstance(value, dict):
            value = value.get(segment, _MISSING)
            if value is _MISSING:
                return _MISSING
        elif isinstance(value, list):
            if not segment.isdigit():
                return _MISSING
            index = int(segment)
            if index >= len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


def _comparison(
    op: str, segments: tuple[str, ...], operand: Callable[[Metadata], Any]
) -> Predicate:
    """The closure for one comparison of the value at `segments` with `operand(metadata)`."""
    top = segments[0]
    single = len(segments) == 1

    def value_of(metadata: Metadata) -> Any:
        if single:
            return metadata.get(top, _MISSING)
        return _resolve(metadata, segments)

    def is_version(types: Types) -> bool:
        return single and types.get(top) == "version"

    if op == "$eq":
        return lambda m, t: (
            (v := value_of(m)) is not _MISSING and _equal(v, operand(m), is_version(t))
        )
    if op == "$ne":
        return lambda m, t: (
            (v := value_of(m)) is _MISSING or not _equal(v, operand(m), is_version(t))
        )
    if op in ("$gt", "$gte", "$lt", "$lte"):
        wanted = {"$gt": (1,), "$gte": (0, 1), "$lt": (-1,), "$lte": (-1, 0)}[op]

        def ordered(m: Metadata, t: Types) -> bool:
            v = value_of(m)
            return v is not _MISSING and _order(v, operand(m), is_version(t)) in wanted

        return ordered
    if op in ("$in", "$nin"):
        negate = op == "$nin"

        def member(m: Metadata, t: Types) -> bool:
            v = value_of(m)
            if v is _MISSING:
                return negate
            options = operand(m)
            if not isinstance(options, list):
                return False
            version = is_version(t)
            return any(_equal(v, option, version) for option in options) is not negate

        return member
    negate = op == "$ncontains"

    def contains(m: Metadata, t: Types) -> bool:
        v = value_of(m)
        if isinstance(v, list):
            wanted_value = operand(m)
            return any(_equal(item, wanted_value, False) for item in v) is not negate
        if isinstance(v, dict):
            key = operand(m)
            return (isinstance(key, str) and key in v) is not negate
        return False

    return contains


def _logical(op: str, parts: list[Predicate]) -> Predicate:
    if op == "$and":
        return lambda m, t: all(p(m, t) for p in parts)
    if op == "$or":
        return lambda m, t: any(p(m, t) for p in parts)
    return lambda m, t: not any(p(m, t) for p in parts)


Hint = tuple[str, list[Any]]
#: a numeric interval on a top-level key: (key, low, low inclusive, high, high inclusive)
Range = tuple[str, float, bool, float, bool]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


@dataclass
class _Compiler:
    count: int = 0
    hints: list[Hint] = field(default_factory=list)
    #: how many of `hints` come from `$eq` (see `Query.exact`)
    eq_hints: int = 0
    #: key -> [low, low inclusive, high, high inclusive], narrowed by every bound seen
    ranges: dict[str, list[Any]] = field(default_factory=dict)

    def bound(self, key: str, op: str, value: float) -> None:
        low, low_in, high, high_in = self.ranges.setdefault(key, [-math.inf, True, math.inf, True])
        if op in ("$gt", "$gte"):
            inclusive = op == "$gte"
            if value > low or (value == low and not inclusive):
                low, low_in = value, inclusive
        else:
            inclusive = op == "$lte"
            if value < high or (value == high and not inclusive):
                high, high_in = value, inclusive
        self.ranges[key] = [low, low_in, high, high_in]

    def bump(self, depth: int) -> None:
        self.count += 1
        if self.count > MAX_CONDITIONS:
            raise QueryError(f"more than {MAX_CONDITIONS} conditions")
        if depth > MAX_DEPTH:
            raise QueryError(f"logical operators nested deeper than {MAX_DEPTH}")

    def condition(self, entry: Any, depth: int, top: bool) -> Predicate:
        """One element of `ops` (or of a `with` list), in either form."""
        if not isinstance(entry, dict) or not entry:
            raise QueryError(f"a condition must be a non-empty object, got {_short(entry)}")
        op = entry.get("op")
        if isinstance(op, str) and op.startswith("$"):
            return self.path_form(entry, op, depth, top)
        parts = []
        for key, spec in entry.items():
            if key in LOGICAL:
                parts.append(self.logical(key, spec, depth, top=False))
            elif key.startswith("$"):
                raise QueryError(f"unknown operator {key!r}")
            else:
                segments = parse_path(key) if key.startswith("/") else (key,)
                parts.append(self.seed_key(segments, spec, depth, top and len(entry) == 1))
        return parts[0] if len(parts) == 1 else _logical("$and", parts)

    def logical(self, op: str, items: Any, depth: int, *, top: bool) -> Predicate:
        self.bump(depth)
        if not isinstance(items, list) or not items:
            raise QueryError(f"{op} takes a non-empty list of conditions")
        return _logical(
            op, [self.condition(item, depth + 1, top and op == "$and") for item in items]
        )

    def seed_key(self, segments: tuple[str, ...], spec: Any, depth: int, top: bool) -> Predicate:
        """`{"key": {"$op": value, ...}}`: operators (or logical lists of them) on one key."""
        if not isinstance(spec, dict) or not spec:
            raise QueryError(f'{"/".join(segments)}: expected {{"$op": value}}, got {_short(spec)}')
        parts = []
        for op, value in spec.items():
            if op in LOGICAL:
                self.bump(depth)
                if not isinstance(value, list) or not value:
                    raise QueryError(f"{op} takes a non-empty list of conditions")
                parts.append(
                    _logical(
                        op, [self.seed_key(segments, item, depth + 1, False) for item in value]
                    )
                )
            else:
                parts.append(self.compare(op, segments, value, depth, top))
        return parts[0] if len(parts) == 1 else _logical("$and", parts)

    def compare(
        self, op: Any, segments: tuple[str, ...], value: Any, depth: int, top: bool
    ) -> Predicate:
        self.bump(depth)
        if op not in COMPARISONS:
            raise QueryError(f"unknown operator {op!r}")
        if op in ("$in", "$nin") and not isinstance(value, list):
            raise QueryError(f"{op} takes a list, got {_short(value)}")
        if top and len(segments) == 1:
            if op == "$eq" and _indexable(value):
                self.hints.append((segments[0], [value]))
                self.eq_hints += 1
            elif op == "$in" and value and all(_indexable(v) for v in value):
                self.hints.append((segments[0], list(value)))
            elif op in ("$gt", "$gte", "$lt", "$lte") and _number(value):
                self.bound(segments[0], op, value)
        return _comparison(op, segments, lambda _m: value)

    def path_form(self, entry: dict[str, Any], op: str, depth: int, top: bool) -> Predicate:
        if op in LOGICAL:
            return self.logical(op, entry.get("with"), depth, top=top)
        segments = parse_path(entry.get("path"))
        to = entry.get("to")
        if not isinstance(to, dict):
            raise QueryError(f'{op} needs "to": {{"value": V}} or {{"path": P, "default": D}}')
        if "value" in to:
            return self.compare(op, segments, to["value"], depth, top)
        if "path" in to:
            self.bump(depth)
            if op not in COMPARISONS:
                raise QueryError(f"unknown operator {op!r}")
            other = parse_path(to["path"])
            default = to.get("default")

            def operand(metadata: Metadata) -> Any:
                found = _resolve(metadata, other)
                return default if found is _MISSING else found

            return _comparison(op, segments, operand)
        raise QueryError(f'{op} needs "to": {{"value": V}} or {{"path": P, "default": D}}')


def _indexable(value: Any) -> bool:
    return isinstance(value, str | int | float) and not (
        isinstance(value, float) and math.isnan(value)
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flag(value: Any) -> bool:
    """`true` and `"true"` are true, everything else false (spec §7)."""
    return value is True or value == "true"


@dataclass(frozen=True, slots=True)
class Query:
    """A parsed query; `raw` is the object as sent (echoed in `no_route`)."""

    raw: Any
    application: str | None = None
    restricted: bool = False
    key: str | None = None
    droppable: bool = False
    optional: bool = False
    predicate: Predicate | None = None
    #: top-level equality conditions: (key, acceptable values), for the index
    hints: tuple[Hint, ...] = ()
    #: ("$min" | "$max" | "$avg", top-level metadata key)
    selector: tuple[str, str] | None = None
    #: top-level numeric intervals the matches must fall in, for the range index
    ranges: tuple[Range, ...] = ()
    #: the predicate is one top-level `$eq` on an indexable value and nothing else: the hash
    #: index's buckets for it hold exactly the clients it matches (`index_key` buckets by the
    #: same kinds `_equal` compares), so `ClientIndex.match` skips it on those members; a
    #: BROADCAST to a group of 1,000 ran it 1,000 times (~8% of the gateway's time)
    exact: bool = False

    def fallback(self) -> Query:
        """`optional`: the same query without ops and selector (decision 5)."""
        return Query(self.raw, self.application, self.restricted, self.key, self.droppable)

    def matches(self, client: Client) -> bool:
        if self.application is not None and client.app_id != self.application:
            return False
        if client.restricted and not self.restricted:
            return False
        return self.predicate is None or self.predicate(client.metadata, client.types)


def parse(raw: Any) -> Query:
    """Parse a query object; raises QueryError with the reason."""
    if not isinstance(raw, dict):
        raise QueryError(f"a query must be an object, got {_short(raw)}")
    application = raw.get("application")
    if application is not None and not isinstance(application, str):
        raise QueryError("application must be a string (application ids, not tags)")
    key = raw.get("key")
    if key is not None and not isinstance(key, str):
        key = str(key)
    ops = raw.get("ops")
    if ops is not None and not isinstance(ops, list):
        raise QueryError("ops must be a list of conditions")
    compiler = _Compiler()
    predicate = None
    if ops:
        parts = [compiler.condition(entry, 1, True) for entry in ops]
        predicate = parts[0] if len(parts) == 1 else _logical("$and", parts)
    return Query(
        raw,
        application,
        _flag(raw.get("restricted")),
        key,
        _flag(raw.get("droppable")),
        _flag(raw.get("optional")),
        predicate,
        tuple(compiler.hints),
        _selector(raw.get("selector")),
        tuple((key, *bounds) for key, bounds in compiler.ranges.items()),
        compiler.count == 1 and compiler.eq_hints == 1 and not compiler.ranges,
    )


def _selector(raw: Any) -> tuple[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) != 1:
        raise QueryError('selector must be one of {"$min"|"$max"|"$avg": "<metadata key>"}')
    ((kind, key),) = raw.items()
    if kind not in SELECTORS:
        raise QueryError(f"unknown selector {kind!r}: use $min, $max or $avg")
    if not isinstance(key, str) or not key:
        raise QueryError(f"{kind} takes a metadata key")
    return kind, key


def select(kind: str, key: str, candidates: Sequence[tuple[Any, Client]]) -> Client | None:
    """Decision 6 over (value, client) pairs gathered from every instance: the client with the
    smallest/largest numeric value, or the one nearest the mean; ties go to the lowest
    (application, client id) so every instance picks the same one. None when no client has a
    number there."""
    numbers = [(value, client) for value, client in candidates if _number(value)]
    if not numbers:
        return None
    mean = sum(value for value, _ in numbers) / len(numbers) if kind == "$avg" else 0.0
    sign = -1 if kind == "$max" else 1

    def rank(pair: tuple[Any, Client]) -> tuple[Any, tuple[str, str]]:
        value, client = pair
        return (abs(value - mean) if kind == "$avg" else sign * value), client.sort_key

    return min(numbers, key=rank)[1]


def rendezvous_weight(key: str, client: Client) -> int:
    """Highest-random-weight hashing: the same on every instance and across restarts, so a
    key's target stays put while the match set is unchanged and only the clients of a
    leaving node move (their keys spread over the others)."""
    digest = hashlib.blake2b(
        f"{key}\0{client.app_id}\0{client.client_id}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, clients: Sequence[Client]) -> Client:
    return max(clients, key=lambda client: rendezvous_weight(key, client))
