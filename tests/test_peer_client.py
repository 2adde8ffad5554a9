"""The shared RMB client under rmb-peer: keepalive, reconnect, failover between relays, and
requests re-sent when a relay goes away. In-process relays on real sockets, real keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rmb_relay.clock import NS
from rmb_relay.errors import ClientError, RequestTimeout
from rmb_relay.sdk import IncomingRequest, RelayLink, RmbClient
from tests.conftest import WAIT, StartRelay, free_port
from tests.helpers import eventually
from tests.rmb_fixtures import FakeClock, RmbRelay, key_for, start_rmb_relay


class Monotonic:
    """A monotonic clock (nanoseconds) the test moves."""

    def __init__(self) -> None:
        self.now = 1_000 * NS

    def __call__(self) -> int:
        return self.now


async def test_link_pings_when_idle_and_drops_a_silent_relay(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(start_relay, tmp_path)
    clock = Monotonic()
    client = RmbClient(1, key_for(1))
    downs: list[RelayLink] = []
    link = RelayLink(
        relay.url, client.login_token, lambda m: None, clock=clock, on_down=downs.append
    )
    await link.connect()
    ws = link.ws
    assert ws is not None
    link.keepalive()  # nothing is due yet
    assert ws.last_sent == clock.now
    clock.now += 20 * NS
    link.keepalive()  # 20 s without writing: a websocket ping
    assert ws.last_sent == clock.now
    await eventually(lambda: ws.last_received == clock.now)  # the relay's pong counts
    clock.now += 40 * NS
    link.keepalive()
    assert link.connected  # 40 s is not yet "more than 40 s" of silence
    clock.now += 1
    link.keepalive()
    await eventually(lambda: downs == [link])
    assert not link.connected
    assert ws.is_open
    assert link.retired == {ws}
    await link.close()


async def test_a_connection_given_up_for_silence_is_read_until_the_relay_closes_it(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    """A silent connection may be a cut path (docs/faults.md, b): what the relay wrote into it
    arrives once the path is repaired. The link keeps reading it after giving it up; the relay
    closes it once the new connection logs in, after what it had written."""
    relay = await start_rmb_relay(start_relay, tmp_path)
    clock = Monotonic()
    client = RmbClient(1, key_for(1))
    received: list[bytes] = []
    link = RelayLink(relay.url, client.login_token, lambda m: received.append(m.data), clock=clock)
    await link.connect()
    old = link.ws
    assert old is not None
    clock.now += 41 * NS
    link.keepalive()
    assert not link.connected
    assert old.is_open
    sender = await relay.client(2, key_type="ed25519")
    sender.send_request(1, "m", b"late")  # the relay still holds twin 1 on the old connection
    await eventually(lambda: len(received) == 1)
    await link.connect()  # the new login replaces the old connection at the relay
    await asyncio.wait_for(old.closed, WAIT)
    assert not link.retired
    assert link.connected
    await link.close()
    await relay.close_clients()


async def test_a_retired_connection_is_read_for_a_bounded_time(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(start_relay, tmp_path)
    clock = Monotonic()
    client = RmbClient(1, key_for(1))
    link = RelayLink(relay.url, client.login_token, lambda m: None, clock=clock, keep_reading=0.05)
    await link.connect()
    old = link.ws
    assert old is not None
    clock.now += 41 * NS
    link.keepalive()
    await asyncio.wait_for(old.closed, WAIT)  # nobody closed it: the bound did
    assert not link.retired
    await link.close()


async def test_link_that_keeps_writing_still_pings_when_nothing_arrives(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    """Before: only an idle writer pinged, so a link that only sends heard nothing for 40 s
    and dropped itself (rmb-load's senders reconnected every 40 s under load)."""
    relay = await start_rmb_relay(start_relay, tmp_path)
    clock = Monotonic()
    client = RmbClient(1, key_for(1))
    link = RelayLink(relay.url, client.login_token, lambda m: None, clock=clock)
    await link.connect()
    ws = link.ws
    assert ws is not None
    clock.now += 20 * NS
    ws.last_sent = clock.now  # it has just written something
    link.keepalive()
    await eventually(lambda: ws.last_received == clock.now)  # pinged, and the pong counts
    assert link.connected
    await link.close()


async def two_relays(start_relay: StartRelay, tmp_path: Path) -> tuple[RmbRelay, RmbRelay]:
    first = await start_rmb_relay(start_relay, tmp_path, db_name="a.sqlite3")
    second = await start_rmb_relay(start_relay, tmp_path, db_name="b.sqlite3")
    return first, second


async def test_request_held_by_a_lost_relay_goes_out_through_the_other(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    """The first relay keeps the request in its mailbox (bob is not there) and dies: alice
    re-sends it through the second relay, where bob is."""
    first, second = await two_relays(start_relay, tmp_path)
    alice = RmbClient(1, key_for(1), reconnect=True, retry_delay=0.05)
    await alice.open([first.url, second.url])
    await eventually(lambda: all(link.connected for link in alice.links))
    bob = await second.client(2, key_type="ed25519")
    bob.handle("echo", lambda r: r.data)
    reply = alice.send_request(2, "echo", b"hello")
    await eventually(lambda: first.dialect.mailbox.depth() == 1)
    await first.server.shutdown()
    assert (await asyncio.wait_for(reply, WAIT)).data == b"hello"
    assert alice.links[0].url == second.url.rstrip("/") + "/"  # the relay that worked is first
    await alice.close()
    await second.close_clients()


async def test_reply_lost_with_its_relay_is_recovered_by_a_resend(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    """Bob got the request through the first relay and answers after it died: alice re-sent
    the request, bob answers both, alice's request resolves once."""
    first, second = await two_relays(start_relay, tmp_path)
    alice = RmbClient(1, key_for(1), reconnect=True, retry_delay=0.05)
    bob = RmbClient(2, key_for(2, "ed25519"), reconnect=True, retry_delay=0.05)
    for client in (alice, bob):
        await client.open([first.url, second.url])
    await eventually(lambda: all(link.connected for c in (alice, bob) for link in c.links))
    release = asyncio.Event()
    seen: list[bytes] = []

    async def slow(request: IncomingRequest) -> bytes:
        seen.append(request.data)
        await release.wait()
        return request.data

    bob.handle("slow", slow)
    reply = alice.send_request(2, "slow", b"once")
    await eventually(lambda: len(seen) == 1)
    await first.server.shutdown()
    await eventually(lambda: len(seen) == 2)  # the re-sent copy, through the second relay
    release.set()
    assert (await asyncio.wait_for(reply, WAIT)).data == b"once"
    assert not alice._pending
    await alice.close()
    await bob.close()


async def test_requests_wait_for_a_relay_and_go_when_it_comes_up(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    port = free_port()
    alice = RmbClient(1, key_for(1), reconnect=True, retry_delay=0.05)
    await alice.open(f"ws://127.0.0.1:{port}/")
    reply = alice.send_request(2, "echo", b"later")
    assert not alice.connected
    relay = await start_rmb_relay(start_relay, tmp_path, port=port)
    bob = await relay.client(2, key_type="ed25519")
    bob.handle("echo", lambda r: r.data)
    await alice.wait_connected(WAIT)
    assert (await asyncio.wait_for(reply, WAIT)).data == b"later"
    await alice.close()
    await relay.close_clients()


async def test_a_request_that_expires_before_any_relay_is_up_fails() -> None:
    clock = FakeClock()
    alice = RmbClient(1, key_for(1), reconnect=True, clock=clock, retry_delay=0.05)
    await alice.open(f"ws://127.0.0.1:{free_port()}/")
    reply = alice.send_request(2, "echo", b"never", expiration=5)
    clock.advance(4)
    alice.sweep()
    assert not reply.done()
    clock.advance(1)
    alice.sweep()
    with pytest.raises(RequestTimeout):
        await reply
    await alice.close()


async def test_plain_client_refuses_to_send_without_a_relay(relay_url: str) -> None:
    alice = await RmbClient.connect(relay_url, 1, key_for(1))
    await alice.close()
    with pytest.raises(ClientError, match="not connected"):
        alice.send_request(2, "x")


@pytest.fixture
async def relay_url(start_relay: StartRelay, tmp_path: Path) -> str:
    relay = await start_rmb_relay(start_relay, tmp_path)
    return relay.url
