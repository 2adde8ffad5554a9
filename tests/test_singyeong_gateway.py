"""The 신경 gateway over real sockets: connect, hello, identify, ready, heartbeats, errors, auth,
restricted mode, duplicate ids, client updates, in all three encodings where it matters."""

from __future__ import annotations

import asyncio

import pytest
import websockets

from tests.helpers import eventually, http_exchange
from tests.sg_client import SgClient
from tests.sg_fixtures import FakeClock, MakeGateway, make_gateway

__all__ = ["make_gateway"]

ENCODINGS = ["json", "msgpack", "etf"]


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_hello_identify_ready_in_every_encoding(
    make_gateway: MakeGateway, encoding: str
) -> None:
    gateway = await make_gateway(heartbeat_ms=30_000)
    client = await gateway.connect(encoding)
    assert set(client.hello) == {"op", "d", "t", "ts"}
    assert client.hello["d"] == {"heartbeat_interval": 30_000}
    assert client.hello["t"] is None
    assert isinstance(client.hello["ts"], int)
    ready = await client.identify("c1", "app")
    assert ready["d"] == {"client_id": "c1", "restricted": False}
    assert set(ready) == {"op", "d", "t", "ts"}
    await client.send(5, {"client_id": "c1"})
    ack = await client.expect(6)
    assert ack["d"] == {"client_id": "c1"}


async def test_etf_envelope_keys_are_atoms(make_gateway: MakeGateway) -> None:
    """An Elixir client reads the envelope with atom keys (spec §1): check the raw bytes."""
    gateway = await make_gateway()
    host, port = gateway.address
    async with websockets.connect(f"ws://{host}:{port}/gateway/websocket?encoding=etf") as ws:
        raw = await ws.recv()
    assert isinstance(raw, bytes)
    assert raw[:6] == bytes((131, 116, 0, 0, 0, 4))  # a map of four pairs
    assert bytes((119, 2)) + b"op" in raw  # SMALL_ATOM_UTF8_EXT "op"
    assert bytes((119, 18)) + b"heartbeat_interval" in raw


