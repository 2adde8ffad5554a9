"""The tunnel's hostile-client cases (issue 33) against a real relay process: tokens used for
what they were not issued for, `Authorization` headers, connectors answering 1xx, tenants
removed or re-keyed while their connectors are attached, tenant names on /metrics, a client
naming ever new tenants, files other local users could read. Each test asserts the refusal,
that an honest tenant's requests through its connector process are all served meanwhile
(`TunnelRelay.honest`) and that the relay logs no error or traceback; test_tunnel_hostile.py has the
finer in-process cases."""

from __future__ import annotations

import asyncio
import os
import stat
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import WAIT, RedisServer
from tests.helpers import eventually, http_exchange
from tests.relay_process import RelayProcess
from tests.scrape import scrape
from tests.tunnel_fixtures import UPGRADE, answer_next, raw_connector_at
from tests.tunnel_processes import TunnelRelay, honest_echo, wait_for_connector

pytestmark = pytest.mark.timeout(120)

#: relay RSS growth allowed while one client names 5,000 tenants that do not exist: the
#: bounded cache's 64 entries are nothing; an unbounded one would keep every name
TENANT_FLOOD_RSS_MIB = 16
#: the watcher revisits connectors every tenant-cache lifetime (10 s), after the cached
#: lookup (10 s) has expired
WATCHER = 3 * 10.0


async def _closed_with(
    ws: aiohttp.ClientWebSocketResponse, timeout: float = WAIT
) -> tuple[int | None, str]:
    while True:
        message = await ws.receive(timeout=timeout)
        if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            return ws.close_code, str(message.extra or "")


async def test_a_client_token_cannot_attach_as_a_connector(tmp_path: Path) -> None:
    async with TunnelRelay(tmp_path) as tunnel:
        await tunnel.add_tenant("acme")
        async with tunnel.honest(), tunnel.client() as client:
            for scope in ("root", "connector admin"):
                refused = await client.post(
                    "/tunnel/token",
                    data={
                        "grant_type": "client_credentials",
                        "client_id": "acme",
                        "client_secret": "process-tenant-secret",
                        "scope": scope,
                    },
                )
                assert (refused.status_code, refused.json()["error"]) == (400, "invalid_scope")
            token = await tunnel.token("acme", "client")
            bearer = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused_ws:
                    await session.ws_connect(tunnel.base + "/tunnel/connector", headers=bearer)
            assert refused_ws.value.status == 401
            body = await client.get(f"/tunnel/body/request/{uuid.uuid4()}", headers=bearer)
            assert body.status_code == 401
            page = await scrape(*tunnel.relay.address)
            assert (
                page.value("rmb_relay_auth_failures_total", dialect="tunnel", reason="token") >= 2
            )
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []


async def test_authorization_reaches_the_target_only_where_the_tenant_says_so(
    tmp_path: Path,
) -> None:
    async with TunnelRelay(tmp_path) as tunnel:
        await tunnel.add_tenant("closed", "--require-auth", "yes")
        await tunnel.add_tenant(
            "passing", "--require-auth", "yes", "--forward-authorization", "yes"
        )
        for name in ("closed", "passing"):
            await tunnel.connect(name, requires_auth=True)
        async with tunnel.honest(), tunnel.client() as client:
            for name, forwarded in (("closed", False), ("passing", True)):
                assert (await client.get(f"/relay/{name}/app/echo")).status_code == 401
                bearer = f"Bearer {await tunnel.token(name, 'client')}"
                answer = await client.get(
                    f"/relay/{name}/app/echo", headers={"Authorization": bearer}
                )
                assert answer.status_code == 200
                assert answer.headers.get("x-got-authorization") == (bearer if forwarded else None)
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []


async def test_a_connector_answering_1xx_is_refused(tmp_path: Path) -> None:
    async with TunnelRelay(tmp_path) as tunnel:
        await tunnel.add_tenant("acme")
        async with tunnel.honest(), tunnel.client() as client:
            for status in (100, 101, 103):
                token = await tunnel.token("acme", "connector")
                async with raw_connector_at(tunnel.base, token) as ws:
                    answer = asyncio.ensure_future(client.get("/relay/acme/app/x"))
                    await answer_next(ws, status, UPGRADE)
                    refused = await answer
                    assert refused.status_code == 502, status
                    assert "upgrade" not in {k.lower() for k in refused.headers}
            page = await scrape(*tunnel.relay.address)
            series = {"dialect": "tunnel", "tenant": "*", "target": "*", "status": "502"}
            assert page.value("rmb_relay_tunnel_requests_total", **series) == 3
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []


