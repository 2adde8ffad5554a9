"""The `/monitor/` views against a relay built by `rmb-relay serve`'s own code, with real
connections of every dialect: RMB twins, SBD keys, a 신경 client, a tunnel connector and an
HTTP client through it. Values are read from the JSON a client gets, as an operator would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rmb_relay._core import SigningKey
from rmb_relay.commands import serve
from rmb_relay.dialects.tunnel.connector import Connector
from rmb_relay.dialects.tunnel.targets import WebTarget
from rmb_relay.dialects.tunnel.tenants import Tenant, TenantStore, hash_secret
from rmb_relay.sdk import RmbClient
from rmb_relay.server.listener import RelayServer
from rmb_relay.services import Services
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT, RedisServer, StartRelay, free_port
from tests.helpers import eventually
from tests.rmb_fixtures import key_for
from tests.sbd_client import SbdClient, key_path
from tests.sg_client import SgClient
from tests.tunnel_fixtures import start_target

SECRET = "monitoring test secret"


@dataclass
class Relay:
    server: RelayServer
    services: Services
    http: httpx.AsyncClient

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.addresses[0]
        return host, port

    async def get(self, path: str, status: int = 200) -> Any:
        answer = await self.http.get(path)
        assert answer.status_code == status, answer.text
        assert answer.headers["content-type"] == "application/json"
        return answer.json()

    async def rows(self, query: str = "limit=all") -> list[dict[str, Any]]:
        page = await self.get(f"/monitor/connections?{query}")
        return page["connections"]  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def running(tmp_path: Path, *flags: str) -> AsyncIterator[Relay]:
    """A relay built by `rmb-relay serve`'s code with `flags`: every dialect on, twins 1..3
    and the tenant `acme` in the directory's file."""
    twins = tmp_path / "twins.sqlite3"
    directory = SqliteTwinDirectory(twins)
    for twin in (1, 2, 3):
        directory.add(Twin(twin, key_for(twin).public_key, frozenset({"relay.test"}), None))
    TenantStore(twins).add(Tenant("acme", secret_hash=hash_secret(SECRET)))
    args = serve.parser().parse_args(
        [
            "-l",
            "127.0.0.1:0",
            "--twins",
            f"sqlite:{twins}",
            "--tunnel-body-store",
            str(tmp_path / "bodies"),
            "--sbd-disable-rate-limit",
            *flags,
        ]
    )
    server, services = await serve.build_server(args)
    await server.start()
    host, port = server.addresses[0]
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=WAIT) as http:
        try:
            yield Relay(server, services, http)
        finally:
            await asyncio.wait_for(server.shutdown(), WAIT)
            await services.close()


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with running(tmp_path) as relay:
        yield relay


def by_who(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["who"]: row for row in rows if row["who"]}


