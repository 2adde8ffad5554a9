"""SBD under an anonymous flood from one IP (issue 9, item 2), with real sockets: the `lbrt`
rebroadcast costs O(1) frames per new connection (counted, not timed), and one IP cannot hold
more than `limit_handshaking_per_ip` connections that never complete the handshake."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rmb_relay.dialects.sbd import SbdSettings
from tests.helpers import eventually
from tests.sbd_client import SbdClient
from tests.test_sbd import make_sbd  # noqa: F401 - the fixture

#: the rate key of a loopback client
IP = "::ffff:127.0.0.1"


async def test_lbrt_frames_grow_linearly_with_connections_from_one_ip(make_sbd: Any) -> None:  # noqa: F811
    """Before: every new connection re-sent lbrt to all of its IP's connections, K(K+1)/2
    frames for K connections (45,150 for 300). Now each connection gets its own at once and
    the others hear the new value at most once per interval."""
    sbd = await make_sbd(limit_handshaking_per_ip=1000)
    host, port = sbd.address
    count = 300
    clients: list[SbdClient] = []
    for _ in range(0, count, 50):
        batch = await asyncio.gather(
            *(SbdClient.connect(host, port, handshake=False) for _ in range(50))
        )
        clients.extend(batch)
        sbd.clients.extend(batch)
    dialect = sbd.dialect
    expected = dialect.settings.nanos_per_byte * count
    await eventually(lambda: all(s.lbrt_sent == expected for s in dialect.sessions.values()))
    assert len(dialect.sessions) == count
    assert dialect.lbrt_frames <= 4 * count, dialect.lbrt_frames
    # what a client hears last is the final value
    first = clients[0]
    while (await first.next_lbrt()) != expected:
        pass


async def test_handshaking_connections_per_ip_are_capped(make_sbd: Any) -> None:  # noqa: F811
    sbd = await make_sbd(limit_handshaking_per_ip=3)
    host, port = sbd.address
    waiting = [await sbd.client(handshake=False) for _ in range(3)]
    with pytest.raises(ConnectionError, match="429"):
        await SbdClient.connect(host, port, handshake=False)
    waiting[0].close()
    handshaking = sbd.dialect.handshaking
    await eventually(lambda: handshaking.get(IP) == 2)
    # a connection holds a slot while it handshakes, and gives it back once ready
    done = await sbd.client()
    assert handshaking.get(IP) == 2
    await sbd.client(handshake=False)
    with pytest.raises(ConnectionError, match="429"):
        await SbdClient.connect(host, port, handshake=False)
    done.forward(done.pubkey, b"still works")
    assert await done.receive_forward() == (done.pubkey, b"still works")
    for client in waiting[1:]:
        client.close()
    await eventually(lambda: handshaking.get(IP) == 1)


def test_handshaking_cap_must_be_positive() -> None:
    from rmb_relay.errors import ConfigError

    with pytest.raises(ConfigError, match="handshaking"):
        SbdSettings(limit_handshaking_per_ip=0)
