"""The Rust tunnel codec (rust/tunnel_wire.rs) against wire.py's Python codec, its reference.

Encoding: the same bytes for every message, JSON and msgpack. Decoding: for any input the Rust
decoder either gives the very objects Python's gives, or refuses it (TunnelWireError), and
then `wire.decode` answers with Python's result or Python's WireError.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rmb_relay._core import (
    HttpRequest,
    HttpStreamParser,
    TunnelWireError,
    tunnel_decode,
    tunnel_encode,
    tunnel_request_headers,
)
from rmb_relay.dialects.tunnel import wire
from rmb_relay.dialects.tunnel.client import HOP_BY_HOP
from rmb_relay.dialects.tunnel.wire import (
    AcknowledgeRequest,
    ClientRequest,
    ErrorMessage,
    TargetResponse,
    TenantConfig,
    WireError,
)

ALL = (ClientRequest, TargetResponse, AcknowledgeRequest, TenantConfig, ErrorMessage)

text = st.text(max_size=40)
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
opt_text = st.none() | text
headers = st.dictionaries(text, st.lists(text, max_size=3), max_size=5)
bodies = st.none() | st.binary(max_size=300)
floats = st.floats(allow_nan=False) | st.integers(-(2**53), 2**53).map(float)

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


@SETTINGS
@given(message=messages, binary=st.booleans())
def test_rust_encoding_is_byte_identical_to_python(message: wire.Message, binary: bool) -> None:
    assert tunnel_encode(message, binary) == wire.encode_py(message, binary)


@SETTINGS
@given(message=messages, binary=st.booleans())
def test_rust_decoding_gives_python_objects(message: wire.Message, binary: bool) -> None:
    data = wire.encode_py(message, binary)
    expected = wire.decode_py(data, binary, ALL)
    try:
        name, values = tunnel_decode(data, binary)
    except TunnelWireError:
        # left to Python: integers beyond 64 bits, which msgpack/JSON can carry, and JSON's
        # Infinity (Python's extension of JSON)
        assert _left_to_python(message, binary)
        return
    decoded = wire._TYPES[name](*values)
    assert decoded == expected
    assert wire.decode(data, binary, ALL) == expected


def _left_to_python(message: wire.Message, binary: bool) -> bool:
    values = [getattr(message, f) for f in message.__slots__]
    return any(
        (type(v) is int and not -(2**63) <= v < 2**63)
        or (type(v) is float and not binary and not math.isfinite(v))
        for v in values
    )


# messages Python decodes one way or refuses, mutated or odd on purpose
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
    message = draw(messages)
    obj = (
        json.loads(wire.encode_py(message, False))
        if not binary
        else msgpack.unpackb(wire.encode_py(message, True), raw=False)
    )
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
        return json.dumps(obj).encode()
    except (TypeError, ValueError, OverflowError):
        return None


def _outcome(fn: Any, data: bytes, binary: bool) -> Any:
    try:
        return ("ok", fn(data, binary, ALL))
    except WireError as err:
        return ("error", str(err))


@SETTINGS
@given(case=odd_invocations())
def test_odd_messages_decode_as_python_decodes_them(case: tuple[Any, bool]) -> None:
    obj, binary = case
    data = _serialise(obj, binary)
    if data is None:
        return
    assert _outcome(wire.decode, data, binary) == _outcome(wire.decode_py, data, binary)


@SETTINGS
@given(data=st.binary(max_size=64), binary=st.booleans())
def test_any_bytes_decode_as_python_decodes_them(data: bytes, binary: bool) -> None:
    assert _outcome(wire.decode, data, binary) == _outcome(wire.decode_py, data, binary)


@pytest.mark.parametrize(
    "data",
    [
        b'{"target":"Deliver","arguments":[{"requestId":"\\ud800","requestOriginId":"o","httpStatusCode":1}]}',
        b'\xef\xbb\xbf{"target":"Error","arguments":[{"message":"bom"}]}',
        b'{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o","httpStatusCode":1e400}]}',
        b'{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o","httpStatusCode":99999999999999999999}]}',
        b'{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o","httpStatusCode":1,"bodyContent":"QR=="}]}',
        b'{"target":"Configure","arguments":[{"keepAliveInterval":NaN}]}',
        b'{"target":"Deliver","arguments":[{"requestId":"r"}]}',
        b"[" * 100 + b"]" * 100,
    ],
)
def test_messages_the_rust_decoder_leaves_to_python(data: bytes) -> None:
    """Each is refused by Rust and decided by Python, with Python's result or error text."""
    with pytest.raises(TunnelWireError):
        tunnel_decode(data, False)
    assert _outcome(wire.decode, data, False) == _outcome(wire.decode_py, data, False)


def test_a_kind_not_expected_gets_pythons_error() -> None:
    data = wire.encode(ErrorMessage("x"), True)
    with pytest.raises(WireError, match="unknown message target 'Error'"):
        wire.decode(data, True, (TargetResponse,))


def test_values_of_other_types_are_encoded_by_python() -> None:
    message = ErrorMessage("x")
    message.message = bytearray(b"x")  # type: ignore[assignment]
    with pytest.raises(TunnelWireError):
        tunnel_encode(message, True)
    assert wire.encode(message, True) == wire.encode_py(message, True)


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