async def test_every_dialect_is_listed_with_its_identity_and_its_traffic(
    relay: Relay, tmp_path: Path
) -> None:
    host, port = relay.address
    async with AsyncExitStack() as stack:
        url = f"ws://{host}:{port}/"
        alice = await RmbClient.connect(url, 1, key_for(1), sid="a")
        stack.push_async_callback(alice.close)
        bob = await RmbClient.connect(url, 2, key_for(2))
        stack.push_async_callback(bob.close)
        sbd_a = await SbdClient.connect(host, port)
        sbd_b = await SbdClient.connect(host, port)
        stack.callback(sbd_a.ws.close)
        stack.callback(sbd_b.ws.close)
        sg = await SgClient.connect(host, port)
        stack.push_async_callback(sg.close)
        await sg.identify("c1", "shop")
        target = await start_target(stack)
        connector = Connector(
            f"http://{host}:{port}", "acme", SECRET, {"app": WebTarget(target.url, WAIT)}
        )
        task = asyncio.get_running_loop().create_task(connector.run())
        stack.push_async_callback(lambda: asyncio.wait_for(asyncio.gather(task), WAIT))
        stack.push_async_callback(connector.stop)
        await asyncio.wait_for(connector.connected.wait(), WAIT)

        rows = by_who(await relay.rows())
        a_key = key_path(sbd_a.pubkey)[1:]
        b_key = key_path(sbd_b.pubkey)[1:]
        assert rows["twin 1:a"]["identity"] == {"twin": 1, "sid": "a"}
        assert rows["twin 2"]["identity"] == {"twin": 2, "sid": None}
        assert rows[f"key {a_key}"]["identity"] == {"key": a_key}
        assert rows["shop/c1"]["identity"] == {"app": "shop", "client": "c1"}
        connector_row = next(r for r in rows.values() if r["dialect"] == "tunnel")
        assert connector_row["identity"]["tenant"] == "acme"
        assert {r["dialect"] for r in rows.values()} == {"rmb", "sbd", "singyeong", "tunnel"}
        for row in rows.values():
            assert row["remote"].startswith("127.0.0.1:")
            assert row["age"] >= 0
            assert row["idle"] >= 0
            assert not row["congested"]
            assert not row["paused"]
        before = rows

        # traffic: twin 1 -> twin 2 (5 RMB requests), SBD a -> b (3 forwards of 100 B),
        # the 신경 client updates its metadata twice, one request through the tunnel
        for n in range(5):
            _, wire = alice.request_envelope(2, "ping", str(n).encode())
            alice.send(wire)
        for _ in range(3):
            sbd_a.forward(sbd_b.pubkey, b"x" * 100)
        for _ in range(3):
            await sbd_b.next_message()
        await sg.update(level=("integer", 1))
        await sg.update(level=("integer", 2))
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=WAIT) as client:
            answer = await client.post("/relay/acme/app/echo", content=b"hello")
            assert answer.status_code == 200

        async def moved() -> bool:
            now = by_who(await relay.rows())
            return (
                now["twin 1:a"]["msgs_in"] - before["twin 1:a"]["msgs_in"] >= 5
                and now["twin 2"]["msgs_out"] - before["twin 2"]["msgs_out"] >= 5
                and now[f"key {a_key}"]["msgs_in"] - before[f"key {a_key}"]["msgs_in"] >= 3
                and now[f"key {b_key}"]["msgs_out"] - before[f"key {b_key}"]["msgs_out"] >= 3
                and now["shop/c1"]["msgs_in"] - before["shop/c1"]["msgs_in"] >= 2
                and now[connector_row["who"]]["msgs_out"] > connector_row["msgs_out"]
                and now[connector_row["who"]]["msgs_in"] > connector_row["msgs_in"]
            )

        await eventually(moved)
        now = by_who(await relay.rows())
        sbd_sent = now[f"key {a_key}"]["bytes_in"] - before[f"key {a_key}"]["bytes_in"]
        assert sbd_sent >= 3 * (32 + 100), "every byte read is counted"
        sbd_got = now[f"key {b_key}"]["bytes_out"] - before[f"key {b_key}"]["bytes_out"]
        assert sbd_got >= 3 * (32 + 100)

        summary = await relay.get("/monitor/server")
        assert summary["connections"]["by_dialect"]["rmb"] == 2
        assert summary["connections"]["by_dialect"]["sbd"] == 2
        assert summary["connections"]["by_dialect"]["singyeong"] == 1
        assert summary["connections"]["by_dialect"]["tunnel"] == 1
        assert summary["totals"]["msgs_in"] >= 5 + 3 + 2
        assert summary["rss_bytes"] > 0
        assert summary["cpu_seconds"] > 0
        assert summary["mailbox"] == {"messages": 0, "bytes": 0}
        names = {b["name"] for b in summary["budgets"]}
        assert {"connections", "mailbox", "rmb slow path", "tunnel requests held"} <= names
        assert {"singyeong queues", "singyeong dead letters"} <= names

        tunnel = await relay.get("/monitor/tunnel")
        assert tunnel["enabled"]
        assert [t["tenant"] for t in tunnel["tenants"]] == ["acme"]
        assert tunnel["tenants"][0]["connectors"] == 1
        assert tunnel["connectors"][0]["tenant"] == "acme"
        assert (await relay.get("/monitor/cluster"))["enabled"] is False
        federation = await relay.get("/monitor/federation")
        assert federation["enabled"]
        assert federation["queue"]["depth"] == 0
        assert (await relay.get("/monitor/"))["routes"][0] == "/monitor/server"

    # every connection left: the totals keep what they carried
    async def gone() -> bool:
        return len(await relay.rows()) <= 1  # (the listing's own connection)

    await eventually(gone)
    summary = await relay.get("/monitor/server")
    assert summary["totals"]["msgs_in"] >= 5 + 3 + 2


async def top_once(relay: Relay) -> str:
    """One screen of `rmb-relay top --once`, 80 columns wide."""
    host, port = relay.address
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rmb_relay",
        "top",
        "--once",
        "--url",
        f"http://{host}:{port}",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80", "LINES": "30"},
    )
    out, _ = await asyncio.wait_for(process.communicate(), WAIT)
    assert process.returncode == 0
    screen = out.decode()
    assert all(len(line) <= 80 for line in screen.splitlines())
    return screen


