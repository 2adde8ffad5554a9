"""Tunnel delivery: request TTL (never executed late), acknowledgement modes with redelivery
after a connector is lost mid-request, manual acknowledge URLs, several connectors per tenant,
the per-tenant concurrency limit, the body store's sweeper."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rmb_relay.clock import NS
from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
from rmb_relay.dialects.tunnel.settings import TunnelSettings, add_arguments
from rmb_relay.errors import ConfigError
from tests.conftest import WAIT
from tests.helpers import FakeClock, eventually
from tests.tunnel_fixtures import StartTunnel, pattern
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)


async def test_request_queued_past_its_ttl_is_408_and_never_executed(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(request_ttl=0.3)
    async with tunnel.client() as client:
        reply = await client.post("/relay/acme/app/sha", content=pattern(50_000))
        assert reply.status_code == 408
        assert tunnel.dialect.hub.expired.value() == 1
        assert tunnel.dialect.store.count() == 0  # its body file went with it
        connector = await tunnel.connect()
        # a request sent after the connector came proves anything queued before it was sent
        assert (await client.get("/relay/acme/$ping/")).status_code == 200
    assert tunnel.target.calls == []
    assert connector.requests_received == 1


async def test_request_expired_while_waiting_for_a_free_slot_is_dropped_at_pickup(
    start_tunnel: StartTunnel,
) -> None:
    clock = FakeClock()
    tunnel = await start_tunnel(max_concurrent=1, request_ttl=60.0, clock=clock)
    connector = await tunnel.connect()
    async with tunnel.client() as client:
        busy = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        queued = asyncio.ensure_future(client.get("/relay/acme/app/echo"))
        await eventually(lambda: tunnel.dialect.hub.queued() == 1)
        clock.now += 61 * NS  # past the TTL while the slot is taken
        tunnel.target.release.set()
        assert (await busy).status_code == 200
        assert (await queued).status_code == 408
    assert tunnel.target.calls == ["GET /slow"]
    assert connector.requests_received == 1


@pytest.mark.parametrize(("mode", "redelivered"), [(2, True), (3, True), (1, False), (0, False)])
async def test_connector_lost_mid_request_redelivers_unacknowledged_requests(
    start_tunnel: StartTunnel, mode: int, redelivered: bool
) -> None:
    tunnel = await start_tunnel(ack_mode=mode)
    first = await tunnel.connect()
    async with tunnel.client() as client:
        pending = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        second = await tunnel.connect()
        await tunnel.disconnect(first)  # killed while the target works
        if redelivered:
            await eventually(lambda: second.requests_received == 1)
            tunnel.target.release.set()
            reply = await pending
            assert (reply.status_code, reply.text) == (200, "slow done")
            assert tunnel.target.calls == ["GET /slow", "GET /slow"]  # at least once
            assert tunnel.dialect.hub.redelivered.value() == 1
        else:
            reply = await pending
            assert reply.status_code == 504  # it reached the target: it may have run
            assert second.requests_received == 0
            tunnel.target.release.set()
    if mode != 3:
        await eventually(lambda: len(tunnel.dialect.hub.core) == 0)


async def test_manual_acknowledge_url_needs_its_token(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(ack_mode=3)
    await tunnel.connect()
    async with tunnel.client() as client:
        reply = await client.post("/relay/acme/app/echo", content=pattern(40_000))
        assert reply.content == pattern(40_000)
        url = reply.headers["x-got-relayserver-acknowledgeurl"]
        assert len(tunnel.dialect.hub.core) == 1  # kept (with its body) until acknowledged
        assert tunnel.dialect.store.count() == 1
        forged = url.rsplit("/", 1)[0] + "/guessed"
        assert (await client.post(forged)).status_code == 404
        assert (await client.post(url)).status_code == 204
        assert (await client.post(url)).status_code == 404  # once only
    assert len(tunnel.dialect.hub.core) == 0
    assert tunnel.dialect.store.count() == 0


async def test_connector_acknowledgements_on_the_socket(start_tunnel: StartTunnel) -> None:
    for mode in (1, 2):
        tunnel = await start_tunnel(ack_mode=mode)
        await tunnel.connect()
        async with tunnel.client() as client:
            reply = await client.post("/relay/acme/app/echo", content=pattern(20_000))
        assert reply.content == pattern(20_000)
        await eventually(lambda t=tunnel: len(t.dialect.hub.core) == 0)  # type: ignore[misc]
        await eventually(lambda t=tunnel: t.dialect.store.count() == 0)  # type: ignore[misc]
        await tunnel.close()


async def test_two_connectors_share_the_load_round_robin(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    a = await tunnel.connect()
    b = await tunnel.connect()
    async with tunnel.client() as client:
        for _ in range(10):
            assert (await client.get("/relay/acme/$ping/")).status_code == 200
    assert (a.requests_received, b.requests_received) == (5, 5)


async def test_least_inflight_picks_the_idle_connector(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(balance="least-inflight")
    a = await tunnel.connect()
    async with tunnel.client() as client:
        busy = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        b = await tunnel.connect()
        for _ in range(4):
            assert (await client.get("/relay/acme/$ping/")).status_code == 200
        assert (a.requests_received, b.requests_received) == (1, 4)
        tunnel.target.release.set()
        assert (await busy).status_code == 200


async def test_concurrency_limit_queues_requests_of_a_tenant(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(max_concurrent=1)
    await tunnel.connect()
    async with tunnel.client() as client:
        busy = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        waiting = asyncio.ensure_future(client.get("/relay/acme/$ping/"))
        await eventually(lambda: tunnel.dialect.hub.queued() == 1)
        assert tunnel.dialect.hub.inflight("ACME") == 1
        tunnel.target.release.set()
        assert (await busy).status_code == 200
        assert (await waiting).status_code == 200


async def test_tenant_limit_overrides_the_relay_default(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(tenant=False)
    tunnel.add_tenant("acme", max_concurrent=1)
    await tunnel.connect()
    async with tunnel.client() as client:
        busy = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        waiting = asyncio.ensure_future(client.get("/relay/acme/$ping/"))
        await eventually(lambda: tunnel.dialect.hub.queued() == 1)
        tunnel.target.release.set()
        assert (await busy).status_code == 200
        assert (await waiting).status_code == 200


async def test_client_gone_mid_download_leaves_an_orphan_the_sweeper_removes(
    start_tunnel: StartTunnel,
) -> None:
    clock = FakeClock()
    tunnel = await start_tunnel(clock=clock)
    store = tunnel.dialect.store
    # a response file nobody will fetch (RelayServer issue #271)
    name = store.name("res", "00000000-0000-0000-0000-00000000abcd")

    async def one() -> AsyncIterator[bytes]:
        yield b"x" * 1000

    await store.write(name, one())
    assert store.count() == 1
    assert store.held == 1000
    assert tunnel.dialect.sweep() == 0  # young
    clock.now += int(store.max_age) + 1
    assert tunnel.dialect.sweep() == 1
    assert store.count() == 0
    assert store.held == 0
    assert not store.path(name).exists()


async def test_the_sweepers_grace_is_a_flag(start_tunnel: StartTunnel) -> None:
    """An orphan's age is request TTL + response timeout + `--tunnel-body-grace`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tunnel-body-grace", "5", "--tunnel-body-sweep", "0.5"])
    flags = TunnelSettings.from_args(args)
    assert (flags.body_grace, flags.body_sweep) == (5.0, 0.5)
    assert TunnelSettings(body_store="-").body_max_age == 120 + 120 + 60  # the defaults
    with pytest.raises(ConfigError, match="--tunnel-body-sweep"):
        TunnelSettings(body_store="-", body_sweep=0)
    clock = FakeClock()
    tunnel = await start_tunnel(clock=clock, request_ttl=1.0, response_timeout=2.0, body_grace=5.0)
    store = tunnel.dialect.store
    name = store.name("res", "00000000-0000-0000-0000-00000000abce")

    async def one() -> AsyncIterator[bytes]:
        yield b"x" * 10

    await store.write(name, one())
    clock.now += 8 * NS - 1
    assert tunnel.dialect.sweep() == 0  # 1 + 2 + 5 s: not yet
    clock.now += 2
    assert tunnel.dialect.sweep() == 1


