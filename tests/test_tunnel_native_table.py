"""The native express table (rust/tunnel_native.rs, dialects/tunnel/native.py) over real
sockets: what it serves, what it leaves to Python and why, and the rare events Python finishes
for it (a client gone or half-closed, the response deadline, a connector that leaves, an answer
the table does not write), each with the Python path's answer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from rmb_relay.dialects.tunnel.native import LEASE, PIPELINE, NativeExpress
from rmb_relay.telemetry.records import Channel
from tests.conftest import WAIT, RedisServer
from tests.helpers import FakeClock, eventually
from tests.tunnel_fixtures import (
    StartTunnel,
    Tunnel,
    deliver_text,
    get_once,
    pattern,
    raw_client,
    raw_connector,
)
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)


async def _scrape(tunnel: Tunnel) -> str:
    async with tunnel.client() as http:
        return (await http.get("/metrics")).text


def _sample(scrape: str, family: str, **labels: str) -> float:
    """The value of `rmb_relay_tunnel_{family}_total` with `labels` (and the dialect's), 0
    when absent (the exposition sorts labels by name)."""
    return _gauge(scrape, f"{family}_total", **labels)


def _gauge(scrape: str, family: str, **labels: str) -> float:
    """The value of `rmb_relay_tunnel_{family}` with `labels` (and the dialect's), 0 when
    absent."""
    labels["dialect"] = "tunnel"
    text = ",".join(f'{name}="{labels[name]}"' for name in sorted(labels))
    prefix = f"rmb_relay_tunnel_{family}{{{text}}} "
    for line in scrape.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def _settled(tunnel: Tunnel) -> NativeExpress:
    """The table with nothing left in it, nor in the hub: every job answered or dropped."""
    native = tunnel.dialect.native
    assert native is not None
    assert len(native.table) == 0
    assert native.table.held("ACME") == 0
    assert tunnel.dialect.hub.jobs == {}
    return native


def _native(tunnel: Tunnel) -> int:
    native = tunnel.dialect.native
    assert native is not None
    return native.table.taken


async def test_relay_requests_are_served_by_the_table_and_counted_in_metrics(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with raw_client(tunnel) as client:
        for size in (0, 1, 1024, 16 * 1024):
            status, _, body = await client.request("POST", "/relay/acme/app/echo", pattern(size))
            assert (status, body) == (200, pattern(size))
        assert (await client.request("GET", "/relay/acme/app/status/201"))[0] == 201
    assert _native(tunnel) == 5
    native = tunnel.dialect.native
    assert native is not None
    assert len(native.table) == 0
    assert tunnel.dialect.hub.jobs == {}
    assert native.table.held("ACME") == 0
    scrape = await _scrape(tunnel)
    assert _sample(scrape, "native_requests", outcome="taken") == 5
    assert _sample(scrape, "express", outcome="taken") == 5
    assert _sample(scrape, "requests", status="200", target="app", tenant="acme") == 4
    assert _sample(scrape, "native_answers") == 5
    # the metrics scrape, the connector's token and websocket are not tunnel requests
    assert _sample(scrape, "native_requests", outcome="path") == 0
    assert _sample(scrape, "native_requests", outcome="request") == 0


async def test_what_the_table_does_not_serve_goes_to_python_with_the_reason_counted(
    start_tunnel: StartTunnel,
) -> None:
    """HEAD, a body over the inline limit, a target with an escape, an unknown tenant, a
    tenant whose connector is not here: each is answered as before, by Python."""
    tunnel = await start_tunnel(request_ttl=0.3)
    tunnel.add_tenant("lonely")
    await tunnel.connect()
    big = pattern(16 * 1024 + 1)
    async with raw_client(tunnel) as client:
        assert (await client.request("HEAD", "/relay/acme/app/bytes/10"))[0] == 200
        assert (await client.request("POST", "/relay/acme/app/echo", big))[2] == big
        assert (await client.request("GET", "/relay/acme/a%70p/status/202"))[0] == 202
    assert (await get_once(tunnel, "/relay/nobody/app/x"))[0] == 404
    # (no connector: it waits for one until its TTL, then 408)
    assert (await get_once(tunnel, "/relay/lonely/app/x"))[0] == 408
    assert _native(tunnel) == 0
    scrape = await _scrape(tunnel)
    # (a tenant is in the table while one of its connectors is here)
    for outcome, count in [("request", 2), ("path", 1), ("tenant", 2)]:
        assert _sample(scrape, "native_requests", outcome=outcome) == count
    assert tunnel.dialect.hub.jobs == {}


async def test_with_the_shortcut_off_the_table_serves_nothing(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    """`--no-tunnel-shortcut`: every request goes through Redis, even to a connector here, so
    the table registers no tenant and takes no lease."""
    tunnel = await start_tunnel(redis_url=redis_server.url, shortcut=False)
    await tunnel.connect()
    bridge = tunnel.dialect.bridge
    await eventually(lambda: bridge is not None and bridge.consuming("ACME"))
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    native = tunnel.dialect.native
    assert native is not None
    assert not native.table.has_tenant("ACME")
    assert native.table.lease("ACME") == 0
    assert _native(tunnel) == 0


async def test_the_lease_is_held_while_a_connector_is_and_given_back_after_the_last(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(request_ttl=0.3)
    budget = tunnel.dialect.hub.budget
    native = tunnel.dialect.native
    assert native is not None
    first = await tunnel.connect()
    second = await tunnel.connect()
    assert budget.held_by("ACME") == LEASE
    # round robin over both: each serves one of two requests
    async with raw_client(tunnel) as client:
        for _ in range(2):
            assert (await client.request("GET", "/relay/acme/app/status/200"))[0] == 200
    await tunnel.disconnect(first)
    await eventually(lambda: len(tunnel.dialect.hub.connectors.get("ACME", [])) == 1)
    assert budget.held_by("ACME") == LEASE
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    await tunnel.disconnect(second)
    await eventually(lambda: not native.table.has_tenant("ACME"))
    assert budget.held_by("ACME") == 0
    # no connector: it waits for one until its TTL, on the Python path
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 408
    assert _native(tunnel) == 3


async def test_a_deliver_for_a_client_gone_is_dropped_and_the_connector_serves_on(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    dialect = tunnel.dialect
    native = dialect.native
    assert native is not None
    async with raw_connector(tunnel) as ws:
        async with raw_client(tunnel) as client:
            client.writer.write(
                b"POST /relay/acme/app/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
            )
            argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
            assert _native(tunnel) == 1
            connections = len(tunnel.relay.connections)
            # a reset, so the relay knows it is gone (a FIN may be a half-close)
            sock = client.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.writer.transport.abort()
            await eventually(lambda: len(tunnel.relay.connections) == connections - 1)
        await ws.send_str(deliver_text(argument, 200, b"late"))
        async with raw_client(tunnel) as client:
            answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
            argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
            await ws.send_str(deliver_text(argument, 200, b"fresh"))
            status, _, body = await answer
    assert (status, body) == (200, b"fresh")
    assert native.table.answered == 1
    assert dialect.metrics.bad_messages.value() == 0
    assert len(native.table) == 0
    assert native.table.held("ACME") == 0


async def test_a_client_that_half_closes_still_gets_its_answer(
    start_tunnel: StartTunnel,
) -> None:
    """`nc -N`: the request, then a FIN. The answer comes, then the relay closes."""
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws, raw_client(tunnel) as client:
        client.writer.write(
            b"POST /relay/acme/app/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
        )
        argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
        assert argument["bodyContent"] == "aGk="
        client.writer.write_eof()
        native = tunnel.dialect.native
        assert native is not None
        await ws.send_str(deliver_text(argument, 200, b"after the fin"))
        answer = await asyncio.wait_for(client.reader.read(), WAIT)  # up to the relay's EOF
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nafter the fin")
    assert len(native.table) == 0
    assert tunnel.dialect.hub.jobs == {}


async def test_no_answer_by_the_deadline_is_504_and_a_late_deliver_is_dropped(
    start_tunnel: StartTunnel,
) -> None:
    """The table's tick answers the clients whose TTL + response timeout passed on the
    dialect's clock (moved by hand here; the tick itself runs every span/4 of real time)."""
    clock = FakeClock()
    tunnel = await start_tunnel(clock=clock, request_ttl=0.2, response_timeout=0.2)
    native = tunnel.dialect.native
    assert native is not None
    async with raw_connector(tunnel) as ws, raw_client(tunnel) as client:
        answer = asyncio.ensure_future(client.request("GET", "/relay/acme/app/x"))
        argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
        assert len(native.table) == 1
        clock.advance(0.4 + 0.001)
        status, _, body = await answer
        assert (status, body) == (504, b"the connector did not answer in time\n")
        await ws.send_str(deliver_text(argument, 200, b"late"))
    await eventually(lambda: len(native.table) == 0)
    assert native.table.held("ACME") == 0
    assert tunnel.dialect.metrics.bad_messages.value() == 0
    scrape = await _scrape(tunnel)
    assert _sample(scrape, "requests", status="504", target="-", tenant="acme") == 1


async def test_a_connector_leaving_mid_request_is_503(start_tunnel: StartTunnel) -> None:
    """Acknowledgements disabled: the connector took the request for good; it is not
    redelivered (as on the Python path)."""
    tunnel = await start_tunnel()
    async with raw_client(tunnel) as client:
        async with raw_connector(tunnel) as ws:
            answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
            await ws.receive_str(timeout=WAIT)
        status, _, body = await answer
    assert (status, body) == (503, b"connector unavailable\n")
    native = tunnel.dialect.native
    assert native is not None
    assert len(native.table) == 0
    assert tunnel.dialect.hub.budget.held_by("ACME") == 0
    scrape = await _scrape(tunnel)
    assert _sample(scrape, "requests", status="503", target="-", tenant="acme") == 1


async def test_answers_the_table_does_not_write_are_finished_by_python(
    start_tunnel: StartTunnel,
) -> None:
    """An error status and a response body in the body store: the job is taken out of the
    table and the hub answers it as an express job, byte for byte as before."""
    tunnel = await start_tunnel()
    await tunnel.connect()
    big = 64 * 1024
    async with raw_client(tunnel) as client:
        status, _, body = await client.request("GET", f"/relay/acme/app/bytes/{big}")
        assert (status, body) == (200, pattern(big))
        status, _, body = await client.request("GET", "/relay/acme/app/status/200")
        assert status == 200
        status, _, _ = await client.request("GET", "/relay/acme/app/status/500")
        assert status == 500
    assert _native(tunnel) == 3
    assert _settled(tunnel).table.answered == 1
    assert tunnel.dialect.metrics.requests.value("acme", "app", "500") == 1


async def test_a_tenant_removed_while_connected_is_left_to_python_at_the_next_tick(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(request_ttl=0.2, response_timeout=0.2, tenant_cache_ttl=0)
    await tunnel.connect()
    native = tunnel.dialect.native
    assert native is not None
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    assert _native(tunnel) == 1
    assert tunnel.store.remove("acme")

    async def unknown() -> bool:
        return (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 404

    await eventually(unknown)  # (the table served it until the tick)
    taken = _native(tunnel)
    assert await unknown()
    assert _native(tunnel) == taken
    assert native.table.has_tenant("ACME")  # its lease stays until the last connector leaves


async def test_delivers_answered_in_the_decoder_and_by_python_keep_their_answers(
    start_tunnel: StartTunnel,
) -> None:
    """The connector's scanner answers the table's `Deliver`s inside the decoder's feed; one
    it cannot answer (an error status) goes to Python, and so does every later one of the
    same read. Sent back to back, in both orders: each client gets its own answer."""
    tunnel = await start_tunnel()
    native = tunnel.dialect.native
    assert native is not None
    async with raw_connector(tunnel) as ws:
        for statuses in [(200, 500), (500, 200)]:
            async with raw_client(tunnel) as first, raw_client(tunnel) as second:
                answers = []
                arguments = []
                for client in (first, second):
                    answers.append(
                        asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
                    )
                    arguments.append(json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0])
                await asyncio.gather(
                    *(
                        ws.send_str(deliver_text(argument, status, str(status).encode()))
                        for argument, status in zip(arguments, statuses, strict=True)
                    )
                )
                got = [(status, body) for status, _, body in await asyncio.gather(*answers)]
            assert got == [(status, str(status).encode()) for status in statuses]
    assert _settled(tunnel).table.answered == 2
    assert tunnel.dialect.metrics.requests.value("acme", "app", "500") == 2


async def test_many_requests_in_one_turn_reach_the_connector_in_pipelined_writes(
    start_tunnel: StartTunnel,
) -> None:
    """More than `PIPELINE` requests read in one loop turn: the connector's outbox is written
    every `PIPELINE` of them and at the turn's end; every client gets its own answer."""
    tunnel = await start_tunnel()
    await tunnel.connect()
    count = 3 * PIPELINE + 1
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(raw_client(tunnel)) for _ in range(count)]
        bodies = [pattern(100 + i) for i in range(count)]
        answers = await asyncio.gather(
            *(
                client.request("POST", "/relay/acme/app/echo", body)
                for client, body in zip(clients, bodies, strict=True)
            )
        )
    assert [(status, body) for status, _, body in answers] == [(200, b) for b in bodies]
    assert _native(tunnel) == count


async def test_a_tenants_new_settings_reach_the_table_at_the_next_tick(
    start_tunnel: StartTunnel,
) -> None:
    """Manual acknowledgements set while the connector is connected: the table's requests
    carry the acknowledge URL from the next tick on; its token acknowledges the job, once,
    and a forged one does not (the table keeps the job, body included, until then)."""
    tunnel = await start_tunnel(request_ttl=0.2, response_timeout=0.2, tenant_cache_ttl=0)
    await tunnel.connect()
    native = tunnel.dialect.native
    assert native is not None
    tenant = tunnel.store.get("acme")
    assert tenant is not None
    assert tunnel.store.update(dataclasses.replace(tenant, ack_mode=3))

    urls: list[str] = []

    async def manual() -> bool:
        async with raw_client(tunnel) as client:
            _, headers, _ = await client.request("POST", "/relay/acme/app/echo", b"hi")
        urls.extend(v for n, v in headers if n.lower() == "x-got-relayserver-acknowledgeurl")
        return bool(urls)

    await eventually(manual)
    url = urls[0]
    assert _native(tunnel) >= 2
    assert native.table.unacked == 1
    path = url.split("://", 1)[1].split("/", 1)[1]
    async with tunnel.client() as http:
        assert (await http.post("/" + path.rsplit("/", 1)[0] + "/guessed")).status_code == 404
        assert (await http.post("/" + path)).status_code == 204
        assert (await http.post("/" + path)).status_code == 404  # once only
    assert native.table.unacked == 0
    assert len(native.table) == 0
    assert native.table.lease("ACME") == LEASE


async def test_held_bytes_count_the_tables_jobs_not_its_lease(start_tunnel: StartTunnel) -> None:
    """`rmb_relay_tunnel_held_bytes` says what requests hold: 0 for a tenant with a connector
    and nothing in flight (the table's lease is reserved, not held), a request's size while
    the table holds it, 0 again once it is answered."""
    tunnel = await start_tunnel()
    native = tunnel.dialect.native
    assert native is not None
    await tunnel.connect()
    assert tunnel.dialect.hub.budget.held_by("ACME") == LEASE
    assert _gauge(await _scrape(tunnel), "held_bytes", tenant="ACME") == 0
    async with raw_client(tunnel) as client:
        answer = asyncio.ensure_future(client.request("GET", "/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        held = native.table.held("ACME")
        assert 0 < held < LEASE
        assert _gauge(await _scrape(tunnel), "held_bytes", tenant="ACME") == held
        tunnel.target.release.set()
        assert (await asyncio.wait_for(answer, WAIT))[0] == 200
    _settled(tunnel)
    assert _gauge(await _scrape(tunnel), "held_bytes", tenant="ACME") == 0


async def test_a_concurrency_limit_is_kept_with_the_table_and_the_queue_goes_first(
    start_tunnel: StartTunnel,
) -> None:
    """A tenant limited to two requests in flight: the table serves two, leaves the third
    (at the limit) and the fourth (the hub has one queued: it would overtake it) to Python's
    queue, and hands its answers to Python while something is queued, so each answer sends
    the next queued request, in order. Once the queue is empty the table serves again."""
    tunnel = await start_tunnel(max_concurrent=2)
    await tunnel.connect()
    hub = tunnel.dialect.hub
    calls = tunnel.target.calls
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(raw_client(tunnel)) for _ in range(4)]
        slow = [
            asyncio.ensure_future(c.request("GET", "/relay/acme/app/slow")) for c in clients[:2]
        ]
        await eventually(lambda: calls.count("GET /slow") == 2)
        assert _native(tunnel) == 2
        queued = []
        for n, client in enumerate(clients[2:]):
            queued.append(
                asyncio.ensure_future(client.request("GET", f"/relay/acme/app/status/20{n}"))
            )
            await eventually(lambda n=n: hub.queued() == n + 1)  # type: ignore[misc]
        assert hub.inflight("ACME") == 2
        tunnel.target.release.set()
        assert [r[0] for r in await asyncio.gather(*slow, *queued)] == [200, 200, 200, 201]
    assert calls == ["GET /slow", "GET /slow", "GET /status/200", "GET /status/201"]
    assert _native(tunnel) == 2
    _settled(tunnel)
    assert (await get_once(tunnel, "/relay/acme/app/status/202"))[0] == 202
    assert _native(tunnel) == 3
    scrape = await _scrape(tunnel)
    assert _sample(scrape, "native_requests", outcome="limit") == 1
    assert _sample(scrape, "native_requests", outcome="queued") == 1


async def test_least_inflight_counts_pythons_jobs_with_the_tables(
    start_tunnel: StartTunnel,
) -> None:
    """Two connectors, least in flight: a request on the Python path (an escaped target
    segment) held by the target keeps its connector busy, so the table sends the next four
    to the other one; and the Python path's pick counts the table's jobs the same way."""
    tunnel = await start_tunnel(balance="least-inflight")
    a = await tunnel.connect()
    b = await tunnel.connect()
    async with raw_client(tunnel) as held, raw_client(tunnel) as client:
        busy = asyncio.ensure_future(held.request("GET", "/relay/acme/a%70p/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        assert _native(tunnel) == 0
        busy_one, idle = (a, b) if a.requests_received else (b, a)
        for _ in range(4):
            assert (await client.request("GET", "/relay/acme/$ping/"))[0] == 200
        assert (busy_one.requests_received, idle.requests_received) == (1, 4)
        assert _native(tunnel) == 4
        tunnel.target.release.set()
        assert (await busy)[0] == 200
    _settled(tunnel)


async def test_route_records_of_the_tables_answers_come_from_rust_at_each_take(
    start_tunnel: StartTunnel,
) -> None:
    """`--records`: the table keeps a record per answer it makes or gives up (delivered, 504,
    503) and the channel takes them at its flush, moved from the hub's clock into the
    records' (two clocks apart by 4,000 s here); an answer Python finishes for the table
    (a 500) is recorded by Python with the table's start. Each as the task path records it:
    `tenant/target`, body size, route local, the time inside the relay."""
    hub_clock = FakeClock()
    records_clock = FakeClock(5_000_000_000_000)

    def advance(seconds: float) -> None:
        hub_clock.advance(seconds)
        records_clock.advance(seconds)

    tunnel = await start_tunnel(clock=hub_clock, request_ttl=0.2, response_timeout=0.2)
    channel = Channel("tunnel", 1.0, records_clock)
    tunnel.dialect.records = channel
    native = tunnel.dialect.native
    assert native is not None
    async with raw_connector(tunnel) as ws:
        assert native.table.recording
        for status, size in [(200, 2), (500, 5)]:
            async with raw_client(tunnel) as client:
                answer = asyncio.ensure_future(
                    client.request("POST", "/relay/acme/app/x", b"hi!!!"[:size])
                )
                argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
                advance(0.003)
                await ws.send_str(deliver_text(argument, status, b"ok"))
                assert (await answer)[0] == status
        async with raw_client(tunnel) as client:
            answer = asyncio.ensure_future(client.request("GET", "/relay/acme/app/x"))
            await ws.receive_str(timeout=WAIT)
            advance(0.4 + 0.001)
            assert (await answer)[0] == 504
    async with raw_client(tunnel) as client:
        async with raw_connector(tunnel) as ws:
            answer = asyncio.ensure_future(client.request("GET", "/relay/acme/app/y"))
            await ws.receive_str(timeout=WAIT)
            advance(0.002)
        assert (await answer)[0] == 503
    assert _native(tunnel) == 4
    batch = channel.take(1.0)
    assert batch is not None
    rows = sorted(batch.full, key=lambda r: r[0])
    assert [r[1:] for r in rows] == [
        (None, "acme/app", 2, "local", "delivered", None, 3_000_000, None),
        (None, "acme/app", 5, "local", "delivered", None, 3_000_000, None),
        (None, "acme/app", 0, "local", "expired", "no answer in time", 401_000_000, None),
        (None, "acme/app", 0, "local", "rejected", "connector unavailable", 2_000_000, None),
    ]
    assert rows[-1][0] == records_clock.now
    assert channel.take(1.0) is None  # taken once


def _acknowledge_text(argument: dict[str, str]) -> str:
    """The JSON `Acknowledge` a raw connector sends for a `RequestTarget`'s arguments."""
    ack = {"originId": argument["acknowledgeOriginId"], "requestId": argument["requestId"]}
    return json.dumps({"target": "Acknowledge", "arguments": [ack]})


@pytest.mark.parametrize("mode", [1, 2])
async def test_acknowledged_requests_are_served_by_the_table(
    start_tunnel: StartTunnel, mode: int
) -> None:
    """Modes 1 and 2 with the packaged connector: sent with the mode, acknowledged by the
    connector's native path (mode 1 when the request comes, mode 2 after its `Deliver`, also
    when the answer takes the connector's Python path: a body for the store, an error
    status), the `Acknowledge` taken by the table's scanner; nothing left behind."""
    tunnel = await start_tunnel(ack_mode=mode)
    connector = await tunnel.connect(binary=mode == 2)
    big = 64 * 1024
    async with raw_client(tunnel) as client:
        for size in (0, 1024, 10):
            status, _, body = await client.request("POST", "/relay/acme/app/echo", pattern(size))
            assert (status, body) == (200, pattern(size))
        # (the first opens the target connection: the task path; the next ones reuse it)
        assert connector.answers_without_task == 2
        status, _, body = await client.request("GET", f"/relay/acme/app/bytes/{big}")
        assert (status, body) == (200, pattern(big))
    assert (await get_once(tunnel, "/relay/acme/app/status/500"))[0] == 500
    assert _native(tunnel) == 5
    await eventually(lambda: not tunnel.dialect.hub.jobs)
    native = tunnel.dialect.native
    assert native is not None
    await eventually(lambda: len(native.table) == 0)
    assert native.table.unacked == 0
    _settled(tunnel)
    assert tunnel.dialect.hub.budget.held_by("ACME") == LEASE
    assert tunnel.dialect.metrics.bad_messages.value() == 0


@pytest.mark.parametrize("mode", [1, 2])
async def test_a_request_not_acknowledged_when_its_connector_leaves_is_sent_again(
    start_tunnel: StartTunnel, mode: int
) -> None:
    """At least once: the first connector takes the request (mode 2: and answers it) but
    leaves before acknowledging it; the hub sends it again, same id and body, to the other
    connector. Mode 1: the client gets the second connector's answer. Mode 2: the client
    had the first one's; the second execution's answer is dropped."""
    tunnel = await start_tunnel(ack_mode=mode)
    native = tunnel.dialect.native
    assert native is not None
    async with (
        raw_client(tunnel) as client,
        raw_connector(tunnel) as first,
        raw_connector(tunnel) as second,
    ):
        answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
        # (round robin: `taker` is whichever connector got it)
        got = await _first_of(first, second)
        taker, other = (first, second) if got[0] is first else (second, first)
        argument = got[1]
        assert (argument["acknowledgeMode"], argument["bodyContent"]) == (mode, "aGk=")
        assert _native(tunnel) == 1
        if mode == 2:
            await taker.send_str(deliver_text(argument, 200, b"first"))
            assert (await answer)[2] == b"first"
        await taker.close()
        again = json.loads(await other.receive_str(timeout=WAIT))["arguments"][0]
        assert (again["requestId"], again["bodyContent"]) == (argument["requestId"], "aGk=")
        assert again["url"] == argument["url"]
        await other.send_str(_acknowledge_text(again))
        await other.send_str(deliver_text(again, 200, b"second"))
        if mode == 1:
            assert (await answer)[2] == b"second"
        await eventually(lambda: not tunnel.dialect.hub.jobs)
    assert tunnel.dialect.metrics.redelivered.value() == 1
    assert tunnel.dialect.metrics.bad_messages.value() == 0
    assert len(native.table) == 0


async def _first_of(
    *connectors: aiohttp.ClientWebSocketResponse,
) -> tuple[aiohttp.ClientWebSocketResponse, dict[str, Any]]:
    """The connector that receives a `RequestTarget` first, and its arguments."""
    reads = {asyncio.ensure_future(ws.receive_str(timeout=WAIT)): ws for ws in connectors}
    done, pending = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
    for read in pending:
        read.cancel()
    read = done.pop()
    return reads[read], json.loads(read.result())["arguments"][0]


async def test_a_request_sent_again_after_its_ttl_is_408_and_not_run(
    start_tunnel: StartTunnel,
) -> None:
    """The TTL holds for a request the table hands back: its connector left without
    acknowledging it, no other was there, and the next one came after the TTL (within the
    response deadline): 408, and it is not sent again."""
    clock = FakeClock()
    tunnel = await start_tunnel(clock=clock, ack_mode=1, request_ttl=0.2, response_timeout=30)
    async with raw_client(tunnel) as client:
        async with raw_connector(tunnel) as first:
            answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
            await first.receive_str(timeout=WAIT)
        await eventually(lambda: tunnel.dialect.hub.queued() == 1)
        clock.advance(0.3)
        async with raw_connector(tunnel):
            assert (await answer)[0] == 408
    assert tunnel.dialect.metrics.expired.value() == 1
    assert tunnel.dialect.metrics.redelivered.value() == 1
    assert not tunnel.dialect.hub.jobs
