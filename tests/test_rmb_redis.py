"""The RMB relay with a real redis-server: durable mailboxes, restarts, Redis going away."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from rmb_relay.mailbox import RedisMailbox, stream_key
from tests.cluster_fixtures import recorder
from tests.conftest import WAIT, RedisServer, StartRelay, start_redis
from tests.helpers import eventually
from tests.rmb_fixtures import RmbRelay, start_rmb_relay


async def test_mailbox_survives_a_relay_restart(
    start_relay: StartRelay, tmp_path: Path, redis_server: RedisServer
) -> None:
    first = await start_rmb_relay(
        start_relay, tmp_path, mailbox=RedisMailbox(Redis.from_url(redis_server.url))
    )
    alice = await first.client(1)
    for i in range(5):
        alice.send_request(3, "m", f"queued {i}".encode())
    probe = Redis.from_url(redis_server.url)
    await eventually(lambda: first.dialect.mailbox.stats.stored == 5)
    assert await probe.xlen(stream_key((3, None))) == 5
    await first.close_clients()
    await asyncio.wait_for(first.server.shutdown(), WAIT)

    second = await start_rmb_relay(
        start_relay, tmp_path, mailbox=RedisMailbox(Redis.from_url(redis_server.url))
    )
    received: list[bytes] = []
    done = asyncio.Event()

    carol = await second.client(3)
    carol.handle("m", recorder(received, done=done, expect=5))
    await asyncio.wait_for(done.wait(), WAIT)
    assert received == [f"queued {i}".encode() for i in range(5)]
    await eventually(lambda: second.dialect.mailbox.depth() == 0)

    # delivered entries are removed from the stream
    async def stream_empty() -> bool:
        return bool(await probe.xlen(stream_key((3, None))) == 0)

    await eventually(stream_empty)
    await probe.aclose()
    await second.close_clients()


async def relay_with_own_redis(
    start_relay: StartRelay, tmp_path: Path
) -> tuple[Path, RedisServer, RmbRelay]:
    """A redis-server this test may stop and restart, and a relay whose mailbox uses it."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = start_redis(str(redis_dir))
    relay = await start_rmb_relay(
        start_relay,
        tmp_path,
        mailbox=RedisMailbox(
            Redis.from_url(server.url, socket_connect_timeout=1, socket_timeout=2)
        ),
    )
    return redis_dir, server, relay


async def test_redis_down_mid_run_gives_error_and_keeps_connection(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    redis_dir, server, relay = await relay_with_own_redis(start_relay, tmp_path)
    alice = await relay.client(1)
    server.stop()
    future = alice.send_request(3, "m", b"while redis is down")
    reply = await asyncio.wait_for(future, WAIT)
    assert reply.from_relay
    assert reply.error == (0, "destination offline and the mailbox is unavailable")
    assert (await alice.ping()).data == b"hello world"  # still connected

    # Redis comes back on the same port: the next message is stored again
    restarted = start_redis(str(redis_dir), port=server.port)
    try:
        alice.send_request(3, "m", b"after redis is back")
        await eventually(lambda: relay.dialect.mailbox.stats.stored == 1)
    finally:
        await relay.close_clients()
        restarted.stop()


async def test_login_while_redis_is_down_still_works(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    _, server, relay = await relay_with_own_redis(start_relay, tmp_path)
    server.stop()
    carol = await relay.client(3)
    alice = await relay.client(1)
    carol.handle("m", lambda r: b"live")
    assert (await alice.request(3, "m", timeout=WAIT)).data == b"live"
    await relay.close_clients()


async def test_a_full_session_refuses_new_mail_and_keeps_the_old(redis_server: RedisServer) -> None:
    """rmb-rs caps a stream with MAXLEN, dropping the oldest: a flood then evicts the mail a
    twin waits for. At `--mailbox-max` the session refuses instead (issue 33)."""
    from rmb_relay.errors import MailboxFull

    mailbox = RedisMailbox(Redis.from_url(redis_server.url), max_per_session=2)
    try:
        deadline = int(time.time()) + 60
        await mailbox.put((7, None), b"victim's 1", deadline)
        await mailbox.put((7, None), b"victim's 2", deadline)
        with pytest.raises(MailboxFull, match="holds 2 messages"):
            await mailbox.put((7, None), b"flood", deadline)
        assert mailbox.stats.refused == 1
        taken = await mailbox.take((7, None))
        assert taken.envelopes == [b"victim's 1", b"victim's 2"]
    finally:
        await mailbox.close()
