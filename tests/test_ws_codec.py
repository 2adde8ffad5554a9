"""rmb_relay._core websocket codec (rust/ws.rs) through the Python binding.

Golden bytes both ways (RFC 6455 section 5.7), every violation with its close code, and a
property test: however a byte stream is cut into chunks, the decoder returns the same events.
"""

from __future__ import annotations

import itertools
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from rmb_relay._core import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    ClientFrameEncoder,
    HttpRequest,
    HttpStreamParser,
    WsClose,
    WsDecoder,
    WsEvent,
    WsMessage,
    WsPing,
    WsPong,
    WsViolation,
    encode_binary,
    encode_binary_batch,
    encode_close,
    encode_frame,
    encode_request,
    encode_switching_protocols,
    validate_websocket_upgrade,
)

MASK = bytes.fromhex("37fa213d")

Event = tuple[object, ...]


def as_tuple(ev: WsEvent) -> Event:
    """Events as plain tuples, easy to compare."""
    if isinstance(ev, WsMessage):
        return ("message", ev.is_text, ev.data)
    if isinstance(ev, WsPing):
        return ("ping", ev.data)
    if isinstance(ev, WsPong):
        return ("pong", ev.data)
    if isinstance(ev, WsClose):
        return ("close", ev.code, ev.reason)
    assert isinstance(ev, WsViolation)
    return ("violation", ev.code, ev.reason)


def decode(data: bytes, **kwargs: object) -> list[Event]:
    return [as_tuple(ev) for ev in WsDecoder(**kwargs).feed(data)]  # type: ignore[arg-type]


