"""Tunnel tenants and the token signing key, in the embedded SQLite file of the twin directory.

Why the same file: a relay runs from one data file with no database server (decision 3 of
spec/tunnel.md); the twin directory already owns its schema versioning and WAL setup, so the
tenant tables are migration 2 of `twins/local.py` and this module opens the file through it
before using its own connection. `rmb-relay tenants ...` (another process) and the management
API write here while relays read; WAL keeps readers from waiting.

Names are case-insensitive as in RelayServer: rows are keyed by the upper-cased name and keep
the spelling they were created with. Secrets are stored as scrypt hashes (`hash_secret`), never
in the clear: a stolen file does not hand out connector access.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import sqlite3
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.errors import ConfigError
from rmb_relay.twins.local import BUSY_TIMEOUT, SqliteTwinDirectory

__all__ = [
    "ACK_MODES",
    "NAME_PATTERN",
    "Tenant",
    "TenantStore",
    "hash_secret",
    "normalize",
    "verify_secret",
]

#: a tenant name is one URL path segment: letters, digits and `-_.`, at most 100 characters
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
#: AcknowledgeMode numbers as RelayServer sends them (spec §11)
ACK_MODES = {"disabled": 0, "connectorreceived": 1, "connectorfinished": 2, "manual": 3}
#: scrypt cost: about 20 ms per check, paid per token request, not per relayed request
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1
_COLUMNS = (
    "name, display_name, description, secret_hash, require_authentication, max_concurrent, "
    "ack_mode, created, forward_authorization"
)


def normalize(name: str) -> str:
    """The lookup key of a tenant name (RelayServer's NormalizeName: upper case)."""
    return name.upper()


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"tenant name {name!r} must be 1-100 characters of letters, digits and -_. "
            "(it is a URL path segment)"
        )
    return name


def hash_secret(secret: str) -> str:
    """`scrypt$N$r$p$salt$hash` (base64): a fresh salt per secret."""
    if not secret:
        raise ConfigError("a tenant secret must not be empty")
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P)
    b64 = base64.b64encode
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${b64(salt).decode()}${b64(digest).decode()}"


