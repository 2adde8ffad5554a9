"""The SBD dialect end to end: every row of the conformance suite (spec/sbd.md §3.2), the
pitfalls of §7 and our decisions, with real sockets and an injected clock for time."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from rmb_relay._core import (
    OP_BINARY,
    OP_CONTINUATION,
    SigningKey,
    encode_frame,
    sbd_encode_command,
)
from rmb_relay.dialects.sbd import SbdDialect, SbdSettings, ip_key
from rmb_relay.server.listener import RelayServer
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import WAIT, StartRelay
from tests.helpers import FakeClock, eventually, http_exchange
from tests.sbd_client import SbdClient, key_path
from tests.scrape import scrape


@dataclass
class Sbd:
    server: RelayServer
    dialect: SbdDialect
    clock: FakeClock
    clients: list[SbdClient] = field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.addresses[0]
        return host, port

    async def client(self, **kwargs: Any) -> SbdClient:
        client = await SbdClient.connect(*self.address, **kwargs)
        self.clients.append(client)
        return client


@pytest.fixture
async def make_sbd(start_relay: StartRelay) -> AsyncIterator[Any]:
    made: list[Sbd] = []

    async def make(**settings: Any) -> Sbd:
        clock = FakeClock()
        registry = Registry()
        dialect = SbdDialect(SbdSettings(**settings), registry, clock=clock)
        server = await start_relay([dialect], registry=registry)
        sbd = Sbd(server, dialect, clock)
        made.append(sbd)
        return sbd

    yield make
    for sbd in made:
        for client in sbd.clients:
            client.close()


# ---- the conformance suite's rows (spec §3.2) ---------------------------------------------


async def test_1_sanity_two_clients_exchange(make_sbd: Any) -> None:
    sbd = await make_sbd()
    a, b = await asyncio.gather(sbd.client(), sbd.client())
    a.forward(b.pubkey, b"hello")
    b.forward(a.pubkey, b"world")
    assert await b.receive_forward() == (a.pubkey, b"hello")
    assert await a.receive_forward() == (b.pubkey, b"world")


@pytest.mark.parametrize(
    "path",
    [
        "/bad-pubkey-path",
        key_path(os.urandom(32)) + "=",  # padding
        "/" + "A" * 43,  # 28 leading zero bytes: looks like a command
        key_path(os.urandom(31)),
    ],
)
async def test_2_bad_pubkey_path_is_http_400_before_upgrade(make_sbd: Any, path: str) -> None:
    sbd = await make_sbd()
    host, port = sbd.address
    request = (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    reply = await http_exchange(host, port, request)
    assert reply.startswith(b"HTTP/1.1 400 ")


async def test_3_bad_handshake_signature_gets_only_lbrt_then_drop(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client(handshake=False)
    while b"areq" not in client.trace:
        client._note(await client.next_message())
    client.send(sbd_encode_command(b"ares", bytes(64)))
    assert await client.dropped_without_close_frame()
    after_areq = client.trace[client.trace.index(b"areq") + 1 :]
    assert set(after_areq) <= {b"lbrt"}


async def test_4_none_before_handshake_is_ignored(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client(handshake=False)
    client.send(sbd_encode_command(b"none", bytes(17)))
    await client.handshake()
    assert client.trace[-1] == b"srdy"


async def test_5_none_after_handshake_is_ignored_and_empty_self_forward_echoes(
    make_sbd: Any,
) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    client.send(sbd_encode_command(b"none", bytes(17)))
    client.forward(client.pubkey, b"")
    assert await client.receive_forward() == (client.pubkey, b"")


async def test_6_oversize_message_drops_the_connection(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    client.forward(client.pubkey, bytes(25000 - 32))
    assert await client.dropped_without_close_frame()


async def test_max_size_message_is_delivered(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    client.forward(client.pubkey, bytes(20000 - 32))
    assert await client.receive_forward() == (client.pubkey, bytes(19968))


async def test_7_per_sender_order_is_kept(make_sbd: Any) -> None:
    sbd = await make_sbd(disable_rate_limit=True)
    echo = await sbd.client()
    senders = await asyncio.gather(*(sbd.client() for _ in range(10)))

    async def echo_loop() -> None:
        for _ in range(10 * 100):
            peer, payload = await echo.receive_forward()
            echo.forward(peer, payload)

    task = asyncio.create_task(echo_loop())
    for s in senders:
        for i in range(100):
            s.forward(echo.pubkey, i.to_bytes(2, "big"))
    for s in senders:
        got = [await s.receive_forward() for _ in range(100)]
        assert got == [(echo.pubkey, i.to_bytes(2, "big")) for i in range(100)]
    await asyncio.wait_for(task, WAIT)


async def test_8_messages_reach_the_right_destination(make_sbd: Any) -> None:
    sbd = await make_sbd()
    echoes = await asyncio.gather(*(sbd.client() for _ in range(10)))
    senders = await asyncio.gather(*(sbd.client() for _ in range(10)))

    async def echo(client: SbdClient) -> None:
        for _ in range(10):
            peer, payload = await client.receive_forward()
            client.forward(peer, payload)

    tasks = [asyncio.create_task(echo(e)) for e in echoes]

    async def send(i: int) -> None:
        for j in range(10):
            senders[i].forward(echoes[i].pubkey, f"{i}-{j}".encode())
            assert await senders[i].receive_forward() == (echoes[i].pubkey, f"{i}-{j}".encode())

    await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(10)), *tasks), WAIT)


async def test_oversize_fragmented_message_drops_without_close_frame(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    mask = os.urandom(4)
    first = encode_frame(OP_BINARY, client.pubkey + bytes(12000), fin=False, mask=mask)
    rest = encode_frame(OP_CONTINUATION, bytes(12000), mask=mask)
    client.ws.send_raw(first + rest)
    assert await client.dropped_without_close_frame()
    assert not sbd.dialect.sessions


# ---- handshake order and routing rules ----------------------------------------------------


async def test_handshake_order_lbrt_areq_then_lidl_srdy(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    assert client.trace == [b"lbrt", b"areq", b"lidl", b"srdy"]
    assert client.lbrt == [8000]
    assert client.lidl == 10000


async def test_forward_to_unknown_key_is_dropped_and_sender_stays(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    client.forward(os.urandom(32), b"nobody")
    client.forward(client.pubkey, b"still here")
    assert await client.receive_forward() == (client.pubkey, b"still here")
    assert sbd.dialect.metrics.hot.forward_drops == 1


async def test_forward_before_handshake_drops(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client(handshake=False)
    client.forward(os.urandom(32), b"too early")
    assert await client.dropped_without_close_frame()


async def test_ares_after_handshake_drops(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    client.send(sbd_encode_command(b"ares", bytes(64)))
    assert await client.dropped_without_close_frame()


async def test_short_message_drops(make_sbd: Any) -> None:
    sbd = await make_sbd()
    client = await sbd.client()
    client.send(b"short")
    assert await client.dropped_without_close_frame()


async def test_newest_connection_with_a_key_takes_the_routing(make_sbd: Any) -> None:
    sbd = await make_sbd()
    key = SigningKey.ed25519(os.urandom(32))
    old = await sbd.client(key=key)
    new = await sbd.client(key=key)
    other = await sbd.client()
    other.forward(key.public_key, b"to the newest")
    assert await new.receive_forward() == (other.pubkey, b"to the newest")
    assert await old.closed_by_server() == 1000


async def test_forward_to_a_handshaking_key_is_dropped(make_sbd: Any) -> None:
    sbd = await make_sbd()
    pending = await sbd.client(handshake=False)
    sender = await sbd.client()
    sender.forward(pending.pubkey, b"not yet")
    sender.forward(sender.pubkey, b"marker")
    assert await sender.receive_forward() == (sender.pubkey, b"marker")
    await pending.handshake()  # a forward before srdy would fail this
    sender.forward(pending.pubkey, b"now")
    assert await pending.receive_forward() == (sender.pubkey, b"now")


async def test_older_duplicate_closing_does_not_unroute_the_newer(make_sbd: Any) -> None:
    sbd = await make_sbd()
    key = SigningKey.ed25519(os.urandom(32))
    old = await sbd.client(key=key)
    new = await sbd.client(key=key)
    assert await old.closed_by_server() == 1000
    await eventually(lambda: len(sbd.dialect.sessions) == 1)
    other = await sbd.client()
    other.forward(key.public_key, b"still routed")
    assert await new.receive_forward() == (other.pubkey, b"still routed")


# ---- rate limits, lbrt, idle, client limit ------------------------------------------------


async def test_lbrt_follows_the_ip_connection_count_up_and_down(make_sbd: Any) -> None:
    sbd = await make_sbd()
    first = await sbd.client()
    second = await sbd.client()
    assert second.lbrt[0] == 16000
    assert await first.next_lbrt() == 16000
    second.close()
    assert await first.next_lbrt() == 8000


async def test_rate_violation_drops_and_blocks_the_ip(make_sbd: Any) -> None:
    sbd = await make_sbd(kbps=1000, burst=1000, block_secs=60)
    client = await sbd.client()
    for _ in range(10):
        client.forward(client.pubkey, bytes(200))
    assert await client.dropped_without_close_frame()
    assert sbd.dialect.metrics.rate_limited.value() == 1
    host, port = sbd.address
    with pytest.raises(ConnectionError, match="429"):
        await SbdClient.connect(host, port)
    sbd.clock.advance(61)
    again = await sbd.client()
    again.forward(again.pubkey, b"ok")
    assert await again.receive_forward() == (again.pubkey, b"ok")


async def test_budget_refills_with_time(make_sbd: Any) -> None:
    sbd = await make_sbd(kbps=1000, burst=1000)
    client = await sbd.client()  # the ares (96 bytes) is charged too
    client.forward(client.pubkey, bytes(800))
    assert len((await client.receive_forward())[1]) == 800
    sbd.clock.advance(1)  # 1000 kbps = 125 bytes/ms: far more than the burst refilled
    client.forward(client.pubkey, bytes(800))
    assert len((await client.receive_forward())[1]) == 800


async def test_idle_connection_is_dropped_by_the_sweep(make_sbd: Any) -> None:
    sbd = await make_sbd(idle_ms=10000)
    idle = await sbd.client()
    busy = await sbd.client()
    sbd.clock.advance(6)
    busy.send(sbd_encode_command(b"keep"))
    await eventually(lambda: sbd.dialect.sessions[_id(sbd, busy)].last_activity == sbd.clock.now)
    sbd.clock.advance(5)
    sbd.dialect.sweep(sbd.clock.now)
    assert await idle.dropped_without_close_frame()
    busy.forward(busy.pubkey, b"alive")
    assert await busy.receive_forward() == (busy.pubkey, b"alive")
    assert sbd.dialect.metrics.idle_closed.value() == 1


async def test_slow_handshake_is_dropped_by_the_sweep(make_sbd: Any) -> None:
    sbd = await make_sbd(idle_ms=1000)
    client = await sbd.client(handshake=False)
    sbd.clock.advance(2)
    sbd.dialect.sweep(sbd.clock.now)
    assert await client.dropped_without_close_frame()


async def test_client_limit_counts_handshaking_and_frees_slots_at_once(make_sbd: Any) -> None:
    sbd = await make_sbd(limit_clients=2)
    first = await sbd.client(handshake=False)
    await sbd.client()
    host, port = sbd.address
    with pytest.raises(ConnectionError, match="503"):
        await SbdClient.connect(host, port)
    first.close()
    await eventually(lambda: len(sbd.dialect.sessions) == 1)
    await sbd.client()


async def test_trusted_ip_header_sets_the_rate_key(make_sbd: Any) -> None:
    sbd = await make_sbd(trusted_ip_header="X-Real-IP")
    a = await sbd.client(headers=[("X-Real-IP", "10.1.2.3")])
    b = await sbd.client(headers=[("X-Real-IP", "10.1.2.4")])
    assert a.lbrt[0] == b.lbrt[0] == 8000  # different IPs: one connection each
    assert {"::ffff:10.1.2.3", "::ffff:10.1.2.4"} <= set(sbd.dialect.by_ip)


async def test_lbrt_is_1_and_nothing_is_limited_when_disabled(make_sbd: Any) -> None:
    sbd = await make_sbd(disable_rate_limit=True, burst=100)
    client = await sbd.client()
    assert client.lbrt == [1]
    for _ in range(20):
        client.forward(client.pubkey, bytes(1000))
    for _ in range(20):
        assert len((await client.receive_forward())[1]) == 1000
    second = await sbd.client()
    assert second.lbrt == [1]
    # the value did not change, so the first connection is not told it again (issue 9)
    assert sbd.dialect.lbrt_frames == 2


async def test_ip_sharing_a_bucket_is_blocked_for_all_new_upgrades(make_sbd: Any) -> None:
    """The bucket is the IP's: a violation on one connection blocks new ones from the IP,
    while an existing connection of that IP stays until it breaks the budget itself."""
    sbd = await make_sbd(burst=2000, block_secs=60)
    quiet = await sbd.client()
    noisy = await sbd.client()
    noisy.forward(noisy.pubkey, bytes(5000))
    assert await noisy.dropped_without_close_frame()
    assert ip_key("127.0.0.1") in sbd.dialect.blocked
    host, port = sbd.address
    with pytest.raises(ConnectionError, match="429"):
        await SbdClient.connect(host, port)
    assert sbd.dialect.metrics.refused.value("429") == 1
    sbd.clock.advance(30)  # the budget refilled; the block has not expired
    quiet.forward(quiet.pubkey, b"fine")
    assert await quiet.receive_forward() == (quiet.pubkey, b"fine")


async def test_sweep_lifts_expired_blocks(make_sbd: Any) -> None:
    sbd = await make_sbd(burst=1000, block_secs=5)
    client = await sbd.client()
    client.forward(client.pubkey, bytes(2000))
    assert await client.dropped_without_close_frame()
    assert len(sbd.dialect.blocked) == 1
    sbd.clock.advance(4)
    sbd.dialect.sweep(sbd.clock.now)
    assert len(sbd.dialect.blocked) == 1
    sbd.clock.advance(1)
    sbd.dialect.sweep(sbd.clock.now)
    assert not sbd.dialect.blocked
    await sbd.client()


async def test_ping_does_not_reset_the_idle_timer(make_sbd: Any) -> None:
    sbd = await make_sbd(idle_ms=10000)
    client = await sbd.client()
    sbd.clock.advance(6)
    client.ws.send_raw(client.ws.encoder.ping(b"hi"))
    pong = await client.ws.next_event()
    assert getattr(pong, "data", None) == b"hi"
    sbd.clock.advance(5)
    sbd.dialect.sweep(sbd.clock.now)
    assert await client.dropped_without_close_frame()


async def test_data_during_the_handshake_resets_the_idle_timer(make_sbd: Any) -> None:
    sbd = await make_sbd(idle_ms=10000)
    client = await sbd.client(handshake=False)
    sbd.clock.advance(6)
    client.ws.send_raw(client.ws.encoder.text("\0" * 28 + "none"))  # text counts as its bytes
    client.send(sbd_encode_command(b"keep"))
    await eventually(
        lambda: next(iter(sbd.dialect.sessions.values())).last_activity == sbd.clock.now
    )
    sbd.clock.advance(5)
    sbd.dialect.sweep(sbd.clock.now)
    await client.handshake()
    client.forward(client.pubkey, b"alive")
    assert await client.receive_forward() == (client.pubkey, b"alive")


def test_ip_keys_map_v4_into_v6_as_the_reference() -> None:
    assert ip_key("127.0.0.1") == "::ffff:127.0.0.1"
    assert ip_key("::ffff:127.0.0.1") == "::ffff:127.0.0.1"
    # IPv6 grouped by --ipv6-prefix (the dialect passes it; 128 keeps each address)
    assert ip_key("2001:db8:0:1::a", 64) == ip_key("2001:db8:0:1::b", 64) == "2001:db8:0:1::/64"
    assert ip_key("2001:db8:0:1::a") == "2001:db8:0:1::a"
    assert ip_key("::1") == "::1"  # a different bucket from 127.0.0.1
    assert ip_key("2001:DB8::1") == "2001:db8::1"


async def test_unparsable_trusted_header_falls_back_to_the_peer(make_sbd: Any) -> None:
    sbd = await make_sbd(trusted_ip_header="X-Forwarded-For")
    await sbd.client(headers=[("X-Forwarded-For", "10.0.0.1, 10.0.0.2")])
    await sbd.client(headers=[("X-Forwarded-For", "10.0.0.9")])
    assert set(sbd.dialect.by_ip) == {"::ffff:127.0.0.1", "::ffff:10.0.0.9"}


async def test_trusted_header_ip_is_the_one_blocked(make_sbd: Any) -> None:
    sbd = await make_sbd(trusted_ip_header="X-Real-IP", burst=1000)
    bad = await sbd.client(headers=[("X-Real-IP", "10.9.9.9")])
    bad.forward(bad.pubkey, bytes(2000))
    assert await bad.dropped_without_close_frame()
    host, port = sbd.address
    with pytest.raises(ConnectionError, match="429"):
        await SbdClient.connect(host, port, headers=[("X-Real-IP", "10.9.9.9")])
    await sbd.client(headers=[("X-Real-IP", "10.9.9.10")])


async def test_metrics_page_counts_sbd_traffic(make_sbd: Any) -> None:
    sbd = await make_sbd()
    a, b = await asyncio.gather(sbd.client(), sbd.client())
    a.forward(b.pubkey, bytes(100))
    assert await b.receive_forward() == (a.pubkey, bytes(100))
    a.forward(os.urandom(32), b"lost")
    a.forward(a.pubkey, b"")
    await a.receive_forward()
    host, port = sbd.address
    page = await scrape(host, port)

    def sbd_value(name: str, **labels: str) -> float:
        return page.value(name, dialect="sbd", **labels)

    assert sbd_value("rmb_relay_sessions") == 2
    assert sbd_value("rmb_relay_connections") == 2
    assert sbd_value("rmb_relay_messages_routed_total", path="local") == 2
    assert sbd_value("rmb_relay_messages_out_total") == 2
    assert sbd_value("rmb_relay_messages_dropped_total", reason="unknown key") == 1
    assert sbd_value("rmb_relay_messages_in_total") == 5
    assert sbd_value("rmb_relay_bytes_out_total") == 164  # 132 + 32: forwarded message bytes
    # 2 ares (96 each) + 132 + 36 + 32
    assert sbd_value("rmb_relay_bytes_in_total") == 392
    assert sbd_value("rmb_relay_connections_closed_total", reason="rate") == 0
    assert sbd_value("rmb_relay_blocked_ips") == 0


# ---- spec-auth -----------------------------------------------------------------------------


async def authenticate(sbd: Sbd, body: bytes) -> tuple[int, bytes]:
    host, port = sbd.address
    request = (
        b"PUT /authenticate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    reply = await http_exchange(host, port, request)
    status = int(reply.split(b" ", 2)[1])
    return status, reply.partition(b"\r\n\r\n")[2]


async def test_without_hook_any_caller_gets_a_token(make_sbd: Any) -> None:
    sbd = await make_sbd()
    status, body = await authenticate(sbd, b"anything")
    assert status == 200
    token = json.loads(body)["authToken"]
    client = await sbd.client(headers=[("Authorization", f"Bearer {token}")])
    client.forward(client.pubkey, b"x")
    assert await client.receive_forward() == (client.pubkey, b"x")
    host, port = sbd.address
    with pytest.raises(ConnectionError, match="401"):
        await SbdClient.connect(host, port, headers=[("Authorization", "Bearer nope")])


async def test_tokens_expire_after_idle_time(make_sbd: Any) -> None:
    sbd = await make_sbd(idle_ms=1000)
    _, body = await authenticate(sbd, b"x")
    token = json.loads(body)["authToken"]
    sbd.clock.advance(2)
    host, port = sbd.address
    with pytest.raises(ConnectionError, match="401"):
        await SbdClient.connect(host, port, headers=[("Authorization", f"Bearer {token}")])


def _id(sbd: Sbd, client: SbdClient) -> int:
    for conn_id, session in sbd.dialect.sessions.items():
        if session.pubkey == client.pubkey:
            return conn_id
    raise KeyError("no such session")
