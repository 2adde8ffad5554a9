"""The tunnel's one wire codec (rust/dialects/tunnel/wire.rs, wire.py its Python face).

Encoding: every message is the bytes Python's msgpack and json libraries write for the same
fields (the reference below). Decoding: what is encoded decodes to the same message; odd and
mutated messages are decoded as the reference rules say (`_reference`: the types wire.py's
dataclasses declare, as Python's libraries read the bytes), or refused with a WireError that
names the field.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import math
import re
from dataclasses import MISSING, fields
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rmb_relay._core import TUNNEL_HOP_BY_HOP as HOP_BY_HOP
from rmb_relay._core import (
    TUNNEL_KINDS,
    HttpRequest,
    HttpStreamParser,
    TunnelWireError,
    tunnel_decode,
    tunnel_encode,
    tunnel_request_headers,
)
from rmb_relay.dialects.tunnel import wire
from rmb_relay.dialects.tunnel.wire import (
    AcknowledgeRequest,
    ClientRequest,
    ErrorMessage,
    TargetResponse,
    TenantConfig,
    WireError,
    decode,
    encode,
)

ALL = (ClientRequest, TargetResponse, AcknowledgeRequest, TenantConfig, ErrorMessage)

text = st.text(max_size=40)
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
opt_text = st.none() | text
headers = st.dictionaries(text, st.lists(text, max_size=3), max_size=5)
bodies = st.none() | st.binary(max_size=300)
floats = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**53), 2**53).map(float)

client_requests = st.builds(
    ClientRequest,
    request_id=text,
    request_origin_id=text,
    target=text,
    tenant_name=text,
    http_method=text,
    url=text,
    http_headers=headers,
    acknowledge_mode=ints,
    acknowledge_origin_id=opt_text,
    original_body_size=ints,
    body_size=ints,
    body_content=bodies,
    enable_tracing=st.booleans(),
    discard_connector_response=st.booleans(),
    expires_in=st.none() | ints,
    acknowledge_url=opt_text,
)
target_responses = st.builds(
    TargetResponse,
    request_id=text,
    request_origin_id=text,
    http_status_code=ints,
    http_headers=headers,
    original_body_size=ints,
    body_size=ints,
    body_content=bodies,
    request_failed=st.booleans(),
    request_start=opt_text,
    request_duration=opt_text,
    connection_id=opt_text,
)
messages = st.one_of(
    client_requests,
    target_responses,
    st.builds(
        AcknowledgeRequest,
        origin_id=text,
        request_id=text,
        remove_request_body_content=st.booleans(),
    ),
    st.builds(
        TenantConfig,
        keep_alive_interval=floats,
        enable_tracing=st.booleans(),
        reconnect_minimum_delay=floats,
        reconnect_maximum_delay=floats,
    ),
    st.builds(ErrorMessage, message=text),
)

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _invocation(message: wire.Message, binary: bool) -> dict[str, Any]:
    """The message as the object the libraries write: bodies base64 text in JSON."""
    obj: dict[str, Any] = {}
    for f in fields(message):
        value = getattr(message, f.name)
        if isinstance(value, bytes) and not binary:
            value = base64.b64encode(value).decode()
        obj[_camel(f.name)] = value
    return {"target": message.NAME, "arguments": [obj]}


def _library_bytes(message: wire.Message, binary: bool) -> bytes:
    invocation = _invocation(message, binary)
    if binary:
        return msgpack.packb(invocation, use_bin_type=True)  # type: ignore[no-any-return]
    return json.dumps(invocation, separators=(",", ":")).encode()


@SETTINGS
@given(message=messages, binary=st.booleans())
def test_encoding_is_what_the_libraries_write(message: wire.Message, binary: bool) -> None:
    assert encode(message, binary) == _library_bytes(message, binary)


@SETTINGS
@given(message=messages, binary=st.booleans())
def test_what_is_encoded_decodes_to_the_same_message(message: wire.Message, binary: bool) -> None:
    assert decode(encode(message, binary), binary, ALL) == message


def test_the_kinds_are_in_the_codecs_order() -> None:
    assert [cls.NAME for cls in ALL] == list(TUNNEL_KINDS)


# ---- the reference rules (what wire.py's dataclasses declare, as the libraries read) --------

_TYPES = {cls.NAME: cls for cls in ALL}


def _reference(data: bytes, binary: bool, expected: tuple[type[wire.Message], ...]) -> Any:
    """("ok", message) or ("error", text) by the rules: the message's shape, then every field
    in dataclass order: absent (its default, or missing), null (None when optional), a value
    of the declared type (an int for a float; base64 text for JSON bodies), else an error."""
    try:
        obj = msgpack.unpackb(data, raw=False) if binary else json.loads(data)
    except ValueError:
        return ("error", "not " + ("msgpack" if binary else "JSON"))
    if not isinstance(obj, dict):
        return ("error", "a message must be an object")
    name = obj.get("target")
    cls = _TYPES.get(name) if isinstance(name, str) else None
    if cls is None or cls not in expected:
        return ("error", "unknown message target")
    arguments = obj.get("arguments")
    if not isinstance(arguments, list) or len(arguments) != 1:
        return ("error", f"{name}: arguments must be a list of one object")
    argument = arguments[0]
    if not isinstance(argument, dict):
        return ("error", f"{name}: the argument must be an object")
    values = []
    for f in fields(cls):
        where = f"{name}.{_camel(f.name)}"
        annotation = str(f.type)
        optional = annotation.endswith("| None")
        base = annotation.removesuffix(" | None")
        if _camel(f.name) not in argument:
            if f.default is MISSING and f.default_factory is MISSING:
                return ("error", f"{where} is missing")
            values.append(f.default_factory() if f.default is MISSING else f.default)  # type: ignore[misc]
            continue
        value = argument[_camel(f.name)]
        if value is None:
            if not optional:
                return ("error", f"{where} must not be null")
            values.append(None)
        elif base == "Headers":
            if not (
                isinstance(value, dict)
                and all(
                    isinstance(v, list) and all(type(s) is str for s in v) for v in value.values()
                )
            ):
                return ("error", f"{where} must map header names to lists of strings")
            values.append(value)
        elif base == "bytes" and not binary and type(value) is str:
            try:
                values.append(binascii.a2b_base64(value, strict_mode=True))
            except (binascii.Error, ValueError):
                return ("error", f"{where} is not valid base64")
        elif base == "float" and type(value) in (int, float):
            values.append(float(value))
        elif type(value).__name__ == base:
            if type(value) is int and not -(2**63) <= value < 2**63:
                return ("error", f"{where} is out of range")
            values.append(value)
        else:
            return ("error", f"{where} must be {base}, got {type(value).__name__}")
    return ("ok", cls(*values))


def _outcome(data: bytes, binary: bool) -> Any:
    try:
        return ("ok", decode(data, binary, ALL))
    except WireError as err:
        return ("error", str(err))


def _lone_surrogate(value: Any) -> bool:
    """Text Python's json reads and the codec refuses (tested on its own above)."""
    if isinstance(value, str):
        return any(0xD800 <= ord(c) < 0xE000 for c in value)
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False


