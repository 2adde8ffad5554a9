"""The twin directory: who a twin is (account key), where it is served (relay domains) and its
end-to-end key. The relay asks it on login (to verify the JWT against the account key) and
when routing to a twin that is not connected here (to learn its relays).

Backends implement `TwinDirectory`: the embedded SQLite file (`local.py`, the default, so a
relay runs with no chain) and tfchain over JSON-RPC (`substrate.py`). `cache.py` puts a TTL
cache with single-flight lookups in front of either; the relay only ever talks to the cache.

The values follow the chain's types (spec/rmb.md §4.1) so that a twin means the same thing
whichever backend produced it: a u32 id, a 32-byte AccountId, an optional relay field that
is a `_`-joined set of bare domains, and an optional 33-byte compressed secp256k1 key.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass

from rmb_relay.errors import ConfigError

__all__ = [
    "ACCOUNT_LEN",
    "MAX_RELAY_FIELD",
    "MAX_TWIN_ID",
    "PK_LEN",
    "Twin",
    "TwinDirectory",
    "format_relays",
    "parse_relays",
    "validate_domain",
]

#: twin ids are u32 on chain; 0 is never a twin (relay-built error envelopes use it as "no source")
MAX_TWIN_ID = 0xFFFF_FFFF
#: AccountId32: the raw ed25519 or sr25519 public key
ACCOUNT_LEN = 32
#: SEC1 compressed secp256k1 point, 0x02/0x03 || X (what rmb-peer publishes, spec §1.4)
PK_LEN = 33
#: the chain stores the joined relay field as BoundedVec<u8, 1024>; longer would not fit there
MAX_RELAY_FIELD = 1024
#: the only characters tfchain's validate_relay_address accepts
_RELAY_CHARS = re.compile(r"[A-Za-z0-9\-_.]+")


@dataclass(frozen=True, slots=True)
class Twin:
    """One twin, validated on construction so a bad value fails where it enters (a CLI flag,
    a stored row), not later in the relay. Frozen: the cache hands the same object to many
    callers."""

    id: int
    #: the twin's 32-byte account public key (ed25519 or sr25519): JWTs and envelopes verify with it
    account: bytes
    #: bare relay domains; None means "relay info is not set" (as on chain), which the relay
    #: reports to senders, while an empty set is "set, but to nothing"
    relays: frozenset[str] | None
    #: 33-byte compressed secp256k1 key for end-to-end encryption, if published
    pk: bytes | None = None

    def __post_init__(self) -> None:
        if not 0 < self.id <= MAX_TWIN_ID:
            raise ConfigError(f"twin id must be 1..{MAX_TWIN_ID}, got {self.id}")
        if len(self.account) != ACCOUNT_LEN:
            raise ConfigError(f"account key must be {ACCOUNT_LEN} bytes, got {len(self.account)}")
        if self.pk is not None:
            if len(self.pk) != PK_LEN:
                raise ConfigError(
                    f"pk must be {PK_LEN} bytes (compressed secp256k1), got {len(self.pk)}"
                )
            if self.pk[0] not in (2, 3):
                raise ConfigError("pk must be a compressed secp256k1 point (starting 02 or 03)")
        if self.relays is not None:
            for domain in self.relays:
                validate_domain(domain)
            field = len(format_relays(self.relays) or "")
            if field > MAX_RELAY_FIELD:
                raise ConfigError(
                    f"relay domains joined with '_' are {field} bytes; "
                    f"the chain stores at most {MAX_RELAY_FIELD}"
                )


def validate_domain(domain: str) -> str:
    """One relay domain by tfchain's rules (validate_relay_address: characters
    [A-Za-z0-9-_.], no leading '.', no '..', no trailing '.'), and without '_', because '_'
    separates domains in the stored field. Returns the domain; raises ConfigError."""
    problem = None
    if not domain:
        problem = "it is empty"
    elif not _RELAY_CHARS.fullmatch(domain):
        problem = "only letters, digits, '-' and '.' are allowed"
    elif "_" in domain:
        problem = "'_' separates domains in the chain's relay field"
    elif domain.startswith("."):
        problem = "it starts with '.'"
    elif domain.endswith("."):
        problem = "it ends with '.'"
    elif ".." in domain:
        problem = "it contains '..'"
    if problem is not None:
        raise ConfigError(f"invalid relay domain {domain!r}: {problem} (a bare host name)")
    return domain


def parse_relays(text: str | None) -> frozenset[str] | None:
    """The chain's `_`-joined relay field into a set; None (not set) stays None.

    Empty parts (`a__b`, a leading or trailing `_`) are skipped: the chain's rules allow them
    and they name no relay. Every other part must be a valid domain (ConfigError otherwise).
    """
    if text is None:
        return None
    return frozenset(validate_domain(part) for part in text.split("_") if part)


def format_relays(relays: frozenset[str] | None) -> str | None:
    """A relay set as the chain's `_`-joined field (sorted, so the stored text is stable)."""
    return None if relays is None else "_".join(sorted(relays))


class TwinDirectory(abc.ABC):
    """What the relay needs from a directory: one lookup by id, and a way to let go.

    `get` distinguishes "no such twin" (None: the relay answers 401 at login, or an
    `unknown twin destination` error envelope) from "could not find out" (TwinLookupError:
    500 `failed to get twin: ...`), because only the first is the peer's fault. Backends are
    not expected to cache; wrap them in `CachedTwinDirectory`.
    """

    @abc.abstractmethod
    async def get(self, twin_id: int) -> Twin | None:
        """The twin, or None if it does not exist; raises TwinLookupError if the backend fails."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the backend (connections, files). Lookups after close are not supported."""
