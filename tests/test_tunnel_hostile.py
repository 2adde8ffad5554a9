"""The tunnel against clients that do not play fair (issue 33): uploads larger than any bound,
tokens used for what they were not issued for, connectors of tenants that were removed or
re-keyed, connector answers HTTP/1.1 must not carry, a body store someone else could read or
fill. Each case asserts the refusal, that nothing is left on disk and that honest traffic in
parallel is served."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import stat
import subprocess
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
from rmb_relay.dialects.tunnel.tenants import hash_secret
from rmb_relay.errors import AuthError, BodyTooLarge, ConfigError
from tests.conftest import WAIT
from tests.relay_process import RelayProcess
from tests.scrape import scrape
from tests.tunnel_fixtures import (
    SECRET,
    UPGRADE,
    StartTunnel,
    answer_next,
    pattern,
    raw_connector,
    start_target,
)
from tests.tunnel_fixtures import start_tunnel as start_tunnel
from tests.tunnel_processes import (
    TunnelRelay,
    add_tenant,
    spawn_connector,
    stop,
    wait_for_connector,
)

MIB = 1 << 20


def _body_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(("req_", "res_")))


def _body_files_under(root: Path) -> list[str]:
    """Body files anywhere below `root` (a relay's store, wherever its build keeps it)."""
    return sorted(p.name for p in root.rglob("*") if p.name.startswith(("req_", "res_")))


#: `_chunked_upload`'s status when the connection was reset before the answer could be read
RESET = b"(reset)"


async def _chunked_upload(
    address: tuple[str, int], path: str, chunk: bytes, chunks: int, *, finish: bool = False
) -> tuple[bytes, int]:
    """POST a chunked body of `chunks` pieces, stopping when the relay answers or closes:
    (the status line, bytes of body sent before that). `finish`: end the body if all of it
    went out unanswered (so a relay that takes it all answers)."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    sent = 0
    answer = asyncio.ensure_future(reader.readline())
    try:
        for _ in range(chunks):
            # the relay may answer and close between two chunks: a write to a closed
            # transport raises (uvloop: RuntimeError) before the answer's read is scheduled
            if answer.done() or writer.is_closing() or reader.at_eof():
                break
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            try:
                await writer.drain()
            except ConnectionError:
                break
            sent += len(chunk)
        if finish and not (answer.done() or writer.is_closing() or reader.at_eof()):
            writer.write(b"0\r\n\r\n")
        try:
            status = await asyncio.wait_for(answer, WAIT)
        except ConnectionResetError:
            # the relay answered and closed with our chunks unread: its kernel resets the
            # connection, and the reset can discard the answer on its way (no lingering close)
            status = RESET
    finally:
        answer.cancel()
        writer.close()
    return status, sent


async def test_an_endless_upload_is_cut_at_the_body_bound_and_leaves_no_file(
    start_tunnel: StartTunnel, tmp_path: Path
) -> None:
    tunnel = await start_tunnel(max_body=4 * MIB)
    await tunnel.connect()
    address = tunnel.relay.addresses[0]
    honest = tunnel.client()
    upload = asyncio.ensure_future(
        _chunked_upload(address, "/relay/acme/app/upload", pattern(256 * 1024), 4096)  # 1 GiB
    )
    async with honest:
        for _ in range(20):  # served while the upload runs
            ok = await honest.post("/relay/acme/app/echo", content=b"hello")
            assert (ok.status_code, ok.content) == (200, b"hello")
        status, sent = await upload
    assert status.startswith(b"HTTP/1.1 413"), status
    assert sent < 64 * MIB  # cut near the bound, not after a gigabyte
    store = tunnel.dialect.store
    assert store.refused["body"] == 1
    assert store.held == 0
    assert _body_files(tmp_path / "bodies") == []
    page = await scrape(*address)
    assert page.value("rmb_relay_tunnel_bodies_refused_total", dialect="tunnel", limit="body") == 1


async def test_a_declared_length_over_the_bound_is_refused_before_a_byte_is_read(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(max_body=MIB)
    await tunnel.connect()
    reader, writer = await asyncio.open_connection(*tunnel.relay.addresses[0])
    writer.write(
        b"PUT /relay/acme/app/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * MIB)
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    body = await asyncio.wait_for(reader.read(), WAIT)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert b"--tunnel-max-body" in body
    assert str(MIB).encode() in body
    assert tunnel.target.calls == []


async def test_a_tenant_cannot_hold_more_of_the_disk_than_its_share(
    start_tunnel: StartTunnel, tmp_path: Path
) -> None:
    """Bodies wait on disk while the connector is slow to fetch them: one tenant's waiting
    bodies stop at --tunnel-tenant-disk; another tenant's still fit."""
    tunnel = await start_tunnel(tenant_disk=3 * MIB, total_disk=64 * MIB, max_body=2 * MIB)
    tunnel.add_tenant("other")
    # no connector: each request waits (up to its TTL) with its body stored
    async with tunnel.client() as client:
        # two at once: their writes interleave, so either may be the one that passes the bound
        answers = await asyncio.gather(
            *(client.post(f"/queue/acme/app/{n}", content=pattern(2 * MIB)) for n in "xy")
        )
        assert sorted(a.status_code for a in answers) == [202, 413]
        assert "--tunnel-tenant-disk" in max(answers, key=lambda a: a.status_code).text
        other = await client.post("/queue/other/app/z", content=pattern(2 * MIB))
        assert other.status_code == 202
    store = tunnel.dialect.store
    assert store.refused["tenant"] == 1
    assert store.disk.held_by("ACME") == 2 * MIB
    assert len(_body_files(tmp_path / "bodies")) == 2


async def test_client_and_connector_tokens_are_distinct(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    form = {"grant_type": "client_credentials", "client_id": "acme", "client_secret": SECRET}
    async with tunnel.client() as client:
        for scope in ("root", "connector admin"):
            refused = await client.post("/tunnel/token", data={**form, "scope": scope})
            assert refused.status_code == 400
            assert refused.json()["error"] == "invalid_scope"
        issued = await client.post("/tunnel/token", data={**form, "scope": "client"})
        assert issued.json()["scope"] == "client"
        client_token = issued.json()["access_token"]
    url = tunnel.base + "/tunnel/connector"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused_ws:
            await session.ws_connect(url, headers={"Authorization": f"Bearer {client_token}"})
    assert refused_ws.value.status == 401
    # the connector's own endpoints refuse it too
    async with tunnel.client() as client:
        body = await client.get(
            "/tunnel/body/request/00000000-0000-0000-0000-000000000000",
            headers={"Authorization": f"Bearer {client_token}"},
        )
        assert body.status_code == 401


async def test_a_client_token_cannot_attach_as_a_connector_on_a_relay_process(
    tmp_path: Path,
) -> None:
    """A token asked for as a client's (`scope=client`, what a tenant gives its users) is
    refused at the connector endpoint of a relay process: a user cannot serve the tenant's
    targets with it."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    home = str(tmp_path)
    env = {**os.environ, "XDG_DATA_HOME": home, "XDG_STATE_HOME": home, "TMPDIR": home}
    await add_tenant(db, env, "acme", "acme-secret-1")
    relay = RelayProcess("--twins", db, env=env)
    form = {"grant_type": "client_credentials", "client_id": "acme", "scope": "client"}
    try:
        base = f"http://127.0.0.1:{relay.port}"
        async with aiohttp.ClientSession() as session:
            form["client_secret"] = "acme-secret-1"
            async with session.post(f"{base}/tunnel/token", data=form) as issued:
                assert issued.status == 200, await issued.text()
                token = (await issued.json())["access_token"]
            bearer = {"Authorization": f"Bearer {token}"}
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                async with session.ws_connect(f"{base}/tunnel/connector", headers=bearer):
                    pass
            assert refused.value.status == 401
    finally:
        relay.close()
    assert relay.problems == []


async def test_authorization_reaches_the_target_only_when_the_tenant_says_so(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    tunnel.add_tenant("closed", require_authentication=True)
    tunnel.add_tenant("passing", require_authentication=True, forward_authorization=True)
    tokens = tunnel.dialect.tokens
    for name in ("closed", "passing"):
        await tunnel.connect(name)
    async with tunnel.client() as client:
        for name, forwarded in (("closed", False), ("passing", True)):
            token = tokens.issue(name, "client")
            answer = await client.get(
                f"/relay/{name}/app/echo", headers={"Authorization": f"Bearer {token}"}
            )
            assert answer.status_code == 200
            seen = answer.headers.get("x-got-authorization")
            assert seen == (f"Bearer {token}" if forwarded else None)


async def _closed_with(ws: aiohttp.ClientWebSocketResponse) -> tuple[int | None, str]:
    while True:
        message = await ws.receive(timeout=WAIT)
        if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            return ws.close_code, str(message.extra or "")


async def test_removing_or_rekeying_a_tenant_disconnects_its_connectors(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(management_key="k" * 24)
    tunnel.add_tenant("rekeyed")
    tunnel.add_tenant("elsewhere")
    headers = {"Api-Key": "k" * 24}
    async with (
        raw_connector(tunnel, "acme") as removed,
        raw_connector(tunnel, "rekeyed") as rekeyed,
        raw_connector(tunnel, "elsewhere") as changed,
        tunnel.client() as client,
    ):
        token = tunnel.dialect.tokens.issue("rekeyed")
        assert (await client.delete("/management/tenants/acme", headers=headers)).status_code in (
            200,
            204,
        )
        assert await _closed_with(removed) == (1008, "tenant removed")
        put = await client.put(
            "/management/tenants/rekeyed", headers=headers, json={"secret": "a-new-secret"}
        )
        assert put.status_code in (200, 204), put.text
        assert await _closed_with(rekeyed) == (1008, "tenant secret changed")
        # its old tokens are gone with the secret
        with pytest.raises(AuthError, match="secret changed"):
            await tunnel.dialect.tokens.verify(token)
        # changed by someone else (another relay on the file, `rmb-relay tenants`): the watcher
        store = tunnel.store
        store.update(replace(store.get("elsewhere"), secret_hash=hash_secret("x")))
        assert not changed.closed
        assert tunnel.dialect.revisit_connectors() == 1
        assert await _closed_with(changed) == (1008, "tenant secret changed")
    assert tunnel.dialect.hub.revoked.value() == 3


async def test_a_removed_tenants_connector_is_closed_on_a_relay_process(tmp_path: Path) -> None:
    """A tenant removed through the management API of a relay process: its attached connector
    is closed at once (1008), not left serving the removed tenant's requests."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    home = str(tmp_path)
    env = {**os.environ, "XDG_DATA_HOME": home, "XDG_STATE_HOME": home, "TMPDIR": home}
    await add_tenant(db, env, "acme", "acme-secret-1")
    key = {"Api-Key": "k" * 24}
    relay = RelayProcess("--twins", db, "--management-key", key["Api-Key"], env=env)
    form = {"grant_type": "client_credentials", "client_id": "acme", "scope": "connector"}
    try:
        base = f"http://127.0.0.1:{relay.port}"
        async with aiohttp.ClientSession() as session:
            form["client_secret"] = "acme-secret-1"
            async with session.post(f"{base}/tunnel/token", data=form) as issued:
                assert issued.status == 200, await issued.text()
                bearer = {"Authorization": f"Bearer {(await issued.json())['access_token']}"}
            async with session.ws_connect(f"{base}/tunnel/connector", headers=bearer) as ws:
                assert json.loads(await ws.receive_str(timeout=WAIT))["target"] == "Configure"
                async with session.delete(f"{base}/management/tenants/acme", headers=key) as gone:
                    assert gone.status in (200, 204), await gone.text()
                assert await _closed_with(ws) == (1008, "tenant removed")
    finally:
        relay.close()
    assert relay.problems == []


@pytest.mark.parametrize("status", [100, 101, 103])
async def test_a_connector_answering_1xx_is_refused(start_tunnel: StartTunnel, status: int) -> None:
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws, tunnel.client() as client:
        answer = asyncio.ensure_future(client.get("/relay/acme/app/x"))
        await answer_next(ws, status, UPGRADE)
        refused = await answer
        assert refused.status_code == 502
        assert "upgrade" not in {k.lower() for k in refused.headers}


def test_the_body_store_is_private(tmp_path: Path) -> None:
    fresh = tmp_path / "state" / "bodies"
    FileBodyStore(fresh, max_age=60)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="written by others"):
        FileBodyStore(shared, max_age=60)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 4242, -1)
        with pytest.raises(ConfigError, match="belongs to uid 4242"):
            FileBodyStore(foreign, max_age=60)
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    FileBodyStore(readable, max_age=60)
    assert stat.S_IMODE(readable.stat().st_mode) == 0o700


