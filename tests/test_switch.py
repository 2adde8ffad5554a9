"""The switch: local delivery, mailbox, no route; presence and displacement; and the listener's
`writable()` that producers outside a socket read wait on."""

from __future__ import annotations

import asyncio
import time

from rmb_relay._core import WsMessage
from rmb_relay.dialects.base import Peer
from rmb_relay.mailbox import MemoryMailbox
from rmb_relay.server.ws_connection import WebSocketConnection as Connection
from rmb_relay.switch import Outcome, Switch
from tests.conftest import WAIT, StartRelay
from tests.dialects import EchoDialect
from tests.helpers import RawWebSocket, eventually


class FakePeer:
    """Just enough of a Peer for the switch's bookkeeping (the switch never sends itself)."""

    def __init__(self, conn_id: int) -> None:
        self.id = conn_id

    async def writable(self) -> None:
        """Never congested."""


class Box:
    """A test endpoint: records what the switch delivers to it."""

    def __init__(self, conn_id: int) -> None:
        self.peer: Peer = FakePeer(conn_id)  # type: ignore[assignment]
        self.frames: list[bytes] = []
        self.mail_calls = 0

    def deliver(self, frame: bytes) -> None:
        self.frames.append(frame)

    def mail_waiting(self) -> None:
        self.mail_calls += 1


async def test_session_address_delivers_locally_when_connected() -> None:
    switch = Switch()
    box = Box(1)
    switch.attach(box)
    assert switch.register_session((7, None), box) is None
    assert await switch.deliver((7, None), b"m") is Outcome.DELIVERED
    assert box.frames == [b"m"]


async def test_offline_session_with_deadline_is_queued_and_without_has_no_route() -> None:
    mailbox = MemoryMailbox()
    switch = Switch(mailbox)
    deadline = int(time.time()) + 60
    assert await switch.deliver((7, "app"), b"a", deadline=deadline) is Outcome.QUEUED
    assert await switch.deliver((7, "app"), b"b") is Outcome.NO_ROUTE
    assert (await mailbox.take((7, "app"))).envelopes == [b"a"]


async def test_pubkey_addresses_never_queue() -> None:
    switch = Switch()
    key = bytes(range(32))
    assert await switch.deliver(key, b"x", deadline=int(time.time()) + 60) is Outcome.NO_ROUTE
    box = Box(3)
    switch.attach(box)
    switch.register_key(key, box)
    assert await switch.deliver(key, b"y") is Outcome.DELIVERED
    assert box.frames == [b"y"]


def test_newer_registration_displaces_and_the_old_cannot_evict_it() -> None:
    switch = Switch()
    old, new = Box(1), Box(2)
    for box in (old, new):
        switch.attach(box)
    switch.register_session((7, None), old)
    assert switch.register_session((7, None), new) is old
    switch.unregister_session((7, None), old)  # the replaced connection closing
    assert switch.lookup((7, None)) is new
    switch.detach(old)
    assert switch.endpoint(1) is None
    assert switch.endpoint(2) is new


async def test_a_session_connecting_while_its_message_is_stored_is_told_to_drain() -> None:
    """The mailbox write awaits; if the session registers meanwhile, it must hear about it."""

    class SlowMailbox(MemoryMailbox):
        def __init__(self) -> None:
            super().__init__()
            self.entered = asyncio.Event()
            self.release = asyncio.Event()

        async def put(
            self,
            key: tuple[int, str | None],
            envelope: bytes,
            deadline: int,
            *,
            sender: str | None = None,
        ) -> None:
            self.entered.set()
            await self.release.wait()
            await super().put(key, envelope, deadline)

    mailbox = SlowMailbox()
    switch = Switch(mailbox)
    storing = asyncio.create_task(
        switch.deliver((9, None), b"late", deadline=int(time.time()) + 60)
    )
    await asyncio.wait_for(mailbox.entered.wait(), WAIT)
    box = Box(4)
    switch.attach(box)
    switch.register_session((9, None), box)
    mailbox.release.set()
    assert await asyncio.wait_for(storing, WAIT) is Outcome.QUEUED
    assert box.mail_calls == 1


async def test_writable_waits_while_the_peer_is_congested(start_relay: StartRelay) -> None:
    """A producer outside a read awaits `writable()`: pending while the client does not read,
    resolved once it reads."""
    server = await start_relay([EchoDialect()], write_high_water=64 * 1024)
    host, port = server.addresses[0]
    ws = await RawWebSocket.connect(host, port, "/echo")
    await eventually(lambda: any(c.is_open for c in server.connections.values()))
    conn: Connection = next(c for c in server.connections.values() if c.is_open)
    await asyncio.wait_for(conn.writable(), WAIT)  # idle: at once
    chunk = bytes(60_000)
    while not conn.congested:  # fill the socket buffers until the transport reports it
        conn.send(chunk)
        await asyncio.sleep(0)
    waiter = asyncio.ensure_future(conn.writable())
    await asyncio.sleep(0)
    assert not waiter.done()
    received = 0
    while not waiter.done():
        event = await ws.next_event()
        assert isinstance(event, WsMessage)
        received += len(event.data)
    await asyncio.wait_for(waiter, WAIT)
    assert received > 0
    ws.close()


async def test_writable_resolves_when_the_peer_goes_away(start_relay: StartRelay) -> None:
    server = await start_relay([EchoDialect()], write_high_water=64 * 1024)
    host, port = server.addresses[0]
    ws = await RawWebSocket.connect(host, port, "/echo")
    await eventually(lambda: any(c.is_open for c in server.connections.values()))
    conn = next(c for c in server.connections.values() if c.is_open)
    while not conn.congested:
        conn.send(bytes(60_000))
        await asyncio.sleep(0)
    waiter = asyncio.ensure_future(conn.writable())
    ws.writer.transport.abort()
    await asyncio.wait_for(waiter, WAIT)


class PeerBox:
    """An endpoint around a real listener connection."""

    def __init__(self, peer: Connection) -> None:
        self.peer = peer

    def deliver(self, frame: bytes) -> None:
        self.peer.send(frame)

    def mail_waiting(self) -> None:
        pass


async def test_deliver_outside_a_read_waits_for_a_congested_receiver(
    start_relay: StartRelay,
) -> None:
    server = await start_relay([EchoDialect()], write_high_water=64 * 1024)
    host, port = server.addresses[0]
    ws = await RawWebSocket.connect(host, port, "/echo")
    await eventually(lambda: any(c.is_open for c in server.connections.values()))
    conn = next(c for c in server.connections.values() if c.is_open)
    switch = Switch()
    box = PeerBox(conn)
    switch.attach(box)
    switch.register_session((5, None), box)
    while not conn.congested:
        conn.send(bytes(60_000))
        await asyncio.sleep(0)
    delivery = asyncio.ensure_future(switch.deliver((5, None), b"after the backlog"))
    await asyncio.sleep(0)
    assert not delivery.done()  # the backlog is not grown while the client does not read
    last = b""
    while last != b"after the backlog":
        event = await ws.next_event()
        assert isinstance(event, WsMessage)
        last = event.data
    assert await asyncio.wait_for(delivery, WAIT) is Outcome.DELIVERED
    ws.close()