async def test_removing_or_rekeying_a_tenant_disconnects_its_connectors(tmp_path: Path) -> None:
    """Through the management API at once; changed in the file by `rmb-relay tenants` (another
    relay's operator) within the watcher's period."""
    key = "k" * 24
    async with TunnelRelay(tmp_path, "--management-key", key) as tunnel:
        for name in ("removed", "rekeyed", "elsewhere"):
            await tunnel.add_tenant(name)
        tokens = {name: await tunnel.token(name, "connector") for name in ("removed", "rekeyed")}
        tokens["elsewhere"] = await tunnel.token("elsewhere", "connector")
        headers = {"Api-Key": key}
        async with (
            tunnel.honest(),
            raw_connector_at(tunnel.base, tokens["removed"]) as removed,
            raw_connector_at(tunnel.base, tokens["rekeyed"]) as rekeyed,
            raw_connector_at(tunnel.base, tokens["elsewhere"]) as elsewhere,
            tunnel.client() as client,
        ):
            gone = await client.delete("/management/tenants/removed", headers=headers)
            assert gone.status_code in (200, 204), gone.text
            assert await _closed_with(removed) == (1008, "tenant removed")
            put = await client.put(
                "/management/tenants/rekeyed", headers=headers, json={"secret": "a-new-secret"}
            )
            assert put.status_code in (200, 204), put.text
            assert await _closed_with(rekeyed) == (1008, "tenant secret changed")
            await tunnel.tenants("set", "elsewhere", "--secret", "changed-in-the-file")
            assert await _closed_with(elsewhere, WATCHER) == (1008, "tenant secret changed")
            # the old secret's tokens are refused with it
            async with aiohttp.ClientSession() as session:
                for name in ("rekeyed", "elsewhere"):
                    bearer = {"Authorization": f"Bearer {tokens[name]}"}
                    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                        await session.ws_connect(tunnel.base + "/tunnel/connector", headers=bearer)
                    assert refused.value.status == 401
            page = await scrape(*tunnel.relay.address)
            assert page.value("rmb_relay_tunnel_connectors_revoked_total", dialect="tunnel") == 3
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []


@pytest.mark.parametrize("labels", [False, True], ids=["default", "tenant-labels"])
async def test_metrics_name_tenants_only_when_asked(tmp_path: Path, labels: bool) -> None:
    """Tenant names are labels only with --tunnel-tenant-labels, and then one label per
    tenant in every family: its name as stored, however a client spelled it in the URL (the
    lookup is case-insensitive) and not its upper-case lookup key."""
    flags = ["--tunnel-tenant-labels"] if labels else []
    async with TunnelRelay(tmp_path, *flags) as tunnel:
        async with tunnel.honest("Secret-Customer"), honest_echo(tunnel.base, "secret-customer"):
            pass
        page = await scrape(*tunnel.relay.address)
        assert ("secret-customer" in page.body.lower()) is labels
        tenant = "Secret-Customer" if labels else "*"
        series = {"dialect": "tunnel", "tenant": tenant, "target": "app" if labels else "*"}
        assert page.value("rmb_relay_tunnel_requests_total", **series, status="200") >= 40
        assert page.value("rmb_relay_tunnel_connectors", dialect="tunnel", tenant=tenant) == 1
        assert "SECRET-CUSTOMER" not in page.body
        assert "secret-customer" not in page.body
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []


async def _status_of(address: tuple[str, int], path: str) -> int:
    """GET `path` on a connection of its own (the relay closes one after a refusal)."""
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    return int((await http_exchange(*address, request)).split(None, 2)[1])


