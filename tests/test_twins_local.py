"""The twin value, the relay-field helpers and the embedded SQLite directory, on real files,
including edits made by other processes and connections while a directory reads the file."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

from rmb_relay.errors import ConfigError, TwinLookupError
from rmb_relay.twins import MAX_RELAY_FIELD, Twin, format_relays, parse_relays, validate_domain
from rmb_relay.twins.local import SCHEMA_VERSION, SqliteTwinDirectory, default_twins_path
from tests.conftest import WAIT

PK = bytes([2]) + bytes(range(32))


def account(seed: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest()


def twin(
    twin_id: int, relays: frozenset[str] | None = frozenset({"r1.example"}), pk: bytes | None = None
) -> Twin:
    return Twin(twin_id, account(twin_id), relays, pk)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "twins.sqlite3"


# ---- Twin and the relay field ---------------------------------------------------------------


def test_twin_accepts_chain_shaped_values() -> None:
    found = Twin(0xFFFF_FFFF, account(1), frozenset({"relay.grid.tf", "r-2.example"}), PK)
    assert found.pk == PK


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"id": 0}, "twin id"),
        ({"id": 2**32}, "twin id"),
        ({"account": b"\x01" * 31}, "account key must be 32 bytes"),
        ({"pk": b"\x02" * 32}, "pk must be 33 bytes"),
        ({"pk": b"\x04" + b"\x01" * 32}, "starting 02 or 03"),
        ({"relays": frozenset({"a" * 600, "b" * 600})}, f"at most {MAX_RELAY_FIELD}"),
    ],
)
def test_twin_refuses_values_the_chain_could_not_hold(
    kwargs: dict[str, object], message: str
) -> None:
    fields: dict[str, object] = {"id": 1, "account": account(1), "relays": None, "pk": None}
    fields.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        Twin(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("domain", "reason"),
    [
        ("", "empty"),
        (".lead.example", "starts with '.'"),
        ("trail.example.", "ends with '.'"),
        ("a..b", "'..'"),
        ("sp ace", "only letters"),
        ("bücher.example", "only letters"),
        ("https://r.example", "only letters"),
        ("r.example:443", "only letters"),
        ("a_b", "separates domains"),
    ],
)
def test_relay_domains_follow_chain_rules(domain: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        validate_domain(domain)
    with pytest.raises(ConfigError, match="invalid relay domain"):
        twin(1, frozenset({domain}))


def test_relay_field_parses_as_the_chain_joins_it() -> None:
    assert parse_relays(None) is None
    assert parse_relays("r1.grid.tf_r2.grid.tf") == frozenset({"r1.grid.tf", "r2.grid.tf"})
    assert parse_relays("") == frozenset()  # set, to nothing: not the same as "not set"
    assert parse_relays("_a__b_") == frozenset({"a", "b"})  # empty parts name no relay
    with pytest.raises(ConfigError):
        parse_relays("ok.example_bad..example")


def test_relay_field_formats_sorted_and_round_trips() -> None:
    relays = frozenset({"z.example", "a.example", "m-1.example"})
    assert format_relays(relays) == "a.example_m-1.example_z.example"
    assert parse_relays(format_relays(relays)) == relays
    assert format_relays(None) is None


# ---- the file ------------------------------------------------------------------------------


async def test_add_get_show_list_remove(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        directory.add(twin(8, None))
        directory.add(twin(7, pk=PK))
        directory.add(twin(9, frozenset()))
        assert await directory.get(7) == twin(7, pk=PK)
        assert directory.show(7) == twin(7, pk=PK)
        assert (await directory.get(8)) == twin(8, None)  # "relay info not set" survives
        assert (await directory.get(9)) == twin(9, frozenset())  # and differs from "empty"
        assert await directory.get(10) is None
        assert [t.id for t in directory.list()] == [7, 8, 9]
        assert directory.remove(7)
        assert not directory.remove(7)
        assert await directory.get(7) is None


async def test_add_replaces_the_twin_with_the_same_id(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        directory.add(twin(7))
        replacement = Twin(7, account(70), frozenset({"new.example"}), PK)
        directory.add(replacement)
        assert await directory.get(7) == replacement
        assert len(directory.list()) == 1


def test_add_many_writes_all_in_one_transaction(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        assert directory.add_many(twin(i) for i in range(1, 501)) == 500
        assert len(directory.list()) == 500


async def test_ids_outside_u32_are_absent_not_errors(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        assert await directory.get(0) is None
        assert await directory.get(2**64) is None  # past SQLite's INTEGER: must not overflow
        assert not directory.remove(-1)


async def test_twins_survive_reopening(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        directory.add(twin(7, pk=PK))
    with SqliteTwinDirectory(db_path) as directory:
        assert await directory.get(7) == twin(7, pk=PK)


def test_schema_is_versioned_and_in_wal_mode(db_path: Path) -> None:
    SqliteTwinDirectory(db_path).__exit__(None, None, None)
    with sqlite3.connect(db_path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()


def test_newer_schema_is_refused_with_upgrade_advice(db_path: Path) -> None:
    SqliteTwinDirectory(db_path).__exit__(None, None, None)
    with sqlite3.connect(db_path) as db:
        db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.close()
    with pytest.raises(ConfigError, match="newer than this rmb-relay understands"):
        SqliteTwinDirectory(db_path)


def test_foreign_sqlite_file_is_refused_untouched(db_path: Path) -> None:
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE invoices (id INTEGER)")
    db.close()
    with pytest.raises(ConfigError, match="not an rmb-relay twin directory"):
        SqliteTwinDirectory(db_path)
    with sqlite3.connect(db_path) as db:
        tables = db.execute("SELECT name FROM sqlite_master").fetchall()
        assert tables == [("invoices",)]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    db.close()


def test_corrupt_file_is_a_clear_config_error(db_path: Path) -> None:
    db_path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match=f"cannot open twin directory {db_path}: .*database"):
        SqliteTwinDirectory(db_path)


def test_unopenable_path_is_a_clear_config_error(tmp_path: Path) -> None:
    (tmp_path / "dir.sqlite3").mkdir()
    with pytest.raises(ConfigError, match=f"cannot open twin directory {tmp_path}/dir.sqlite3"):
        SqliteTwinDirectory(tmp_path / "dir.sqlite3")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot open twin directory"):
        SqliteTwinDirectory(tmp_path / "file" / "twins.sqlite3")  # parent is a file


def test_parent_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "twins.sqlite3"
    with SqliteTwinDirectory(path):
        assert path.exists()


def test_default_path_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_twins_path() == tmp_path / "data" / "rmb-relay" / "twins.sqlite3"
    fallback = tmp_path / "home" / ".local" / "share" / "rmb-relay" / "twins.sqlite3"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")  # invalid per the XDG spec: ignored
    assert default_twins_path() == fallback
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_twins_path() == fallback
    assert not fallback.parent.exists()  # naming the default creates nothing


# ---- other writers while a directory is open -----------------------------------------------


async def cli(path: Path, *args: str) -> None:
    """`python -m rmb_relay.twins.cli` as a real second process, awaited without blocking."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rmb_relay.twins.cli",
        args[0],
        "--twins",
        f"sqlite:{path}",
        *args[1:],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), WAIT)
    assert process.returncode == 0, stderr.decode()


