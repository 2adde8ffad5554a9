"""The msgbus: rmb-peer's Redis keys and JSON messages, exactly as the public rmb-peer has them
(spec/rmb.md §5.4-§5.9), so services and tools written for it work unchanged.

Queues (producers LPUSH, consumers pop from the right):

| key | who pushes | who pops | JSON |
|---|---|---|---|
| `msgbus.system.local` | a client | the peer | outgoing request |
| `msgbus.system.reply` | a service | the peer | outgoing response |
| `msgbus.<cmd>` | the peer (capped at 10,000) | a service | incoming request |
| the request's `ret` | the peer (capped at 10,000) | the client | incoming response |
| `msgbus.backlog.<uid>` | the peer (SETEX) | the peer | protobuf `Backlog` |

Parsing follows serde's rules for the public structs: keys the struct does not know are ignored,
an `Option` key may be missing or null, every other key is required with its JSON type (an
integer is not a float or a bool). What does not parse raises `BadMessage` carrying the `ret`
and `ref` when they can still be read, so the client can be told (rmb-peer only logs it).
Services often answer without an `err` key and with keys of the request copied in (§6): both
are fine. Output is compact JSON with the keys in the public structs' order.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from rmb_relay.errors import BadMessage

__all__ = [
    "BACKLOG_PREFIX",
    "BLOCK_SECONDS",
    "LOCAL_QUEUE",
    "MAX_COMMANDS",
    "REPLY_QUEUE",
    "Codes",
    "OutgoingRequest",
    "OutgoingResponse",
    "PeerReply",
    "PeerRequest",
    "backlog_key",
    "command_queue",
    "error_response",
    "incoming_request",
    "incoming_response",
    "outgoing_response",
    "parse_incoming_request",
    "parse_incoming_response",
    "parse_request",
    "parse_response",
]

LOCAL_QUEUE = b"msgbus.system.local"
REPLY_QUEUE = b"msgbus.system.reply"
BACKLOG_PREFIX = "msgbus.backlog."
#: rmb-peer's cap on a command or reply queue (LTRIM 0 9999 after every push): a twin that
#: floods a command nobody serves cannot fill the peer's Redis (spec §8.9)
MAX_COMMANDS = 10_000
#: how long one blocking pop waits before it is issued again (a dead connection shows by then)
BLOCK_SECONDS = 5
_U32 = 0xFFFF_FFFF


class Codes:
    """rmb-peer's ProtocolError codes (spec §5.9), as they reach a client's `err.code`."""

    INVALID_PAYLOAD_TYPE = 100
    INVALID_PAYLOAD_DATA = 101
    EXPIRED = 102
    UNKNOWN_TWIN = 103
    INVALID_SIGNATURE = 104
    NO_PUBLIC_KEY = 105
    E2E = 106
    OTHER = 500


def command_queue(command: str) -> bytes:
    return b"msgbus." + command.encode()


def backlog_key(uid: str) -> bytes:
    return (BACKLOG_PREFIX + uid).encode()


def _dumps(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadMessage(f"{what} is not JSON: {err}") from None
    if not isinstance(message, dict):
        raise BadMessage(f"{what} must be a JSON object, got {type(message).__name__}")
    return message


class _Fields:
    """Typed access to one JSON object with serde's required/optional rules."""

    def __init__(self, message: dict[str, Any], what: str, ret: str | None, ref: str | None):
        self.message = message
        self.what = what
        self.ret = ret
        self.ref = ref

    def fail(self, reason: str) -> BadMessage:
        return BadMessage(f"{self.what}: {reason}", self.ret, self.ref)

    def uint(self, key: str, limit: int = (1 << 64) - 1, *, required: bool = True) -> int:
        value = self.message.get(key)
        if value is None and not required:
            return 0
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise self.fail(f"{key!r} must be an integer 0..{limit}, got {value!r}")
        return value

    def text(self, key: str) -> str:
        value = self.message.get(key)
        if not isinstance(value, str):
            raise self.fail(f"{key!r} must be a string, got {value!r}")
        return value

    def optional_text(self, key: str) -> str | None:
        value = self.message.get(key)
        if value is not None and not isinstance(value, str):
            raise self.fail(f"{key!r} must be a string or null, got {value!r}")
        return value

    def data(self, key: str = "dat") -> bytes:
        text = self.text(key)
        try:
            # serde's base64 writes padding; a client that leaves it out is still understood
            return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise self.fail(f"{key!r} must be standard base64") from None