def masked(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    return encode_frame(opcode, payload, fin=fin, mask=MASK)


def test_opcode_constants_match_rfc6455() -> None:
    assert (OP_CONTINUATION, OP_TEXT, OP_BINARY) == (0x0, 0x1, 0x2)
    assert (OP_CLOSE, OP_PING, OP_PONG) == (0x8, 0x9, 0xA)


# ---- golden bytes (RFC 6455 section 5.7) ----


def test_unmasked_text_golden_bytes_both_ways() -> None:
    frame = bytes.fromhex("810548656c6c6f")
    assert encode_frame(OP_TEXT, b"Hello") == frame
    assert decode(frame, client_mode=True) == [("message", True, b"Hello")]


def test_masked_text_golden_bytes_both_ways() -> None:
    frame = bytes.fromhex("818537fa213d7f9f4d5158")
    assert encode_frame(OP_TEXT, b"Hello", mask=MASK) == frame
    assert decode(frame) == [("message", True, b"Hello")]


def test_fragmented_text_golden_bytes() -> None:
    first = bytes.fromhex("010348656c")
    last = bytes.fromhex("80026c6f")
    assert encode_frame(OP_TEXT, b"Hel", fin=False) == first
    assert encode_frame(OP_CONTINUATION, b"lo") == last
    assert decode(first + last, client_mode=True) == [("message", True, b"Hello")]


def test_binary_length_encodings() -> None:
    assert encode_binary(b"\x00" * 256)[:4] == bytes.fromhex("827e0100")
    assert encode_binary(b"\x00" * 65536)[:10] == bytes.fromhex("827f0000000000010000")
    assert len(encode_binary(b"\x00" * 125)) == 127


def test_encode_close_golden_bytes() -> None:
    assert encode_close(1000) == bytes.fromhex("880203e8")
    assert encode_close(1001, "bye") == bytes.fromhex("880503e9") + b"bye"


def test_encode_close_rejects_codes_that_may_not_be_sent() -> None:
    for code in (0, 999, 1005, 1006, 1015, 5000, 70000):
        with pytest.raises(ValueError, match="may not be sent"):
            encode_close(code)


def test_encode_close_cuts_long_reason_at_a_character_boundary() -> None:
    frame = encode_close(1000, "é" * 100)
    assert decode(frame, client_mode=True) == [("close", 1000, "é" * 61)]


def test_encode_frame_rejects_bad_mask_and_opcode() -> None:
    with pytest.raises(ValueError, match="4 bytes"):
        encode_frame(OP_BINARY, b"x", mask=b"abc")
    with pytest.raises(ValueError, match="4 bits"):
        encode_frame(16, b"x")


def test_binary_batch_is_the_concatenation_of_frames() -> None:
    payloads = [b"", b"a", b"b" * 125, b"c" * 126, b"d" * 70000]
    assert encode_binary_batch(payloads) == b"".join(encode_binary(p) for p in payloads)
    assert encode_binary_batch([]) == b""
    events = decode(encode_binary_batch(payloads), client_mode=True)
    assert events == [("message", False, p) for p in payloads]


# ---- decoding ----


def test_decoder_events_are_the_public_types() -> None:
    events = WsDecoder().feed(masked(OP_BINARY, b"x") + masked(OP_PING, b"p"))
    assert all(isinstance(ev, WsEvent) for ev in events)
    assert isinstance(events[0], WsMessage)
    assert events[0].data == b"x"
    assert not events[0].is_text
    assert repr(events[1]) == "WsPing(len=1)"


def test_control_frames_interleave_with_fragments() -> None:
    data = (
        masked(OP_BINARY, b"one ", fin=False)
        + masked(OP_PING, b"p")
        + masked(OP_CONTINUATION, b"two ", fin=False)
        + masked(OP_PONG, b"q")
        + masked(OP_CONTINUATION, b"three")
    )
    assert decode(data) == [("ping", b"p"), ("pong", b"q"), ("message", False, b"one two three")]


def test_partial_frame_is_buffered_until_complete() -> None:
    decoder = WsDecoder()
    frame = masked(OP_BINARY, b"x" * 1000)
    assert decoder.feed(frame[:500]) == []
    assert decoder.buffered == 500
    assert [as_tuple(ev) for ev in decoder.feed(frame[500:])] == [("message", False, b"x" * 1000)]
    assert decoder.buffered == 0


def test_close_without_body_has_no_code_and_ends_decoding() -> None:
    decoder = WsDecoder()
    events = decoder.feed(masked(OP_CLOSE, b"") + masked(OP_BINARY, b"after"))
    assert [as_tuple(ev) for ev in events] == [("close", None, "")]
    assert decoder.closed
    assert decoder.feed(masked(OP_BINARY, b"later")) == []


def test_client_mode_decodes_server_frames() -> None:
    data = encode_binary(b"bin") + encode_frame(OP_PING, b"hb") + encode_close(1001, "going")
    assert decode(data, client_mode=True) == [
        ("message", False, b"bin"),
        ("ping", b"hb"),
        ("close", 1001, "going"),
    ]


# ---- violations and their close codes ----


def assert_violation(data: bytes, code: int, **kwargs: object) -> None:
    decoder = WsDecoder(**kwargs)  # type: ignore[arg-type]
    events = decoder.feed(data)
    assert len(events) == 1
    assert isinstance(events[0], WsViolation)
    assert events[0].code == code
    assert decoder.closed
    assert decoder.buffered == 0
    assert decoder.feed(masked(OP_BINARY, b"more")) == []


def test_server_rejects_unmasked_frame() -> None:
    assert_violation(encode_binary(b"x"), 1002)


def test_client_rejects_masked_frame() -> None:
    assert_violation(masked(OP_BINARY, b"x"), 1002, client_mode=True)


@pytest.mark.parametrize("rsv", [0x40, 0x20, 0x10])
def test_reserved_bits_are_a_protocol_error(rsv: int) -> None:
    frame = bytearray(masked(OP_BINARY, b"x"))
    frame[0] |= rsv
    assert_violation(bytes(frame), 1002)


@pytest.mark.parametrize("opcode", [3, 4, 5, 6, 7, 0xB, 0xC, 0xD, 0xE, 0xF])
def test_unknown_opcode_is_a_protocol_error(opcode: int) -> None:
    assert_violation(masked(opcode, b""), 1002)


def test_fragmented_or_long_control_frames_are_protocol_errors() -> None:
    assert_violation(masked(OP_PING, b"", fin=False), 1002)
    assert_violation(masked(OP_PONG, b"x" * 126)[:2], 1002)


def test_continuation_without_a_message_is_a_protocol_error() -> None:
    assert_violation(masked(OP_CONTINUATION, b"x"), 1002)


def test_new_message_inside_a_fragmented_one_is_a_protocol_error() -> None:
    assert_violation(masked(OP_TEXT, b"a", fin=False) + masked(OP_BINARY, b"b"), 1002)


def test_length_with_high_bit_set_is_a_protocol_error() -> None:
    header = bytes([0x82, 0x80 | 127]) + struct.pack(">Q", 1 << 63) + MASK
    assert_violation(header, 1002)


def test_one_byte_close_payload_is_a_protocol_error() -> None:
    assert_violation(masked(OP_CLOSE, b"\x03"), 1002)


@pytest.mark.parametrize("code", [0, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000, 65535])
def test_invalid_close_code_is_a_protocol_error(code: int) -> None:
    assert_violation(masked(OP_CLOSE, struct.pack(">H", code)), 1002)


@pytest.mark.parametrize("code", [1000, 1003, 1007, 1014, 3000, 4999])
def test_valid_close_code_is_reported(code: int) -> None:
    assert decode(masked(OP_CLOSE, struct.pack(">H", code) + b"ok")) == [("close", code, "ok")]


def test_invalid_utf8_is_1007() -> None:
    assert_violation(masked(OP_CLOSE, b"\x03\xe8\xff"), 1007)
    assert_violation(masked(OP_TEXT, b"\xc3\x28"), 1007)
    assert_violation(masked(OP_TEXT, b"ok", fin=False) + masked(OP_CONTINUATION, b"\xff"), 1007)


def test_oversized_message_is_1009_from_its_header_alone() -> None:
    header = bytes([0x82, 0x80 | 127]) + struct.pack(">Q", 1 << 40) + MASK
    assert_violation(header, 1009)
    assert_violation(masked(OP_BINARY, b"x" * 101)[:8], 1009, max_message=100)
    reassembled = masked(OP_BINARY, b"x" * 60, fin=False) + masked(OP_CONTINUATION, b"y" * 41)
    assert_violation(reassembled, 1009, max_message=100)
    assert decode(masked(OP_BINARY, b"x" * 100), max_message=100) == [
        ("message", False, b"x" * 100)
    ]


def test_events_before_a_violation_are_returned_in_order() -> None:
    data = masked(OP_BINARY, b"a") + masked(OP_PING, b"b") + encode_binary(b"unmasked")
    assert decode(data) == [
        ("message", False, b"a"),
        ("ping", b"b"),
        ("violation", 1002, "unmasked client frame"),
    ]


# ---- client encoder ----


def test_client_encoder_frames_decode_in_server_mode() -> None:
    enc = ClientFrameEncoder(os.urandom(32))
    data = (
        enc.binary(b"bin")
        + enc.binary_batch([b"b1", b"", b"b3" * 40000])
        + enc.text("héllo")
        + enc.ping(b"p")
        + enc.pong()
        + enc.close(4000, "bye")
    )
    assert decode(data) == [
        ("message", False, b"bin"),
        ("message", False, b"b1"),
        ("message", False, b""),
        ("message", False, b"b3" * 40000),
        ("message", True, "héllo".encode()),
        ("ping", b"p"),
        ("pong", b""),
        ("close", 4000, "bye"),
    ]
    assert decode(enc.close()) == [("close", 1000, "")]


def test_client_encoder_masks_depend_on_the_seed() -> None:
    frames_a = [ClientFrameEncoder(b"a" * 32).binary(b"x" * 8) for _ in range(2)]
    frames_b = ClientFrameEncoder(b"b" * 32).binary(b"x" * 8)
    assert frames_a[0] == frames_a[1]
    assert frames_a[0] != frames_b
    enc = ClientFrameEncoder(os.urandom(32))
    masks = {enc.binary(b"")[2:6] for _ in range(200)}
    assert len(masks) > 190


def test_client_encoder_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        ClientFrameEncoder(b"short")
    enc = ClientFrameEncoder(os.urandom(32))
    with pytest.raises(ValueError, match="125"):
        enc.ping(b"x" * 126)
    with pytest.raises(ValueError, match="125"):
        enc.pong(b"x" * 126)
    with pytest.raises(ValueError, match="may not be sent"):
        enc.close(1006)


# ---- any split of a stream gives the same events ----


@st.composite
def client_streams(draw: st.DrawFn) -> tuple[bytes, list[Event]]:
    """A random stream of client frames and the events it must decode to."""
    enc = ClientFrameEncoder(draw(st.binary(min_size=32, max_size=32)))
    payloads = st.binary(max_size=300)
    data = bytearray()
    expect: list[Event] = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["binary", "batch", "text", "ping", "pong", "fragmented"]))
        if kind == "binary":
            payload = draw(st.one_of(payloads, st.just(b"z" * 70000)))
            data += enc.binary(payload)
            expect.append(("message", False, payload))
        elif kind == "batch":
            batch = draw(st.lists(payloads, max_size=5))
            data += enc.binary_batch(batch)
            expect += [("message", False, p) for p in batch]
        elif kind == "text":
            text = draw(st.text(max_size=100))
            data += enc.text(text)
            expect.append(("message", True, text.encode()))
        elif kind in ("ping", "pong"):
            payload = draw(st.binary(max_size=125))
            data += enc.ping(payload) if kind == "ping" else enc.pong(payload)
            expect.append((kind, payload))
        else:
            parts = draw(st.lists(payloads, min_size=1, max_size=5))
            for i, part in enumerate(parts):
                opcode = OP_BINARY if i == 0 else OP_CONTINUATION
                mask = draw(st.binary(min_size=4, max_size=4))
                data += encode_frame(opcode, part, fin=i == len(parts) - 1, mask=mask)
                if i < len(parts) - 1 and draw(st.booleans()):
                    data += enc.ping(b"between")
                    expect.append(("ping", b"between"))
            expect.append(("message", False, b"".join(parts)))
    if draw(st.booleans()):
        data += enc.close(1000, "done")
        expect.append(("close", 1000, "done"))
    return bytes(data), expect


