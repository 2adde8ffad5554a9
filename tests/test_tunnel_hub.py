"""The tunnel's hub (rust/dialects/tunnel/hub.rs, dialects/tunnel/hub.py) over real sockets:
the fast path and the Python side take the same decisions and give the same answers, and
the rare events (a client gone or half-closed, the deadlines, a connector that leaves, an
answer Python writes, acknowledgements, redelivery, tenant changes, route records) are
handled once whichever side took the request.

Requests go over raw keep-alive sockets: head and body in one write, so the relay reads each
whole in one `data_received` (the fast path's condition), or chunked, which the fast path
leaves to Python."""

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

from rmb_relay.clock import NS
from rmb_relay.dialects.tunnel.hub import PIPELINE
from rmb_relay.dialects.tunnel.tokens import LEEWAY, TokenAuthority
from rmb_relay.dialects.tunnel.wire import AcknowledgeRequest, TargetResponse, encode
from rmb_relay.telemetry.records import Channel
from tests.conftest import WAIT, RedisServer
from tests.helpers import FakeClock, eventually
from tests.tunnel_fixtures import (
    Response,
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

SIZES = [0, 1, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1]


def _fast(tunnel: Tunnel, outcome: str = "taken") -> float:
    return tunnel.dialect.hub.fast_path.value(outcome)


def _settled(tunnel: Tunnel) -> None:
    """Nothing left in the hub: every job answered or dropped, no budget held."""
    core = tunnel.dialect.hub.core
    assert len(core) == 0
    assert core.held_total == 0


async def _gauge(tunnel: Tunnel, family: str, **labels: str) -> float:
    async with tunnel.client() as http:
        scrape = (await http.get("/metrics")).text
    labels["dialect"] = "tunnel"
    text = ",".join(f'{name}="{labels[name]}"' for name in sorted(labels))
    prefix = f"rmb_relay_tunnel_{family}{{{text}}} "
    for line in scrape.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


async def _exchanges(tunnel: Tunnel, chunked: bool) -> list[Response]:
    answers = []
    async with raw_client(tunnel) as client:

        async def request(method: str, path: str, body: bytes = b"", **kw: Any) -> Response:
            return await client.request(method, path, body, chunked=chunked, **kw)

        answers.append(await request("GET", "/relay/acme/app/status/201", headers=[("X-A", "1")]))
        answers.append(
            await request(
                "GET", "/relay/acme/app/echo?q=1", headers=[("X-Multi", "one"), ("X-Multi", "two")]
            )
        )
        for size in SIZES:
            answers.append(await request("POST", "/relay/acme/app/echo", pattern(size)))
            answers.append(await request("GET", f"/relay/acme/app/bytes/{size}"))
        answers.append(await request("GET", "/relay/acme/$ping/"))
        answers.append(await request("GET", "/trace/acme/$ping/"))
        # (an answer of 400 or more closes the connection: last)
        answers.append(await request("GET", "/relay/acme/nothere/x"))
    return answers


def _comparable(answers: list[Response]) -> list[Response]:
    """The answers without what differs between any two exchanges (the target's Date, the
    trace mode's request id)."""
    drop = {"date", "relayserver-requestid", "relayserver-targetduration"}
    return [(s, [(n, v) for n, v in h if n not in drop], b) for s, h, b in answers]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_the_fast_path_and_the_python_side_give_identical_answers(
    start_tunnel: StartTunnel, binary: bool
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect(binary=binary)
    fast = await _exchanges(tunnel, chunked=False)
    taken = _fast(tunnel)
    slow = await _exchanges(tunnel, chunked=True)
    assert _comparable(fast) == _comparable(slow)
    assert _fast(tunnel) == taken  # (chunked: none from the read)
    assert _fast(tunnel, "request") >= len(slow)
    trace = dict(fast[-2][1])
    assert trace["relayserver-requestid"]
    assert "relayserver-server-version" in trace
    assert [s for s, _, _ in fast][-1] == 404
    _settled(tunnel)


async def test_what_the_fast_path_leaves_to_python_is_answered_the_same_with_the_reason(
    start_tunnel: StartTunnel,
) -> None:
    """HEAD, a body over the inline limit, an unknown tenant (not known yet, then known not
    to exist), a tenant with no connector (it waits up to its TTL): each answered by the
    hub's decisions on the Python side; an escaped target segment is the fast path's."""
    tunnel = await start_tunnel(request_ttl=0.3)
    tunnel.add_tenant("lonely")
    await tunnel.connect()
    big = pattern(16 * 1024 + 1)
    async with raw_client(tunnel) as client:
        assert (await client.request("HEAD", "/relay/acme/app/bytes/10"))[0] == 200
        assert (await client.request("POST", "/relay/acme/app/echo", big))[2] == big
        assert (await client.request("GET", "/relay/acme/a%70p/status/202"))[0] == 202
    assert _fast(tunnel) == 1
    for _ in range(2):
        assert (await get_once(tunnel, "/relay/nobody/app/x"))[0] == 404
    assert (await get_once(tunnel, "/relay/lonely/app/x"))[0] == 408
    assert _fast(tunnel, "request") == 2
    assert _fast(tunnel, "tenant") == 3  # twice nobody (asked, then cached), lonely once
    assert _fast(tunnel) == 1
    assert tunnel.dialect.hub.requests.value("-", "-", "404") == 2
    assert tunnel.dialect.hub.expired.value() == 1
    _settled(tunnel)


async def test_with_the_shortcut_off_requests_go_through_redis(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    tunnel = await start_tunnel(redis_url=redis_server.url, shortcut=False)
    await tunnel.connect()
    bridge = tunnel.dialect.bridge
    await eventually(lambda: bridge is not None and bridge.consuming("ACME"))
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    assert _fast(tunnel) == 0
    assert _fast(tunnel, "cluster") == 1


async def test_held_bytes_are_what_requests_hold(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    assert await _gauge(tunnel, "held_bytes", tenant="acme") == 0
    async with raw_client(tunnel) as client:
        answer = asyncio.ensure_future(client.request("GET", "/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        held = tunnel.dialect.hub.core.held_total
        assert 0 < held < 4096
        assert await _gauge(tunnel, "held_bytes", tenant="acme") == held
        tunnel.target.release.set()
        assert (await asyncio.wait_for(answer, WAIT))[0] == 200
    _settled(tunnel)
    assert await _gauge(tunnel, "held_bytes", tenant="acme") == 0


async def test_a_deliver_for_a_client_gone_is_dropped_and_the_connector_serves_on(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws:
        async with raw_client(tunnel) as client:
            client.writer.write(
                b"POST /relay/acme/app/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
            )
            argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
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
    assert tunnel.dialect.hub.bad_messages.value() == 0
    _settled(tunnel)


async def test_a_client_leaving_a_python_side_request_leaves_nothing_behind(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with raw_client(tunnel) as client:
        pending = asyncio.ensure_future(client.request("GET", "/relay/acme/app/slow", chunked=True))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        pending.cancel()
    tunnel.target.release.set()  # the connector answers a job nobody waits for
    await eventually(lambda: len(tunnel.dialect.hub.core) == 0)
    assert not tunnel.dialect.hub.waiting
    async with raw_client(tunnel) as client:
        assert (await client.request("GET", "/relay/acme/app/status/200"))[0] == 200
    assert tunnel.dialect.hub.bad_messages.value() == 0


async def test_a_client_that_half_closes_still_gets_its_answer(start_tunnel: StartTunnel) -> None:
    """`nc -N`: the request, then a FIN. The answer comes, then the relay closes."""
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws, raw_client(tunnel) as client:
        client.writer.write(
            b"POST /relay/acme/app/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
        )
        argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
        assert argument["bodyContent"] == "aGk="
        client.writer.write_eof()
        await eventually(lambda: tunnel.dialect.hub.core.has_connector("ACME"))
        await ws.send_str(deliver_text(argument, 200, b"after the fin"))
        answer = await asyncio.wait_for(client.reader.read(), WAIT)  # up to the relay's EOF
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nafter the fin")
    _settled(tunnel)


@pytest.mark.parametrize("chunked", [False, True], ids=["fast", "python"])
async def test_no_answer_by_the_deadline_is_504_and_a_late_deliver_is_dropped(
    start_tunnel: StartTunnel, chunked: bool
) -> None:
    """The hub's answer deadline (TTL + response timeout) on the dialect's clock, moved by
    hand: one timer at the hub's next deadline answers it."""
    clock = FakeClock()
    tunnel = await start_tunnel(clock=clock, request_ttl=0.2, response_timeout=0.2)
    async with raw_connector(tunnel) as ws, raw_client(tunnel) as client:
        answer = asyncio.ensure_future(
            client.request("POST", "/relay/acme/app/x", b"q", chunked=chunked)
        )
        argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
        assert len(tunnel.dialect.hub.core) == 1
        clock.advance(0.4 + 0.001)
        status, _, body = await answer
        assert (status, body) == (504, b"the connector did not answer in time\n")
        await ws.send_str(deliver_text(argument, 200, b"late"))
    await eventually(lambda: len(tunnel.dialect.hub.core) == 0)
    _settled(tunnel)
    assert tunnel.dialect.hub.bad_messages.value() == 0
    assert tunnel.dialect.hub.requests.value("acme", "-", "504") == 1


@pytest.mark.parametrize("chunked", [False, True], ids=["fast", "python"])
async def test_a_connector_leaving_mid_request_is_504(
    start_tunnel: StartTunnel, chunked: bool
) -> None:
    """Acknowledgements disabled: the connector took the request for good; it is not sent
    again, and the client is told it may have run (504), not that it did not (503)."""
    tunnel = await start_tunnel()
    async with raw_client(tunnel) as client:
        async with raw_connector(tunnel) as ws:
            answer = asyncio.ensure_future(
                client.request("POST", "/relay/acme/app/x", b"hi", chunked=chunked)
            )
            await ws.receive_str(timeout=WAIT)
        status, _, body = await answer
    assert (status, body) == (504, b"the connector left holding the request; it may have run\n")
    _settled(tunnel)
    assert tunnel.dialect.hub.requests.value("acme", "-", "504") == 1


async def test_answers_python_writes_for_the_fast_path(start_tunnel: StartTunnel) -> None:
    """An error status (the connection closes after it) and a response body in the body
    store (it streams): the hub hands them to Python, byte for byte as before."""
    tunnel = await start_tunnel()
    await tunnel.connect()
    big = 64 * 1024
    async with raw_client(tunnel) as client:
        status, _, body = await client.request("GET", f"/relay/acme/app/bytes/{big}")
        assert (status, body) == (200, pattern(big))
        assert (await client.request("GET", "/relay/acme/app/status/200"))[0] == 200
        assert (await client.request("GET", "/relay/acme/app/status/500"))[0] == 500
    assert _fast(tunnel) == 3
    _settled(tunnel)
    assert tunnel.dialect.hub.requests.value("acme", "app", "500") == 1
    await eventually(lambda: tunnel.dialect.store.count() == 0)


async def test_a_tenant_removed_while_connected_is_unknown_once_its_lookup_expires(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel(tenant_cache_ttl=0.001)
    await tunnel.connect()
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    assert tunnel.store.remove("acme")

    async def unknown() -> bool:
        return (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 404

    await eventually(unknown)


async def test_a_tenant_unknown_once_is_found_when_its_miss_expires(
    start_tunnel: StartTunnel,
) -> None:
    """A miss is cached like a hit, and expires like one (issue 33: misses were kept
    forever, so a tenant added after a client had asked for it stayed unknown)."""
    tunnel = await start_tunnel(tenant_cache_ttl=0.001)
    assert (await get_once(tunnel, "/relay/newcomer/app/status/200"))[0] == 404
    tunnel.add_tenant("newcomer")
    await tunnel.connect("newcomer")

    async def found() -> bool:
        return (await get_once(tunnel, "/relay/newcomer/app/status/200"))[0] == 200

    await eventually(found)


async def test_delivers_answered_in_the_decoder_and_by_python_keep_their_answers(
    start_tunnel: StartTunnel,
) -> None:
    """The connector's scanner answers `Deliver`s inside the decoder's feed; one the hub
    hands Python (an error status) goes there, and so does every later one of the same
    read. Sent back to back, in both orders: each client gets its own answer."""
    tunnel = await start_tunnel()
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
    _settled(tunnel)
    assert tunnel.dialect.hub.requests.value("acme", "app", "500") == 2


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
    assert _fast(tunnel) == count


async def test_a_tenants_new_settings_apply_once_its_lookup_expires(
    start_tunnel: StartTunnel,
) -> None:
    """Manual acknowledgements set while the connector is connected: requests carry the
    acknowledge URL once the tenant's lookup expired; its token acknowledges the job, once,
    and a forged one does not (the hub keeps the job, body included, until then)."""
    tunnel = await start_tunnel(tenant_cache_ttl=0.001)
    await tunnel.connect()
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
    await eventually(lambda: len(tunnel.dialect.hub.core) == 1)
    path = urls[0].split("://", 1)[1].split("/", 1)[1]
    async with tunnel.client() as http:
        assert (await http.post("/" + path.rsplit("/", 1)[0] + "/guessed")).status_code == 404
        assert (await http.post("/" + path)).status_code == 204
        assert (await http.post("/" + path)).status_code == 404  # once only
    _settled(tunnel)


async def test_a_concurrency_limit_queues_in_order_for_both_sides(
    start_tunnel: StartTunnel,
) -> None:
    """A tenant limited to two requests in flight: two go out, the next wait in the hub's
    queue in order (the fast path leaves requests of a tenant with a queue to Python, which
    queues them behind), and each answer sends the next."""
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
    assert _fast(tunnel, "queued") == 1
    _settled(tunnel)


async def test_least_inflight_counts_every_request_in_flight(start_tunnel: StartTunnel) -> None:
    """Two connectors, least in flight: a Python-side request held by the target keeps its
    connector busy, so the next four go to the other one."""
    tunnel = await start_tunnel(balance="least-inflight")
    a = await tunnel.connect()
    b = await tunnel.connect()
    async with raw_client(tunnel) as held, raw_client(tunnel) as client:
        busy = asyncio.ensure_future(held.request("GET", "/relay/acme/app/slow", chunked=True))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        busy_one, idle = (a, b) if a.requests_received else (b, a)
        for _ in range(4):
            assert (await client.request("GET", "/relay/acme/$ping/"))[0] == 200
        assert (busy_one.requests_received, idle.requests_received) == (1, 4)
        tunnel.target.release.set()
        assert (await busy)[0] == 200
    _settled(tunnel)


async def test_route_records_are_the_hubs_in_the_records_clock(start_tunnel: StartTunnel) -> None:
    """`--records`: a record per answer (delivered, a 500 Python writes, 504, 503) taken at
    the channel's flush, moved from the hub's clock into the records' (4,000 s apart here):
    `tenant/target`, body size, route local, the time inside the relay."""
    hub_clock = FakeClock()
    records_clock = FakeClock(5_000_000_000_000)

    def advance(seconds: float) -> None:
        hub_clock.advance(seconds)
        records_clock.advance(seconds)

    tunnel = await start_tunnel(clock=hub_clock, request_ttl=0.2, response_timeout=0.2)
    channel = Channel("tunnel", 1.0, records_clock)
    tunnel.dialect.record_into(channel)
    async with raw_connector(tunnel) as ws:
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
        assert (await answer)[0] == 504
    batch = channel.take(1.0)
    assert batch is not None
    rows = sorted(batch.full, key=lambda r: r[0])
    assert [r[1:] for r in rows] == [
        (None, "acme/app", 2, "local", "delivered", None, 3_000_000, None),
        (None, "acme/app", 5, "local", "delivered", None, 3_000_000, None),
        (None, "acme/app", 0, "local", "expired", "no answer in time", 401_000_000, None),
        (None, "acme/app", 0, "local", "rejected", "no answer in time", 2_000_000, None),
    ]
    assert rows[-1][0] == records_clock.now
    assert channel.take(1.0) is None  # taken once


def _acknowledge_text(argument: dict[str, str]) -> str:
    """The JSON `Acknowledge` a raw connector sends for a `RequestTarget`'s arguments."""
    ack = {"originId": argument["acknowledgeOriginId"], "requestId": argument["requestId"]}
    return json.dumps({"target": "Acknowledge", "arguments": [ack]})


@pytest.mark.parametrize("mode", [1, 2])
async def test_acknowledged_requests_leave_nothing_behind(
    start_tunnel: StartTunnel, mode: int
) -> None:
    """Modes 1 and 2 with the packaged connector: sent with the mode, acknowledged by the
    connector (mode 1 when the request comes, mode 2 after its `Deliver`, also for a body in
    the store and an error status); nothing left behind."""
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
    await eventually(lambda: len(tunnel.dialect.hub.core) == 0)
    _settled(tunnel)
    assert tunnel.dialect.hub.bad_messages.value() == 0


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


@pytest.mark.parametrize("mode", [1, 2])
async def test_a_request_not_acknowledged_when_its_connector_leaves_is_sent_again(
    start_tunnel: StartTunnel, mode: int
) -> None:
    """At least once: the first connector takes the request (mode 2: and answers it) but
    leaves before acknowledging it; the hub sends it again, same id and body, to the other
    connector. Mode 1: the client gets the second connector's answer. Mode 2: the client
    had the first one's; the second execution's answer is dropped."""
    tunnel = await start_tunnel(ack_mode=mode)
    async with (
        raw_client(tunnel) as client,
        raw_connector(tunnel) as first,
        raw_connector(tunnel) as second,
    ):
        answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
        got = await _first_of(first, second)
        taker, other = (first, second) if got[0] is first else (second, first)
        argument = got[1]
        assert (argument["acknowledgeMode"], argument["bodyContent"]) == (mode, "aGk=")
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
        await eventually(lambda: len(tunnel.dialect.hub.core) == 0)
    assert tunnel.dialect.hub.redelivered.value() == 1
    assert tunnel.dialect.hub.bad_messages.value() == 0


async def test_a_request_sent_again_after_its_ttl_is_408_and_not_run(
    start_tunnel: StartTunnel,
) -> None:
    """The TTL holds for a request sent again: its connector left without acknowledging it,
    no other was there, and the next one came after the TTL (within the answer deadline):
    408, and it is not sent again."""
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
    assert tunnel.dialect.hub.expired.value() == 1
    assert tunnel.dialect.hub.redelivered.value() == 1
    _settled(tunnel)


async def test_malformed_and_unknown_deliveries_are_refused_while_a_request_waits(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws, raw_client(tunnel) as client:
        answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
        argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
        bad = [
            "{",
            '{"target": "Deliver", "arguments": [{"requestId": 1}]}',
            encode(TargetResponse("unknown", "o", 200), False).decode(),
            encode(AcknowledgeRequest("o", "unknown"), False).decode(),
        ]
        for text in bad:
            await ws.send_str(text)
            error = json.loads(await ws.receive_str(timeout=WAIT))
            assert error["target"] == "Error"
            assert error["arguments"][0]["message"]
        assert not answer.done()
        response = TargetResponse(
            argument["requestId"],
            argument["requestOriginId"],
            207,
            {"X-One": ["a", "b"]},
            body_size=2,
            body_content=b"ok",
        )
        await ws.send_str(encode(response, False).decode())
        status, headers, body = await answer
    assert (status, body) == (207, b"ok")
    assert [v for n, v in headers if n == "x-one"] == ["a", "b"]
    assert tunnel.dialect.hub.bad_messages.value() == len(bad)
    _settled(tunnel)


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (204, {}, b"hi"),  # no body may follow a 204
        (42, {}, b""),  # no such status in HTTP/1.1
        (101, {"Upgrade": ["websocket"]}, b""),  # would switch the client's connection over
        (103, {}, b""),  # an interim answer is not an answer
        (200, {"X-Split": ["a\r\nInjected: 1"]}, b""),  # a field that would split the head
    ],
)
async def test_a_deliver_http_cannot_carry_is_a_502_and_the_connector_keeps_serving(
    start_tunnel: StartTunnel, status: int, headers: dict[str, list[str]], body: bytes
) -> None:
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws:
        for want_status, (code, fields, content) in [
            (502, (status, headers, body)),
            (200, (200, {}, b"fine")),
        ]:
            async with raw_client(tunnel) as client:
                answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
                argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
                response = TargetResponse(
                    argument["requestId"],
                    argument["requestOriginId"],
                    code,
                    fields,
                    body_size=len(content),
                    body_content=content,
                )
                await ws.send_str(encode(response, False).decode())
                assert (await answer)[0] == want_status
                if want_status == 502:  # the connector hears why
                    error = json.loads(await ws.receive_str(timeout=WAIT))
                    assert "not one HTTP/1.1 carries" in error["arguments"][0]["message"]
            assert not ws.closed
    _settled(tunnel)


class WallClock:
    """A unix-time clock the test moves (tokens are judged against the wall clock)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000 * NS

    def __call__(self) -> int:
        return self.now


async def _authenticated(tunnel: Tunnel, token: str) -> list[Response]:
    auth = [("Authorization", f"Bearer {token}")]
    answers = []
    async with raw_client(tunnel) as client:
        for _ in range(3):  # the first checks the token (Python), the next find it verified
            answers.append(
                await client.request("GET", "/relay/secure/app/status/201", headers=auth)
            )
        answers.append(
            await client.request("POST", "/relay/secure/app/echo", pattern(100), headers=auth)
        )
    return answers


async def _refused(tunnel: Tunnel, token: str) -> Response:
    """One request with `token` on its own connection (a 401 closes it)."""
    async with raw_client(tunnel) as client:
        return await client.request(
            "GET", "/relay/secure/app/status/200", headers=[("Authorization", f"Bearer {token}")]
        )


async def test_a_tenants_tokens_are_checked_once_and_judged_alike(
    start_tunnel: StartTunnel,
) -> None:
    """A tenant requiring a token: the first request with a token verifies it (Python), the
    next ones find its verdict in the hub (the fast path); badly signed, another tenant's
    and expired tokens are refused 401 and nothing runs."""
    tunnel = await start_tunnel()
    tunnel.add_tenant("secure", require_authentication=True)
    clock = WallClock()
    tunnel.dialect.tokens.clock = clock
    tunnel.dialect.hub.wall = clock
    await tunnel.connect("secure")
    tokens = tunnel.dialect.tokens
    hub = tunnel.dialect.hub
    token = tokens.issue("secure", "client")
    taken = _fast(tunnel)
    answers = await _authenticated(tunnel, token)
    assert [status for status, _, _ in answers] == [201, 201, 201, 200]
    assert answers[3][2] == pattern(100)
    assert _fast(tunnel, "auth") == 1
    assert _fast(tunnel) == taken + 3
    assert hub.requests.value("secure", "app", "201") == 3

    forged = TokenAuthority(b"x" * 32, clock=clock).issue("secure")
    other = tokens.issue("acme", "client")
    assert await tokens.verify(other, "client") == "acme"
    calls = len(tunnel.target.calls)
    failures = hub.auth_failures.value("client")
    for bad, why in [(forged, b"token refused"), (other, b"another tenant")]:
        refused = await _refused(tunnel, bad)
        assert refused[0] == 401
        assert ("www-authenticate", "Bearer") in refused[1]
        assert why in refused[2]
    assert hub.auth_failures.value("client") == failures + 2
    assert len(tunnel.target.calls) == calls

    # still good up to exp + leeway, then refused and forgotten
    clock.now += (tokens.ttl + LEEWAY) * NS
    assert (await _refused(tunnel, token))[0] == 200
    clock.now += 1 * NS
    refused = await _refused(tunnel, token)
    assert refused[0] == 401
    assert b"token expired" in refused[2]
    assert hub.requests.value("secure", "-", "401") == 3
    assert len(tunnel.target.calls) == calls + 1
    _settled(tunnel)


async def test_the_tenant_cache_is_bounded(start_tunnel: StartTunnel) -> None:
    """A client naming ever new tenants costs at most `--tunnel-tenant-cache` lookups kept
    (misses included); a connected tenant stays, whatever the churn."""
    tunnel = await start_tunnel(tenant_cache_max=16)
    await tunnel.connect()
    async with raw_client(tunnel) as client:
        assert (await client.request("GET", "/relay/acme/app/status/200"))[0] == 200
    for n in range(64):
        assert (await get_once(tunnel, f"/relay/nobody{n}/app/x"))[0] == 404
        assert tunnel.dialect.hub.core.tenants_cached <= 16
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    assert await _gauge(tunnel, "tenants_cached") <= 16
