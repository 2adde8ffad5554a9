"""The connector websocket's messages (decision 2 of spec/tunnel.md), JSON or msgpack.

Every message is an invocation shaped like SignalR's, `{"target": NAME, "arguments": [OBJ]}`,
named after RelayServer's hub methods, with RelayServer's camelCase wire objects (spec §4):

| target | direction | argument |
|---|---|---|
| `RequestTarget` | relay → connector | ClientRequest |
| `Configure` | relay → connector | TenantConfig |
| `Error` | relay → connector | `{"message": ...}`: a message of the connector's was refused |
| `Deliver` | connector → relay | TargetResponse |
| `Acknowledge` | connector → relay | AcknowledgeRequest |

JSON travels in text frames with bodies base64-encoded; msgpack (asked for with
`?protocol=msgpack`) in binary frames with bodies as raw bytes. Two fields are ours:
`expiresIn` (ms the connector has left to start the request: it refuses expired work) and
`acknowledgeUrl` (the manual acknowledgement path, with its unguessable token).

Both directions run the one codec, in Rust (`rust/dialects/tunnel/wire.rs`): `encode` writes
what Python's msgpack and json libraries would write for the same fields, `decode` checks every
field's type and raises `WireError` naming the field; a connector gets that text back in an
`Error` message and its connection stays up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

from rmb_relay._core import TUNNEL_KINDS, TunnelWireError, tunnel_decode, tunnel_encode

__all__ = [
    "AcknowledgeRequest",
    "ClientRequest",
    "TargetResponse",
    "TenantConfig",
    "WireError",
    "decode",
    "encode",
]

Headers = dict[str, list[str]]


class WireError(ValueError):
    """A malformed message (the sender's fault); the text says what is wrong."""


@dataclass(slots=True)
class ClientRequest:
    request_id: str
    request_origin_id: str
    target: str
    tenant_name: str
    http_method: str
    url: str
    http_headers: Headers = field(default_factory=dict)
    acknowledge_mode: int = 0
    acknowledge_origin_id: str | None = None
    original_body_size: int = 0
    body_size: int = 0
    body_content: bytes | None = None
    enable_tracing: bool = False
    discard_connector_response: bool = False
    expires_in: int | None = None
    acknowledge_url: str | None = None

    NAME: ClassVar[str] = "RequestTarget"

    @property
    def outsourced(self) -> bool:
        """The body waits in the relay's body store (RelayServer's definition)."""
        return self.body_size > 0 and self.body_content is None


@dataclass(slots=True)
class TargetResponse:
    request_id: str
    request_origin_id: str
    http_status_code: int
    http_headers: Headers = field(default_factory=dict)
    original_body_size: int = 0
    body_size: int = 0
    body_content: bytes | None = None
    request_failed: bool = False
    request_start: str | None = None
    request_duration: str | None = None
    connection_id: str | None = None

    NAME: ClassVar[str] = "Deliver"

    @property
    def outsourced(self) -> bool:
        return self.body_size > 0 and self.body_content is None


@dataclass(slots=True)
class AcknowledgeRequest:
    origin_id: str
    request_id: str
    remove_request_body_content: bool = True

    NAME: ClassVar[str] = "Acknowledge"


@dataclass(slots=True)
class TenantConfig:
    """RelayServer's Configure(ITenantConfig); intervals in seconds."""

    keep_alive_interval: float = 15.0
    enable_tracing: bool = False
    reconnect_minimum_delay: float = 30.0
    reconnect_maximum_delay: float = 300.0

    NAME: ClassVar[str] = "Configure"


@dataclass(slots=True)
class ErrorMessage:
    message: str

    NAME: ClassVar[str] = "Error"


Message = ClientRequest | TargetResponse | AcknowledgeRequest | TenantConfig | ErrorMessage
_TYPES: dict[str, type[Message]] = {
    cls.NAME: cls
    for cls in (ClientRequest, TargetResponse, AcknowledgeRequest, TenantConfig, ErrorMessage)
}
M = TypeVar("M", bound=Message)


#: each kind's bit in the codec's sets of expected kinds (its order: `TUNNEL_KINDS`)
_BITS: dict[type[Any], int] = {_TYPES[name]: 1 << i for i, name in enumerate(TUNNEL_KINDS)}
#: the set of each `expected` tuple a caller passed (made once per tuple)
_SETS: dict[tuple[type[Any], ...], int] = {}


def encode(message: Message, binary: bool) -> bytes:
    """One websocket message: msgpack when `binary`, else UTF-8 JSON."""
    return tunnel_encode(message, binary)


def decode(data: bytes, binary: bool, expected: tuple[type[M], ...]) -> M:
    """Parse one message; WireError unless it is one of the `expected` kinds, well formed."""
    kinds = _SETS.get(expected)
    if kinds is None:
        kinds = _SETS[expected] = sum([_BITS[kind] for kind in expected])
    try:
        name, values = tunnel_decode(data, binary, kinds)
    except TunnelWireError as err:
        raise WireError(str(err)) from None
    return cast(M, _TYPES[name](*values))
