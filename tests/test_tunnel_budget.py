"""Requests the tunnel holds in memory within their byte budget, over real sockets (issues #12,
#13): waiting and queue-mode requests count their inline bytes per tenant and in all; one over
the budget gets 503 naming the limit, is not queued and never runs, while those accepted run
once a connector comes; the bytes are given back and shown on /metrics."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from rmb_relay.dialects.tunnel.settings import TunnelSettings, add_arguments
from rmb_relay.errors import ConfigError
from tests.conftest import WAIT, RedisServer
from tests.conftest import redis_server as redis_server
from tests.helpers import eventually
from tests.scrape import scrape
from tests.tunnel_fixtures import StartTunnel, pattern
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)

BODY = pattern(10_000)  # inline (under 16 KiB): held in memory while it waits


async def test_waiting_requests_over_the_tenant_budget_get_503_and_never_run(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(tenant_bytes=25_000)
    hub = tunnel.dialect.hub
    async with tunnel.client() as client:
        for n in range(2):
            reply = await client.post(f"/queue/acme/app/sha?n={n}", content=BODY)
            assert reply.status_code == 202
        refused = await client.post("/queue/acme/app/sha?n=2", content=BODY)
        assert refused.status_code == 503
        assert "tenant acme" in refused.text
        assert "--tunnel-tenant-bytes" in refused.text
        assert "will not be executed" in refused.text
        # a relay-mode request is refused the same way, before it waits
        assert (await client.post("/relay/acme/app/sha", content=BODY)).status_code == 503
        assert len(hub.core) == 2
        assert 20_000 < hub.core.held_total <= 25_000
        page = await scrape(*tunnel.relay.addresses[0])
        assert page.value("rmb_relay_tunnel_refused_total", dialect="tunnel", limit="tenant") == 2
        held = page.value("rmb_relay_tunnel_held_bytes", dialect="tunnel", tenant="acme")
        assert held == hub.core.held_total
        # the accepted ones run once a connector comes, the refused ones never
        await tunnel.connect()
        await eventually(lambda: len(tunnel.target.calls) == 2)
        assert sorted(tunnel.target.calls) == ["POST /sha?n=0", "POST /sha?n=1"]
        await eventually(lambda: len(hub.core) == 0)
        assert hub.core.held_total == 0
        assert all(g[5] == 0 for g in hub.core.tenant_gauges())
        # with room again, requests pass
        reply = await client.post("/relay/acme/app/sha", content=BODY)
        assert reply.status_code == 200
    assert tunnel.target.calls.count("POST /sha") == 1


async def test_total_budget_spans_tenants(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(total_bytes=25_000)
    tunnel.add_tenant("other")
    async with tunnel.client() as client:
        for _n in range(2):
            assert (await client.post("/queue/acme/app/x", content=BODY)).status_code == 202
        refused = await client.post("/queue/other/app/x", content=BODY)
    assert refused.status_code == 503
    assert "all tenants" in refused.text
    assert "--tunnel-total-bytes" in refused.text
    assert tunnel.dialect.hub.core.refused[1] == 1


async def test_request_from_another_relay_over_the_budget_is_503_and_never_runs(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    """The budget is the one of the relay holding the connector: a request reaching it over
    Redis that does not fit is answered 503 there, and the client hears it through its own."""
    a = await start_tunnel(redis_url=redis_server.url)
    b = await start_tunnel(
        redis_url=redis_server.url, target=a.target, max_concurrent=1, tenant_bytes=15_000
    )
    await b.connect()
    await eventually(lambda: b.dialect.bridge is not None and b.dialect.bridge.consuming("ACME"))
    async with a.client() as client:
        slow = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(a.target.entered.wait(), WAIT)
        waiting = asyncio.ensure_future(client.post("/relay/acme/app/sha?n=1", content=BODY))
        await eventually(lambda: b.dialect.hub.queued("ACME") == 1)
        refused = await client.post("/relay/acme/app/sha?n=2", content=BODY)
        assert refused.status_code == 503
        assert b.dialect.hub.core.refused[0] == 1
        a.target.release.set()
        assert (await slow).status_code == 200
        assert (await waiting).status_code == 200
    assert a.target.calls == ["GET /slow", "POST /sha?n=1"]
    await eventually(lambda: b.dialect.hub.core.held_total == 0)


def test_budget_flags_parse_and_must_be_positive() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tunnel-tenant-bytes", "100", "--tunnel-total-bytes", "200"])
    settings = TunnelSettings.from_args(args)
    assert (settings.tenant_bytes, settings.total_bytes) == (100, 200)
    assert "never executed" in parser.format_help()
    with pytest.raises(ConfigError, match="--tunnel-tenant-bytes"):
        TunnelSettings(total_bytes=0)