@settings(deadline=None, max_examples=150)
@given(stream=client_streams(), cuts=st.lists(st.floats(0, 1), max_size=20))
def test_any_split_of_a_stream_gives_the_same_events(
    stream: tuple[bytes, list[Event]], cuts: list[float]
) -> None:
    data, expect = stream
    assert decode(data) == expect
    points = sorted({int(c * len(data)) for c in cuts} | {0, len(data)})
    decoder = WsDecoder()
    events: list[Event] = []
    for start, end in itertools.pairwise(points):
        events += [as_tuple(ev) for ev in decoder.feed(data[start:end])]
    assert events == expect


def test_byte_at_a_time_gives_the_same_events() -> None:
    enc = ClientFrameEncoder(os.urandom(32))
    data = enc.binary(b"a" * 300) + enc.ping(b"p") + enc.text("t" * 70000) + enc.close()
    decoder = WsDecoder()
    events: list[Event] = []
    for i in range(len(data)):
        events += [as_tuple(ev) for ev in decoder.feed(data[i : i + 1])]
    assert events == decode(data)
    assert len(events) == 4


# ---- interoperability with the `websockets` library (sans-I/O, no sockets) ----


def test_websockets_client_talks_to_our_server_codec() -> None:
    client = ClientProtocol(parse_uri("ws://relay/?jwt"))
    client.send_request(client.connect())
    request = HttpStreamParser().feed(b"".join(client.data_to_send()))[0]
    assert isinstance(request, HttpRequest)
    assert request.is_websocket_upgrade
    accept = validate_websocket_upgrade(request)
    client.receive_data(encode_switching_protocols(accept) + encode_binary(b"from server"))
    events = client.events_received()
    assert events[-1].opcode == Opcode.BINARY
    assert events[-1].data == b"from server"

    client.send_binary(b"from client")
    client.send_text(b"text too")
    client.send_ping(b"hb")
    client.send_close(1000, "bye")
    decoded = decode(b"".join(client.data_to_send()))
    assert decoded == [
        ("message", False, b"from client"),
        ("message", True, b"text too"),
        ("ping", b"hb"),
        ("close", 1000, "bye"),
    ]


def test_websockets_server_accepts_our_client_codec() -> None:
    server = ServerProtocol()
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    server.receive_data(
        encode_request(
            "GET",
            "/gateway/websocket",
            [
                ("Host", "relay"),
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
                ("Sec-WebSocket-Key", key),
                ("Sec-WebSocket-Version", "13"),
            ],
        )
    )
    (request,) = server.events_received()
    server.send_response(server.accept(request))
    assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in server.data_to_send()[0]

    enc = ClientFrameEncoder(os.urandom(32))
    server.receive_data(enc.binary(b"x" * 70000) + enc.text("hé") + enc.ping(b"p"))
    frames = server.events_received()
    assert [(f.opcode, f.data) for f in frames] == [
        (Opcode.BINARY, b"x" * 70000),
        (Opcode.TEXT, "hé".encode()),
        (Opcode.PING, b"p"),
    ]
