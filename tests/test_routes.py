"""The Rust route table: displacement semantics that the relay's session rules rely on."""

from __future__ import annotations

import pytest

from rmb_relay._core import RouteTable


def test_newer_session_displaces_older() -> None:
    table = RouteTable()
    assert table.register_session(7, "a", 1) is None
    assert table.register_session(7, "a", 2) == 1
    assert table.lookup_session(7, "a") == 2


def test_absent_sid_differs_from_empty_sid() -> None:
    table = RouteTable()
    table.register_session(7, None, 1)
    assert table.lookup_session(7, "") is None
    table.register_session(7, "", 2)
    assert table.lookup_session(7, None) == 1
    assert table.session_count == 2


def test_late_unregister_of_replaced_connection_keeps_successor() -> None:
    table = RouteTable()
    table.register_session(7, None, 1)
    table.register_session(7, None, 2)
    assert not table.unregister_session(7, None, 1)
    assert table.lookup_session(7, None) == 2


def test_pubkey_routes() -> None:
    table = RouteTable()
    key = bytes(range(32))
    assert table.register_pubkey(key, 5) is None
    assert table.lookup_pubkey(key) == 5
    assert table.register_pubkey(key, 6) == 5
    assert table.unregister_pubkey(key, 6)
    assert table.pubkey_count == 0
    with pytest.raises(ValueError, match="32 bytes"):
        table.lookup_pubkey(b"short")
