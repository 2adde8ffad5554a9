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

Decoding validates every field's type and raises `WireError` with a message naming the field:
a connector gets that text back in an `Error` message and its connection stays up.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

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


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


#: exact types accepted per annotation (bool is not an int here)
_SIMPLE: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,)}


class _Field:
    """One field's wire name and type, worked out once per class (decoding runs per message)."""

    __slots__ = ("attr", "base", "optional", "required", "simple", "wire")

    def __init__(self, attr: str, annotation: str, required: bool) -> None:
        self.attr = attr
        self.wire = _camel(attr)
        self.optional = annotation.endswith("| None")
        self.base = annotation.removesuffix(" | None")
        self.required = required
        #: the exact types a str/int/bool field takes as they are (checked inline by
        #: `_from_object`, without a `_check` call per field); empty for the other kinds
        self.simple: tuple[type, ...] = _SIMPLE.get(self.base, ())


_FIELDS: dict[type[Any], tuple[_Field, ...]] = {
    cls: tuple(
        _Field(f.name, str(f.type), f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)
    )
    for cls in _TYPES.values()
}


def _check(cls: type[Any], spec: _Field, value: Any, binary: bool) -> Any:
    """`value` as the field's type, or WireError."""
    base = spec.base
    if value is None:
        if spec.optional:
            return None
        raise WireError(f"{cls.NAME}.{spec.wire} must not be null")
    simple = _SIMPLE.get(base)
    if simple is not None:
        if type(value) in simple:
            return value
    elif base == "bytes":
        if binary and type(value) is bytes:
            return value
        if not binary and type(value) is str:
            try:
                # strict: the alphabet, padding and nothing after it, checked in C
                # (b64decode(validate=True) runs a regex over the text first)
                return binascii.a2b_base64(value, strict_mode=True)
            except (binascii.Error, ValueError):
                raise WireError(f"{cls.NAME}.{spec.wire} is not valid base64") from None
    elif base == "float":
        if type(value) in (int, float):
            return float(value)
    elif base == "Headers":
        if _is_headers(value):
            return value
        raise WireError(f"{cls.NAME}.{spec.wire} must map header names to lists of strings")
    raise WireError(f"{cls.NAME}.{spec.wire} must be {base}, got {type(value).__name__}")


def _is_headers(value: Any) -> bool:
    """A dict of str to lists of str. Plain loops: nested `all(...)` generators were the largest
    item of message decoding in the relay's profile (two generator frames per header)."""
    if type(value) is not dict:
        return False
    for name, values in value.items():
        if type(name) is not str or type(values) is not list:
            return False
        for item in values:
            if type(item) is not str:
                return False
    return True


def _to_object(message: Message, binary: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in _FIELDS[type(message)]:
        value = getattr(message, spec.attr)
        if value is not None and not binary and spec.base == "bytes":
            value = base64.b64encode(value).decode()
        out[spec.wire] = value
    return out


def _from_object(cls: type[M], obj: Any, binary: bool) -> M:
    if type(obj) is not dict:
        raise WireError(f"{cls.NAME}: the argument must be an object")
    values: dict[str, Any] = {}
    for spec in _FIELDS[cls]:
        value = obj.get(spec.wire, _ABSENT)
        if value is _ABSENT:
            if spec.required:
                raise WireError(f"{cls.NAME}.{spec.wire} is missing")
            continue
        if type(value) in spec.simple or (value is None and spec.optional):
            values[spec.attr] = value  # the common case, decided without a call
        else:
            values[spec.attr] = _check(cls, spec, value, binary)
    return cls(**values)


_ABSENT = object()


def encode(message: Message, binary: bool) -> bytes:
    """One websocket message: msgpack when `binary`, else UTF-8 JSON."""
    invocation = {"target": message.NAME, "arguments": [_to_object(message, binary)]}
    if binary:
        return msgpack.packb(invocation, use_bin_type=True)  # type: ignore[no-any-return]
    return json.dumps(invocation, separators=(",", ":")).encode()


def decode(data: bytes, binary: bool, expected: tuple[type[M], ...]) -> M:
    """Parse one message; WireError unless it is one of the `expected` kinds, well formed."""
    try:
        invocation = (
            msgpack.unpackb(data, raw=False, strict_map_key=True) if binary else json.loads(data)
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise WireError(f"not {'msgpack' if binary else 'JSON'}: {err}") from None
    if not isinstance(invocation, dict):
        raise WireError('a message must be an object {"target": ..., "arguments": [...]}')
    name = invocation.get("target")
    arguments = invocation.get("arguments")
    cls = _TYPES.get(name) if isinstance(name, str) else None
    if cls is None or cls not in expected:
        names = ", ".join(kind.NAME for kind in expected)
        raise WireError(f"unknown message target {name!r} (expected {names})")
    if not isinstance(arguments, list) or len(arguments) != 1:
        raise WireError(f"{name}: arguments must be a list of one object")
    return _from_object(cls, arguments[0], binary)