async def test_body_files_are_the_relays_alone_and_bounded(tmp_path: Path) -> None:
    store = FileBodyStore(tmp_path / "b", max_age=60, max_body=10, tenant_bytes=15, total_bytes=20)

    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    name = store.name("req", "0" * 32)
    assert await store.write(name, chunks(b"12345", b"678"), owner="A") == 8
    assert stat.S_IMODE(store.path(name).stat().st_mode) == 0o600
    too_big = store.name("req", "1" * 32)
    with pytest.raises(BodyTooLarge, match="--tunnel-max-body"):
        await store.write(too_big, chunks(b"123456", b"789012"), owner="A")
    assert not store.path(too_big).exists()
    over_tenant = store.name("req", "2" * 32)
    with pytest.raises(BodyTooLarge, match="--tunnel-tenant-disk"):
        await store.write(over_tenant, chunks(b"12345678"), owner="A")
    assert await store.write(store.name("res", "3" * 32), chunks(b"1234567890"), owner="B") == 10
    with pytest.raises(BodyTooLarge, match="--tunnel-total-disk"):
        await store.write(store.name("res", "4" * 32), chunks(b"123"), owner="C")
    assert store.held == 18
    store.remove(name)
    assert store.held == 10
    assert store.disk.held_by("A") == 0


