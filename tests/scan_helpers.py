"""What the scanner tests build their input from: client frames and small envelopes."""

from __future__ import annotations

from rmb_relay._core import MSG_REQUEST, ClientFrameEncoder, Envelope

#: SBD keys of a sender and of its destination
SENDER = bytes([2]) * 32
DEST = bytes([1]) * 32


def frames(*payloads: bytes) -> bytes:
    """The payloads as masked binary frames, as a client sends them."""
    return ClientFrameEncoder(bytes(32)).binary_batch(list(payloads))


def envelope(
    source: tuple[int, str | None] = (7, "app"),
    dest: tuple[int, str | None] = (9, "svc"),
    kind: int = MSG_REQUEST,
    body: bytes = b"",
) -> bytes:
    """Uid "u" from twin/connection `source` to `dest`; a request has command "c"."""
    env = Envelope("u")
    env.source_twin, env.source_connection = source
    env.dest_twin, env.dest_connection = dest
    env.kind = kind
    if kind == MSG_REQUEST:
        env.command = "c"
    if body:
        env.plain = body
    return env.encode()
