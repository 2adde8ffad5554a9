"""Twin identities: keys from a mnemonic or seed, and the RMB login JWT.

Key derivation follows substrate (spec/rmb.md §1.4): a BIP39 phrase is turned back into its
ENTROPY, and `PBKDF2-HMAC-SHA512(entropy, "mnemonic", 2048)[:32]` is the mini secret (sr25519)
or seed (ed25519). This is not the standard BIP39 sentence seed; a wallet that uses that would
derive another account. A `0x` + 64 hex digits secret is used as the 32 bytes directly.

The JWT (spec/rmb.md §1.2) is `b64url({"alg":"RS512"}) . b64url(claims) . b64url(sig65)`: the
alg value is a fixed placeholder, the signature is over the ASCII `header.claims` string, and
it is the 65-byte prefixed form (`e`/`s` + 64 bytes).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from rmb_relay._core import SignatureError, SigningKey, verify_prefixed
from rmb_relay.errors import AuthError, ConfigError

KeyType = Literal["sr25519", "ed25519"]

#: the fixed JWT header rmb-rs emits and requires (`{"alg":"RS512"}`)
JWT_HEADER = b'{"alg":"RS512"}'
JWT_HEADER_B64 = "eyJhbGciOiJSUzUxMiJ9"
#: rmb-peer's token lifetime (spec/rmb.md §1.2)
DEFAULT_JWT_TTL = 300
#: a login token longer than this is refused before any decoding (rmb-peer's are ~250 chars;
#: a sid is a short name): parsing cost and JSON nesting stay bounded
MAX_JWT_LEN = 4096
#: the longest a token may still be valid when presented (`exp - now`, seconds). rmb-rs sets no
#: bound (spec/rmb.md §1.2), so a token with exp = 2^64-1 never expires; rmb-peer's live 300 s.
#: `iat` is the client's word and is not used: a stale iat with a short exp is harmless
DEFAULT_MAX_TOKEN_LIFETIME = 3600
#: PBKDF2 rounds of substrate-bip39
_BIP39_ROUNDS = 2048


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Unpadded base64url; raises ValueError on anything else."""
    if "=" in text or any(c in text for c in "+/"):
        raise ValueError("not unpadded base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def secret_from_phrase(secret: str) -> bytes:
    """32 secret bytes from a BIP39 phrase (substrate derivation) or `0x` + 64 hex digits."""
    secret = secret.strip()
    if secret.startswith("0x"):
        try:
            raw = bytes.fromhex(secret[2:])
        except ValueError:
            raise ConfigError("hex seed must be 0x followed by 64 hex digits") from None
        if len(raw) != 32:
            raise ConfigError(f"hex seed must be 32 bytes, got {len(raw)}")
        return raw
    from mnemonic import Mnemonic

    words = " ".join(secret.split())
    try:
        entropy = bytes(Mnemonic("english").to_entropy(words))
    except (ValueError, LookupError) as err:
        raise ConfigError(f"not a valid BIP39 English mnemonic: {err}") from None
    return hashlib.pbkdf2_hmac("sha512", entropy, b"mnemonic", _BIP39_ROUNDS)[:32]


def signing_key(secret: str | bytes, key_type: KeyType = "sr25519") -> SigningKey:
    """A signing key from a mnemonic, `0x` hex seed, or 32 raw bytes."""
    raw = secret if isinstance(secret, bytes) else secret_from_phrase(secret)
    if key_type == "sr25519":
        return SigningKey.sr25519(raw)
    if key_type == "ed25519":
        return SigningKey.ed25519(raw)
    raise ConfigError(f"unknown key type {key_type!r}: use sr25519 or ed25519")


@dataclass(frozen=True, slots=True)
class Claims:
    twin: int
    sid: str | None
    iat: int
    exp: int


def make_jwt(
    key: SigningKey, twin: int, sid: str | None, now: int, ttl: int = DEFAULT_JWT_TTL
) -> str:
    """A login token exactly as rmb-peer builds it (claims in struct order, compact JSON)."""
    claims = json.dumps(
        {"sub": twin, "sid": sid, "iat": now, "exp": now + ttl}, separators=(",", ":")
    ).encode()
    signed = f"{JWT_HEADER_B64}.{b64url(claims)}"
    return f"{signed}.{b64url(key.sign_prefixed(signed.encode('ascii')))}"


@dataclass(frozen=True, slots=True)
class ParsedJwt:
    claims: Claims
    signed: bytes
    signature: bytes


def parse_jwt(token: str, now: int, max_lifetime: int = DEFAULT_MAX_TOKEN_LIFETIME) -> ParsedJwt:
    """Structure, header, expiry and lifetime checks (before any twin lookup). Raises
    AuthError(401) for anything malformed, however hostile: never another exception."""
    if len(token) > MAX_JWT_LEN:
        raise AuthError(401, f"invalid jwt: token over {MAX_JWT_LEN} characters")
    parts = token.split(".")
    if len(parts) != 3:
        raise AuthError(401, "invalid jwt: token must have three dot-separated parts")
    try:
        header = json.loads(b64url_decode(parts[0]))
        claims = json.loads(b64url_decode(parts[1]))
        signature = b64url_decode(parts[2])
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: JSON nested deeper than the decoder's stack (`[[[[...`)
        raise AuthError(401, "invalid jwt: malformed base64url or JSON") from None
    if not isinstance(header, dict) or header.get("alg") != "RS512":
        raise AuthError(401, "invalid jwt: algorithm mismatch (expected RS512)")
    if not isinstance(claims, dict):
        raise AuthError(401, "invalid jwt: claims must be an object")
    sub, iat, exp, sid = claims.get("sub"), claims.get("iat"), claims.get("exp"), claims.get("sid")
    for name, value in (("sub", sub), ("iat", iat), ("exp", exp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise AuthError(401, f"invalid jwt: claim {name} must be a non-negative integer")
    assert isinstance(sub, int)
    assert isinstance(iat, int)
    assert isinstance(exp, int)
    if sub > 0xFFFFFFFF:
        raise AuthError(401, "invalid jwt: claim sub is not a twin id")
    if sid is not None and not isinstance(sid, str):
        raise AuthError(401, "invalid jwt: claim sid must be a string or null")
    if now > exp:
        raise AuthError(401, "invalid jwt: jwt has expired")
    if exp - now > max_lifetime:
        raise AuthError(401, f"invalid jwt: jwt lifetime over {max_lifetime} s")
    return ParsedJwt(Claims(sub, sid, iat, exp), f"{parts[0]}.{parts[1]}".encode(), signature)


def verify_jwt_signature(parsed: ParsedJwt, account: bytes) -> None:
    """Check the token signature against the twin's 32-byte account key. Raises AuthError(401)."""
    try:
        ok = verify_prefixed(account, parsed.signed, parsed.signature)
    except SignatureError as err:
        raise AuthError(401, f"invalid jwt: {err}") from None
    if not ok:
        raise AuthError(401, "invalid jwt: signature does not match the twin's account key")
