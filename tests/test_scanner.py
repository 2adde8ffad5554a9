"""Scanners in the websocket decoder (rust/scan.rs) through the Python binding.

A scanner reads each data message's routing inside the one `WsDecoder.feed` per read: RMB
envelopes (source check, destination lookup) and SBD messages (limiter charge, command or
forward, destination lookup, the forward rewritten in the copy that unmasks it). Golden bytes
both ways, and a property test holding the SBD scanner to the per-message functions it replaces.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rmb_relay._core import (
    MSG_REQUEST,
    OP_BINARY,
    OP_CONTINUATION,
    OP_TEXT,
    SBD_COMMAND,
    SBD_FORWARD,
    ByteNanosLimiter,
    ClientFrameEncoder,
    EnvelopeRouting,
    EnvelopeScanner,
    RmbScanner,
    RouteTable,
    SbdRouting,
    SbdScanner,
    Scanner,
    WsDecoder,
    WsMessage,
    encode_frame,
    sbd_classify,
    sbd_encode_command,
    sbd_rewrite_forward,
)
from tests.scan_helpers import DEST, SENDER, envelope, frames

MASK = bytes.fromhex("37fa213d")
Z = bytes(28)
IP = "::ffff:10.0.0.1"

#: uid "u", source {7, "app"}, destination {9, "svc"}, request {command "c"}
GOLDEN_ENVELOPE = bytes.fromhex("0a0175 2a0708071203617070 3207080912037376 63 3a030a0163")


def messages(decoder: WsDecoder, data: bytes, now: int = 0) -> list[WsMessage]:
    events = decoder.feed(data, now)
    assert all(isinstance(e, WsMessage) for e in events)
    return events  # type: ignore[return-value]


def envelope_routing(message: WsMessage) -> EnvelopeRouting:
    assert isinstance(message.routing, EnvelopeRouting), message.scan_error
    return message.routing


def sbd_routing(message: WsMessage) -> SbdRouting:
    assert isinstance(message.routing, SbdRouting), message.scan_error
    return message.routing


# ---- the decoder's scanner slot ------------------------------------------------------------


def test_decoder_without_scanner_leaves_messages_unscanned() -> None:
    (message,) = messages(WsDecoder(), frames(GOLDEN_ENVELOPE))
    assert (message.data, message.routing, message.scan_error) == (GOLDEN_ENVELOPE, None, None)


def test_scanner_is_held_as_passed_and_can_be_replaced() -> None:
    scanner = EnvelopeScanner()
    decoder = WsDecoder(scanner=scanner)
    assert decoder.scanner is scanner
    assert isinstance(scanner, Scanner)
    decoder.set_scanner(None)
    assert decoder.scanner is None
    (message,) = messages(decoder, frames(GOLDEN_ENVELOPE))
    assert message.routing is None


def test_anything_else_is_not_a_scanner() -> None:
    with pytest.raises(TypeError):
        WsDecoder(scanner=RouteTable())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        WsDecoder().set_scanner("rmb")  # type: ignore[arg-type]


# ---- RMB -----------------------------------------------------------------------------------


def test_golden_envelope_both_ways() -> None:
    assert envelope((7, "app"), (9, "svc")) == GOLDEN_ENVELOPE
    (message,) = messages(WsDecoder(scanner=EnvelopeScanner()), frames(GOLDEN_ENVELOPE))
    routing = envelope_routing(message)
    assert (routing.uid, routing.kind, routing.source_twin, routing.source_connection) == (
        "u",
        MSG_REQUEST,
        7,
        "app",
    )
    assert (routing.dest_twin, routing.dest_connection) == (9, "svc")
    assert message.data == GOLDEN_ENVELOPE


def test_envelope_scanner_checks_no_session() -> None:
    (message,) = messages(WsDecoder(scanner=EnvelopeScanner()), frames(GOLDEN_ENVELOPE))
    routing = envelope_routing(message)
    assert (routing.from_session, routing.dest_conn_id) == (False, None)


def test_rmb_scanner_checks_the_source_exactly_and_finds_the_destination() -> None:
    routes = RouteTable()
    routes.register_session(9, "svc", 42)
    routes.register_session(9, None, 43)
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, "app"))
    cases = [
        ((7, "app"), (9, "svc"), True, 42),
        ((7, "other"), (9, "svc"), False, 42),
        ((8, "app"), (9, "svc"), False, 42),
        ((7, ""), (9, None), False, 43),
        ((7, None), (9, ""), False, None),
        ((7, "app"), (10, "svc"), True, None),
    ]
    got = messages(decoder, frames(*[envelope(src, dst) for src, dst, _, _ in cases]))
    assert [(envelope_routing(m).from_session, envelope_routing(m).dest_conn_id) for m in got] == [
        (from_session, conn) for _, _, from_session, conn in cases
    ]


def test_rmb_scanner_lookups_see_the_table_as_it_is_at_each_feed() -> None:
    routes = RouteTable()
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, "app"))
    data = frames(GOLDEN_ENVELOPE)
    assert envelope_routing(messages(decoder, data)[0]).dest_conn_id is None
    routes.register_session(9, "svc", 42)
    assert envelope_routing(messages(decoder, data)[0]).dest_conn_id == 42


def test_rmb_scanner_leaves_text_unscanned_and_reports_bad_envelopes() -> None:
    decoder = WsDecoder(scanner=RmbScanner(RouteTable(), 7, None))
    encoder = ClientFrameEncoder(bytes(32))
    text, bad = messages(decoder, encoder.text("hello") + encoder.binary(b"\x0a\x05ab"))
    assert (text.is_text, text.routing, text.scan_error) == (True, None, None)
    assert bad.routing is None
    assert bad.scan_error is not None
    assert "past the end" in bad.scan_error


# ---- SBD -----------------------------------------------------------------------------------


def sbd_decoder(
    routes: RouteTable | None = None,
    *,
    ready: bool = True,
    limiter: ByteNanosLimiter | None = None,
) -> tuple[WsDecoder, SbdScanner]:
    scanner = SbdScanner(routes or RouteTable(), SENDER, limiter, IP)
    scanner.ready = ready
    return WsDecoder(max_message=20_000, scanner=scanner), scanner


@pytest.mark.parametrize(
    ("golden", "tag", "payload"),
    [
        (Z + bytes.fromhex("6b656570"), b"keep", b""),
        (Z + bytes.fromhex("6c627274 00001f40"), b"lbrt", (8000).to_bytes(4, "big")),
        (Z + bytes.fromhex("61726573") + bytes(range(64)), b"ares", bytes(range(64))),
    ],
)
def test_sbd_command_golden_bytes_keep_their_data(
    golden: bytes, tag: bytes, payload: bytes
) -> None:
    assert sbd_encode_command(tag, payload) == golden
    for ready in (False, True):
        decoder, _ = sbd_decoder(ready=ready)
        (message,) = messages(decoder, frames(golden))
        routing = sbd_routing(message)
        assert message.data == golden
        assert (routing.kind, routing.tag, routing.payload) == (SBD_COMMAND, tag, payload)
        assert (routing.peer, routing.dest_conn_id, routing.over_limit) == (b"", None, False)


def test_sbd_forward_data_is_already_rewritten_to_the_sender() -> None:
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    decoder, _ = sbd_decoder(routes)
    sent = DEST + b"data"
    (message,) = messages(decoder, frames(sent))
    routing = sbd_routing(message)
    assert message.data == SENDER + b"data" == sbd_rewrite_forward(sent, SENDER)
    assert (routing.kind, routing.peer, routing.dest_conn_id) == (SBD_FORWARD, DEST, 5)
    assert (routing.tag, routing.payload, routing.sender_ready) == (b"", b"", True)


def test_sbd_header_only_forward_is_rewritten_and_short_message_has_a_scan_error() -> None:
    decoder, _ = sbd_decoder()
    forward, short = messages(decoder, frames(DEST, DEST[:31]))
    assert forward.data == SENDER
    assert sbd_routing(forward).kind == SBD_FORWARD
    assert (short.data, short.routing) == (DEST[:31], None)
    assert short.scan_error == "message of 31 bytes is shorter than the 32-byte header"


def test_sbd_forward_to_an_unknown_key_has_no_destination() -> None:
    decoder, _ = sbd_decoder()
    (message,) = messages(decoder, frames(DEST + b"x"))
    assert sbd_routing(message).dest_conn_id is None


def test_sbd_forward_before_the_handshake_is_reported_not_routed() -> None:
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    decoder, scanner = sbd_decoder(routes, ready=False)
    data = frames(DEST + b"early")
    (message,) = messages(decoder, data)
    routing = sbd_routing(message)
    assert (routing.kind, routing.sender_ready, routing.dest_conn_id) == (SBD_FORWARD, False, None)
    assert message.data == SENDER + b"early"
    scanner.ready = True  # what the handshake does
    (message,) = messages(decoder, data)
    assert (sbd_routing(message).sender_ready, sbd_routing(message).dest_conn_id) == (True, 5)


def test_sbd_fragmented_and_text_messages_are_scanned_too() -> None:
    decoder, _ = sbd_decoder()
    header_text = bytes([0x41]) * 32  # a key that happens to be ASCII
    data = (
        encode_frame(OP_BINARY, DEST[:10], fin=False, mask=MASK)
        + encode_frame(OP_CONTINUATION, DEST[10:] + b"tail", mask=MASK)
        + encode_frame(OP_TEXT, header_text + b"hi", mask=MASK)
    )
    fragmented, text = messages(decoder, data)
    assert fragmented.data == SENDER + b"tail"
    assert sbd_routing(fragmented).peer == DEST
    assert text.is_text
    assert text.data == SENDER + b"hi"
    assert sbd_routing(text).peer == header_text


def test_sbd_limiter_charges_every_message_at_the_feed_time() -> None:
    # 10 ns per byte, burst 100 bytes: shared by every connection of the IP
    limiter = ByteNanosLimiter(10, 100)
    decoder, scanner = sbd_decoder(limiter=limiter)
    keep = sbd_encode_command(b"keep")
    got = messages(decoder, frames(keep, keep, keep, keep), now=1_000)
    assert [sbd_routing(m).over_limit for m in got] == [False, False, False, True]
    assert scanner.over_limit
    # long after the debt is paid, this connection stays refused
    (late,) = messages(decoder, frames(keep), now=10**12)
    assert sbd_routing(late).over_limit
    # another connection from the same IP starts from the shared bucket, paid back by then
    other = WsDecoder(scanner=SbdScanner(RouteTable(), DEST, limiter, IP))
    (fresh,) = messages(other, frames(keep), now=10**12)
    assert not sbd_routing(fresh).over_limit


def test_sbd_over_limit_forward_is_not_routed() -> None:
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    decoder, _ = sbd_decoder(routes, limiter=ByteNanosLimiter(10, 100))
    (message,) = messages(decoder, frames(DEST + bytes(100)))
    routing = sbd_routing(message)
    assert (routing.over_limit, routing.dest_conn_id) == (True, None)


def test_sbd_short_and_text_messages_are_charged_as_their_bytes() -> None:
    limiter = ByteNanosLimiter(10, 40)
    decoder, scanner = sbd_decoder(limiter=limiter)
    encoder = ClientFrameEncoder(bytes(32))
    messages(decoder, encoder.binary(bytes(31)))
    assert not scanner.over_limit
    (text,) = messages(decoder, encoder.text("x" * 32))
    assert sbd_routing(text).over_limit, "31 + 32 bytes over a 40-byte burst"


def test_sbd_scanner_rejects_a_key_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        SbdScanner(RouteTable(), bytes(31))
    scanner = SbdScanner(RouteTable(), SENDER)
    assert (scanner.pubkey, scanner.ip, scanner.limiter, scanner.ready) == (SENDER, "", None, False)


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.binary(max_size=80)),
        min_size=1,
        max_size=8,
    )
)
def test_sbd_scanner_agrees_with_the_per_message_functions(
    specs: list[tuple[bool, int, bytes]],
) -> None:
    """The scanner's answer equals sbd_classify + lookup_pubkey + sbd_rewrite_forward."""
    routes = RouteTable()
    keys = [bytes([k + 5]) * 32 for k in range(3)]
    for conn_id, key in enumerate(keys[:2], start=10):
        routes.register_pubkey(key, conn_id)
    sent = [
        (Z + b"keep" if is_command else ([*keys, DEST][key])) + body
        for is_command, key, body in specs
    ]
    decoder, _ = sbd_decoder(routes)
    got = messages(decoder, frames(*sent))
    for message, original in zip(got, sent, strict=True):
        routing = sbd_routing(message)
        reference = sbd_classify(original)
        assert routing.kind == reference.kind
        if reference.kind == SBD_FORWARD:
            assert routing.peer == reference.peer
            assert routing.dest_conn_id == routes.lookup_pubkey(reference.peer)
            assert message.data == sbd_rewrite_forward(original, SENDER)
        else:
            assert (routing.tag, routing.payload) == (reference.tag, reference.payload)
            assert message.data == original
