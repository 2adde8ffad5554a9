"""A stalled Redis (stopped with SIGSTOP, not dead) over real sockets (issue 9, item 3): the
relay's memory stays bounded, senders hear at once that the mailbox is unavailable or the relay
busy, and a twin that logs in during the stall gets its live messages without waiting for Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from rmb_relay.dialects.rmb import RmbSettings
from rmb_relay.mailbox import RedisMailbox
from tests.conftest import WAIT, RedisServer, StartRelay, start_redis
from tests.helpers import eventually
from tests.rmb_fixtures import RmbRelay, start_rmb_relay

#: how long the relay waits on Redis in these tests (seconds)
TIMEOUT = 0.3
UNAVAILABLE = "destination offline and the mailbox is unavailable"
BUSY = "relay busy: too many messages waiting to be routed"


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = start_redis(str(directory))
    try:
        yield server
    finally:
        if server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


async def stalled_relay(
    start_relay: StartRelay, tmp_path: Path, redis: RedisServer, **settings: int
) -> RmbRelay:
    client = Redis.from_url(redis.url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
    mailbox = RedisMailbox(client, timeout=TIMEOUT, max_inflight_bytes=1 << 20)
    return await start_rmb_relay(
        start_relay, tmp_path, mailbox=mailbox, settings=RmbSettings(**settings)
    )


async def test_stalled_redis_pushes_back_on_the_sender_and_answers_every_request(
    start_relay: StartRelay, tmp_path: Path, own_redis: RedisServer
) -> None:
    """Before: 200 x 1 MB piled up in the relay (RSS +190 MiB) until Redis came back. Now the
    sender's socket is no longer read while 1 MiB of its messages wait, and each waiting
    message fails fast once the stall is noticed."""
    relay = await stalled_relay(start_relay, tmp_path, own_redis, slow_session_bytes=1 << 20)
    alice = await relay.client(1)
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    payload = b"p" * 200_000
    futures = [alice.send_request(3, "m", payload) for _ in range(40)]
    replies = await asyncio.wait_for(asyncio.gather(*futures), WAIT)
    assert {reply.error for reply in replies} == {(0, UNAVAILABLE)}
    # at most one socket read beyond the bound
    assert relay.dialect.slow_bytes_peak <= 2 << 20
    assert relay.dialect.slow_bytes == 0
    assert relay.dialect.mailbox.held_bytes() == 0
    assert (await alice.ping(timeout=WAIT)).data == b"hello world"

    # Redis answers again: mail is stored again (after the short stall back-off)
    os.kill(own_redis.process.pid, signal.SIGCONT)

    stats = relay.dialect.mailbox.stats

    async def stored() -> bool:
        before = stats.stored
        reply = alice.send_request(3, "m", b"after")  # answered only if it was refused
        await eventually(lambda: reply.done() or stats.stored > before)
        reply.cancel()
        return stats.stored > before

    await eventually(stored)
    await relay.close_clients()


async def test_many_senders_together_are_refused_beyond_the_total_bound(
    start_relay: StartRelay, tmp_path: Path, own_redis: RedisServer
) -> None:
    relay = await stalled_relay(start_relay, tmp_path, own_redis, slow_total_bytes=1 << 20)
    alice = await relay.client(1)
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    futures = [alice.send_request(3, "m", b"q" * 200_000) for _ in range(20)]
    replies = await asyncio.wait_for(asyncio.gather(*futures), WAIT)
    errors = Counter(reply.error for reply in replies)
    assert set(errors) == {(0, UNAVAILABLE), (0, BUSY)}, errors
    assert relay.dialect.slow_bytes_peak <= 1 << 20
    os.kill(own_redis.process.pid, signal.SIGCONT)
    await relay.close_clients()


async def test_login_during_a_stall_gets_live_messages(
    start_relay: StartRelay, tmp_path: Path, own_redis: RedisServer
) -> None:
    """Before: the mailbox read on login waited for Redis, and live traffic waited behind it."""
    relay = await stalled_relay(start_relay, tmp_path, own_redis)
    alice = await relay.client(1)
    os.kill(own_redis.process.pid, signal.SIGSTOP)
    carol = await relay.client(3)
    carol.handle("m", lambda r: b"live " + r.data)
    reply = await alice.request(3, "m", b"1", timeout=WAIT)
    assert reply.data == b"live 1"
    # a second login while the stall back-off is on fails fast too
    bob = await relay.client(2, key_type="ed25519")
    bob.handle("m", lambda r: b"bob")
    assert (await alice.request(2, "m", timeout=WAIT)).data == b"bob"
    os.kill(own_redis.process.pid, signal.SIGCONT)
    await relay.close_clients()
