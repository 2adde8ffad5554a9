"""Metadata types and validation (spec §8, decision 8), and semver for the `version` type.

An UPDATE_METADATA `d` (and identify's `metadata`) is `{key: {"type": T, "value": V}}`. Every
key is checked and every error collected, so a client learns all of them at once:
`"<k>: type '<t>' doesn't exists"` (sic: the public server's text, which clients may match),
`"<k>: value fails validation for '<t>'"`, `"<k>: forbidden metadata key"`, and ours for a
malformed entry, `"<k>: expected {\"type\": T, \"value\": V}"`.

Bounds (issue 33): a refusal names at most `MAX_REPORTED_PROBLEMS` keys (the rest are
counted under the key `"..."`), and every name or type quoted in a message is cut to
`QUOTED` characters, so an update of 887 KiB of bad keys is answered in a few KiB, not
994 KiB. What a client's metadata may hold is bounded by `MetadataAccount`: keys
(`--sg-metadata-keys`) and bytes (`--sg-metadata-bytes`, `value_bytes` of each value plus its
key's length), counting the updates still waiting for the rate limit.

Two copies of a client's metadata (issue 33 asked whether both are needed)
-------------------------------------------------------------------------
Every client's metadata is held twice: as Python values in `Client.metadata` / `types`
(clients.py) and as the core's `Value`s in `SgIndex` (rust/dialects/singyeong/index.rs), which
matches every query. The Python copy is read, not matched against, and only by what the core
cannot answer today, because `SgIndex` has no way to hand a client's values back to Python:
- QUERY_NODES and `POST /api/v1/query` answer with each client's metadata and types
  (`Client.describe`);
- the cluster's replica entry of a local client is its metadata as JSON (cluster.py `_state`);
- `/api/v1/proxy` reads the `ip` a client declared (proxy.py `Proxy.target`).
No policy lives in the Python copy: validation and the bounds are here, matching and routing
in the core. Dropping it needs a core call that returns a client's metadata (values and
types, as `Value` -> Python conversion in rust/dialects/singyeong/py.rs) for those three
readers; not done yet. What it would save, measured (`SgIndex` vs the Python objects, 4,000
clients of ~1 KiB metadata: 8 strings of 100 characters, 4 integers, a list of 5 strings, a
version; 1,173 bytes charged each): the Python copy (the `Client`, its two dicts, values)
3.7 KiB per client by tracemalloc, the core's index 8.9-11.2 KiB per client by RSS (a hash
bucket per distinct top-level value, the sorted index of numbers, the values). So the second
copy is about a quarter of a client's metadata memory, and both together are about 11x
what `value_bytes` charges. So every key is charged `KEY_BYTES` besides its name and value
(`entry_bytes`): 14 keys of that client then count ~10 KiB, near the ~12.6 KiB measured, and
`--sg-metadata-total-bytes` bounds memory, not only text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the keys the gateway sets itself; a client may not write them (spec §8)
FORBIDDEN_KEYS = frozenset(
    (
        "last_heartbeat_time",
        "ip",
        "restricted",
        "encoding",
        "namespace",
        "receive_client_updates",
    )
)

#: a metadata key longer than this is refused (keys are index entries and metric-free, but
#: still memory per client)
MAX_KEY_LENGTH = 256
#: keys named in one refusal; the others are counted (issue 33: bounded error replies)
MAX_REPORTED_PROBLEMS = 16
#: characters of a key or type name quoted in an error message
QUOTED = 64
#: metadata keys one client may hold (its own; the gateway's base keys are not counted)
DEFAULT_METADATA_KEYS = 256
#: bytes of metadata one client may hold (`entry_bytes` of each key, so ~95 keys of small
#: values, fewer than `DEFAULT_METADATA_KEYS`, which binds when the bytes are raised)
DEFAULT_METADATA_BYTES = 64 << 10
#: bytes of metadata all of an instance's clients may hold together (thousands of clients
#: from one address stay within it even at the per-client bound)
DEFAULT_METADATA_TOTAL_BYTES = 128 << 20
#: bytes of metadata the replicas of other instances' clients may hold together (cluster.py):
#: four instances' worth of this instance's own total
DEFAULT_REPLICA_TOTAL_BYTES = 4 * DEFAULT_METADATA_TOTAL_BYTES
#: what `value_bytes` charges per item on top of a string's length: a Python object's
#: header and its slot in the container holding it
ITEM_BYTES = 16
#: what one key costs beyond its name and value, charged with them (`entry_bytes`): the core
#: index's entries for it (its `Value`, the hash bucket or sorted slot of a top-level value)
#: and the Python copy's two dict slots. Measured: ~700 B per key over `value_bytes` (4,000
#: clients of 14 keys, the docstring above), so the byte bounds count memory, not only text
KEY_BYTES = 640

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)

#: semver precedence key: (major, minor, patch, release?, prerelease identifiers)
VersionKey = tuple[int, int, int, int, tuple[tuple[int, int, str], ...]]


def version_key(text: Any) -> VersionKey | None:
    """The semver precedence of `text` (build metadata ignored), or None if it is not semver."""
    if not isinstance(text, str):
        return None
    match = _SEMVER.match(text)
    if match is None:
        return None
    major, minor, patch, pre, _build = match.groups()
    if pre is None:
        return (int(major), int(minor), int(patch), 1, ())
    # numeric identifiers sort before alphanumeric ones, numerically; others lexically
    ids = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split("."))
    return (int(major), int(minor), int(patch), 0, ids)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_VALIDATORS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": _is_int,
    "float": lambda v: isinstance(v, float),
    "version": lambda v: version_key(v) is not None,
    "list": lambda v: isinstance(v, list),
    "boolean": lambda v: isinstance(v, bool),
    "map": lambda v: isinstance(v, dict),
}

TYPES = frozenset(_VALIDATORS)


def entry_bytes(key: str, value: Any) -> int:
    """What one metadata key costs: `KEY_BYTES`, its name and `value_bytes` of its value."""
    return KEY_BYTES + len(key) + value_bytes(value)


def value_bytes(value: Any) -> int:
    """What a decoded value costs the heap, roughly: `ITEM_BYTES` per item (containers and
    their members) plus the length of every string and binary. Walked with a stack, not
    recursion: a decoded value may be as deep as the decoder allows."""
    total = 0
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        item = pop()
        total += ITEM_BYTES
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, dict):
            push(item.keys())
            push(item.values())
        elif isinstance(item, list | tuple):
            push(item)
    return total


#: base keys a client's own bounds do not count (the gateway writes them; `ip` and
#: `namespace` carry the client's strings and count)
UNCOUNTED_KEYS = FORBIDDEN_KEYS - {"ip", "namespace"}


def replica_size(metadata: dict[str, Any]) -> tuple[int, int]:
    """(keys, bytes) of another instance's client's metadata as this instance's bounds count
    a local client's (`MetadataAccount`: keys the client wrote; `value_bytes` plus key
    lengths of those and of `ip` and `namespace`)."""
    keys = size = 0
    for key, value in metadata.items():
        if key in UNCOUNTED_KEYS:
            continue
        if key not in FORBIDDEN_KEYS:
            keys += 1
        size += entry_bytes(key, "" if value is None else value)
    return keys, size


def _quoted(text: Any) -> str:
    shown = text if isinstance(text, str) else repr(text)
    return shown if len(shown) <= QUOTED else shown[:QUOTED] + "..."


@dataclass(frozen=True, slots=True)
class Update:
    """A validated update: key -> value, key -> type name, key -> bytes (`value_bytes` of
    the value plus the key's length)."""

    values: dict[str, Any]
    types: dict[str, str]
    sizes: dict[str, int]


class MetadataError(ValueError):
    """Invalid metadata; `errors` maps each bad key to its message (the first
    `MAX_REPORTED_PROBLEMS`; `"..."` says how many more)."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("invalid metadata")
        self.errors = errors


_LIMIT_FLAGS = {
    "keys": "--sg-metadata-keys",
    "bytes": "--sg-metadata-bytes",
    "total": "--sg-metadata-total-bytes",
}


class MetadataLimit(ValueError):
    """An update that would take a client over its keys or bytes, or all clients over
    their bytes; `limit` is which ("keys", "bytes", "total")."""

    def __init__(self, limit: str, allowed: int, wanted: int) -> None:
        unit = "keys" if limit == "keys" else "bytes"
        whose = "all clients' metadata" if limit == "total" else "the client's metadata"
        super().__init__(
            f"the update was not applied: {whose} would hold {wanted} {unit}, "
            f"{allowed} allowed ({_LIMIT_FLAGS[limit]})"
        )
        self.limit = limit
        self.allowed = allowed

    def info(self) -> dict[str, Any]:
        """op 3's extra_info."""
        return {"limit": self.limit, "allowed": self.allowed, "reason": str(self)}


class MetadataAccount:
    """What one client's metadata holds once its waiting updates are applied: bytes per key
    and their sum. `charge` checks an update against the limits before it is applied or
    merged (a refused update changes nothing)."""

    __slots__ = ("held", "sizes")

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.held = 0

    def charge(
        self,
        update: Update,
        max_keys: int,
        max_bytes: int,
        total: tuple[int, int] | None = None,
    ) -> int:
        """Take `update` into the account; raises MetadataLimit (nothing taken) if it does
        not fit: in `max_keys`, `max_bytes`, or `total` (bytes all clients hold now, their
        bound) when it grows. Returns the change in bytes held."""
        sizes = self.sizes
        new_keys = 0
        delta = 0
        for key, size in update.sizes.items():
            old = sizes.get(key)
            if old is None:
                new_keys += 1
                delta += size
            else:
                delta += size - old
        if len(sizes) + new_keys > max_keys:
            raise MetadataLimit("keys", max_keys, len(sizes) + new_keys)
        if self.held + delta > max_bytes:
            raise MetadataLimit("bytes", max_bytes, self.held + delta)
        if total is not None and delta > 0 and total[0] + delta > total[1]:
            raise MetadataLimit("total", total[1], total[0] + delta)
        sizes.update(update.sizes)
        self.held += delta
        return delta


def validate(data: Any) -> Update:
    """Check a whole update; raises MetadataError with every bad key's message."""
    if not isinstance(data, dict):
        raise MetadataError({"": "metadata must be a map of key -> {type, value}"})
    values: dict[str, Any] = {}
    types: dict[str, str] = {}
    sizes: dict[str, int] = {}
    errors: dict[str, str] = {}
    problems = 0
    for key, entry in data.items():
        problem = _problem(key, entry)
        if problem is not None:
            problems += 1
            if len(errors) < MAX_REPORTED_PROBLEMS:
                errors[_quoted(key)] = problem
            continue
        value = entry["value"]
        values[key] = value
        types[key] = entry["type"]
        sizes[key] = entry_bytes(key, value)
    if problems:
        if problems > len(errors):
            errors["..."] = f"{problems - len(errors)} more problems not listed"
        raise MetadataError(errors)
    return Update(values, types, sizes)


def _problem(key: Any, entry: Any) -> str | None:
    """Why one entry is refused (its key and type quoted short), or None."""
    if not isinstance(key, str):
        return f"{_quoted(key)}: keys must be strings"
    if key in FORBIDDEN_KEYS:
        return f"{key}: forbidden metadata key"
    if len(key) > MAX_KEY_LENGTH or not key:
        return f"{key[:32]}: keys must be 1 to {MAX_KEY_LENGTH} characters"
    if not isinstance(entry, dict) or "type" not in entry or "value" not in entry:
        return f'{key}: expected {{"type": T, "value": V}}'
    kind = entry["type"]
    check = _VALIDATORS.get(kind) if isinstance(kind, str) else None
    if check is None:
        return f"{key}: type '{_quoted(kind)}' doesn't exists"
    if not check(entry["value"]):
        return f"{key}: value fails validation for '{kind}'"
    return None
