"""Metadata types and validation (spec §8, decision 8), and semver for the `version` type.

An UPDATE_METADATA `d` (and identify's `metadata`) is `{key: {"type": T, "value": V}}`. Every
key is checked and every error collected, so a client learns all of them at once:
`"<k>: type '<t>' doesn't exists"` (sic: the public server's text, which clients may match),
`"<k>: value fails validation for '<t>'"`, `"<k>: forbidden metadata key"`, and ours for a
malformed entry, `"<k>: expected {\"type\": T, \"value\": V}"`.
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


@dataclass(frozen=True, slots=True)
class Update:
    """A validated update: key -> value and key -> type name."""

    values: dict[str, Any]
    types: dict[str, str]


class MetadataError(ValueError):
    """Invalid metadata; `errors` maps each bad key to its message."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("invalid metadata")
        self.errors = errors


def validate(data: Any) -> Update:
    """Check a whole update; raises MetadataError with every bad key's message."""
    if not isinstance(data, dict):
        raise MetadataError({"": "metadata must be a map of key -> {type, value}"})
    values: dict[str, Any] = {}
    types: dict[str, str] = {}
    errors: dict[str, str] = {}
    for key, entry in data.items():
        if key in FORBIDDEN_KEYS:
            errors[key] = f"{key}: forbidden metadata key"
            continue
        if len(key) > MAX_KEY_LENGTH or not key:
            errors[key] = f"{key[:32]}: keys must be 1 to {MAX_KEY_LENGTH} characters"
            continue
        if not isinstance(entry, dict) or "type" not in entry or "value" not in entry:
            errors[key] = f'{key}: expected {{"type": T, "value": V}}'
            continue
        kind = entry["type"]
        check = _VALIDATORS.get(kind) if isinstance(kind, str) else None
        if check is None:
            errors[key] = f"{key}: type '{kind}' doesn't exists"
            continue
        value = entry["value"]
        if not check(value):
            errors[key] = f"{key}: value fails validation for '{kind}'"
            continue
        values[key] = value
        types[key] = kind
    if errors:
        raise MetadataError(errors)
    return Update(values, types)