def _same(data: bytes, binary: bool) -> None:
    if not binary:
        with contextlib.suppress(ValueError):
            assume(not _lone_surrogate(json.loads(data)))
    got, want = _outcome(data, binary), _reference(data, binary, ALL)
    if want[0] == "ok" or got[0] == "ok":
        assert got == want
    else:  # the texts of the format's own errors differ from the libraries' (same meaning)
        assert got[1].startswith(want[1]), (got, want)


json_objects = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)
field_names = st.sampled_from(
    [
        "requestId",
        "requestOriginId",
        "httpStatusCode",
        "httpHeaders",
        "bodySize",
        "bodyContent",
        "requestFailed",
        "originId",
        "removeRequestBodyContent",
        "message",
        "keepAliveInterval",
    ]
)


@st.composite
def odd_invocations(draw: st.DrawFn) -> tuple[Any, bool]:
    """An invocation of a known kind with some fields replaced by arbitrary values."""
    binary = draw(st.booleans())
    obj = _invocation(draw(messages), binary)
    argument = obj["arguments"][0]
    for name in draw(st.lists(field_names, max_size=3)):
        if draw(st.booleans()):
            argument.pop(name, None)
        else:
            argument[name] = draw(json_objects)
    if draw(st.integers(0, 9)) == 0:
        obj["target"] = draw(st.sampled_from(["Deliver", "Acknowledge", "Nope", 3]))
    if draw(st.integers(0, 9)) == 0:
        obj["arguments"] = draw(json_objects)
    return obj, binary


def _serialise(obj: Any, binary: bool) -> bytes | None:
    try:
        if binary:
            return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
        return json.dumps(obj, allow_nan=False).encode()
    except (TypeError, ValueError, OverflowError):
        return None


@SETTINGS
@given(case=odd_invocations())
def test_odd_messages_decode_by_the_rules(case: tuple[Any, bool]) -> None:
    obj, binary = case
    data = _serialise(obj, binary)
    assume(data is not None)
    assert data is not None
    _same(data, binary)


