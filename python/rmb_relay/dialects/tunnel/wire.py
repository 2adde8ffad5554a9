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

`encode` and `decode` run the Rust codec (`rust/tunnel_wire.rs`, the same bytes and the same
objects, checked by tests/test_tunnel_wire_native.py); whatever it leaves alone (a value of an
unusual type, a malformed message, anything it does not parse) goes through the Python codec
below (`encode_py`, `decode_py`), which also words every error.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from rmb_relay._core import TunnelWireError, tunnel_decode, tunnel_encode

__all__ = [
    "AcknowledgeRequest",
    "ClientRequest",
    "TargetResponse",
    "TenantConfig",
    "WireError",
    "decode",
    "decode_py",
    "encode",
    "encode_py",
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

    __slots__ = ("attr", "base", "default", "optional", "required", "simple", "wire")

    def __init__(
        self, attr: str, annotation: str, required: bool, default: Callable[[], Any]
    ) -> None:
        self.attr = attr
        #: the value of an absent optional field (a fresh one each time: `default_factory`)
        self.default = default
        self.wire = _camel(attr)
        self.optional = annotation.endswith("| None")
        self.base = annotation.removesuffix(" | None")
        self.required = required
        #: the exact types a str/int/bool field takes as they are (checked inline by
        #: `_from_object`, without a `_check` call per field); empty for the other kinds
        self.simple: tuple[type, ...] = _SIMPLE.get(self.base, ())


def _default(f: Field[Any]) -> Callable[[], Any]:
    if f.default_factory is not MISSING:
        return f.default_factory
    value = None if f.default is MISSING else f.default
    return lambda: value


_FIELDS: dict[type[Any], tuple[_Field, ...]] = {
    cls: tuple(
        _Field(
            f.name,
            str(f.type),
            f.default is MISSING and f.default_factory is MISSING,
            _default(f),
        )
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
    obj: dict[str, Any] = _ENCODERS[type(message)](message, binary)
    return obj


def _from_object(cls: type[M], obj: Any, binary: bool) -> M:
    if type(obj) is not dict:
        raise WireError(f"{cls.NAME}: the argument must be an object")
    message: M = _DECODERS[cls](obj, binary)
    return message


_ABSENT = object()


def _slow(cls: type[Any], spec: _Field, value: Any, binary: bool) -> Any:
    """A field the generated decoder could not take as it is: absent (its default, or
    WireError when required), null, or a kind `_check` converts or refuses."""
    if value is _ABSENT:
        if spec.required:
            raise WireError(f"{cls.NAME}.{spec.wire} is missing")
        return spec.default()
    if value is None and spec.optional:
        return None
    return _check(cls, spec, value, binary)


def _inline_test(spec: _Field, var: str) -> str:
    """The generated decoder's test for a value taken as it is (else `_slow` decides)."""
    if spec.simple:
        return f"type({var}) is {spec.simple[0].__name__}"
    if spec.base == "bytes":
        return f"binary and type({var}) is bytes"
    if spec.base == "float":
        return f"type({var}) is float"
    return "False"  # headers: `_check` walks them


def _compile_decoder(cls: type[Any]) -> Any:
    """A function `(obj, binary) -> cls` with one line per field, generated once per kind: the
    generic walk over `_FIELDS` (a loop, a sentinel lookup and a kwargs dict per message) was
    the largest part of decoding in the connector's profile. Same results as the walk: a value
    of the field's exact type is taken as it is, everything else goes through `_slow`."""
    specs = _FIELDS[cls]
    lines = ["def decode(obj, binary):", "    get = obj.get"]
    for i, spec in enumerate(specs):
        var = f"v{i}"
        lines.append(f"    {var} = get({spec.wire!r}, _ABSENT)")
        lines.append(f"    if not ({_inline_test(spec, var)}):")
        lines.append(f"        {var} = _slow(cls, specs[{i}], {var}, binary)")
    lines.append(f"    return cls({', '.join(f'v{i}' for i in range(len(specs)))})")
    namespace: dict[str, Any] = {"_ABSENT": _ABSENT, "_slow": _slow, "cls": cls, "specs": specs}
    exec("\n".join(lines), namespace)  # the source is built above from field names
    return namespace["decode"]


def _compile_encoder(cls: type[Any]) -> Any:
    """A function `(message, binary) -> dict` with the wire names spelled out, generated once
    per kind (as `_compile_decoder`); bytes fields are base64 text in JSON."""
    specs = _FIELDS[cls]
    items = []
    prelude = []
    for i, spec in enumerate(specs):
        if spec.base == "bytes":
            prelude.append(f"    b{i} = message.{spec.attr}")
            prelude.append(f"    if b{i} is not None and not binary:")
            prelude.append(f"        b{i} = b64encode(b{i}).decode()")
            items.append(f"{spec.wire!r}: b{i}")
        else:
            items.append(f"{spec.wire!r}: message.{spec.attr}")
    lines = ["def encode(message, binary):", *prelude, f"    return {{{', '.join(items)}}}"]
    namespace: dict[str, Any] = {"b64encode": base64.b64encode}
    exec("\n".join(lines), namespace)  # the source is built above from field names
    return namespace["encode"]


_DECODERS: dict[type[Any], Any] = {cls: _compile_decoder(cls) for cls in _TYPES.values()}
_ENCODERS: dict[type[Any], Any] = {cls: _compile_encoder(cls) for cls in _TYPES.values()}


def encode(message: Message, binary: bool) -> bytes:
    """One websocket message: msgpack when `binary`, else UTF-8 JSON (Rust, else Python)."""
    try:
        return tunnel_encode(message, binary)
    except TunnelWireError:
        return encode_py(message, binary)


def decode(data: bytes, binary: bool, expected: tuple[type[M], ...]) -> M:
    """Parse one message; WireError unless it is one of the `expected` kinds, well formed."""
    if type(data) is bytes:
        try:
            name, values = tunnel_decode(data, binary)
        except TunnelWireError:
            pass
        else:
            cls = _TYPES[name]
            if cls in expected:
                return cls(*values)
    return decode_py(data, binary, expected)


def encode_py(message: Message, binary: bool) -> bytes:
    """`encode` in Python: the reference the Rust codec is held to."""
    invocation = {"target": message.NAME, "arguments": [_to_object(message, binary)]}
    if binary:
        return _pack(invocation)  # type: ignore[no-any-return]
    return _dump_json(invocation).encode()


#: one packer and one JSON encoder for every message (packb and dumps(separators=) build
#: theirs on each call); the same bytes as `msgpack.packb(use_bin_type=True)` and compact JSON
_pack = msgpack.Packer(use_bin_type=True).pack
_dump_json = json.JSONEncoder(separators=(",", ":")).encode


def decode_py(data: bytes, binary: bool, expected: tuple[type[M], ...]) -> M:
    """`decode` in Python: the reference the Rust codec is held to, and the words of every
    WireError."""
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
