"""The fast path (rust/forward.rs, rust/scan.rs): local forwards decided and framed in Rust.

First the `Outboxes` and the scanners through the Python binding: what the fast path takes
(no event, the frame in the destination's outbox, counted) and what it leaves to Python (an
event, as before). Then end to end over real sockets: RMB and SBD forwards counted as local,
a congested receiver still pauses its sender and loses nothing, a mailbox is delivered before
live traffic, and a replaced or closing connection is no longer forwarded to.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from rmb_relay._core import (
    MSG_PING,
    OP_TEXT,
    ClientFrameEncoder,
    EnvelopeRouting,
    FixedWindowLimiter,
    Outboxes,
    RecordBuffer,
    RmbScanner,
    RouteTable,
    SbdRouting,
    SbdScanner,
    WsDecoder,
    WsMessage,
    encode_binary,
    encode_frame,
    sbd_encode_command,
)
from rmb_relay.dialects.rmb import RmbSettings
from rmb_relay.identity import make_jwt
from tests.conftest import WAIT, StartRelay
from tests.helpers import RawWebSocket, eventually
from tests.rmb_fixtures import RmbRelay, key_for, start_rmb_relay
from tests.scan_helpers import DEST, SENDER, envelope, frames
from tests.scrape import scrape

SENDER_CONN, DEST_CONN, OTHER_CONN = 1, 2, 3
NOW = 1_700_000_000 * 1_000_000_000


class Conn:
    """What `drain` hands back: any object standing for a connection."""

    def __init__(self, name: str) -> None:
        self.name = name


def rmb_setup(
    **scanner: object,
) -> tuple[WsDecoder, Outboxes, dict[int, Conn], RouteTable]:
    routes = RouteTable()
    routes.register_session(9, "svc", DEST_CONN)
    routes.register_session(9, "other", OTHER_CONN)
    outboxes = Outboxes()
    conns = {i: Conn(str(i)) for i in (SENDER_CONN, DEST_CONN, OTHER_CONN)}
    for conn_id, conn in conns.items():
        outboxes.open(conn_id, conn, "rmb")
    decoder = WsDecoder(
        scanner=RmbScanner(
            routes,
            7,
            "app",
            outboxes=outboxes,
            conn_id=SENDER_CONN,
            **scanner,  # type: ignore[arg-type]
        )
    )
    return decoder, outboxes, conns, routes


def drained(outboxes: Outboxes) -> dict[str, bytes]:
    return {conn.name: data for conn, data in outboxes.drain()}


# ---- Outboxes ------------------------------------------------------------------------------


def test_python_sends_and_fast_forwards_keep_one_order_per_connection() -> None:
    decoder, outboxes, _, _ = rmb_setup()
    outboxes.push(DEST_CONN, b"before")
    assert decoder.feed(frames(envelope())) == []
    outboxes.push_raw(DEST_CONN, encode_frame(OP_TEXT, b"after"))
    outboxes.push_many(DEST_CONN, [b"x", b"y"])
    want = b"".join(
        [
            encode_binary(b"before"),
            encode_binary(envelope()),
            encode_frame(OP_TEXT, b"after"),
            encode_binary(b"x"),
            encode_binary(b"y"),
        ]
    )
    assert outboxes.pending(DEST_CONN) == len(want)
    assert outboxes.take(DEST_CONN) == want
    assert outboxes.take(DEST_CONN) is None
    assert outboxes.drain() == [], "taken by Python before the drain"


def test_unknown_or_removed_connections_take_nothing() -> None:
    outboxes = Outboxes()
    outboxes.push(5, b"lost")
    assert outboxes.take(5) is None
    outboxes.open(5, Conn("5"))
    outboxes.push(5, b"kept")
    outboxes.remove(5)
    assert (outboxes.take(5), len(outboxes)) == (None, 0)


# ---- RMB scanner with outboxes -------------------------------------------------------------


def test_rmb_local_forward_is_framed_into_the_destination_without_an_event() -> None:
    decoder, outboxes, _, _ = rmb_setup()
    one, two = envelope(body=b"1" * 300), envelope(body=b"2" * 70_000)
    assert decoder.feed(frames(one, two, one)) == []
    assert drained(outboxes) == {"2": encode_binary(one) + encode_binary(two) + encode_binary(one)}
    size = 2 * len(one) + len(two)
    assert outboxes.forwarded("rmb") == (3, size)
    assert outboxes.forwarded("sbd") == (0, 0)
    assert drained(outboxes) == {}


def test_rmb_forwards_to_several_destinations_each_once_per_drain() -> None:
    decoder, outboxes, _, _ = rmb_setup()
    svc, other = envelope(dest=(9, "svc")), envelope(dest=(9, "other"), body=b"o")
    # the second and later envelopes are unmasked into the last destination's outbox first
    assert decoder.feed(frames(svc, other, other, svc)) == []
    assert drained(outboxes) == {
        "2": encode_binary(svc) * 2,
        "3": encode_binary(other) * 2,
    }


def test_fragmented_envelopes_take_the_fast_path_too() -> None:
    decoder, outboxes, _, _ = rmb_setup()
    data = envelope(body=b"f" * 1000)
    encoder = ClientFrameEncoder(bytes(32))
    wire = encoder.binary(data)  # one frame, then the same as two fragments
    from rmb_relay._core import OP_BINARY, OP_CONTINUATION

    mask = bytes(4)
    wire += encode_frame(OP_BINARY, data[:500], fin=False, mask=mask)
    wire += encode_frame(OP_CONTINUATION, data[500:], mask=mask)
    assert decoder.feed(wire) == []
    assert drained(outboxes) == {"2": encode_binary(data) * 2}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (envelope(source=(7, "else")), "not from the session"),
        (envelope(dest=(7, "app"), kind=MSG_PING), "a ping is answered by the dialect"),
        (envelope(dest=(0, None)), "no destination"),
        (envelope(dest=(10, None)), "not connected here"),
    ],
)
def test_rmb_messages_that_need_python_still_arrive_as_events(data: bytes, why: str) -> None:
    decoder, outboxes, _, _ = rmb_setup()
    (message,) = decoder.feed(frames(data))
    assert isinstance(message, WsMessage), why
    assert message.data == data
    assert isinstance(message.routing, EnvelopeRouting)
    assert drained(outboxes) == {}
    assert outboxes.forwarded("rmb")[0] == 0


def test_after_a_message_for_python_the_rest_of_the_read_goes_to_python_too() -> None:
    """The dialect may close the connection over it (here a text frame): what follows in the
    same read must not have been forwarded already."""
    decoder, outboxes, _, _ = rmb_setup()
    encoder = ClientFrameEncoder(bytes(32))
    first, text, after = envelope(body=b"1"), b"hi", envelope(body=b"2")
    events = decoder.feed(encoder.binary(first) + encoder.text("hi") + encoder.binary(after))
    assert [e.data for e in events if isinstance(e, WsMessage)] == [text, after]
    assert drained(outboxes) == {"2": encode_binary(first)}
    assert decoder.feed(frames(after)) == [], "the next read takes the fast path again"


def test_text_and_invalid_messages_reach_python() -> None:
    decoder, outboxes, _, _ = rmb_setup()
    encoder = ClientFrameEncoder(bytes(32))
    text, bad = decoder.feed(encoder.text("hi") + encoder.binary(b"\x0a\x05ab"))
    assert isinstance(text, WsMessage)
    assert text.is_text
    assert isinstance(bad, WsMessage)
    assert bad.routing is None
    assert bad.scan_error
    assert drained(outboxes) == {}


@pytest.mark.parametrize("state", ["congested", "held", "closed", "removed"])
def test_a_destination_that_does_not_accept_gets_it_through_python(state: str) -> None:
    decoder, outboxes, _, _ = rmb_setup()
    if state == "congested":
        outboxes.set_congested(DEST_CONN, True)
    elif state == "held":
        outboxes.set_held(DEST_CONN, True)
    elif state == "closed":
        outboxes.close(DEST_CONN)
    else:
        outboxes.remove(DEST_CONN)
    assert not outboxes.accepts(DEST_CONN)
    (message,) = decoder.feed(frames(envelope()))
    assert isinstance(message, WsMessage)
    assert isinstance(message.routing, EnvelopeRouting)
    assert message.routing.dest_conn_id == DEST_CONN
    assert outboxes.pending(DEST_CONN) == 0


def test_nothing_is_forwarded_from_a_closing_sender() -> None:
    decoder, outboxes, _, _ = rmb_setup()
    outboxes.close(SENDER_CONN)
    (message,) = decoder.feed(frames(envelope()))
    assert isinstance(message, WsMessage)
    assert drained(outboxes) == {}


def test_limiter_runs_once_per_envelope_and_refusals_reach_python() -> None:
    limiter = FixedWindowLimiter(2, 1 << 20, 60)
    decoder, outboxes, _, _ = rmb_setup(limiter=limiter)
    data = envelope()
    events = decoder.feed(frames(data, data, data, data), NOW)
    assert len(events) == 2
    for event in events:
        assert isinstance(event, WsMessage)
        assert isinstance(event.routing, EnvelopeRouting)
        assert event.routing.limited
    assert outboxes.forwarded("rmb")[0] == 2
    # the next window: allowed again (the clock is `now`, in whole seconds)
    assert decoder.feed(frames(data), NOW + 60 * 1_000_000_000) == []
    # without outboxes the scanner still counts and reports
    plain = WsDecoder(scanner=RmbScanner(RouteTable(), 7, "app", None, FixedWindowLimiter(1, 100)))
    first, second = plain.feed(frames(data, data), NOW)
    assert isinstance(first, WsMessage)
    assert isinstance(first.routing, EnvelopeRouting)
    assert isinstance(second, WsMessage)
    assert isinstance(second.routing, EnvelopeRouting)
    assert (first.routing.limited, second.routing.limited) == (False, True)


def test_fast_forwards_append_route_records() -> None:
    records = RecordBuffer()
    limiter = FixedWindowLimiter(1, 1 << 20, 60)
    decoder, _, _, _ = rmb_setup(records=records, limiter=limiter)
    data = envelope()
    (limited,) = decoder.feed(frames(data, data), NOW)
    assert isinstance(limited, WsMessage)
    assert isinstance(limited.routing, EnvelopeRouting)
    assert limited.routing.record == -1, "a refused envelope has no record"
    *columns, _ = records.take()
    rows = [np.frombuffer(column, dtype=np.int64).tolist() for column in columns]
    assert rows == [[NOW // 1000], [7], [9], [len(data)]]


# ---- SBD scanner with outboxes -------------------------------------------------------------


def sbd_setup() -> tuple[WsDecoder, SbdScanner, Outboxes]:
    routes = RouteTable()
    routes.register_pubkey(DEST, DEST_CONN)
    outboxes = Outboxes()
    outboxes.open(SENDER_CONN, Conn("sender"), "sbd")
    outboxes.open(DEST_CONN, Conn("dest"), "sbd")
    scanner = SbdScanner(routes, SENDER, None, "", None, outboxes, SENDER_CONN)
    return WsDecoder(max_message=20_000, scanner=scanner), scanner, outboxes


def test_sbd_forward_is_rewritten_straight_into_the_destination() -> None:
    decoder, scanner, outboxes = sbd_setup()
    scanner.ready = True
    keep = sbd_encode_command(b"keep")
    events = decoder.feed(frames(DEST + b"hello", DEST + b"again", keep), 42)
    (command,) = events
    assert isinstance(command, WsMessage)
    assert isinstance(command.routing, SbdRouting)
    assert drained(outboxes) == {
        "dest": encode_binary(SENDER + b"hello") + encode_binary(SENDER + b"again")
    }
    assert outboxes.forwarded("sbd") == (2, 74)
    assert scanner.active_at == 42


def test_sbd_forward_before_the_handshake_or_to_a_busy_peer_reaches_python() -> None:
    decoder, scanner, outboxes = sbd_setup()
    (early,) = decoder.feed(frames(DEST + b"x"))
    assert isinstance(early, WsMessage)
    assert isinstance(early.routing, SbdRouting)
    assert not early.routing.sender_ready
    scanner.ready = True
    outboxes.set_congested(DEST_CONN, True)
    (busy,) = decoder.feed(frames(DEST + b"y"))
    assert isinstance(busy, WsMessage)
    assert isinstance(busy.routing, SbdRouting)
    assert (busy.data, busy.routing.dest_conn_id) == (SENDER + b"y", DEST_CONN)
    assert outboxes.forwarded("sbd")[0] == 0
    assert scanner.active_at == 0


# ---- end to end ----------------------------------------------------------------------------


async def rmb_raw(relay: RmbRelay, twin: int) -> RawWebSocket:
    host, port = relay.server.addresses[0]
    key = key_for(twin, "ed25519" if twin == 2 else "sr25519")
    token = make_jwt(key, twin, None, int(time.time()))
    return await RawWebSocket.connect(host, port, f"/?{token}")


async def test_rmb_fast_path_forwards_are_counted_as_local(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(start_relay, tmp_path)
    alice = await relay.client(1)
    bob = await relay.client(2, key_type="ed25519")
    bob.handle("echo", lambda r: r.data)
    for i in range(5):
        reply = await alice.request(2, "echo", str(i).encode(), timeout=WAIT)
        assert reply.data == str(i).encode()
    outboxes = relay.dialect.switch.outboxes
    assert outboxes.forwarded("rmb")[0] == 10, "5 requests and 5 replies, none through Python"
    host, port = relay.server.addresses[0]
    page = await scrape(host, port)
    assert page.value("rmb_relay_messages_routed_total", dialect="rmb", path="local") == 10
    assert page.value("rmb_relay_messages_in_total", dialect="rmb") == 10
    assert page.value("rmb_relay_messages_out_total", dialect="rmb") == 10
    assert page.value("rmb_relay_bytes_out_total", dialect="rmb") == outboxes.forwarded("rmb")[1]
    await relay.close_clients()


async def test_congested_receiver_pauses_the_fast_path_sender_and_loses_nothing(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(
        start_relay, tmp_path, settings=RmbSettings(), write_high_water=64 * 1024
    )
    receiver = await rmb_raw(relay, 2)
    sender = await rmb_raw(relay, 1)
    await eventually(lambda: relay.dialect.switch.routes.session_count == 2)
    count = 300  # ~18 MB: far more than loopback socket buffers hold
    sent = [
        envelope(dest=(2, None), source=(1, None), body=os.urandom(60 * 1024)) for _ in range(count)
    ]
    for data in sent:
        sender.send_binary(data)
    metric = relay.server.metrics.backpressure_pauses
    await eventually(lambda: metric.value("rmb") > 0)
    outboxes = relay.dialect.switch.outboxes
    assert outboxes.forwarded("rmb")[0] > 0
    for data in sent:
        event = await receiver.next_event()
        assert getattr(event, "data", None) == data
    # some went through Python (the receiver was congested), in order with the rest
    assert outboxes.forwarded("rmb")[0] < count
    receiver.close()
    sender.close()


async def test_a_replaced_session_is_no_longer_forwarded_to(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(start_relay, tmp_path)
    first = await rmb_raw(relay, 2)
    sender = await rmb_raw(relay, 1)
    await eventually(lambda: relay.dialect.switch.routes.session_count == 2)
    sender.send_binary(envelope(dest=(2, None), source=(1, None), body=b"one"))
    assert getattr(await first.next_event(), "data", None) == envelope(
        dest=(2, None), source=(1, None), body=b"one"
    )
    second = await rmb_raw(relay, 2)
    closing = await first.next_event()
    assert getattr(closing, "code", None) == 1008
    sender.send_binary(envelope(dest=(2, None), source=(1, None), body=b"two"))
    event = await asyncio.wait_for(second.next_event(), WAIT)
    assert getattr(event, "data", None) == envelope(dest=(2, None), source=(1, None), body=b"two")
    for ws in (first, second, sender):
        ws.close()
