"""Connector tokens (decision 3 of spec/tunnel.md): short-lived JWTs, embedded or from an OIDC
provider.

Embedded: `POST /tunnel/token` trades a tenant's client credentials for an HS256 JWT signed with
the key kept in the tenant store (so every relay on that file accepts it). With
`--oidc-issuer/--oidc-audience` the relay also accepts any token of that provider: its JWKS is
found through the discovery document and cached by PyJWT's `PyJWKClient` (maintained code for
key rotation and `kid` lookup, rather than ours). Either way a token names its tenant in
`client_id` and must carry the scope `connector`, as RelayServer's.

Time: expiry is checked here against the clock passed in (PyJWT's own time checks are off), so
tests move time instead of waiting for it.

A token that passed is remembered until its end in the tunnel's hub (its one cache of
verdicts, which its fast path reads too: `TokenCache`), so a client or connector presenting
the same token again is not checked again. An entry lasts until the token's own end as judged
here (`exp` + LEEWAY), and for OIDC tokens at most one JWKS lifespan from the check. Refused
tokens are never kept: each presentation takes the full check and gets its 401 with the reason.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import urllib.request
from typing import TYPE_CHECKING, Any, Protocol

from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.errors import AuthError, ConfigError

if TYPE_CHECKING:
    # PyJWT (and the cryptography x509 modules it loads) is imported by the methods that sign
    # or check a token, not with the tunnel: ~11 MB of RSS a relay that never sees a tunnel
    # token does not pay (bench/README.md "Idle connections")
    import jwt
    import jwt.types

__all__ = ["EMBEDDED_ISSUER", "OidcVerifier", "TokenAuthority"]

#: `iss` of the tokens this relay signs
EMBEDDED_ISSUER = "rmb-relay"
#: `aud` of embedded tokens (RelayServer's audience)
EMBEDDED_AUDIENCE = "relayserver"
#: the scope a connector token must hold
CONNECTOR_SCOPE = "connector"
#: asymmetric algorithms accepted from an OIDC provider (never `none`, never HS*: a public
#: JWKS key must not be usable as an HMAC secret)
OIDC_ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]
#: how long fetched JWKS keys are trusted before the set is fetched again (seconds)
JWKS_LIFESPAN = 300
#: tolerated clock difference for `exp`/`nbf` (seconds)
LEEWAY = 30
_NO_TIME_CHECKS: jwt.types.Options = {
    "verify_exp": False,
    "verify_iat": False,
    "verify_nbf": False,
}


def _tenant_of(claims: dict[str, Any]) -> str:
    tenant = claims.get("client_id")
    if not isinstance(tenant, str) or not tenant:
        raise AuthError(401, "token has no client_id claim")
    scope = claims.get("scope", "")
    scopes = scope.split() if isinstance(scope, str) else scope
    if not isinstance(scopes, list) or CONNECTOR_SCOPE not in scopes:
        raise AuthError(401, f"token lacks the scope {CONNECTOR_SCOPE!r}")
    return tenant


def _check_time(claims: dict[str, Any], now: int) -> float:
    """The last unix second the token is good (`exp` + LEEWAY); AuthError when it is not now."""
    exp = claims.get("exp")
    if not isinstance(exp, int | float):
        raise AuthError(401, "token has no exp claim")
    if now > exp + LEEWAY:
        raise AuthError(401, "token expired")
    nbf = claims.get("nbf")
    if isinstance(nbf, int | float) and now + LEEWAY < nbf:
        raise AuthError(401, "token not valid yet")
    return exp + LEEWAY


class OidcVerifier:
    """Tokens of one external OIDC provider, keys from its JWKS (found by discovery)."""

    def __init__(self, issuer: str, audience: str, *, clock: Clock = wall_clock) -> None:
        if not issuer.startswith(("http://", "https://")):
            raise ConfigError(f"--oidc-issuer must be an http(s) URL, got {issuer!r}")
        if not audience:
            raise ConfigError("--oidc-audience must not be empty")
        self.issuer = issuer.rstrip("/")
        self.audience = audience
        self.clock = clock
        self._jwks: jwt.PyJWKClient | None = None
        self._lock = asyncio.Lock()

    def _discover(self) -> jwt.PyJWKClient:
        import jwt

        url = f"{self.issuer}/.well-known/openid-configuration"
        with urllib.request.urlopen(url, timeout=10) as reply:
            document = json.loads(reply.read())
        jwks_uri = document.get("jwks_uri") if isinstance(document, dict) else None
        if not isinstance(jwks_uri, str):
            raise AuthError(401, f"OIDC discovery document at {url} names no jwks_uri")
        return jwt.PyJWKClient(jwks_uri, cache_keys=True, lifespan=JWKS_LIFESPAN)

    async def verify(self, token: str) -> str:
        """The tenant the token is for; AuthError when it is not valid."""
        return (await self.check(token))[0]

    async def check(self, token: str) -> tuple[str, float]:
        """The tenant the token is for and the last unix second the verdict may be relied on:
        its expiry, and at most one JWKS lifespan from now (the key that verified it is
        trusted no longer without fetching the set again); AuthError when it is not valid."""
        import jwt

        try:
            async with self._lock:
                if self._jwks is None:
                    self._jwks = await asyncio.to_thread(self._discover)
            jwks = self._jwks
            key = await asyncio.to_thread(jwks.get_signing_key_from_jwt, token)
            claims = jwt.decode(
                token,
                key.key,
                algorithms=OIDC_ALGORITHMS,
                audience=self.audience,
                issuer=self.issuer,
                options=_NO_TIME_CHECKS,
            )
        except (jwt.PyJWTError, OSError, ValueError) as err:
            raise AuthError(401, f"token refused: {err}") from None
        now = seconds(self.clock())
        until = _check_time(claims, now)
        return _tenant_of(claims), min(until, now + JWKS_LIFESPAN)


class TokenCache(Protocol):
    """Where verdicts are kept (the tunnel's hub, `_core.TunnelHub`)."""

    def known_token(self, token: str, wall: int, /) -> str | None:
        """The tenant claim of a token that passed and is still good at `wall` (unix s)."""

    def add_token(self, token: str, tenant: str, until: int, /) -> None:
        """A token that passed, for `tenant`, good up to the unix second `until`."""


class TokenAuthority:
    """Issues embedded tokens and checks any token a connector or client presents."""

    def __init__(
        self,
        key: bytes,
        *,
        ttl: int = 300,
        clock: Clock = wall_clock,
        oidc: OidcVerifier | None = None,
        cache: TokenCache | None = None,
    ) -> None:
        """`cache`: where verdicts are kept (None: every token is checked every time)."""
        if ttl <= 0:
            raise ConfigError("--tunnel-token-ttl must be positive")
        self._key = key
        self.ttl = ttl
        self.clock = clock
        self.oidc = oidc
        self.cache = cache

    def issue(self, tenant: str) -> str:
        import jwt

        now = seconds(self.clock())
        claims = {
            "iss": EMBEDDED_ISSUER,
            "aud": EMBEDDED_AUDIENCE,
            "client_id": tenant,
            "scope": CONNECTOR_SCOPE,
            "iat": now,
            "exp": now + self.ttl,
            "jti": secrets.token_urlsafe(12),
        }
        return jwt.encode(claims, self._key, algorithm="HS256")

    async def verify(self, token: str) -> str:
        """The tenant name the token is for; AuthError otherwise. A token that passes is
        remembered until its end, and found there the next time."""
        cache = self.cache
        if cache is not None:
            tenant = cache.known_token(token, seconds(self.clock()))
            if tenant is not None:
                return tenant
        tenant, until = await self._check(token)
        if cache is not None:
            cache.add_token(token, tenant, math.floor(until))
        return tenant

    async def _check(self, token: str) -> tuple[str, float]:
        """The full check: the tenant and the last unix second the token is good."""
        import jwt

        try:
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as err:
            raise AuthError(401, f"malformed token: {err}") from None
        issuer = unverified.get("iss")
        if issuer != EMBEDDED_ISSUER:
            if self.oidc is not None and issuer == self.oidc.issuer:
                return await self.oidc.check(token)
            raise AuthError(401, f"token issuer {issuer!r} is not accepted")
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=["HS256"],
                audience=EMBEDDED_AUDIENCE,
                issuer=EMBEDDED_ISSUER,
                options=_NO_TIME_CHECKS,
            )
        except jwt.PyJWTError as err:
            raise AuthError(401, f"token refused: {err}") from None
        until = _check_time(claims, seconds(self.clock()))
        return _tenant_of(claims), until


def bearer(authorization: bytes | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header value, or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
