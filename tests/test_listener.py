"""The listener and the Rust codec end to end: real sockets, a real `websockets` client and a
raw client for frames no real client sends."""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import socket
import ssl
import string
import struct
from pathlib import Path

import pytest
from prometheus_client.exposition import choose_encoder
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from rmb_relay._core import HttpRequest, WsClose
from rmb_relay.dialects.base import Peer, WebSocketHandler
from rmb_relay.server.listener import HTTP_METHODS, RelayServer
from rmb_relay.server.ws_connection import WebSocketConnection
from tests.conftest import WAIT, StartRelay
from tests.dialects import EchoDialect, PipeDialect
from tests.helpers import RawWebSocket, eventually, http_exchange
from tests.scrape import OPENMETRICS, scrape


def ws_url(server: RelayServer, path: str = "/echo") -> str:
    return server.url + path


async def test_echo_text_and_binary(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    async with connect(ws_url(server)) as ws:
        await ws.send("héllo")
        assert await asyncio.wait_for(ws.recv(), WAIT) == "héllo"
        await ws.send(b"\x00\x01\x02")
        assert await asyncio.wait_for(ws.recv(), WAIT) == b"\x00\x01\x02"


async def test_an_upgraded_connection_keeps_no_http_idle_timer(start_relay: StartRelay) -> None:
    """The HTTP idle timer stays armed across keep-alive requests (one per connection, not one
    per request); a websocket must not keep it, or each idle websocket holds a timer (~600
    bytes) for the idle timeout after its upgrade (bench.scenarios idle). The upgrade hands
    the transport to a websocket connection, which has no HTTP state at all."""
    server = await start_relay([EchoDialect()], http_idle_timeout=300.0)
    async with connect(ws_url(server)) as ws:
        await ws.send("x")
        assert await asyncio.wait_for(ws.recv(), WAIT) == "x"
        (conn,) = server.connections.values()
        assert isinstance(conn, WebSocketConnection)
        assert conn.is_open
        assert not hasattr(conn, "_http_timer")


async def test_fragmented_message_is_reassembled(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    async with connect(ws_url(server)) as ws:
        await ws.send([b"frag", b"men", b"ted"])
        assert await asyncio.wait_for(ws.recv(), WAIT) == b"fragmented"
        await ws.send(["tex", "t"])
        assert await asyncio.wait_for(ws.recv(), WAIT) == "text"


async def test_one_mebibyte_message_round_trips(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    payload = os.urandom(1 << 20)
    async with connect(ws_url(server), max_size=2 << 20) as ws:
        await ws.send(payload)
        assert await asyncio.wait_for(ws.recv(), WAIT) == payload


async def test_ping_is_answered_with_pong(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    async with connect(ws_url(server)) as ws:
        pong = await ws.ping(b"are you there")
        await asyncio.wait_for(pong, WAIT)


async def test_close_handshake_reports_the_code_to_the_dialect(start_relay: StartRelay) -> None:
    dialect = EchoDialect()
    server = await start_relay([dialect])
    async with connect(ws_url(server)) as ws:
        await ws.close(4000, "bye")
    assert ws.close_code == 4000
    await eventually(lambda: dialect.closed_codes == [4000])


async def test_oversize_message_is_closed_with_1009(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect(max_message=1024)])
    async with connect(ws_url(server)) as ws:
        await ws.send(b"x" * 2000)
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), WAIT)
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 1009


def frame(first_byte: int, payload: bytes, *, masked: bool = True) -> bytes:
    """A hand-built client frame (payload < 126 bytes), for frames encoders refuse to make."""
    mask = b"\x01\x02\x03\x04"
    length = len(payload) | (0x80 if masked else 0)
    if not masked:
        return bytes([first_byte, length]) + payload
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([first_byte, length]) + mask + body


MALFORMED = {
    "unmasked": (frame(0x82, b"abc", masked=False), 1002),
    "reserved bit": (frame(0xC2, b"abc"), 1002),
    "unknown opcode": (frame(0x83, b"abc"), 1002),
    "fragmented ping": (frame(0x09, b"abc"), 1002),
    "continuation without start": (frame(0x80, b"abc"), 1002),
    "close code 1005": (frame(0x88, struct.pack("!H", 1005)), 1002),
    "one-byte close": (frame(0x88, b"\x03"), 1002),
    "invalid utf-8 text": (frame(0x81, b"\xff\xfe"), 1007),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_frame_gets_close_code_and_disconnect(
    start_relay: StartRelay, case: str
) -> None:
    data, expected = MALFORMED[case]
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    ws = await RawWebSocket.connect(host, port, "/echo")
    ws.send_raw(data)
    events = await ws.read_until_eof()
    closes = [e for e in events if isinstance(e, WsClose)]
    assert [c.code for c in closes] == [expected]
    ws.close()


async def test_oversize_control_frame_is_refused(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    ws = await RawWebSocket.connect(host, port, "/echo")
    # a ping of 126 bytes needs the 16-bit length form; build it by hand
    mask = b"\x00\x00\x00\x00"
    ws.send_raw(bytes([0x89, 0x80 | 126]) + struct.pack("!H", 126) + mask + b"p" * 126)
    events = await ws.read_until_eof()
    ws.close()
    assert [e.code for e in events if isinstance(e, WsClose)] == [1002]


async def test_garbage_http_gets_400_and_close(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    reply = await http_exchange(host, port, b"GARBAGE\x00\x01 nonsense\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")


async def test_oversize_head_gets_431_and_close(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    request = b"GET /health HTTP/1.1\r\nHost: relay\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    reply = await http_exchange(host, port, request)
    assert reply.startswith(b"HTTP/1.1 431 ")


async def test_upgrade_without_key_gets_400(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    request = (
        b"GET /echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    reply = await http_exchange(host, port, request)
    assert reply.startswith(b"HTTP/1.1 400 ")


async def test_upgrade_with_a_body_gets_400(
    start_relay: StartRelay, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    request = (
        b"GET /echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Content-Length: 4\r\n\r\nbody"
    )
    reply = await http_exchange(host, port, request)
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert reply.endswith(b"websocket upgrade with a body")
    assert not [r for r in caplog.records if r.name == "asyncio"]  # the body was not read


class StallingDialect(EchoDialect):
    """`accept` never finishes (an authentication backend that hangs)."""

    name = "stall"
    paths = ("/stall",)

    async def accept(self, request: HttpRequest, conn: Peer) -> WebSocketHandler:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_upgrade_whose_accept_hangs_gets_503_at_the_deadline(
    start_relay: StartRelay,
) -> None:
    server = await start_relay([StallingDialect()], http_request_timeout=0.3)
    with pytest.raises(InvalidStatus) as info:
        async with connect(server.url + "/stall", open_timeout=WAIT):
            pass
    assert info.value.response.status_code == 503
    assert info.value.response.body == b"request not answered within 0.3 s"


async def test_upgrade_on_unknown_path_gets_404(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    with pytest.raises(InvalidStatus) as info:
        async with connect(server.url + "/nowhere"):
            pass
    assert info.value.response.status_code == 404


async def test_dialect_refusal_is_an_http_status_with_reason(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    with pytest.raises(InvalidStatus) as info:
        async with connect(server.url + "/echo?deny"):
            pass
    assert info.value.response.status_code == 403
    assert info.value.response.body == b"denied by test"


async def test_head_health_is_200_with_no_body(start_relay: StartRelay) -> None:
    server = await start_relay([])
    host, port = server.addresses[0]
    reply = await http_exchange(
        host, port, b"HEAD /health HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert reply.endswith(b"Content-Length: 3\r\nConnection: close\r\n\r\n")


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this host")
async def test_the_unspecified_v6_address_serves_ipv4_clients_too(start_relay: StartRelay) -> None:
    """`[::]:PORT` (the default listen address, as in rmb-rs) is dual-stack."""
    server = await start_relay([], host="::")
    _, port = server.addresses[0]
    for host in ("127.0.0.1", "::1"):
        reply = await http_exchange(
            host, port, b"GET /health HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
        )
        assert reply.startswith(b"HTTP/1.1 200 "), host


async def test_an_address_in_use_is_a_clear_error(start_relay: StartRelay) -> None:
    server = await start_relay([])
    _, port = server.addresses[0]
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
        await start_relay([], port=port)


async def test_health_and_metrics(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    reply = await http_exchange(
        host, port, b"GET /health HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert reply.endswith(b"ok\n")
    async with connect(ws_url(server)):
        page = await scrape(host, port)
    assert page.value("rmb_relay_connections", dialect="echo") == 1


async def test_metrics_page_is_prometheus_text_with_the_listener_families(
    start_relay: StartRelay,
) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    await http_exchange(
        host, port, b"GET /health HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
    )
    page = await scrape(host, port)
    assert page.status == 200
    assert page.headers["content-type"] == choose_encoder("")[1]
    assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert page.types == {
        "rmb_relay_connections": "gauge",
        "rmb_relay_http_requests": "counter",
        "rmb_relay_http_parse_errors": "counter",
        "rmb_relay_ws_protocol_violations": "counter",
        "rmb_relay_messages_dropped": "counter",
        "rmb_relay_backpressure_pauses": "counter",
        "rmb_relay_reply_backpressure_pauses": "counter",
        "rmb_relay_close_linger_aborts": "counter",
        "rmb_relay_log_lines_suppressed": "counter",
        "rmb_relay_connections_refused": "counter",
        "rmb_relay_accept_pauses": "counter",
        "rmb_relay_accept_paused": "gauge",
    }
    assert page.value("rmb_relay_http_requests_total", method="GET", status="200") == 1
    assert page.value("rmb_relay_connections", dialect="echo") == 0


async def test_metrics_page_speaks_openmetrics_when_asked(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    page = await scrape(host, port, accept=OPENMETRICS)
    assert page.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert page.body.endswith("# EOF\n")
    assert page.value("rmb_relay_connections", dialect="echo") == 0


async def test_random_http_methods_create_a_bounded_number_of_series(
    start_relay: StartRelay,
) -> None:
    """The method label comes from the client: only the standard methods get their own series,
    anything else is `other`, so 1,000 made-up methods cannot grow the page."""
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    rng = random.Random(7)
    token = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
    methods = [
        rng.choice(sorted(HTTP_METHODS))
        if rng.random() < 0.2
        else "".join(rng.choices(token, k=rng.randint(1, 16)))
        for _ in range(1000)
    ]

    async def send(method: str) -> None:
        path = rng.choice(["/health", "/nope"])
        await http_exchange(
            host,
            port,
            f"{method} {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n".encode(),
        )

    for start in range(0, len(methods), 50):
        await asyncio.gather(*(send(m) for m in methods[start : start + 50]))
    page = await scrape(host, port)
    series = page.series("rmb_relay_http_requests_total")
    assert {s["method"] for s in series} <= HTTP_METHODS | {"other"}
    assert {s["status"] for s in series} <= {"200", "404", "405"}
    assert len(series) <= (len(HTTP_METHODS) + 1) * 3
    assert sum(page.value("rmb_relay_http_requests_total", **s) for s in series) == 1000
    assert page.value("rmb_relay_http_requests_total", method="other", status="404") > 0


async def test_pipelined_requests_are_answered_in_order(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    host, port = server.addresses[0]
    reply = await http_exchange(
        host,
        port,
        b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n"
        b"GET /nope HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n",
    )
    first, _, second = reply.partition(b"ok\n")
    assert first.startswith(b"HTTP/1.1 200 ")
    assert second.startswith(b"HTTP/1.1 404 ")


async def test_unknown_route_is_404_page_not_found(start_relay: StartRelay) -> None:
    server = await start_relay([])
    host, port = server.addresses[0]
    reply = await http_exchange(
        host, port, b"GET /x HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 404 ")
    assert reply.endswith(b"page not found")


async def test_shutdown_closes_websockets_with_1001(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()])
    async with connect(ws_url(server)) as ws:
        await asyncio.wait_for(server.shutdown(), WAIT)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), WAIT)
    assert ws.close_code == 1001


async def test_slow_receiver_pauses_sender_and_loses_nothing(start_relay: StartRelay) -> None:
    dialect = PipeDialect()
    server = await start_relay([dialect], write_high_water=64 * 1024)
    host, port = server.addresses[0]
    receiver = await RawWebSocket.connect(host, port, "/pipe/slow")
    sender = await RawWebSocket.connect(host, port, "/pipe/fast")
    await eventually(lambda: {"slow", "fast"} <= dialect.members.keys())
    chunk = os.urandom(60 * 1024)
    count = 300  # ~18 MB: far more than loopback socket buffers hold
    for _ in range(count):
        sender.send_binary(b"slow:" + chunk)
    metric = server.metrics.backpressure_pauses
    await eventually(lambda: metric.value("pipe") > 0)
    received = 0
    while received < count:
        event = await receiver.next_event()
        assert getattr(event, "data", None) == chunk
        received += 1
    receiver.close()
    sender.close()


async def test_tls_listener_serves_wss(start_relay: StartRelay, tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = await start_relay([EchoDialect()], tls_cert=str(cert_path), tls_key=str(key_path))
    client_ctx = ssl.create_default_context(cafile=str(cert_path))
    port = server.addresses[0][1]
    async with connect(f"wss://localhost:{port}/echo", ssl=client_ctx) as ws:
        await ws.send(b"secret")
        assert await asyncio.wait_for(ws.recv(), WAIT) == b"secret"
