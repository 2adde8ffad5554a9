"""The twin directory: who a twin is (account key), where it is served (relay domains) and its
end-to-end key. The relay asks it on login and when routing to a twin that is not connected.

Backends implement `TwinDirectory`: the embedded SQLite file (`local.py`, the default, so a
relay runs with no chain) and, later, tfchain over JSON-RPC. `cache.py` puts a TTL cache with
single-flight lookups in front of either.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass

from rmb_relay.errors import ConfigError

#: tfchain's validate_relay_address: [A-Za-z0-9-_.], no leading/trailing '.', no '..'
_DOMAIN = re.compile(r"^(?!\.)(?!.*\.\.)[A-Za-z0-9\-_.]+(?<!\.)$")
ACCOUNT_LEN = 32
PK_LEN = 33


@dataclass(frozen=True, slots=True)
class Twin:
    id: int
    #: the twin's 32-byte account public key (ed25519 or sr25519): JWTs and envelopes verify with it
    account: bytes
    #: bare relay domains; None means "relay info is not set" (as on chain)
    relays: frozenset[str] | None
    #: 33-byte compressed secp256k1 key for end-to-end encryption, if published
    pk: bytes | None = None

    def __post_init__(self) -> None:
        if not 0 < self.id <= 0xFFFFFFFF:
            raise ConfigError(f"twin id must be 1..4294967295, got {self.id}")
        if len(self.account) != ACCOUNT_LEN:
            raise ConfigError(f"account key must be {ACCOUNT_LEN} bytes, got {len(self.account)}")
        if self.pk is not None and len(self.pk) != PK_LEN:
            raise ConfigError(
                f"pk must be {PK_LEN} bytes (compressed secp256k1), got {len(self.pk)}"
            )
        for domain in self.relays or ():
            validate_domain(domain)


def validate_domain(domain: str) -> str:
    if not _DOMAIN.match(domain) or "_" in domain:
        raise ConfigError(
            f"invalid relay domain {domain!r}: a bare host name (letters, digits, '-', '.')"
        )
    return domain


def parse_relays(text: str | None) -> frozenset[str] | None:
    """The chain's `_`-joined relay field into a set (None stays None)."""
    if text is None:
        return None
    return frozenset(validate_domain(d) for d in text.split("_") if d)


def format_relays(relays: frozenset[str] | None) -> str | None:
    return None if relays is None else "_".join(sorted(relays))


class TwinDirectory(abc.ABC):
    @abc.abstractmethod
    async def get(self, twin_id: int) -> Twin | None:
        """The twin, or None if it does not exist; raises TwinLookupError if the backend fails."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the backend."""