async def test_an_upload_flood_on_a_relay_process(tmp_path: Path) -> None:
    """The real process: a 1 GiB chunked upload to an open tenant is cut at the bound, the
    relay's memory does not grow with it, nothing is left on disk, honest requests are served
    meanwhile and nothing is logged as an error."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path)}
    await add_tenant(db, env, "acme", "flood-secret")
    relay = RelayProcess("--twins", db, "--tunnel-max-body", str(8 * MIB), env=env)
    connector = None
    try:
        async with AsyncExitStack() as stack:
            target = await start_target(stack)
            base = f"http://127.0.0.1:{relay.port}"
            connector = await spawn_connector(
                base,
                "acme",
                "flood-secret",
                target.url,
                env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await wait_for_connector(base, "acme")
            before = relay.rss_mib()
            upload = asyncio.ensure_future(
                _chunked_upload(relay.address, "/relay/acme/app/upload", pattern(256 * 1024), 4096)
            )
            async with aiohttp.ClientSession() as honest:
                answered = 0
                while not upload.done() or answered < 20:  # served while the upload runs
                    async with honest.post(f"{base}/relay/acme/app/echo", data=b"hi") as ok:
                        assert (ok.status, await ok.read()) == (200, b"hi")
                    answered += 1
            status, sent = await upload
            assert status.startswith(b"HTTP/1.1 413"), status
            assert sent < 128 * MIB
            assert relay.rss_mib() - before < 64
            assert _body_files(tmp_path / "rmb-relay" / "bodies") == []
    finally:
        if connector is not None:
            stop(connector)
        relay.close()
    assert relay.problems == []


async def test_an_upload_to_a_queue_is_cut_on_a_relay_process(tmp_path: Path) -> None:
    """The issue's case as it was tried: a chunked upload to `/queue/TENANT/...` of a tenant
    that does not require auth, no connector (the body is stored for one): 413 at the bound,
    not 202 for all of it, and no body file left wherever the relay keeps them."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    home = str(tmp_path)
    env = {**os.environ, "XDG_DATA_HOME": home, "XDG_STATE_HOME": home, "TMPDIR": home}
    await add_tenant(db, env, "acme", "flood-secret")
    relay = RelayProcess("--twins", db, "--tunnel-max-body", str(8 * MIB), env=env)
    try:
        before = relay.rss_mib()
        status, sent = await _chunked_upload(
            relay.address, "/queue/acme/x/upload", pattern(256 * 1024), 512, finish=True
        )
        if status == RESET:  # the 413 lost with the reset: the relay counted it
            page = await scrape(*relay.address)
            refused = sum(
                value
                for (name, labels), value in page.samples.items()
                if name == "rmb_relay_tunnel_bodies_refused_total" and ("limit", "body") in labels
            )
            assert refused == 1, f"reset after {sent / MIB:.0f} MiB, no 413 counted"
        else:
            assert status.startswith(b"HTTP/1.1 413"), f"{status!r} after {sent / MIB:.0f} MiB"
        assert sent < 64 * MIB
        assert relay.rss_mib() - before < 64
        assert _body_files_under(tmp_path) == []
    finally:
        relay.close()
    assert relay.problems == []