def verify_secret(secret: str, stored: str | None) -> bool:
    """Whether `secret` matches a `hash_secret` value (False for no or a malformed hash)."""
    if not stored:
        return False
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        actual = hashlib.scrypt(
            secret.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p)
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(expected, actual)


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant (RelayServer's Tenant row, spec §12), with its secret's hash."""

    name: str
    display_name: str = ""
    description: str = ""
    secret_hash: str | None = None
    #: clients must send a bearer token of this tenant (else 401)
    require_authentication: bool = False
    #: requests of this tenant in flight at once on one relay (0: the relay's default)
    max_concurrent: int = 0
    #: AcknowledgeMode (0-3) for its requests; None: the relay's default
    ack_mode: int | None = None
    #: unix seconds
    created: int = 0
    #: with `require_authentication`, the client's `Authorization` (the relay's token) still
    #: reaches the target; otherwise it is dropped there (a tenant without required auth
    #: passes its clients' Authorization on: it is theirs, for the target)
    forward_authorization: bool = False

    @property
    def normalized(self) -> str:
        return normalize(self.name)

    def as_json(self) -> dict[str, object]:
        """The management API's Tenant DTO (camelCase, as RelayServer's), without the secret."""
        return {
            "name": self.name,
            "displayName": self.display_name,
            "description": self.description,
            "requireAuthentication": self.require_authentication,
            "maximumConcurrentConnectorRequests": self.max_concurrent,
            "acknowledgeMode": self.ack_mode,
            "forwardAuthorization": self.forward_authorization,
            "hasSecret": self.secret_hash is not None,
        }


class TenantStore:
    """Tenants in the twin directory's SQLite file. Methods are synchronous (primary-key reads
    in WAL mode take microseconds) and raise ConfigError."""

    def __init__(
        self, path: str | Path, *, clock: Clock = wall_clock, busy_timeout: float = BUSY_TIMEOUT
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        # the twin directory owns the schema: opening it applies any pending migration
        SqliteTwinDirectory(path, busy_timeout=busy_timeout).__exit__(None, None, None)
        try:
            self._db: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=busy_timeout, isolation_level=None
            )
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        except sqlite3.Error as err:
            raise ConfigError(f"cannot open tenant store {self.path}: {err}") from None

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise ConfigError(f"tenant store {self.path} is closed")
        return self._db

    def _run(self, sql: str, params: tuple[object, ...] = ()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, params)
        except sqlite3.IntegrityError as err:
            raise ConfigError(f"tenant store {self.path}: {err}") from None
        except sqlite3.Error as err:
            raise ConfigError(f"cannot use tenant store {self.path}: {err}") from None

    def add(self, tenant: Tenant) -> Tenant:
        """Create a tenant; ConfigError if one with the same (case-insensitive) name exists."""
        check_name(tenant.name)
        _check_fields(tenant)
        tenant = replace(tenant, created=tenant.created or seconds(self.clock()))
        if self.get(tenant.name) is not None:
            raise ConfigError(f"tenant {tenant.name!r} exists already")
        self._run(
            f"INSERT INTO tunnel_tenants (normalized, {_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (tenant.normalized, *_row(tenant)),
        )
        return tenant

    def update(self, tenant: Tenant) -> bool:
        """Replace the tenant's fields (its name's spelling included); False if absent."""
        check_name(tenant.name)
        _check_fields(tenant)
        cursor = self._run(
            "UPDATE tunnel_tenants SET name=?, display_name=?, description=?, secret_hash=?, "
            "require_authentication=?, max_concurrent=?, ack_mode=?, forward_authorization=? "
            "WHERE normalized=?",
            (*_row(tenant)[:7], int(tenant.forward_authorization), tenant.normalized),
        )
        return cursor.rowcount > 0

    def remove(self, name: str) -> bool:
        cursor = self._run("DELETE FROM tunnel_tenants WHERE normalized=?", (normalize(name),))
        return cursor.rowcount > 0

    def get(self, name: str) -> Tenant | None:
        row = self._run(
            f"SELECT {_COLUMNS} FROM tunnel_tenants WHERE normalized=?", (normalize(name),)
        ).fetchone()
        return None if row is None else self._tenant(row)

    def list(self, skip: int = 0, take: int = -1) -> list[Tenant]:
        rows = self._run(
            f"SELECT {_COLUMNS} FROM tunnel_tenants ORDER BY normalized LIMIT ? OFFSET ?",
            (take, skip),
        ).fetchall()
        return [self._tenant(row) for row in rows]

    def count(self) -> int:
        return int(self._run("SELECT count(*) FROM tunnel_tenants").fetchone()[0])

    def signing_key(self) -> bytes:
        """The HS256 key of embedded tokens: made on first use and kept in the file, so every
        relay on this file (and restarts) accept each other's tokens."""
        row = self._run("SELECT key FROM tunnel_keys WHERE id = 1").fetchone()
        if row is None:
            self._run("INSERT OR IGNORE INTO tunnel_keys VALUES (1, ?)", (secrets.token_bytes(32),))
            row = self._run("SELECT key FROM tunnel_keys WHERE id = 1").fetchone()
        key = row[0]
        if not isinstance(key, bytes) or len(key) < 32:
            raise ConfigError(f"tenant store {self.path}: the token signing key is malformed")
        return key

    def _tenant(self, row: tuple[object, ...]) -> Tenant:
        name, display, description, secret_hash, require, max_concurrent, ack, created, forward = (
            row
        )
        if not (
            isinstance(name, str)
            and isinstance(display, str)
            and isinstance(description, str)
            and isinstance(secret_hash, str | None)
            and isinstance(require, int)
            and isinstance(max_concurrent, int)
            and isinstance(ack, int | None)
            and isinstance(created, int)
            and isinstance(forward, int)
        ):
            raise ConfigError(f"tenant store {self.path}: tenant {name!r} has a malformed row")
        return Tenant(
            name,
            display,
            description,
            secret_hash,
            bool(require),
            max_concurrent,
            ack,
            created,
            bool(forward),
        )

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> TenantStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _check_fields(tenant: Tenant) -> None:
    if tenant.max_concurrent < 0:
        raise ConfigError("maximumConcurrentConnectorRequests must not be negative")
    if tenant.ack_mode is not None and tenant.ack_mode not in ACK_MODES.values():
        raise ConfigError("acknowledgeMode must be 0-3 (disabled, connectorreceived, ...)")


def _row(tenant: Tenant) -> tuple[object, ...]:
    return (
        tenant.name,
        tenant.display_name,
        tenant.description,
        tenant.secret_hash,
        int(tenant.require_authentication),
        tenant.max_concurrent,
        tenant.ack_mode,
        tenant.created,
        int(tenant.forward_authorization),
    )