async def test_sorting_filtering_limits_and_paging(relay: Relay) -> None:
    host, port = relay.address
    async with AsyncExitStack() as stack:
        clients = []
        for _ in range(6):
            client = await SbdClient.connect(host, port)
            stack.callback(client.ws.close)
            clients.append(client)
        sink = clients[-1]
        # client n sends n forwards: the most active sender is clients[4]
        for n, client in enumerate(clients[:5]):
            for _ in range(n):
                client.forward(sink.pubkey, b"m")
        for _ in range(sum(range(5))):
            await sink.next_message()
        keys = [key_path(c.pubkey)[1:] for c in clients]

        async def counted() -> bool:
            rows = by_who(await relay.rows("dialect=sbd&limit=all"))
            return all(rows[f"key {keys[n]}"]["msgs_in"] >= n + 1 for n in range(5))

        await eventually(counted)

        # numbers sort biggest first; ties by id
        top = await relay.rows("sort=msgs_in&dialect=sbd&limit=2")
        assert [r["who"] for r in top] == [f"key {keys[4]}", f"key {keys[3]}"]
        ascending = await relay.rows("sort=msgs_in&order=asc&dialect=sbd&limit=all")
        values = [r["msgs_in"] for r in ascending]
        assert values == sorted(values)
        assert len(values) == 6
        assert (await relay.rows("sort=-id&limit=1"))[0]["id"] == max(
            r["id"] for r in await relay.rows()
        )
        by_text = await relay.rows("sort=who&dialect=sbd&limit=all")
        assert [r["who"] for r in by_text] == sorted(r["who"] for r in by_text)
        # the sink received the most
        assert (await relay.rows("sort=msgs_out&dialect=sbd&limit=1"))[0]["who"] == f"key {keys[5]}"

        # filters: dialect, identity text (case-insensitive)
        assert {r["dialect"] for r in await relay.rows("dialect=sbd,rmb")} == {"sbd"}
        found = await relay.rows(f"who={keys[2][:12].upper()}")
        assert [r["who"] for r in found] == [f"key {keys[2]}"]
        assert await relay.rows("dialect=rmb") == []

        # offset paging and cursor paging both visit every row once, in order
        everything = await relay.rows("sort=msgs_in&limit=all")
        ids = [r["id"] for r in everything]
        by_offset = []
        for offset in range(0, len(ids), 4):
            page = await relay.get(f"/monitor/connections?sort=msgs_in&limit=4&offset={offset}")
            assert page["total"] == len(ids)
            by_offset += [r["id"] for r in page["connections"]]
        assert by_offset == ids
        by_cursor: list[int] = []
        page = await relay.get("/monitor/connections?sort=msgs_in&limit=3")
        while True:
            by_cursor += [r["id"] for r in page["connections"]]
            if page["next"] is None:
                break
            page = await relay.get(
                f"/monitor/connections?sort=msgs_in&limit=3&cursor={page['next']}"
            )
        assert by_cursor == ids

        # what the relay cannot answer is the client's mistake, said plainly
        for query, word in (
            ("sort=nonsense", "sort"),
            ("limit=0", "limit"),
            ("limit=-1", "limit"),
            ("offset=x", "offset"),
            ("order=up", "order"),
            ("cursor=!!!", "cursor"),
        ):
            error = await relay.get(f"/monitor/connections?{query}", status=400)
            assert error["error"].startswith(word), error
        text_cursor = (await relay.get("/monitor/connections?sort=who&limit=1"))["next"]
        error = await relay.get(
            f"/monitor/connections?sort=msgs_in&cursor={text_cursor}", status=400
        )
        assert "another field" in error["error"]


async def test_a_receiver_that_does_not_read_shows_as_congested(relay: Relay) -> None:
    host, port = relay.address
    async with AsyncExitStack() as stack:
        sender = await SbdClient.connect(host, port)
        stack.callback(sender.ws.close)
        key = SigningKey.ed25519(os.urandom(32))
        receiver = await SbdClient.connect(host, port, key=key)
        stack.callback(receiver.ws.close)
        # the receiver reads nothing from now on; its socket's buffers fill, then the relay's
        receiver.ws.writer.transport.pause_reading()
        who = f"key {key_path(key.public_key)[1:]}"
        payload = os.urandom(16000)

        async def congested() -> bool:
            for _ in range(64):
                sender.forward(key.public_key, payload)
            await sender.ws.writer.drain()
            rows = await relay.rows("congested=1")
            return any(r["who"] == who for r in rows)

        await eventually(congested)
        row = by_who(await relay.rows("dialect=sbd"))[who]
        assert row["congested"]
        assert row["pending"] > 0
        summary = await relay.get("/monitor/server")
        assert summary["connections"]["congested"] >= 1
        sorted_by_pending = await relay.rows("sort=pending&limit=1")
        assert sorted_by_pending[0]["who"] == who
        # `top` lists it under congested, flagged C
        screen = await top_once(relay)
        congested_part = screen.split("congested (", 1)[1]
        line = next(ln for ln in congested_part.splitlines() if ln.split()[:1] == [str(row["id"])])
        assert line.rstrip().endswith("C")


