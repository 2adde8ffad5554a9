"""The embedded twin directory: one SQLite file, managed with `rmb-relay twins ...`.

Why SQLite: a relay must run with no chain and no Redis, and an operator must be able to add a
twin while the relay runs. The CLI is another process writing the same file, so:

- the database runs in WAL mode: readers (the relay) never wait for a writer (the CLI), and a
  writer waits for another writer for at most `busy_timeout` (SQLITE_BUSY is retried by
  SQLite's busy handler instead of failing at once);
- every `get` is its own read transaction (autocommit), so it sees everything committed
  before it; nothing is cached here (the cache in front does that, with a TTL);
- the schema has a version table and a list of migrations, so a later release can change it
  without breaking files users already have, and an older release refuses a newer file
  instead of misreading it.

`get` runs the query on the event loop thread: a primary-key read in WAL mode takes
microseconds and does not wait for writers, which is cheaper than a hop to a worker thread,
and the cache keeps it off the per-message path anyway.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from rmb_relay.errors import ConfigError, TwinLookupError
from rmb_relay.twins import MAX_TWIN_ID, Twin, TwinDirectory, format_relays, parse_relays

log = logging.getLogger("rmb_relay.twins")

__all__ = ["BUSY_TIMEOUT", "SCHEMA_VERSION", "SqliteTwinDirectory", "default_twins_path"]

#: how long (seconds) a writer waits for another process's write lock before giving up
BUSY_TIMEOUT = 5.0

#: migrations[n] is the statements that take a file from schema version n to n + 1; append,
#: never edit. Version 1: `relays` is the chain's '_'-joined field (NULL = not set), `pk` the
#: 33-byte e2e key or NULL.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    ("CREATE TABLE twins ( id INTEGER PRIMARY KEY, account BLOB NOT NULL, relays TEXT, pk BLOB)",),
    # version 2: the HTTP tunnel's tenants and its token signing key (dialects/tunnel/tenants.py)
    (
        "CREATE TABLE tunnel_tenants ( name TEXT NOT NULL, normalized TEXT PRIMARY KEY,"
        " display_name TEXT NOT NULL DEFAULT '', description TEXT NOT NULL DEFAULT '',"
        " secret_hash TEXT, require_authentication INTEGER NOT NULL DEFAULT 0,"
        " max_concurrent INTEGER NOT NULL DEFAULT 0, ack_mode INTEGER,"
        " created INTEGER NOT NULL)",
        "CREATE TABLE tunnel_keys ( id INTEGER PRIMARY KEY, key BLOB NOT NULL)",
    ),
    # version 3: whether a tenant's clients' Authorization reaches its targets
    ("ALTER TABLE tunnel_tenants ADD COLUMN forward_authorization INTEGER NOT NULL DEFAULT 0",),
)
SCHEMA_VERSION = len(_MIGRATIONS)
_OUR_TABLES = frozenset({"twins", "schema_version", "tunnel_tenants", "tunnel_keys"})
_COLUMNS = "id, account, relays, pk"


def default_twins_path() -> Path:
    """`$XDG_DATA_HOME/rmb-relay/twins.sqlite3`, else `~/.local/share/rmb-relay/twins.sqlite3`.

    A relative XDG_DATA_HOME is ignored, as the XDG base directory spec requires (it would
    otherwise depend on the directory the relay was started from). Nothing is created here;
    `SqliteTwinDirectory` creates the parent directories when it opens the file.
    """
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "rmb-relay" / "twins.sqlite3"


def create_private(path: Path) -> None:
    """Make the file only its owner can read: the tunnel keeps tenant secret hashes and its
    token-signing key in it. A new directory is made 0700 and a new file 0600 (SQLite gives
    its -wal and -shm files the database file's mode); an existing file of ours that others
    may read is narrowed to 0600, with a warning."""
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, exist_ok=True)
        parent.chmod(0o700)  # (mkdir's mode is filtered by the umask; the owner's intent wins)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return
    except FileExistsError:
        pass
    info = path.stat()
    if info.st_mode & 0o077 and info.st_uid == os.getuid():
        log.warning(
            "%s was readable by other users (mode %o): narrowed to 0600",
            path,
            info.st_mode & 0o777,
        )
        path.chmod(0o600)


class SqliteTwinDirectory(TwinDirectory):
    """Twins in one SQLite file. Management methods (`add`, `remove`, `list`, `show`) are
    synchronous and raise ConfigError; `get` is the relay's async lookup and raises
    TwinLookupError. Usable as a context manager that closes the file."""

    def __init__(self, path: str | Path, *, busy_timeout: float = BUSY_TIMEOUT) -> None:
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        try:
            if str(path) != ":memory:":
                create_private(self.path)
            # isolation_level=None: autocommit, so each statement is its own transaction and a
            # read never holds a snapshot (or a lock) past the statement that needed it
            self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            self._migrate(self._db)  # first: a file that is not ours is refused untouched
            self._db.execute("PRAGMA journal_mode = WAL")
        except (sqlite3.Error, OSError) as err:
            self._close_quietly()
            raise ConfigError(f"cannot open twin directory {self.path}: {err}") from None
        except ConfigError:
            self._close_quietly()
            raise

    def _migrate(self, db: sqlite3.Connection) -> None:
        # IMMEDIATE takes the write lock before reading the version, so two processes opening
        # a new file at once apply each migration exactly once
        db.execute("BEGIN IMMEDIATE")
        try:
            tables = {
                row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            if "schema_version" not in tables and tables - _OUR_TABLES:
                raise ConfigError(
                    f"{self.path} is an SQLite database but not an rmb-relay twin directory "
                    f"(it has tables {', '.join(sorted(tables))})"
                )
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT max(version) FROM schema_version").fetchone()
            version = row[0] or 0
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"twin directory {self.path} has schema version {version}, newer than this "
                    f"rmb-relay understands ({SCHEMA_VERSION}): upgrade rmb-relay"
                )
            for migration in _MIGRATIONS[version:]:
                for statement in migration:
                    db.execute(statement)
            if version < SCHEMA_VERSION:
                db.execute("DELETE FROM schema_version")
                db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise ConfigError(f"twin directory {self.path} is closed")
        return self._db

    def _close_quietly(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ---- management (the CLI, test fixtures, the load harness) -----------------------------

    def add(self, twin: Twin) -> None:
        """Insert the twin, or replace the one with its id."""
        self.add_many((twin,))

    def add_many(self, twins: Iterable[Twin]) -> int:
        """Insert or replace several twins in one transaction (one fsync, not one per twin)."""
        rows = [(t.id, t.account, format_relays(t.relays), t.pk) for t in twins]
        db = self._conn
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(f"INSERT OR REPLACE INTO twins ({_COLUMNS}) VALUES (?,?,?,?)", rows)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as err:
            raise ConfigError(f"cannot write twin directory {self.path}: {err}") from None
        return len(rows)

    def remove(self, twin_id: int) -> bool:
        """Delete a twin; False if there was none with this id."""
        if not 0 < twin_id <= MAX_TWIN_ID:
            return False
        try:
            cursor = self._conn.execute("DELETE FROM twins WHERE id = ?", (twin_id,))
        except sqlite3.Error as err:
            raise ConfigError(f"cannot write twin directory {self.path}: {err}") from None
        return cursor.rowcount > 0

    def list(self) -> list[Twin]:
        """Every twin, by id."""
        try:
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM twins ORDER BY id").fetchall()
        except sqlite3.Error as err:
            raise ConfigError(f"cannot read twin directory {self.path}: {err}") from None
        return [self._twin(row) for row in rows]

    def show(self, twin_id: int) -> Twin | None:
        """One twin by id (None if absent). Raises ConfigError on an unreadable file or row."""
        if not 0 < twin_id <= MAX_TWIN_ID:
            return None  # cannot exist, and SQLite would overflow on ids past 2**63
        try:
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM twins WHERE id = ?", (twin_id,)
            ).fetchone()
        except sqlite3.Error as err:
            raise ConfigError(f"cannot read twin directory {self.path}: {err}") from None
        return None if row is None else self._twin(row)

    def find_account(self, account: bytes) -> Twin | None:
        """The twin whose account key this is (tfchain's TwinIdByAccountID), or None: rmb-peer
        finds its twin id this way. Raises ConfigError on an unreadable file or row."""
        try:
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM twins WHERE account = ? ORDER BY id LIMIT 1", (account,)
            ).fetchone()
        except sqlite3.Error as err:
            raise ConfigError(f"cannot read twin directory {self.path}: {err}") from None
        return None if row is None else self._twin(row)

    def _twin(self, row: tuple[object, ...]) -> Twin:
        """A stored row back into a Twin, re-validated: the file may have been edited by hand."""
        twin_id, account, relays, pk = row
        if (
            not isinstance(twin_id, int)
            or not isinstance(account, bytes)
            or not isinstance(relays, str | None)
            or not isinstance(pk, bytes | None)
        ):
            raise ConfigError(f"twin directory {self.path}: twin {twin_id!r} has a malformed row")
        try:
            return Twin(twin_id, account, parse_relays(relays), pk)
        except ConfigError as err:
            raise ConfigError(f"twin directory {self.path}: twin {twin_id}: {err}") from None

    # ---- the relay's view ------------------------------------------------------------------

    async def get(self, twin_id: int) -> Twin | None:
        """A point lookup by primary key, as one fresh read transaction."""
        try:
            return self.show(twin_id)
        except ConfigError as err:
            raise TwinLookupError(str(err)) from None

    async def close(self) -> None:
        self._close_quietly()

    def __enter__(self) -> SqliteTwinDirectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._close_quietly()


def parse_twins_url(text: str) -> Path:
    """`sqlite:PATH` -> PATH (`~` expanded). Other schemes are a ConfigError: the chain is a
    different option (`--substrate URL`, twins/substrate.py), not a `--twins` URL."""
    scheme, sep, rest = text.partition(":")
    if not sep or scheme != "sqlite" or not rest:
        raise ConfigError(
            f"--twins {text!r}: expected sqlite:PATH "
            "(to read twins from tfchain use --substrate URL)"
        )
    return Path(rest).expanduser()
