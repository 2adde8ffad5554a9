"""Bearer tokens already verified, so a token is checked once rather than on every request.

Why: a JWT's full check (PyJWT's decode and an HMAC, or an RSA signature and possibly a JWKS
fetch for OIDC tokens) costs tens of microseconds and may await, so the express path
(express.py), which cannot await, declined every request of a tenant requiring a token. A
token's verdict cannot change while it is valid: the same text carries the same signed claims.
So a good token's tenant is kept here, keyed by the token text, and the express path and the
task path (client.py, through `TokenAuthority.verify`) both look here first: one mechanism.

An entry lasts until the earliest of the token's own end as tokens.py judges it (`exp` +
LEEWAY: a cached token is accepted exactly as long as a fresh check would accept it) and the
bound the verifier gives (for OIDC tokens one JWKS lifespan from the check, so a key the
provider withdrew stops vouching for a token after the relay would have fetched the key set
again). Refused tokens are never kept: each presentation takes the full check and gets its
401 with the reason.

Limits: at most `size` tokens, the least recently used dropped first, so a client presenting
ever new tokens costs O(size) memory. Time: `now` (unix seconds) is passed in.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SIZE", "VerifiedTokens"]

#: tokens kept: far more than the tenants' live tokens at any moment (one per connector or
#: client, renewed every `--tunnel-token-ttl`), and ~200 bytes each
SIZE = 4096


class VerifiedTokens:
    """token text -> (tenant claim, last unix second it is still good)."""

    __slots__ = ("entries", "size")

    def __init__(self, size: int = SIZE) -> None:
        if size <= 0:
            raise ValueError("the verified-token cache needs room for at least one token")
        self.size = size
        self.entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, token: str, now: int) -> str | None:
        """The tenant a still-good verified token is for, or None (unknown or past its end)."""
        entry = self.entries.get(token)
        if entry is None:
            return None
        if now > entry[1]:
            del self.entries[token]
            return None
        self.entries.move_to_end(token)
        return entry[0]

    def put(self, token: str, tenant: str, until: float) -> None:
        """Remember a token that passed the full check, good up to `until` (unix seconds)."""
        entries = self.entries
        entries[token] = (tenant, until)
        entries.move_to_end(token)
        if len(entries) > self.size:
            entries.popitem(last=False)
