"""Cross-instance forwards in Rust (rust/crossing.rs): the sending scanner queues an envelope
for a session another instance holds as a bus record itself (a remote route mirrored from the
presence cache), and the receiving instance writes the records of a bus entry for its RMB
sessions straight into their outboxes.

First through the Python binding (what crosses and what still reaches Python as an event, the
records' bytes, placing an entry), then in-process instances on a real redis-server: a burst
crosses in Rust on both sides in order; a refused batch tells each request's sender; a batch
for an instance that left is routed again; the mirrored route goes with the answer it copies.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from rmb_relay._core import (
    MSG_PING,
    Envelope,
    FixedWindowLimiter,
    Outboxes,
    RmbScanner,
    RouteTable,
    WsDecoder,
    WsMessage,
    check_bus_records,
    encode_binary,
)
from rmb_relay.cluster import wire
from rmb_relay.errors import RemoteError
from rmb_relay.sdk import RmbClient
from tests.cluster_fixtures import (  # noqa: F401 - the fixture is used by name
    MakeInstance,
    make_instance_fixture,
    recorder,
)
from tests.conftest import WAIT, RedisServer, start_redis
from tests.helpers import eventually
from tests.scan_helpers import envelope, frames

SENDER_CONN, LOCAL_CONN = 1, 2
NOW = 1_700_000_000 * 1_000_000_000
SECOND = 1_000_000_000
MAILBOX_TTL = 3600
FAR = (9, "far")


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name


def crossing_setup(
    limiter: FixedWindowLimiter | None = None,
) -> tuple[WsDecoder, RmbScanner, Outboxes, RouteTable]:
    """Session 7:"app" on SENDER_CONN; 9:"far" held by instance 4 until NOW + 1 s."""
    routes = RouteTable()
    routes.set_remote(FAR[0], FAR[1], 4, b"r:9:far", NOW - SECOND, NOW + SECOND)
    outboxes = Outboxes()
    outboxes.crossing_open = True
    outboxes.store_ttl = MAILBOX_TTL
    for conn_id in (SENDER_CONN, LOCAL_CONN):
        outboxes.open(conn_id, Conn(str(conn_id)), "rmb")
    scanner = RmbScanner(routes, 7, "app", limiter=limiter, outboxes=outboxes, conn_id=SENDER_CONN)
    return WsDecoder(scanner=scanner), scanner, outboxes, routes


def dated(timestamp: int, expiration: int, tags: str | None = None) -> bytes:
    env = Envelope.decode(envelope(dest=FAR, body=b"x" * 100))
    env.timestamp, env.expiration = timestamp, expiration
    if tags is not None:
        env.tags = tags
    return env.encode()


# ---- the sending scanner -------------------------------------------------------------------


def test_an_envelope_for_a_remote_session_becomes_its_bus_record_without_an_event() -> None:
    decoder, _, outboxes, _ = crossing_setup()
    now_s = NOW // SECOND
    sent = [
        dated(now_s - 10, 60),  # its own expiry
        dated(0, 60),  # no timestamp: from now
        dated(now_s, 10 * MAILBOX_TTL),  # capped by the mailbox TTL
        dated(now_s, 60, tags="fail-fast"),  # never stored
    ]
    assert decoder.feed(frames(*sent), NOW) == []
    ((instance, data, count),) = outboxes.take_crossing()
    assert (instance, count) == (4, 4)
    records = wire.decode(data)
    assert [r.frame for r in records] == sent
    assert {(r.kind, r.name, r.hops) for r in records} == {(wire.MESSAGE, "r:9:far", 0)}
    assert [r.deadline for r in records] == [now_s + 50, now_s + 60, now_s + MAILBOX_TTL, 0]
    # byte for byte what the Python sender encodes
    assert data == b"".join(wire.encode_message("r:9:far", r.frame, r.deadline) for r in records)
    assert outboxes.crossed == (4, sum(map(len, sent)))
    assert outboxes.forwarded("rmb")[0] == 0
    assert outboxes.take_crossing() == []


def test_the_crossing_batches_go_to_the_sink_at_the_drain() -> None:
    decoder, _, outboxes, _ = crossing_setup()
    got: list[list[tuple[int, bytes, int]]] = []
    outboxes.set_crossing_sink(got.append)
    one = envelope(dest=FAR)
    assert decoder.feed(frames(one, one), NOW) == []
    assert outboxes.drain() == []
    assert [[(i, n) for i, _, n in batches] for batches in got] == [[(4, 2)]]
    assert outboxes.drain() == []
    assert len(got) == 1, "nothing new: the sink is not called"


def test_a_failing_sink_loses_no_connection_output(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder, _, outboxes, routes = crossing_setup()
    routes.register_session(9, "svc", LOCAL_CONN)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))

    def sink(batches: list[tuple[int, bytes, int]]) -> None:
        raise RuntimeError("a bug in the sink")

    outboxes.set_crossing_sink(sink)
    local = envelope(dest=(9, "svc"))
    assert decoder.feed(frames(local, envelope(dest=FAR)), NOW) == []
    assert [(conn.name, bytes(data)) for conn, data in outboxes.drain()] == [
        (str(LOCAL_CONN), encode_binary(local))
    ]
    assert [str(err) for err in reported] == ["a bug in the sink"]


@pytest.mark.parametrize(
    "why",
    [
        "expired",
        "clock went back",
        "slow path busy",
        "bus full",
        "not from the session",
        "ping",
        "limited",
    ],
)
def test_what_may_not_cross_reaches_python_as_before(why: str) -> None:
    limiter = FixedWindowLimiter(0 if why == "limited" else 100, 1 << 20)
    decoder, scanner, outboxes, _ = crossing_setup(limiter)
    data, now = envelope(dest=FAR), NOW
    if why == "expired":
        now = NOW + SECOND
    elif why == "clock went back":
        now = NOW - 2 * SECOND
    elif why == "slow path busy":
        scanner.set_slow(True)
    elif why == "bus full":
        outboxes.crossing_open = False
    elif why == "not from the session":
        data = envelope(source=(7, "else"), dest=FAR)
    elif why == "ping":
        data = envelope(dest=FAR, kind=MSG_PING)
    (message,) = decoder.feed(frames(data), now)
    assert isinstance(message, WsMessage)
    assert message.data == data
    assert outboxes.take_crossing() == []
    assert outboxes.crossed[0] == 0
    if why == "slow path busy":
        scanner.set_slow(False)
        assert decoder.feed(frames(data), now) == [], "crosses again once it is done"


def test_a_local_session_wins_over_a_remote_route() -> None:
    decoder, _, outboxes, routes = crossing_setup()
    routes.register_session(FAR[0], FAR[1], LOCAL_CONN)
    one = envelope(dest=FAR)
    assert decoder.feed(frames(one), NOW) == []
    assert outboxes.take(LOCAL_CONN) == encode_binary(one)
    assert outboxes.take_crossing() == []
    # congested: Python decides (it pauses the sender), never the other instance
    outboxes.set_congested(LOCAL_CONN, True)
    (message,) = decoder.feed(frames(one), NOW)
    assert isinstance(message, WsMessage)
    assert outboxes.take_crossing() == []


def test_remote_routes_are_forgotten_by_address_and_by_instance() -> None:
    routes = RouteTable()
    routes.set_remote(1, None, 0, b"r:1", 0, NOW)
    routes.set_remote(2, "x", 1, b"r:2:x", 0, NOW)
    routes.set_remote(3, None, 1, b"r:3", 0, NOW)
    assert routes.lookup_remote(2, "x", NOW - 1) == 1
    assert routes.lookup_remote(2, "x", NOW) is None
    assert routes.forget_instance(1) == 2
    assert routes.forget_remote(1, None)
    assert routes.remote_count == 0
    with pytest.raises(ValueError, match="65535"):
        routes.set_remote(1, None, 0, b"x" * 65536, 0, NOW)


# ---- the receiving side --------------------------------------------------------------------


def test_an_entry_is_placed_in_order_up_to_what_python_must_handle() -> None:
    routes = RouteTable()
    routes.register_session(1, None, 10)
    routes.register_session(2, "x", 20)
    outboxes = Outboxes()
    outboxes.open(10, Conn("10"))
    outboxes.open(20, Conn("20"))
    entry = b"".join(
        [
            wire.encode_message("r:1", b"one", 0),
            wire.encode_message("r:2:x", b"two", 0),
            wire.encode(wire.Record(wire.MAIL, "r:1")),  # a notice: Python's
            wire.encode_message("r:1", b"after", 0),
        ]
    )
    offset, placed = outboxes.place_records(routes, entry, 0, 1 << 20)
    assert placed == 2
    notice, after = wire.decode_from(entry, offset)
    assert (notice.kind, after.frame) == (wire.MAIL, b"after")
    assert outboxes.place_records(routes, entry, offset, 1 << 20) == (offset, 0)
    rest = offset + len(wire.encode(notice))
    assert outboxes.place_records(routes, entry, rest, 1 << 20) == (len(entry), 1)
    assert {conn.name: bytes(data) for conn, data in outboxes.drain()} == {
        "10": encode_binary(b"one") + encode_binary(b"after"),
        "20": encode_binary(b"two"),
    }
    assert outboxes.placed == (3, 11)
    # a receiver that does not accept now stops it at its record
    outboxes.set_held(20, True)
    offset, placed = outboxes.place_records(routes, entry, 0, 1 << 20)
    assert placed == 1
    assert wire.decode_from(entry, offset)[0].frame == b"two"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x00" * 5, "truncated"),
        (wire.encode(wire.Record(wire.MESSAGE, "r:1", b"abc"))[:-1], "runs past"),
        (b"\x09" + wire.encode(wire.Record(wire.MESSAGE, "r:1"))[1:], "unknown record kind"),
        (wire.encode(wire.Record(wire.MESSAGE, "r:1")).replace(b"r:1", b"\xff\xfe1"), "UTF-8"),
    ],
)
def test_entries_are_checked_as_the_python_decoder_checks_them(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_bus_records(data)
    with pytest.raises(wire.BusFormatError, match=why):
        wire.decode(data)
    good = wire.encode_message("r:1", b"a", 0) * 3
    assert check_bus_records(good) == len(wire.decode(good)) == 3


# ---- instances on a real Redis -------------------------------------------------------------


async def warm(client: RmbClient, twin: int, command: str) -> None:
    """Two requests: the first caches the twin (an await), the second takes the slow path
    without one (`forward_now`), which mirrors the holder for the scanner."""
    for _ in range(2):
        await client.request(twin, command, b"warm", timeout=WAIT)


async def test_a_burst_crosses_in_rust_on_both_sides_in_order(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """After one envelope took the slow path (and mirrored its holder), the next ones are
    queued by A's scanner and written by B's bus reader without a Python call per message."""
    a = await make_instance(redis_server.url, twin_ttl=3600.0, cache_ttl=3600.0)
    b = await make_instance(redis_server.url)
    got: list[bytes] = []
    done = asyncio.Event()
    await b.client(3, handlers={"m": recorder(got, done=done, expect=202)})
    await b.cluster.claimed((3, None))
    alice = await a.client(1)
    await warm(alice, 3, "m")
    assert a.switch.routes.lookup_remote(3, None, a.rmb.clock()) is not None
    crossed, placed = a.switch.outboxes.crossed[0], b.switch.outboxes.placed[0]
    for i in range(200):
        alice.send_request(3, "m", b"burst %d" % i)
    await asyncio.wait_for(done.wait(), WAIT)
    assert got[2:] == [b"burst %d" % i for i in range(200)]
    assert a.switch.outboxes.crossed[0] - crossed == 200
    assert b.switch.outboxes.placed[0] - placed == 200
    await eventually(lambda: a.cluster.counters.sent == 202)
    assert b.cluster.counters.received == 202


async def test_a_crossed_batch_redis_refuses_tells_each_request_sender(
    make_instance: MakeInstance, tmp_path: Path
) -> None:
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = start_redis(str(redis_dir))
    try:
        a = await make_instance(server.url, twin_ttl=3600.0, cache_ttl=3600.0)
        b = await make_instance(server.url)
        alice = await a.client(1)
        bob = await b.client(2)
        bob.handle("echo", lambda request: request.data)
        await warm(alice, 2, "echo")
        crossed = a.switch.outboxes.crossed[0]
        server.stop()
        with pytest.raises(RemoteError, match="destination unreachable: the relay's redis is"):
            await alice.request(2, "echo", b"down", timeout=WAIT)
        assert a.switch.outboxes.crossed[0] == crossed + 1, "it was queued by the scanner"
        assert (await alice.ping()).data == b"hello world"
    finally:
        server.stop()


async def test_a_crossed_batch_for_an_instance_that_left_is_routed_again(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url, twin_ttl=3600.0, cache_ttl=3600.0)
    b = await make_instance(redis_server.url)
    c = await make_instance(redis_server.url)
    carol = await b.client(3)
    carol.handle("m", lambda request: b"on b")
    await b.cluster.claimed((3, None))
    alice = await a.client(1)
    await warm(alice, 3, "m")  # mirrored: "B"
    await b.stop()  # its stream is deleted
    got: list[bytes] = []
    await c.client(3, handlers={"m": recorder(got)})
    await c.cluster.claimed((3, None))
    crossed = a.switch.outboxes.crossed[0]
    alice.send_request(3, "m", b"after B left")
    await eventually(lambda: got == [b"after B left"])
    assert a.switch.outboxes.crossed[0] == crossed + 1
    # routed again when its stream is found gone (passed on), or, when B's leaving reached A
    # first (the same loop runs both: 1 run in ~10), routed to C at once: once either way
    assert a.cluster.counters.passed_on <= 1
    assert got == [b"after B left"]
    assert a.switch.routes.remote_count == 0, "no route to the instance that left"


async def test_a_mirrored_route_goes_with_the_presence_answer_it_copies(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url, twin_ttl=3600.0, cache_ttl=3600.0)
    b = await make_instance(redis_server.url)
    await b.client(3, handlers={"m": recorder([])})
    await b.cluster.claimed((3, None))
    alice = await a.client(1)
    await warm(alice, 3, "m")
    assert a.switch.routes.remote_count == 1
    # carol logs in on A too: A's answer for her is dropped, and so is its copy
    await a.client(3, handlers={"m": recorder([])})
    assert a.switch.routes.remote_count == 0
