"""The dialects `rmb-relay serve` knows, in one list.

Adding a dialect is one new module (or package) exposing a `DialectEntry` plus one line here.
Tests and plugins may `register` more at run time; path conflicts between dialects are refused
when the listener starts (`dialects/paths.py`).
"""

from __future__ import annotations

from rmb_relay.dialects import rmb, sbd, singyeong, tunnel
from rmb_relay.dialects.base import DialectEntry

_ENTRIES: list[DialectEntry] = [
    rmb.ENTRY,
    sbd.ENTRY,
    singyeong.ENTRY,
    tunnel.ENTRY,
]


def entries() -> list[DialectEntry]:
    """Every registered dialect, in registration order (the banner's order)."""
    return list(_ENTRIES)


def register(entry: DialectEntry) -> None:
    """Add a dialect (tests, plugins). A second entry with the same name is refused."""
    if any(existing.name == entry.name for existing in _ENTRIES):
        raise ValueError(f"a dialect named {entry.name!r} is already registered")
    _ENTRIES.append(entry)


def unregister(name: str) -> None:
    """Remove a dialect registered with `register` (tests clean up after themselves)."""
    _ENTRIES[:] = [entry for entry in _ENTRIES if entry.name != name]