async def test_edits_by_another_process_are_seen_by_the_next_get(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        assert await directory.get(42) is None
        await cli(db_path, "add", "--id", "42", "--account", "ab" * 32, "--relay", "r.example")
        found = await directory.get(42)
        assert found == Twin(42, b"\xab" * 32, frozenset({"r.example"}), None)
        await cli(db_path, "add", "--id", "42", "--account", "cd" * 32)
        assert await directory.get(42) == Twin(42, b"\xcd" * 32, None, None)
        await cli(db_path, "rm", "42")
        assert await directory.get(42) is None


async def test_processes_creating_one_new_file_at_once_all_succeed(db_path: Path) -> None:
    await asyncio.gather(
        *(cli(db_path, "add", "--id", str(i), "--account", f"{i:02x}" * 32) for i in range(1, 7))
    )
    with SqliteTwinDirectory(db_path) as directory:
        assert [t.id for t in directory.list()] == list(range(1, 7))


async def test_reads_do_not_wait_for_a_writer_and_see_only_committed_twins(
    db_path: Path,
) -> None:
    with SqliteTwinDirectory(db_path, busy_timeout=0.05) as directory:
        directory.add(twin(1))
        writer = sqlite3.connect(db_path, isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")
            writer.execute("DELETE FROM twins WHERE id = 1")
            writer.execute(
                "INSERT INTO twins (id, account, relays, pk) VALUES (2, ?, NULL, NULL)",
                (account(2),),
            )
            # the write lock is held: a read still answers at once, from the committed state
            assert await directory.get(1) == twin(1)
            assert await directory.get(2) is None
            writer.execute("COMMIT")
        finally:
            writer.close()
        assert await directory.get(1) is None
        assert await directory.get(2) == Twin(2, account(2), None, None)


def test_a_write_waits_for_another_writer_within_the_busy_timeout(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path, busy_timeout=WAIT) as directory:
        other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        try:
            other.execute("BEGIN IMMEDIATE")
            release = threading.Timer(0.3, other.execute, ("COMMIT",))
            release.start()
            directory.add(twin(1))  # SQLITE_BUSY is retried until the other commits
            release.join()
        finally:
            other.close()
        assert directory.show(1) == twin(1)


def test_a_writer_holding_the_lock_too_long_is_a_clear_error(db_path: Path) -> None:
    with SqliteTwinDirectory(db_path, busy_timeout=0.1) as directory:
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(ConfigError, match=f"cannot write twin directory {db_path}.*lock"):
                directory.add(twin(1))
            other.execute("ROLLBACK")
        finally:
            other.close()


async def test_a_row_broken_by_hand_is_a_lookup_error_naming_twin_and_file(
    db_path: Path,
) -> None:
    with SqliteTwinDirectory(db_path) as directory:
        directory.add(twin(1))
        with sqlite3.connect(db_path) as db:
            db.execute("INSERT INTO twins (id, account) VALUES (5, x'0102')")
            db.execute(
                "INSERT INTO twins (id, account, relays) VALUES (6, ?, 'bad..relay')", (account(6),)
            )
        db.close()
        assert await directory.get(1) == twin(1)  # the others still work
        with pytest.raises(TwinLookupError, match=f"{db_path}: twin 5: account key"):
            await directory.get(5)
        with pytest.raises(TwinLookupError, match="twin 6: invalid relay domain"):
            await directory.get(6)
        with pytest.raises(ConfigError, match="twin 5"):
            directory.list()


async def test_lookup_on_a_closed_directory_is_a_lookup_error(db_path: Path) -> None:
    directory = SqliteTwinDirectory(db_path)
    await directory.close()
    with pytest.raises(TwinLookupError, match="closed"):
        await directory.get(1)
    await directory.close()  # closing twice is harmless