@SETTINGS
@given(message=messages, binary=st.booleans(), cut=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_mutated_messages_decode_by_the_rules(
    message: wire.Message, binary: bool, cut: int, byte: int
) -> None:
    data = bytearray(encode(message, binary))
    data[cut % len(data)] = byte
    _same(bytes(data), binary)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"not json", "not JSON: unexpected input at byte 0"),
        (b"[]", 'a message must be an object {"target": ..., "arguments": [...]}'),
        (
            b'{"target":"Nope","arguments":[{}]}',
            "unknown message target 'Nope' (expected RequestTarget, Deliver, Acknowledge, "
            "Configure, Error)",
        ),
        (
            b'{"target":"Deliver","arguments":[{"requestId":"\\ud800","requestOriginId":"o",'
            b'"httpStatusCode":1}]}',
            "Deliver.requestId is not valid Unicode",
        ),
        (
            b'{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o",'
            b'"httpStatusCode":99999999999999999999}]}',
            "Deliver.httpStatusCode is out of range",
        ),
        (b'{"target":"Configure","arguments":[{"keepAliveInterval":NaN}]}', "not JSON"),
        (b'{"target":"Deliver","arguments":[{"requestId":"r"}]}', "Deliver.requestOriginId is"),
        (b"[" * 100 + b"]" * 100, "not JSON: nested too deeply"),
    ],
)
def test_refusals_say_why(data: bytes, error: str) -> None:
    """Among them what Python's libraries would read (a lone surrogate, an integer beyond 64
    bits, NaN, deep nesting): the codec refuses those too, saying why."""
    with pytest.raises(WireError, match="^" + re.escape(error)):
        decode(data, False, ALL)
    with pytest.raises(TunnelWireError):
        tunnel_decode(data, False)


def test_a_bom_and_base64_trailing_bits_are_taken_as_python_takes_them() -> None:
    data = b'\xef\xbb\xbf{"target":"Error","arguments":[{"message":"bom"}]}'
    assert decode(data, False, ALL) == ErrorMessage("bom")
    data = (
        b'{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o",'
        b'"httpStatusCode":1,"bodyContent":"QR=="}]}'
    )
    assert decode(data, False, (TargetResponse,)).body_content == b"A"


def test_a_kind_not_expected_is_unknown() -> None:
    data = encode(ErrorMessage("x"), True)
    with pytest.raises(WireError, match=r"unknown message target 'Error' \(expected Deliver\)"):
        decode(data, True, (TargetResponse,))


def test_a_value_no_message_carries_is_refused_naming_the_field() -> None:
    message = ErrorMessage("x")
    message.message = object()  # type: ignore[assignment]
    with pytest.raises(
        TunnelWireError, match=r"cannot encode Error\.message: a value of type object"
    ):
        tunnel_encode(message, True)
    big = AcknowledgeRequest("o", "r")
    big.remove_request_body_content = 2**70  # type: ignore[assignment]
    with pytest.raises(TunnelWireError, match="beyond 64 bits"):
        encode(big, False)


def test_floats_are_written_as_python_writes_them() -> None:
    for value in (15.0, 0.1, 1e16, 1e-05, -0.0, 2.5e-07, math.inf):
        config = TenantConfig(keep_alive_interval=value)
        assert encode(config, False) == _library_bytes(config, False)


def _request_headers_py(request: HttpRequest) -> dict[str, list[str]]:
    """client.request_headers as it was in Python: the reference of the Rust one."""
    headers: dict[str, list[str]] = {}
    for name, value in request.headers:
        if name not in HOP_BY_HOP:
            headers.setdefault(name, []).append(value.decode("latin-1"))
    return headers


header_names = st.sampled_from(
    ["x-a", "X-B", "accept", "connection", "keep-alive", "te", "expect", "upgrade", "x-c"]
)
header_values = st.binary(max_size=12).map(
    lambda b: bytes(c for c in b if c not in b"\r\n\x00" and c >= 0x20)
)


@SETTINGS
@given(fields=st.lists(st.tuples(header_names, header_values), max_size=8))
def test_rust_request_headers_are_pythons(fields: list[tuple[str, bytes]]) -> None:
    head = b"GET /relay/a/b/c HTTP/1.1\r\nHost: h\r\n"
    head += b"".join(name.encode() + b": " + value + b"\r\n" for name, value in fields)
    events = HttpStreamParser(max_head=65536).feed(head + b"\r\n")
    request = events[0]
    assume(isinstance(request, HttpRequest))  # (values the parser refuses never get here)
    assert isinstance(request, HttpRequest)
    assert tunnel_request_headers(request) == _request_headers_py(request)
    assert request.header_count("host") == 1
