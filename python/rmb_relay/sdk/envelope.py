"""RMB envelopes as protobuf objects, for everything that speaks RMB as a twin: the SDK
(`client.py` here), rmb-peer (`peer/`) and the load harness.

The classes are generated from `proto/` at build time (`make proto`) into `rmb_relay._proto`
and ship in the wheel. The relay itself never builds these objects: it forwards bytes and reads
routing fields with the Rust scanner. A twin has to look at every field anyway (to sign, verify,
encrypt and answer), and the protobuf runtime keeps unknown fields and field presence exactly as
rmb-rs's does.

What is here is the part of spec/rmb.md every twin needs the same way:

- `challenge` (§2.1): the MD5 of the fields in a fixed order, numbers as decimal ASCII, absent
  optional strings contributing nothing. `sign` puts the 65-byte prefixed signature (§1.3) over
  it; `signature_ok` checks one against an account key.
- `stamp` and `ttl` (§2.2): the deadline `timestamp + expiration` is what counts; stamping
  rewrites the timestamp to now and shortens the expiration so the deadline stays. An envelope
  whose deadline is now or past has expired (ttl 0 is expired).
- `Address` text (`"<twin>"` or `"<twin>:<sid>"`), as the msgbus JSON writes sources and
  destinations.
"""

from __future__ import annotations

import hashlib

from rmb_relay._core import SignatureError, SigningKey, verify_prefixed
from rmb_relay._proto.types_pb2 import Address, Envelope

__all__ = [
    "DEFAULT_TTL",
    "MAX_TTL",
    "Address",
    "Envelope",
    "address_text",
    "challenge",
    "challenge_around_payload",
    "kind",
    "parse_address",
    "sign",
    "signature_ok",
    "stamp",
    "ttl",
]

#: rmb-peer's TTL for an envelope whose expiration is 0, and its cap (spec §5.6)
DEFAULT_TTL = 300
MAX_TTL = 1800


def challenge(env: Envelope) -> bytes:
    """The 16-byte digest an envelope's signature covers (spec/rmb.md §2.1)."""
    before, after = challenge_around_payload(env)
    payload = env.WhichOneof("payload")
    data = env.plain if payload == "plain" else env.cipher if payload == "cipher" else b""
    return hashlib.md5(before + data + after).digest()


def challenge_around_payload(env: Envelope) -> tuple[bytes, bytes]:
    """What the challenge hashes before the payload and after it (the relays): a sender that
    changes only the payload per message (the load harness, `_core.StampedBatch.sign_with`)
    hashes these around each one."""
    parts = [env.uid.encode()]
    if env.HasField("tags"):
        parts.append(env.tags.encode())
    source, dest = env.source, env.destination
    parts.append(b"%d%d%d" % (env.timestamp, env.expiration, source.twin))
    if source.HasField("connection"):
        parts.append(source.connection.encode())
    parts.append(b"%d" % dest.twin)
    if dest.HasField("connection"):
        parts.append(dest.connection.encode())
    message = env.WhichOneof("message")
    if message == "request":
        parts.append(env.request.command.encode())
    elif message == "error":
        parts.append(b"%d" % env.error.code)
        parts.append(env.error.message.encode())
    if env.HasField("schema"):
        parts.append(env.schema.encode())
    if env.HasField("federation"):
        parts.append(env.federation.encode())
    return b"".join(parts), b"".join(relay.encode() for relay in env.relays)


def sign(env: Envelope, key: SigningKey) -> None:
    """Set the signature; call after every other field is final (it covers the ciphertext and
    the stamped times)."""
    env.signature = key.sign_prefixed(challenge(env))


def signature_ok(env: Envelope, account: bytes) -> str | None:
    """None if the envelope is signed by the 32-byte account key, else why not (the text
    rmb-peer's error 104 carries after `invalid envelope signature: `)."""
    if not env.HasField("signature"):
        return "envelope is not signed"
    try:
        ok = verify_prefixed(account, challenge(env), env.signature)
    except SignatureError as err:
        return f"{err}"
    return None if ok else "signature does not match the sender's account key"


def kind(env: Envelope) -> str | None:
    """Which message the envelope carries: request, response, error, ping, pong or None."""
    which: str | None = env.WhichOneof("message")
    return which


def stamp(now: int, timestamp: int, expiration: int) -> tuple[int, int]:
    """(timestamp, expiration) rewritten to `now` keeping the deadline (spec §2.2). A timestamp
    of 0 or in the future is replaced by now with the expiration unchanged. All unix seconds."""
    if timestamp == 0 or timestamp > now:
        return now, expiration
    return now, max(0, expiration - (now - timestamp))


def ttl(now: int, timestamp: int, expiration: int) -> int | None:
    """Seconds left before the deadline, or None once it is reached (spec §2.2)."""
    left = timestamp + expiration - now
    return left if left > 0 else None


def address_text(address: Address) -> str:
    """`"<twin>"` or `"<twin>:<sid>"`: how the msgbus JSON names a source."""
    if address.HasField("connection"):
        return f"{address.twin}:{address.connection}"
    return str(address.twin)


def parse_address(text: str) -> tuple[int, str | None]:
    """`"<twin>[:<sid>]"` into (twin, sid); ValueError when the twin is not a u32."""
    twin_text, sep, sid = text.partition(":")
    twin = int(twin_text) if twin_text.isdigit() else -1
    if not 0 <= twin <= 0xFFFF_FFFF:
        raise ValueError(f"{text!r} is not <twin>[:<session>]")
    return twin, sid if sep else None