def _readable(message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    return value if isinstance(value, str) else None


# ---- from local clients and services ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutgoingRequest:
    """A client's request from `msgbus.system.local` (JsonOutgoingRequest)."""

    ref: str | None
    command: str
    expiration: int
    data: bytes
    tags: str | None
    destinations: tuple[int, ...]
    ret: str
    schema: str | None
    now: int


def parse_request(raw: bytes) -> OutgoingRequest:
    """Raises BadMessage (with `ret` when the client named one)."""
    message = _object(raw, "request")
    fields = _Fields(message, "request", _readable(message, "ret"), _readable(message, "ref"))
    fields.uint("ver", _U32)
    ret = fields.text("ret")
    dst = message.get("dst")
    if not isinstance(dst, list):
        raise fields.fail(f"'dst' must be a list of twin ids, got {dst!r}")
    if not dst:
        raise fields.fail("'dst' names no twin")
    for twin in dst:
        if not isinstance(twin, int) or isinstance(twin, bool) or not 0 < twin <= _U32:
            raise fields.fail(f"'dst' must hold twin ids 1..{_U32}, got {twin!r}")
    return OutgoingRequest(
        ref=fields.optional_text("ref"),
        command=fields.text("cmd"),
        expiration=fields.uint("exp"),
        data=fields.data(),
        tags=fields.optional_text("tag"),
        destinations=tuple(dst),
        ret=ret,
        schema=fields.optional_text("shm"),
        now=fields.uint("now"),
    )


@dataclass(frozen=True, slots=True)
class OutgoingResponse:
    """A service's reply from `msgbus.system.reply` (JsonOutgoingResponse)."""

    ref: str | None
    data: bytes
    destination: str
    schema: str | None
    now: int
    error: tuple[int, str] | None


def parse_response(raw: bytes) -> OutgoingResponse:
    """Raises BadMessage (there is nobody to tell: the caller logs it)."""
    message = _object(raw, "reply")
    fields = _Fields(message, "reply", None, _readable(message, "ref"))
    fields.uint("ver", _U32)
    dst = message.get("dst")
    if isinstance(dst, int) and not isinstance(dst, bool):
        dst = str(dst)  # the twin id as a number: what else could it mean
    if not isinstance(dst, str):
        raise fields.fail(f"'dst' must be a string '<twin>[:<session>]', got {dst!r}")
    error = None
    err = message.get("err")
    if err is not None:
        if not isinstance(err, dict):
            raise fields.fail(f"'err' must be an object {{code, message}} or null, got {err!r}")
        inner = _Fields(err, "reply 'err'", None, fields.ref)
        error = (inner.uint("code", _U32), inner.text("message"))
    return OutgoingResponse(
        ref=fields.optional_text("ref"),
        # the payload of an error reply is not sent, so it need not decode
        data=fields.data() if error is None else b"",
        destination=dst,
        schema=fields.optional_text("shm"),
        now=fields.uint("now"),
        error=error,
    )


# ---- to local services and clients -----------------------------------------------------------


def incoming_request(
    uid: str,
    source: str,
    command: str,
    expiration: int,
    data: bytes,
    tags: str | None,
    schema: str | None,
    timestamp: int,
) -> bytes:
    """JsonIncomingRequest for `msgbus.<cmd>`: `ref` is the envelope uid, which the service
    echoes in its reply; `ret` is always `msgbus.system.reply`."""
    return _dumps(
        {
            "ver": 1,
            "ref": uid,
            "src": source,
            "cmd": command,
            "exp": expiration,
            "dat": _b64(data),
            "tag": tags,
            "ret": "msgbus.system.reply",
            "shm": schema,
            "now": timestamp,
        }
    )


def incoming_response(
    ref: str | None,
    data: bytes,
    source: str,
    schema: str | None,
    now: int,
    error: tuple[int, str] | None,
) -> bytes:
    """JsonIncomingResponse for a client's `ret` queue; `ref` is the client's own."""
    return _dumps(
        {
            "ver": 1,
            "ref": ref,
            "dat": _b64(data),
            "src": source,
            "shm": schema,
            "now": now,
            "err": None if error is None else {"code": error[0], "message": error[1]},
        }
    )


def error_response(ref: str | None, code: int, message: str) -> bytes:
    """The peer's own error to a client (undeliverable, expired, bad request): `src` is ""."""
    return incoming_response(ref, b"", "", None, 0, (code, message))


# ---- the SDK's side (RmbPeerClient) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerReply:
    """One reply from rmb-peer's `ret` queue: `source` is `"<twin>[:<sid>]"`, `"0"` for a relay
    error and `""` for an error of the peer itself (spec §5.5)."""

    source: str
    data: bytes
    error: tuple[int, str] | None
    schema: str | None
    now: int

    @property
    def twin(self) -> int | None:
        twin = self.source.partition(":")[0]
        return int(twin) if twin.isdigit() else None


@dataclass(frozen=True, slots=True)
class PeerRequest:
    """A request a service receives from rmb-peer on `msgbus.<cmd>`."""

    ref: str
    source: str
    command: str
    data: bytes
    schema: str | None
    expiration: int
    now: int


def parse_incoming_response(raw: bytes) -> tuple[str | None, PeerReply]:
    """(the client's ref, the reply) of a JsonIncomingResponse. Raises BadMessage."""
    message = _object(raw, "incoming reply")
    fields = _Fields(message, "incoming reply", None, None)
    error = None
    err = message.get("err")
    if isinstance(err, dict):
        inner = _Fields(err, "incoming reply 'err'", None, None)
        error = (inner.uint("code", _U32), inner.text("message"))
    reply = PeerReply(
        fields.text("src"),
        fields.data(),
        error,
        fields.optional_text("shm"),
        fields.uint("now", required=False),
    )
    return fields.optional_text("ref"), reply


def parse_incoming_request(raw: bytes) -> PeerRequest:
    """A JsonIncomingRequest as a service sees it. Raises BadMessage."""
    message = _object(raw, "incoming request")
    fields = _Fields(message, "incoming request", None, None)
    return PeerRequest(
        fields.text("ref"),
        fields.text("src"),
        fields.text("cmd"),
        fields.data(),
        fields.optional_text("shm"),
        fields.uint("exp", required=False),
        fields.uint("now", required=False),
    )


def outgoing_response(
    request: PeerRequest, data: bytes, error: tuple[int, str] | None, now: int
) -> bytes:
    """A service's JsonOutgoingResponse to `request`, for `msgbus.system.reply`."""
    return _dumps(
        {
            "ver": 1,
            "ref": request.ref,
            "dat": _b64(data),
            "dst": request.source,
            "shm": request.schema,
            "now": now,
            "err": None if error is None else {"code": error[0], "message": error[1]},
        }
    )
