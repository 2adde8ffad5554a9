"""The embedded twin directory: one SQLite file, managed with `rmb-relay twins ...`.

The file may be edited by the CLI while a relay reads it (another process), so the database
runs in WAL mode with a busy timeout, and every `get` is a fresh read (the cache in front keeps
that cheap). The schema has a version table so later releases can migrate it.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from rmb_relay.errors import ConfigError, TwinLookupError
from rmb_relay.twins import Twin, TwinDirectory, format_relays, parse_relays

SCHEMA_VERSION = 1
#: how long a reader or writer waits for the other process's lock
BUSY_TIMEOUT_MS = 5000


def default_twins_path() -> Path:
    """`$XDG_DATA_HOME/rmb-relay/twins.sqlite3`, else `~/.local/share/rmb-relay/...`."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "rmb-relay" / "twins.sqlite3"


class SqliteTwinDirectory(TwinDirectory):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None
            )
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._migrate()
        except (sqlite3.DatabaseError, OSError) as err:
            raise ConfigError(f"cannot open twin directory {self.path}: {err}") from None

    def _migrate(self) -> None:
        db = self._db
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row else 0
        if version > SCHEMA_VERSION:
            raise ConfigError(
                f"twin directory {self.path} has schema {version}, newer than this rmb-relay "
                f"understands ({SCHEMA_VERSION}): upgrade rmb-relay"
            )
        if version < 1:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "CREATE TABLE IF NOT EXISTS twins ("
                " id INTEGER PRIMARY KEY,"
                " account BLOB NOT NULL,"
                " relays TEXT,"
                " pk BLOB)"
            )
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            db.execute("COMMIT")

    # ---- management (the CLI) --------------------------------------------------------------

    def add(self, twin: Twin) -> None:
        """Insert or replace."""
        self._db.execute(
            "INSERT OR REPLACE INTO twins (id, account, relays, pk) VALUES (?, ?, ?, ?)",
            (twin.id, twin.account, format_relays(twin.relays), twin.pk),
        )

    def remove(self, twin_id: int) -> bool:
        return self._db.execute("DELETE FROM twins WHERE id = ?", (twin_id,)).rowcount > 0

    def list(self) -> list[Twin]:
        rows = self._db.execute("SELECT id, account, relays, pk FROM twins ORDER BY id")
        return [self._twin(row) for row in rows]

    def show(self, twin_id: int) -> Twin | None:
        row = self._db.execute(
            "SELECT id, account, relays, pk FROM twins WHERE id = ?", (twin_id,)
        ).fetchone()
        return None if row is None else self._twin(row)

    @staticmethod
    def _twin(row: tuple[int, bytes, str | None, bytes | None]) -> Twin:
        twin_id, account, relays, pk = row
        return Twin(
            twin_id, bytes(account), parse_relays(relays), None if pk is None else bytes(pk)
        )

    # ---- the relay's view ------------------------------------------------------------------

    async def get(self, twin_id: int) -> Twin | None:
        """A point lookup by primary key (microseconds; the cache keeps it off the hot path)."""
        try:
            return self.show(twin_id)
        except (sqlite3.DatabaseError, ConfigError) as err:
            raise TwinLookupError(f"twin directory {self.path}: {err}") from err

    async def close(self) -> None:
        self._db.close()