async def test_unknown_encoding_is_refused_before_upgrade(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    host, port = gateway.address
    reply = await http_exchange(
        host,
        port,
        b"GET /gateway/websocket?encoding=xml HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 400")
    assert b"use json, msgpack or etf" in reply


async def test_non_identify_op_before_identify_is_fatal(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.connect()
    await client.send(5, None)
    error = await client.expect(8)
    assert error["d"]["error"] == "sent payload with non-identify opcode without identifying first"
    assert await client.closed() == 1000


@pytest.mark.parametrize(
    ("encoding", "garbage", "message"),
    [
        ("json", "{not json", "decode: invalid json"),
        ("msgpack", b"\xc1", "decode: invalid msgpack"),
        ("etf", b"\x83\x68\x00", "decode: invalid etf: unsupported term: small tuple"),
        ("etf", b"\x83\x74\x00\x00\x00\x01\x61\x01\x61\x01", "decode: invalid etf: map keys"),
    ],
)
async def test_undecodable_frames_are_a_clear_op8_and_the_gateway_keeps_serving(
    make_gateway: MakeGateway, encoding: str, garbage: bytes | str, message: str
) -> None:
    gateway = await make_gateway()
    client = await gateway.connect(encoding)
    await client.ws.send(garbage)
    error = await client.expect(8)
    assert error["d"]["error"].startswith(message), error
    assert await client.closed() == 1000
    other = await gateway.client("still-here", encoding=encoding)
    await other.send(5)
    await other.expect(6)


async def test_binary_frame_on_a_json_socket(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.connect("json")
    await client.ws.send(b'{"op": 5}')
    error = await client.expect(8)
    assert error["d"]["error"] == "decode: payload: invalid websocket opcode/encoding combo"


async def test_invalid_client_op_after_identify(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.client("c1")
    await client.send(6, None)
    error = await client.expect(8)
    assert error["d"]["error"] == "invalid client op heartbeat_ack"
    client2 = await gateway.client("c2")
    await client2.send(42, None)
    assert (await client2.expect(8))["d"]["error"] == "invalid client op 42"


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (None, "payload has no data"),
        ({"application_id": "a"}, "identify: client_id must be a non-empty string"),
        ({"client_id": 5, "application_id": "a"}, "identify: client_id must be"),
        ({"client_id": "c"}, "identify: application_id must be a non-empty string"),
    ],
)
async def test_identify_without_ids_is_fatal(
    make_gateway: MakeGateway, d: object, message: str
) -> None:
    gateway = await make_gateway()
    client = await gateway.connect()
    await client.send(1, d)
    error = await client.expect(8)
    assert error["d"]["error"].startswith(message)


async def test_invalid_initial_metadata_names_every_bad_key(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.connect()
    await client.send(
        1,
        {
            "client_id": "c",
            "application_id": "a",
            "metadata": {
                "ok": {"type": "integer", "value": 1},
                "bad": {"type": "integer", "value": 1.5},
                "ip": {"type": "string", "value": "1.2.3.4"},
                "what": {"type": "uuid", "value": "x"},
            },
        },
    )
    error = await client.expect(8)
    assert error["d"]["error"] == "initial metadata: invalid"
    assert error["d"]["extra_info"] == {
        "bad": "bad: value fails validation for 'integer'",
        "ip": "ip: forbidden metadata key",
        "what": "what: type 'uuid' doesn't exists",
    }


async def test_duplicate_client_id_is_invalid_then_closed(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await gateway.client("same", "app")
    await gateway.client("same", "other-app")  # another application: fine
    second = await gateway.connect()
    await second.send(1, {"client_id": "same", "application_id": "app"})
    frame = await second.expect(3)
    assert frame["d"]["error"] == "same: already registered for app app"
    assert await second.closed() == 1000


async def test_identify_twice_is_invalid_not_fatal(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.client("c")
    await client.send(1, {"client_id": "c", "application_id": "app"})
    assert (await client.expect(3))["d"]["error"] == "already identified"
    await client.send(5)
    await client.expect(6)


async def test_heartbeat_right_after_identify_is_valid(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.connect()
    await client.send(1, {"client_id": "c", "application_id": "app"})
    await client.send(5, {"client_id": "c"})
    await client.expect(2)
    await client.expect(6)


async def test_missed_heartbeats_close_the_socket(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(fake_clock=True, heartbeat_ms=1000)
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    quiet = await gateway.client("quiet")
    beating = await gateway.client("beating")
    clock.advance(1.0)
    await beating.send(5)
    await beating.expect(6)
    clock.advance(0.6)  # quiet: 1.6 s > 1.5 x interval; beating: 0.6 s
    gateway.dialect.sweep(clock())
    error = await quiet.expect(8)
    assert error["d"]["error"] == "heartbeat took too long"
    assert await quiet.closed() == 1000
    await beating.send(5)
    await beating.expect(6)
    assert gateway.dialect.metrics.heartbeat_closed.value() == 1


async def test_a_beating_client_first_in_line_does_not_hide_a_silent_one(
    make_gateway: MakeGateway,
) -> None:
    """The sweep reads clients in heartbeat order: one that connected first but beats moves
    behind one that connected later and went silent."""
    gateway = await make_gateway(fake_clock=True, heartbeat_ms=1000)
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    beating = await gateway.client("beating")
    quiet = await gateway.client("quiet")
    for _ in range(4):
        clock.advance(0.5)
        await beating.send(5)
        await beating.expect(6)
        gateway.dialect.sweep(clock())
    error = await quiet.expect(8)
    assert error["d"]["error"] == "heartbeat took too long"
    await beating.send(5)
    await beating.expect(6)
    assert gateway.dialect.metrics.heartbeat_closed.value() == 1


async def test_heartbeat_timer_fires_on_its_own(make_gateway: MakeGateway) -> None:
    """No frame needed: the timer closes a silent client (decision 7)."""
    gateway = await make_gateway(heartbeat_ms=100)
    client = await gateway.client("silent")
    error = await client.expect(8)
    assert error["d"]["error"] == "heartbeat took too long"


async def test_wrong_or_missing_password_means_restricted(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(auth="s3cret")
    good = await gateway.connect()
    assert (await good.identify("good", auth="s3cret"))["d"]["restricted"] is False
    wrong = await gateway.connect()
    assert (await wrong.identify("wrong", auth="nope"))["d"]["restricted"] is True
    missing = await gateway.connect()
    assert (await missing.identify("missing"))["d"]["restricted"] is True
    # a restricted client may only update its metadata
    await wrong.dispatch("SEND", {"target": {"application": "app"}, "payload": 1})
    frame = await wrong.expect(3)
    assert frame["d"]["error"] == "invalid dispatch type SEND (are you restricted?)"
    await wrong.update(x=("integer", 1))
    await wrong.send(5)
    await wrong.expect(6)  # nothing came back for the update
    client = gateway.dialect.index.get("app", "wrong")
    assert client is not None
    assert client.metadata["ip"] is None
    assert client.metadata["restricted"] is True


async def test_no_password_configured_never_restricts(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.connect()
    assert (await client.identify("c", auth="anything"))["d"]["restricted"] is False


async def test_restricted_clients_may_not_use_etf(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(auth="pw")
    client = await gateway.connect("etf")
    await client.send(1, {"client_id": "c", "application_id": "a"})
    assert (await client.expect(8))["d"]["error"] == "restricted clients may not use ETF"


async def test_client_updates_go_to_clients_that_asked(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(auth="pw")
    listener = await gateway.client("listener", "watch", receive_client_updates=True, auth="pw")
    deaf = await gateway.client("deaf", "watch", auth="pw")
    restricted = await gateway.client("r", "watch", receive_client_updates=True)
    joining = await gateway.client("joining", "api", auth="pw")
    # its own arrival included (spec §6), then every other client of any application
    frames = [await listener.expect(4, "CLIENT_CONNECTED") for _ in range(4)]
    apps = [f["d"]["payload"]["app"] for f in frames]
    assert apps == ["watch", "watch", "watch", "api"]
    assert frames[0]["d"] == {"target": None, "nonce": None, "payload": {"app": "watch"}}
    await joining.close()
    gone = await listener.expect(4, "CLIENT_DISCONNECTED")
    assert gone["d"]["payload"] == {"app": "api"}
    for other in (deaf, restricted):
        await other.send(5)
        await other.expect(6)  # nothing queued before the ack


async def test_a_client_leaving_frees_its_id(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    first = await gateway.client("c")
    await first.close()
    await eventually(lambda: gateway.dialect.index.get("app", "c") is None)
    again = await gateway.client("c")
    await again.send(5)
    await again.expect(6)


async def test_unknown_dispatch_type_is_invalid(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.client("c")
    await client.dispatch("FLY", {})
    frame = await client.expect(3)
    assert frame["d"]["error"] == "invalid dispatch payload"
    await client.send(4, {}, None)
    assert (await client.expect(3))["d"]["error"] == "a dispatch needs a string t"


async def test_version_endpoint(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    host, port = gateway.address
    reply = await http_exchange(
        host, port, b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 200")
    assert reply.endswith(b'{"singyeong":"0.0.1","api":"v1"}')


async def test_many_clients_connect_at_once(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    clients = await asyncio.gather(*(gateway.client(f"c{i}") for i in range(50)))
    assert len(gateway.dialect.index) == 50
    assert isinstance(clients[0], SgClient)