async def test_a_client_naming_ever_new_tenants_costs_a_bounded_cache(tmp_path: Path) -> None:
    """5,000 tenants that do not exist: each 404, at most `--tunnel-tenant-cache` lookups kept;
    a miss expires, so a tenant added after it is found."""
    async with TunnelRelay(
        tmp_path, "--tunnel-tenant-cache", "64", "--tunnel-require-connection"
    ) as tunnel:
        async with tunnel.honest(), tunnel.client() as client:
            before = tunnel.relay.rss_mib()
            for batch in range(100):  # 50 connections at once
                paths = [f"/relay/nobody-{batch}-{n}-{'x' * 200}/app/x" for n in range(50)]
                statuses = [_status_of(tunnel.relay.address, path) for path in paths]
                assert await asyncio.gather(*statuses) == [404] * 50
            page = await scrape(*tunnel.relay.address)
            assert page.value("rmb_relay_tunnel_tenants_cached", dialect="tunnel") <= 64
            assert tunnel.relay.rss_mib() - before < TENANT_FLOOD_RSS_MIB
            assert (await client.get("/relay/late/app/x")).status_code == 404
            await tunnel.add_tenant("late")
            # the miss is remembered for its lifetime, then looked up again: there now, with
            # no connector (503 under --tunnel-require-connection)
            assert (await client.get("/relay/late/app/x")).status_code == 404

            async def found() -> bool:
                return (await client.get("/relay/late/app/x")).status_code == 503

            await eventually(found, timeout=3 * 10.0)
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_the_relays_files_are_its_users_alone(tmp_path: Path) -> None:
    """On default paths: the SQLite file (tenant secret hashes, the token-signing key) 0600 in
    a 0700 directory, the body store 0700 and a waiting body 0600; a body store others may
    write to, or (as root) one another user owns, is refused at startup in one line."""
    async with TunnelRelay(tmp_path / "home") as tunnel:
        data = tmp_path / "home" / "rmb-relay"
        assert _mode(data) == 0o700
        for name in os.listdir(data):  # the file, its -wal and -shm
            if name.startswith("twins.sqlite3"):
                assert _mode(data / name) & 0o077 == 0, name
        assert _mode(data / "twins.sqlite3") == 0o600
        bodies = data / "bodies"
        assert _mode(bodies) == 0o700
        await tunnel.add_tenant("parked")  # no connector: its requests wait with their bodies
        async with tunnel.honest(), tunnel.client() as client:
            waiting = await client.post("/queue/parked/app/x", content=b"b" * (64 * 1024))
            assert waiting.status_code == 202
            files = [bodies / name for name in os.listdir(bodies) if name.startswith("req_")]
            assert len(files) == 1
            assert _mode(files[0]) == 0o600
        assert tunnel.relay.stop() == 0
    assert tunnel.relay.problems == []
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    refusals = [(shared, "may be written by others")]
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 4242, -1)
        refusals.append((foreign, "belongs to uid 4242"))
    for directory, reason in refusals:
        with pytest.raises(RuntimeError, match="relay did not start") as refused:
            RelayProcess("--tunnel-body-store", str(directory))
        assert reason in str(refused.value)
        assert "Traceback" not in str(refused.value)


async def test_a_body_nobody_fetches_in_scale_out_is_swept(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Relays A and B share Redis and a body store; B holds the tenant's connector and is
    SIGKILLed. A client's `/queue/` request to A goes to the tenant's work queue while B
    still counts as alive, its body into the store, and nobody ever reads it: A's sweeper
    deletes the file once it is older than request TTL + response timeout + the grace (1 + 1
    + 1 s here; it sweeps every 0.5 s). A's own tenant is served all along."""
    bodies = tmp_path / "bodies"
    shared = ["--redis", redis_server.url, "--no-sbd", "--tunnel-body-store", str(bodies)]
    shared += ["--tunnel-request-ttl", "1", "--tunnel-response-timeout", "1", "--cluster-ttl", "30"]
    shared += ["--tunnel-body-grace", "1", "--tunnel-body-sweep", "0.5"]
    async with TunnelRelay(tmp_path / "a", *shared, "--instance-id", "sweep-a") as a:
        await a.add_tenant("acme")
        async with TunnelRelay(
            tmp_path / "b", *shared, "--instance-id", "sweep-b", "--twins", a.db
        ) as b:
            await b.connect("acme")
            await wait_for_connector(a.base, "acme")  # through B, over the cluster
            b.relay.process.kill()  # alive for A until its --cluster-ttl (30 s) passes
            b.relay.process.wait(WAIT)
        async with a.honest(), a.client() as client:
            posted = time.monotonic()
            queued = await client.post("/queue/acme/app/x", content=b"q" * (64 * 1024))
            assert queued.status_code == 202
            files = [name for name in os.listdir(bodies) if name.startswith("req_")]
            assert len(files) == 1

            async def swept() -> bool:
                page = await scrape(*a.relay.address)
                return page.value("rmb_relay_tunnel_body_files_swept_total", dialect="tunnel") >= 1

            await eventually(swept, timeout=WAIT)
            assert not (bodies / files[0]).exists()
            # by the sweeper for its age (1 + 1 + 1 s), not removed earlier by anyone else
            assert time.monotonic() - posted > 3
            page = await scrape(*a.relay.address)
            assert page.value("rmb_relay_tunnel_body_store_bytes", dialect="tunnel") == 0
        assert a.relay.stop() == 0
    assert a.relay.problems == []
