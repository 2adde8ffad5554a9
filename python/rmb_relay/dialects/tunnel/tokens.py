"""Connector tokens (decision 3 of spec/tunnel.md): short-lived JWTs, embedded or from an OIDC
provider.

Embedded: `POST /tunnel/token` trades a tenant's client credentials for an HS256 JWT signed with
the key kept in the tenant store (so every relay on that file accepts it). With
`--oidc-issuer/--oidc-audience` the relay also accepts any token of that provider: its JWKS is
found through the discovery document and cached by PyJWT's `PyJWKClient` (maintained code for
key rotation and `kid` lookup, rather than ours). Either way a token names its tenant in
`client_id`, and its scopes say what it is for: `connector` (a connector's websocket and body
side channels, as RelayServer's) or `client` (a client request of a tenant that requires a
token). One is not the other: a client's token cannot attach a connector.

An embedded token carries a fingerprint of its tenant's secret (`sv`): once the secret is
changed (or the tenant removed) the tokens issued with the old one are refused.

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
import hashlib
import json
import math
import secrets
import urllib.request
from collections.abc import Callable
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
#: the scope a client's token must hold (tenants with requireAuthentication)
CLIENT_SCOPE = "client"
#: the roles a token's scopes give, as the hub keeps them (rust/dialects/tunnel/hub.rs ROLE_*)
ROLES = {CONNECTOR_SCOPE: 1, CLIENT_SCOPE: 2}
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


def fingerprint(secret_hash: str | None) -> str | None:
    """What an embedded token carries of its tenant's secret (`sv`): changes with the secret."""
    if secret_hash is None:
        return None
    return hashlib.sha256(secret_hash.encode()).hexdigest()[:16]


def _tenant_of(claims: dict[str, Any]) -> tuple[str, int]:
    """The tenant a token is for and the roles its scopes give (`ROLES`)."""
    tenant = claims.get("client_id")
    if not isinstance(tenant, str) or not tenant:
        raise AuthError(401, "token has no client_id claim")
    scope = claims.get("scope", "")
    scopes = scope.split() if isinstance(scope, str) else scope
    roles = 0
    if isinstance(scopes, list):
        for name in scopes:
            roles |= ROLES.get(name, 0) if isinstance(name, str) else 0
    if not roles:
        raise AuthError(401, f"token lacks the scope {CONNECTOR_SCOPE!r} or {CLIENT_SCOPE!r}")
    return tenant, roles


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

    async def check(self, token: str) -> tuple[str, float, int]:
        """The tenant the token is for, the last unix second the verdict may be relied on (its
        expiry, and at most one JWKS lifespan from now: the key that verified it is trusted no
        longer without fetching the set again) and its roles; AuthError when it is not valid."""
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
        tenant, roles = _tenant_of(claims)
        return tenant, min(until, now + JWKS_LIFESPAN), roles


class TokenCache(Protocol):
    """Where verdicts are kept (the tunnel's hub, `_core.TunnelHub`)."""

    def known_token(self, token: str, wall: int, /) -> tuple[str, int] | None:
        """The tenant claim and roles of a token that passed and is still good at `wall`."""

    def add_token(self, token: str, tenant: str, until: int, roles: int, /) -> None:
        """A token that passed, for `tenant` and `roles`, good up to the unix second `until`."""


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
        secret_of: Callable[[str], str | None] | None = None,
    ) -> None:
        """`cache`: where verdicts are kept (None: every token is checked every time);
        `secret_of`: the fingerprint of a tenant's current secret (None: no such tenant, or
        no secret), which an embedded token must carry (None here: not checked)."""
        if ttl <= 0:
            raise ConfigError("--tunnel-token-ttl must be positive")
        self._key = key
        self.ttl = ttl
        self.clock = clock
        self.oidc = oidc
        self.cache = cache
        self.secret_of = secret_of

    def issue(self, tenant: str, scope: str = CONNECTOR_SCOPE) -> str:
        """An embedded token of `tenant` for `scope` (space-separated scopes of `ROLES`)."""
        import jwt

        now = seconds(self.clock())
        claims: dict[str, Any] = {
            "iss": EMBEDDED_ISSUER,
            "aud": EMBEDDED_AUDIENCE,
            "client_id": tenant,
            "scope": scope,
            "iat": now,
            "exp": now + self.ttl,
            "jti": secrets.token_urlsafe(12),
        }
        if self.secret_of is not None:
            claims["sv"] = self.secret_of(tenant)
        return jwt.encode(claims, self._key, algorithm="HS256")

    async def verify(self, token: str, role: str = CONNECTOR_SCOPE) -> str:
        """The tenant name the token is for, when its scopes allow `role` (`ROLES`);
        AuthError otherwise. A token that passes is remembered until its end, and found there
        the next time."""
        cache = self.cache
        known = cache.known_token(token, seconds(self.clock())) if cache is not None else None
        if known is not None:
            tenant, roles = known
        else:
            tenant, until, roles = await self._check(token)
            if cache is not None:
                cache.add_token(token, tenant, math.floor(until), roles)
        if not roles & ROLES[role]:
            raise AuthError(401, f"the token's scope does not include {role!r}")
        return tenant

    async def _check(self, token: str) -> tuple[str, float, int]:
        """The full check: the tenant, the last unix second the token is good, its roles."""
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
        tenant, roles = _tenant_of(claims)
        if self.secret_of is not None and claims.get("sv") != self.secret_of(tenant):
            raise AuthError(
                401, "token issued before the tenant's secret changed, or for no tenant"
            )
        return tenant, until, roles


def bearer(authorization: bytes | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header value, or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
