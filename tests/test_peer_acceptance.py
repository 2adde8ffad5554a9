"""Acceptance (issue 10): a client and an echo service written only against the public msgbus
JSON (the plain `redis` package, nothing imported from rmb_relay) exchange 10,000 requests
through two rmb-peers, end-to-end encrypted, and nothing is lost; then again through two
relays, one of which is killed mid-run."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.peer_fixtures import (
    Peer,
    Relay,
    add_twin,
    echo_service,
    redis_servers,
    run_client,
    start_peer,
    start_relay,
)

REQUESTS = 10_000


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
    answered = await run_client(a.redis.url, REQUESTS, on_progress)
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