async def test_monitor_routes_are_served_to_connections_over_the_cap(
    start_relay: StartRelay,
) -> None:
    """An operations-only connection (over --max-connections) is served /monitor/ as it is
    /metrics; anything else gets the cap's 503."""
    server = await start_relay(max_connections=1)
    host, port = server.addresses[0]
    idle = await asyncio.open_connection(host, port)
    try:

        async def over_cap(path: str) -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                return await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT)
            finally:
                writer.close()

        await eventually(lambda: server.limits.total == 1)
        assert (await over_cap("/monitor/server")).startswith(b"HTTP/1.1 200")
        assert (await over_cap("/monitor/connections?limit=1")).startswith(b"HTTP/1.1 200")
        assert (await over_cap("/elsewhere")).startswith(b"HTTP/1.1 503")
    finally:
        idle[1].close()


async def test_http_connections_count_requests_and_bytes(relay: Relay) -> None:
    host, port = relay.address
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(3):
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readuntil(b"ok\n")
        rows = await relay.rows("dialect=http&sort=msgs_in&limit=1")
        assert rows[0]["msgs_in"] == 3
        assert rows[0]["msgs_out"] == 3
        assert rows[0]["bytes_in"] == 3 * len(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert rows[0]["bytes_out"] > 3 * 3
    finally:
        writer.close()


async def test_cluster_view_lists_the_instances_and_their_liveness(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with running(tmp_path, "--redis", redis_server.url, "--instance-id", "one") as relay:
        host, port = relay.address
        client = await RmbClient.connect(f"ws://{host}:{port}/", 1, key_for(1))
        try:

            async def claimed() -> bool:
                view = await relay.get("/monitor/cluster")
                return bool(view["presence_here"] >= 1)

            await eventually(claimed)
            view = await relay.get("/monitor/cluster")
            assert view["enabled"]
            assert view["me"] == "one"
            assert view["instances"] == [{"instance": "one", "alive": True, "me": True}]
            assert view["sessions_here"] == 1
        finally:
            await client.close()


async def test_federation_view_shows_the_peer_relays_that_fail_and_those_that_accept(
    tmp_path: Path,
) -> None:
    """Relay A federates: twin 4 is served by relay B (domain 127.0.0.1), which accepts; twin
    3's relay (127.0.0.2, where nobody listens) refuses connections."""
    peer_port = free_port()
    (tmp_path / "b").mkdir()
    dead, alive = "127.0.0.2", "127.0.0.1"
    b_flags = ("-l", f"127.0.0.1:{peer_port}", "--domain", alive)
    async with running(tmp_path / "b", *b_flags) as peer:
        SqliteTwinDirectory(tmp_path / "b" / "twins.sqlite3").add(
            Twin(4, key_for(4).public_key, frozenset({alive}), None)
        )
        flags = ("--domain", "relay.test", "--twin-cache-ttl", "0")
        flags += ("--federation-url-template", f"http://{{domain}}:{peer_port}/")
        async with running(tmp_path, *flags) as relay:
            host, port = relay.address
            directory = SqliteTwinDirectory(tmp_path / "twins.sqlite3")
            directory.add(Twin(3, key_for(3).public_key, frozenset({dead}), None))
            directory.add(Twin(4, key_for(4).public_key, frozenset({alive}), None))
            client = await RmbClient.connect(f"ws://{host}:{port}/", 1, key_for(1))
            try:
                for dest in (3, 4, 4):
                    _, wire = client.request_envelope(dest, "ping")
                    client.send(wire)

                async def posted() -> bool:
                    view = await relay.get("/monitor/federation")
                    peers = {p["relay"]: p for p in view["peers"]}
                    return (
                        dead in peers
                        and peers[dead]["failed"] >= 1
                        and alive in peers
                        and peers[alive]["accepted"] == 2
                    )

                await eventually(posted)
                view = await relay.get("/monitor/federation")
                peers = {p["relay"]: p for p in view["peers"]}
                assert peers[dead]["window_failures"] >= 1
                assert peers[dead]["score"] > 0
                assert peers[dead]["accepted"] == 0
                assert peers[alive]["failed"] == 0
                assert view["totals"]["accepted"] == 2
                # the envelope for twin 3 waits for its retry: held by the queue
                assert view["queue"]["depth"] == 1
                assert (await peer.get("/monitor/server"))["mailbox"]["messages"] == 2
                # `top` names the failing relay, not the one that accepts
                screen = await top_once(relay)
                failing = screen.split("failing peer relays", 1)[1]
                assert dead in failing
                assert alive not in failing
            finally:
                await client.close()
