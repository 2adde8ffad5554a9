"""The Rust envelope scan and codec against the `protobuf` package's full decode."""

from __future__ import annotations

import contextlib
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmb_relay._core import (
    MSG_ERROR,
    MSG_NONE,
    MSG_PING,
    MSG_PONG,
    MSG_REQUEST,
    MSG_RESPONSE,
    Envelope,
    EnvelopeError,
    build_error_envelope,
    build_pong,
    scan_envelope,
)
from tests._proto import types_pb2

KINDS = {
    None: MSG_NONE,
    "request": MSG_REQUEST,
    "response": MSG_RESPONSE,
    "error": MSG_ERROR,
    "ping": MSG_PING,
    "pong": MSG_PONG,
}

text = st.text(max_size=20)
maybe_text = st.none() | text


@st.composite
def envelopes(draw: st.DrawFn) -> types_pb2.Envelope:
    env = types_pb2.Envelope(
        uid=draw(text),
        timestamp=draw(st.integers(0, 2**64 - 1)),
        expiration=draw(st.integers(0, 2**64 - 1)),
    )
    for name in ("tags", "schema", "federation"):
        value = draw(maybe_text)
        if value is not None:
            setattr(env, name, value)
    for field in ("source", "destination"):
        if draw(st.booleans()):
            address = getattr(env, field)
            address.SetInParent()
            address.twin = draw(st.integers(0, 2**32 - 1))
            connection = draw(maybe_text)
            if connection is not None:
                address.connection = connection
    kind = draw(st.sampled_from(list(KINDS)))
    if kind == "request":
        env.request.command = draw(text)
    elif kind == "error":
        env.error.code = draw(st.integers(0, 2**32 - 1))
        env.error.message = draw(text)
    elif kind is not None:
        getattr(env, kind).SetInParent()
    payload = draw(st.sampled_from([None, "plain", "cipher"]))
    if payload is not None:
        setattr(env, payload, draw(st.binary(max_size=64)))
    signature = draw(st.none() | st.binary(min_size=65, max_size=65))
    if signature is not None:
        env.signature = signature
    env.relays.extend(draw(st.lists(text, max_size=3)))
    return env


@settings(max_examples=300)
@given(envelopes())
def test_scan_agrees_with_protobuf_decode(reference: types_pb2.Envelope) -> None:
    wire = reference.SerializeToString()
    routing = scan_envelope(wire)
    assert routing.uid == reference.uid
    assert routing.tags == (reference.tags if reference.HasField("tags") else None)
    assert routing.timestamp == reference.timestamp
    assert routing.expiration == reference.expiration
    assert routing.source_twin == reference.source.twin
    assert routing.source_connection == (
        reference.source.connection if reference.source.HasField("connection") else None
    )
    assert routing.dest_twin == reference.destination.twin
    assert routing.dest_connection == (
        reference.destination.connection if reference.destination.HasField("connection") else None
    )
    assert routing.kind == KINDS[reference.WhichOneof("message")]
    tokens = reference.tags.replace(",", " ").split() if reference.HasField("tags") else []
    assert routing.fail_fast == ("fail-fast" in tokens)


@settings(max_examples=300)
@given(envelopes())
def test_decode_encode_round_trips_through_protobuf(reference: types_pb2.Envelope) -> None:
    wire = reference.SerializeToString()
    ours = Envelope.decode(wire)
    again = types_pb2.Envelope.FromString(ours.encode())
    assert again == reference
    assert ours.plain == (reference.plain if reference.HasField("plain") else None)
    assert ours.cipher == (reference.cipher if reference.HasField("cipher") else None)
    assert ours.relays == list(reference.relays)


@settings(max_examples=200)
@given(envelopes())
def test_challenge_matches_an_independent_computation(reference: types_pb2.Envelope) -> None:
    stream = reference.uid.encode()
    if reference.HasField("tags"):
        stream += reference.tags.encode()
    stream += str(reference.timestamp).encode() + str(reference.expiration).encode()
    for address in (reference.source, reference.destination):
        stream += str(address.twin).encode()
        if address.HasField("connection"):
            stream += address.connection.encode()
    kind = reference.WhichOneof("message")
    if kind == "request":
        stream += reference.request.command.encode()
    elif kind == "error":
        stream += str(reference.error.code).encode() + reference.error.message.encode()
    for name in ("schema", "federation"):
        if reference.HasField(name):
            stream += getattr(reference, name).encode()
    payload = reference.WhichOneof("payload")
    if payload is not None:
        stream += getattr(reference, payload)
    for relay in reference.relays:
        stream += relay.encode()
    assert Envelope.decode(reference.SerializeToString()).challenge() == (
        hashlib.md5(stream).digest()
    )


@given(st.binary(max_size=200))
def test_random_bytes_scan_or_raise_envelope_error(data: bytes) -> None:
    with contextlib.suppress(EnvelopeError):
        scan_envelope(data)


@settings(max_examples=100)
@given(envelopes(), st.data())
def test_truncated_envelopes_scan_or_raise_envelope_error(
    reference: types_pb2.Envelope, data: st.DataObject
) -> None:
    wire = reference.SerializeToString()
    cut = data.draw(st.integers(0, len(wire)))
    with contextlib.suppress(EnvelopeError):
        scan_envelope(wire[:cut])


def test_error_envelope_matches_rmb_rs_bytes() -> None:
    wire = build_error_envelope("ab", "no", 5, 7, None)
    # uid | timestamp | expiration 300 | destination{twin 7} | error{message}: rmb-rs order
    assert wire == bytes.fromhex("0a026162180520ac023202080762041202") + b"no"
    parsed = types_pb2.Envelope.FromString(wire)
    assert not parsed.HasField("source")
    assert parsed.error.code == 0


def test_pong_answers_ping() -> None:
    ping = types_pb2.Envelope(uid="p", plain=b"x")
    ping.source.twin = 1
    ping.destination.twin = 2
    ping.ping.SetInParent()
    pong = types_pb2.Envelope.FromString(build_pong(ping.SerializeToString()))
    assert pong.WhichOneof("message") == "pong"
    assert (pong.source.twin, pong.destination.twin) == (2, 1)
    assert pong.plain == b"xhello world"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x0a\x05ab", "past the end"),
        (b"\x08\x01", "wire type"),
        (b"\x0a\x01\xff", "UTF-8"),
        (b"\x00", "field number"),
    ],
)
def test_malformed_envelopes_say_what_is_wrong(data: bytes, reason: str) -> None:
    with pytest.raises(EnvelopeError, match=reason):
        scan_envelope(data)


def test_decoder_bound_to_a_session_checks_source_and_finds_destination() -> None:
    from rmb_relay._core import ClientFrameEncoder, RmbScanner, RouteTable, WsDecoder

    routes = RouteTable()
    routes.register_session(9, "svc", 42)
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, "app"))
    frames = []
    for source_sid, dest_sid in (("app", "svc"), ("other", "svc"), ("app", None)):
        env = Envelope("u")
        env.source_twin, env.source_connection = 7, source_sid
        env.dest_twin, env.dest_connection = 9, dest_sid
        frames.append(env.encode())
    events = decoder.feed(ClientFrameEncoder(bytes(32)).binary_batch(frames))
    routings = [e.routing for e in events]
    assert [(r.from_session, r.dest_conn_id) for r in routings] == [
        (True, 42),
        (False, 42),
        (True, None),
    ]
    routes.unregister_session(9, "svc", 42)  # later feeds see the table as it is then
    (event,) = decoder.feed(ClientFrameEncoder(bytes(32)).binary(frames[0]))
    assert event.routing.dest_conn_id is None