async def test_metrics_of_a_relay_process_name_no_tenant(tmp_path: Path) -> None:
    """`/metrics` is open to anyone on the public listener: after a request to a tenant, its
    name is in no label of a relay process on defaults."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    home = str(tmp_path)
    env = {**os.environ, "XDG_DATA_HOME": home, "XDG_STATE_HOME": home, "TMPDIR": home}
    await add_tenant(db, env, "customer-acme", "acme-secret")
    relay = RelayProcess("--twins", db, env=env)
    try:
        base = f"http://127.0.0.1:{relay.port}"
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{base}/queue/customer-acme/app/x", data=b"hi") as queued:
                assert queued.status == 202
            async with client.get(f"{base}/metrics") as metrics:
                page = await metrics.text()
        assert "rmb_relay_tunnel_" in page
        assert [line for line in page.splitlines() if "customer-acme" in line] == []
    finally:
        relay.close()
    assert relay.problems == []


async def test_an_upload_faster_than_its_rate_is_slowed_and_arrives_whole(tmp_path: Path) -> None:
    """A relay process with a 1 MiB/s upload rate per tenant: a 3 MiB body sent as fast as
    loopback goes is read at the rate (the relay counts the seconds it did not read it for:
    close to (3 MiB - the 1/4 s burst) / 1 MiB/s) and reaches the target whole; the address
    rate (default, 64 MiB/s) never held it. Then the same client is refused nothing."""
    rate = MIB
    async with TunnelRelay(tmp_path, "--tunnel-upload-rate-per-tenant", str(rate)) as tunnel:
        await tunnel.add_tenant("acme")
        await tunnel.connect("acme")
        body = pattern(3 * MIB)
        timeout = aiohttp.ClientTimeout(total=60)
        async with (
            aiohttp.ClientSession(timeout=timeout) as client,
            client.post(f"{tunnel.base}/relay/acme/app/sha", data=io.BytesIO(body)) as answer,
        ):
            assert answer.status == 200
            assert await answer.json() == {
                "sha256": hashlib.sha256(body).hexdigest(),
                "size": len(body),
            }
        page = await scrape(*tunnel.relay.address)
        paused = page.value("rmb_relay_tunnel_upload_paused_seconds_total", limit="tenant")
        expected = (len(body) - rate / 4) / rate  # 2.75 s
        # the pauses the rate asked for add up to that, less the loop's lateness in
        # resuming and the time spent reading (each lets the debt shrink meanwhile)
        assert expected / 2 < paused <= expected + 0.01, paused
        assert page.value("rmb_relay_tunnel_upload_pauses_total", limit="tenant") >= 2
        with pytest.raises(KeyError):
            page.value("rmb_relay_tunnel_upload_pauses_total", limit="ip")
    assert tunnel.relay.problems == []


async def test_time_an_upload_is_held_for_its_rate_is_not_the_clients_idleness(
    start_tunnel: StartTunnel,
) -> None:
    """At 256 KiB/s a read of a loopback upload (up to 256 KiB) is paused for longer than the
    listener's 0.5 s idle timeout, during which the handler waits for body bytes that cannot
    come: it keeps waiting (the relay held them), and the upload arrives whole."""
    rate = 256 * 1024
    tunnel = await start_tunnel(upload_rate_per_tenant=rate, listener={"http_idle_timeout": 0.5})
    await tunnel.connect()
    body = pattern(768 * 1024)
    async with tunnel.client() as client:
        answer = await client.post("/relay/acme/app/sha", content=body, timeout=WAIT * 3)
    assert answer.status_code == 200
    assert answer.json() == {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    paused = tunnel.dialect.upload_rate.paused.value("tenant")
    assert paused > 3 * 0.5, paused  # (768 KiB - the 64 KiB burst) / 256 KiB/s = 2.75 s


async def test_metrics_name_no_tenant_unless_asked(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(tenant_labels=False)
    tunnel.add_tenant("secret-customer")
    await tunnel.connect("secret-customer")
    async with tunnel.client() as client:
        assert (await client.get("/relay/secret-customer/app/echo")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert "secret-customer" not in metrics
    assert "acme" not in metrics
    page = await scrape(*tunnel.relay.addresses[0])
    series = {"dialect": "tunnel", "tenant": "*", "target": "*", "status": "200"}
    assert page.value("rmb_relay_tunnel_requests_total", **series) == 1
    assert page.value("rmb_relay_tunnel_connectors", dialect="tunnel", tenant="*") == 1