def test_leftover_files_of_an_earlier_run_are_removed_when_old(tmp_path: Path) -> None:
    old = tmp_path / "req_00000000-0000-0000-0000-000000000001"
    young = tmp_path / "res_00000000-0000-0000-0000-000000000002"
    other = tmp_path / "notes.txt"
    for path in (old, young, other):
        path.write_bytes(b"x")
    os.utime(old, (1000, 1000))
    store = FileBodyStore(tmp_path, max_age=60)
    assert store.sweep_leftovers(now_unix=young.stat().st_mtime + 1, max_age=60) == 1
    assert not old.exists()
    assert young.exists()
    assert other.exists()


def test_reconnect_delay_is_immediate_then_random_in_range() -> None:
    import random

    from rmb_relay.dialects.tunnel.connector import reconnect_delay

    rng = random.Random(7)
    assert reconnect_delay(1, 30, 300, rng) == 0.0
    delays = [reconnect_delay(2, 30, 300, rng) for _ in range(1000)]
    assert all(30 <= d <= 300 for d in delays)
    assert max(delays) - min(delays) > 200  # spread out, not one value


async def test_stop_ends_a_connector_waiting_to_reconnect() -> None:
    """SIGTERM (stop) during a long reconnect delay ends the connector at once."""
    from rmb_relay.dialects.tunnel.connector import Connector
    from tests.redis_process import free_port

    waiting = asyncio.Event()

    class Rng(random.Random):
        def uniform(self, a: float, b: float) -> float:
            waiting.set()  # reconnect_delay draws the delay right before the wait
            return super().uniform(a, b)

    connector = Connector(
        f"http://127.0.0.1:{free_port()}", "acme", "x", {}, reconnect=(3600, 3600), rng=Rng()
    )
    task = asyncio.get_running_loop().create_task(connector.run())
    await asyncio.wait_for(waiting.wait(), WAIT)
    await connector.stop()
    await asyncio.wait_for(task, WAIT)


async def test_connector_reconnects_after_the_relay_drops_it(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(reconnect_min=0.0, reconnect_max=0.0)
    connector = await tunnel.connect()
    for session in list(tunnel.dialect.hub.connectors_of("ACME")):
        session.peer.abort()
    await eventually(
        lambda: (
            not connector.connected.is_set() or len(tunnel.dialect.hub.connectors_of("ACME")) == 1
        )
    )
    await eventually(lambda: len(tunnel.dialect.hub.connectors_of("ACME")) == 1)
    async with tunnel.client() as client:
        assert (await client.get("/relay/acme/$ping/")).status_code == 200
