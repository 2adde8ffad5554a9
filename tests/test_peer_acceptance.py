"""Acceptance (issue 10): a client and an echo service written only against the public msgbus
JSON (the plain `redis` package, nothing imported from rmb_relay) exchange 10,000 requests
through two rmb-peers, end-to-end encrypted, and nothing is lost; then again through two
relays, one of which is killed mid-run."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tests.peer_fixtures import Peer, Relay, add_twin, redis_servers, start_peer, start_relay

REQUESTS = 10_000
#: requests in flight at once
WINDOW = 500
#: items taken per pop and pushed per pipeline
BATCH = 200


async def echo_service(url: str, stop: asyncio.Event) -> int:
    """Pops msgbus.test.echo, answers each request with its payload reversed."""
    served = 0
    async with Redis.from_url(url) as redis:
        while not stop.is_set():
            popped = await redis.brpop(["msgbus.test.echo"], timeout=0.2)
            if popped is None:
                continue
            batch = [popped[1], *(await redis.rpop("msgbus.test.echo", BATCH) or [])]
            pipe = redis.pipeline(transaction=False)
            for raw in batch:
                request = json.loads(raw)
                data = base64.b64decode(request["dat"])[::-1]
                reply = {
                    "ver": 1,
                    "ref": request["ref"],
                    "dat": base64.b64encode(data).decode(),
                    "dst": request["src"],
                    "shm": None,
                    "now": int(time.time()),
                }
                pipe.lpush("msgbus.system.reply", json.dumps(reply))
            await pipe.execute()
            served += len(batch)
    return served


async def run_client(url: str, on_progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Sends REQUESTS requests with at most WINDOW unanswered; returns replies per ref."""
    answered: dict[str, int] = {}
    errors: list[object] = []
    window = asyncio.Semaphore(WINDOW)
    done = asyncio.Event()
    async with Redis.from_url(url) as redis, Redis.from_url(url) as reader_redis:

        async def reader() -> None:
            while len(answered) < REQUESTS:
                popped = await reader_redis.brpop(["acceptance.ret"], timeout=0.2)
                if popped is None:
                    continue
                more = await reader_redis.rpop("acceptance.ret", BATCH) or []
                for raw in [popped[1], *more]:
                    reply = json.loads(raw)
                    ref = reply["ref"]
                    expected = f"payload {ref}".encode()[::-1]
                    if reply["err"] is not None or base64.b64decode(reply["dat"]) != expected:
                        errors.append(reply)
                    if ref not in answered:
                        window.release()
                    answered[ref] = answered.get(ref, 0) + 1
                if on_progress is not None:
                    on_progress(len(answered))
            done.set()

        task = asyncio.create_task(reader())
        sent = 0
        while sent < REQUESTS:
            pipe = redis.pipeline(transaction=False)
            for _ in range(min(BATCH, REQUESTS - sent)):
                await window.acquire()
                ref = str(sent)
                request = {
                    "ver": 1,
                    "ref": ref,
                    "cmd": "test.echo",
                    "exp": 300,
                    "dat": base64.b64encode(f"payload {ref}".encode()).decode(),
                    "tag": None,
                    "dst": [2],
                    "ret": "acceptance.ret",
                    "shm": None,
                    "now": int(time.time()),
                }
                pipe.lpush("msgbus.system.local", json.dumps(request))
                sent += 1
            await pipe.execute()
        await asyncio.wait_for(done.wait(), 120)
        await task
    assert errors == []
    return answered


def twins_file(tmp_path: Path) -> str:
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    add_twin(twins, 1)
    add_twin(twins, 2, "ed25519")
    return twins


@pytest.fixture
def one_relay(tmp_path: Path) -> Iterator[tuple[Peer, Peer]]:
    twins = twins_file(tmp_path)
    relay = start_relay(twins)
    with redis_servers(tmp_path, 2) as (ra, rb):
        a = start_peer(1, twins, ra, [relay])
        b = start_peer(2, twins, rb, [relay], key_type="ed25519")
        yield a, b
        assert a.process.stop() == 0
        assert b.process.stop() == 0
    relay.process.stop()


async def exchange(a: Peer, b: Peer, on_progress: Callable[[int], None] | None = None) -> None:
    stop = asyncio.Event()
    service = asyncio.create_task(echo_service(b.redis.url, stop))
    started = time.perf_counter()
    answered = await run_client(a.redis.url, on_progress)
    elapsed = time.perf_counter() - started
    stop.set()
    served = await service
    print(f"{REQUESTS} requests in {elapsed:.2f}s ({REQUESTS / elapsed:.0f}/s), served {served}")
    assert len(answered) == REQUESTS
    assert set(answered.values()) == {1}  # each answered exactly once
    assert served >= REQUESTS  # re-sent requests may be served twice, never lost


async def test_ten_thousand_encrypted_requests_through_two_peers(
    one_relay: tuple[Peer, Peer],
) -> None:
    await exchange(*one_relay)


async def test_ten_thousand_requests_survive_a_relay_killed_mid_run(tmp_path: Path) -> None:
    twins = twins_file(tmp_path)
    relays: list[Relay] = [start_relay(twins), start_relay(twins)]
    try:
        with redis_servers(tmp_path, 2) as (ra, rb):
            a = start_peer(1, twins, ra, relays)
            b = start_peer(2, twins, rb, relays, key_type="ed25519")
            killed = False

            def kill_first_relay_halfway(answered: int) -> None:
                nonlocal killed
                if not killed and answered >= REQUESTS // 2:
                    killed = True
                    relays[0].process.popen.send_signal(signal.SIGKILL)

            try:
                await exchange(a, b, kill_first_relay_halfway)
            finally:
                assert a.process.stop() == 0
                assert b.process.stop() == 0
            assert killed
            assert a.output.count("lost relay") >= 1
    finally:
        for relay in relays:
            relay.process.stop()
