"""The HTTP tunnel end to end: httpx → relay → connector → aiohttp target, all on real sockets.
Statuses of decision 1, headers, methods, bodies around the inline limit, tokens and the
connector protocol's refusals."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from rmb_relay.dialects.tunnel.targets import WebTarget
from rmb_relay.dialects.tunnel.wire import (
    AcknowledgeRequest,
    ClientRequest,
    TargetResponse,
    WireError,
    decode,
    encode,
)
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.tunnel_fixtures import SECRET, KeepAliveThenClose, StartTunnel, pattern, raw_connector
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)


async def test_get_through_the_tunnel_reaches_the_target_with_path_and_query(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        reply = await client.get("/relay/acme/app/echo/a/b?x=1&y=2", headers={"X-Test": "yes"})
    assert reply.status_code == 200
    assert tunnel.target.calls == ["GET /echo/a/b?x=1&y=2"]
    assert reply.headers["x-got-x-test"] == "yes"
    assert reply.headers["x-method"] == "GET"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
async def test_methods_and_bodies_pass_byte_for_byte(
    start_tunnel: StartTunnel, method: str
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    body = pattern(1000)
    async with tunnel.client() as client:
        reply = await client.request(method, "/relay/ACME/App/echo", content=body)
    assert reply.status_code == 200
    assert reply.content == body
    assert reply.headers["x-method"] == method


@pytest.mark.parametrize("size", [0, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1, 10 << 20])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_bodies_both_ways_around_the_inline_limit(
    start_tunnel: StartTunnel, size: int, binary: bool
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect(binary=binary)
    body = pattern(size)
    async with tunnel.client() as client:
        reply = await client.post("/relay/acme/app/echo", content=body)
        assert reply.status_code == 200
        assert len(reply.content) == size
        assert reply.content == body
        down = await client.get(f"/relay/acme/app/bytes/{size}")
        assert down.content == pattern(size)
    assert tunnel.dialect.store.count() == 0  # every body file was removed after use


async def test_chunked_client_body_and_chunked_target_response(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    data = pattern(300_000)

    async def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(data), 7000):
            yield data[i : i + 7000]

    async with tunnel.client() as client:
        reply = await client.post("/relay/acme/app/sha", content=chunks())
        assert reply.json()["size"] == len(data)
        down = await client.get("/relay/acme/app/bytes/40000?chunked=1")
        assert down.content == pattern(40000)


async def test_repeated_header_names_survive_both_ways(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        reply = await client.get(
            "/relay/acme/app/status/201", headers=[("X-Multi", "one"), ("X-Multi", "two")]
        )
        echoed = await client.get(
            "/relay/acme/app/echo", headers=[("X-Multi", "one"), ("X-Multi", "two")]
        )
    assert reply.status_code == 201
    assert reply.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert echoed.headers.get_list("x-got-x-multi") == ["one", "two"]


async def test_unknown_tenant_and_target_are_404(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        assert (await client.get("/relay/nobody/app/echo")).status_code == 404
        assert (await client.get("/relay/acme/nothere/x")).status_code == 404
        assert (await client.get("/relay/acme")).status_code == 404
        assert (await client.get("/relay/acme/")).status_code == 404


async def test_target_errors_map_to_502_and_504(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    dead = WebTarget("http://127.0.0.1:1", 5.0)
    await tunnel.connect(
        targets={"app": WebTarget(tunnel.target.url, 5.0), "dead": dead}, target_timeout=0.5
    )
    async with tunnel.client() as client:
        assert (await client.get("/relay/acme/dead/x")).status_code == 502
        slow = await client.get("/relay/acme/app/slow")
        assert slow.status_code == 504
        tunnel.target.release.set()
        # the target's own statuses pass through untouched
        assert (await client.get("/relay/acme/app/status/418")).status_code == 418


async def test_kept_alive_target_connection_504_then_recovers(start_tunnel: StartTunnel) -> None:
    """The task-less path (a kept-alive target connection at hand) keeps the statuses: a
    target that does not answer in time is 504, and the next request gets a new connection."""
    tunnel = await start_tunnel()
    await tunnel.connect(targets={"app": WebTarget(tunnel.target.url, 5.0)}, target_timeout=0.5)
    async with tunnel.client() as client:
        assert (await client.get("/relay/acme/app/status/201")).status_code == 201  # warm
        assert (await client.get("/relay/acme/app/slow")).status_code == 504
        tunnel.target.release.set()
        assert (await client.post("/relay/acme/app/echo", content=b"hi")).content == b"hi"


async def test_target_closing_kept_alive_connections_is_retried(
    start_tunnel: StartTunnel,
) -> None:
    """A target that announces keep-alive and then closes the connection: the request sent on
    the closed connection is retried on a new one, not answered 502."""
    target = KeepAliveThenClose()
    server = await asyncio.start_server(target, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        tunnel = await start_tunnel()
        await tunnel.connect(targets={"app": WebTarget(f"http://127.0.0.1:{port}", 5.0)})
        async with tunnel.client() as client:
            for _ in range(3):
                reply = await client.get("/relay/acme/app/x")
                assert (reply.status_code, reply.content) == (200, b"ok")
        assert target.served == 3
    finally:
        server.close()
        await server.wait_closed()


async def test_queue_mode_answers_202_and_the_target_runs(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        reply = await client.post("/queue/acme/app/sha", content=b"fire and forget")
    assert reply.status_code == 202
    await eventually(lambda: tunnel.target.calls == ["POST /sha"])
    await eventually(lambda: len(tunnel.dialect.hub.core) == 0)


async def test_trace_mode_adds_relayserver_headers(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        reply = await client.get("/trace/acme/app/echo")
    assert "relayserver-requestid" in reply.headers
    assert reply.headers["x-got-relayserver-requestid"] == reply.headers["relayserver-requestid"]
    assert "relayserver-targetduration" in reply.headers


async def test_builtin_ping_and_echo_targets(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        ping = await client.get("/relay/acme/$ping/")
        echo = await client.post("/relay/acme/$echo/", content=pattern(50_000))
        not_ping = await client.post("/relay/acme/$ping/")
    assert (ping.status_code, ping.text) == (200, "PONG")
    assert echo.content == pattern(50_000)
    assert not_ping.status_code == 404


async def test_no_connector_and_required_connection_is_503(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(require_connection=True)
    async with tunnel.client() as client:
        reply = await client.get("/relay/acme/app/echo")
    assert reply.status_code == 503


async def test_connector_lost_mid_request_without_acks_is_504(start_tunnel: StartTunnel) -> None:
    """The target got the request: 504 says it may have run (RelayServer's 503 says it did not)."""
    tunnel = await start_tunnel()
    connector = await tunnel.connect()
    async with tunnel.client() as client:
        pending = asyncio.ensure_future(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        await tunnel.disconnect(connector)
        reply = await pending
    assert reply.status_code == 504
    tunnel.target.release.set()


async def test_client_auth_required_tenant(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    tunnel.add_tenant("closed", require_authentication=True)
    await tunnel.connect("closed")
    async with tunnel.client() as client:
        assert (await client.get("/relay/closed/app/echo")).status_code == 401
        bad = await client.get("/relay/closed/app/echo", headers={"Authorization": "Bearer x.y.z"})
        assert bad.status_code == 401
        # a token of another tenant is not enough
        other = tunnel.dialect.tokens.issue("acme", "client")
        wrong = await client.get(
            "/relay/closed/app/echo", headers={"Authorization": f"Bearer {other}"}
        )
        assert wrong.status_code == 401
        # nor is the tenant's connector token: client and connector tokens are distinct
        connector = tunnel.dialect.tokens.issue("closed")
        held = await client.get(
            "/relay/closed/app/echo", headers={"Authorization": f"Bearer {connector}"}
        )
        assert held.status_code == 401
        good = tunnel.dialect.tokens.issue("closed", "client")
        ok = await client.get("/relay/closed/app/echo", headers={"Authorization": f"Bearer {good}"})
        assert ok.status_code == 200


async def test_token_endpoint(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    form = {"grant_type": "client_credentials", "client_id": "acme", "client_secret": SECRET}
    async with tunnel.client() as client:
        good = await client.post("/tunnel/token", data={**form, "scope": "connector"})
        assert good.status_code == 200
        assert good.json()["token_type"] == "Bearer"
        assert await tunnel.dialect.tokens.verify(good.json()["access_token"]) == "acme"
        wrong = await client.post("/tunnel/token", data={**form, "client_secret": "nope"})
        assert (wrong.status_code, wrong.json()["error"]) == (401, "invalid_client")
        unknown = await client.post("/tunnel/token", data={**form, "client_id": "ghost"})
        assert unknown.status_code == 401
        grant = await client.post("/tunnel/token", data={**form, "grant_type": "password"})
        assert grant.json()["error"] == "unsupported_grant_type"
        as_json = await client.post("/tunnel/token", json=form)
        assert as_json.json()["error"] == "invalid_request"
        discovery = await client.get("/.well-known/relayserver-configuration")
        assert discovery.json()["connectorEndpoint"].endswith("/tunnel/connector")


async def test_connector_websocket_refuses_bad_tokens(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    url = tunnel.base + "/tunnel/connector"
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer garbage"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url, headers=headers)
            assert refused.value.status == 401
        # a token of a tenant removed since
        tunnel.add_tenant("gone")
        token = tunnel.dialect.tokens.issue("gone")
        tunnel.store.remove("gone")
        tunnel.dialect.forget_tenant("gone")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(url, headers={"Authorization": f"Bearer {token}"})
        assert refused.value.status == 401  # its verdict went with the tenant


async def test_malformed_connector_messages_get_an_error_and_the_connection_stays(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()  # a well-behaved connector keeps serving meanwhile
    async with raw_connector(tunnel) as ws:
        bad = [
            "not json",
            "[]",
            '{"target": "Nope", "arguments": [{}]}',
            '{"target": "Deliver", "arguments": [{"requestId": "x"}]}',
            '{"target": "Deliver", "arguments": [{"requestId": "x", "requestOriginId": "o",'
            ' "httpStatusCode": "200"}]}',
            encode(
                TargetResponse("00000000-0000-0000-0000-000000000000", "o", 200), False
            ).decode(),
            encode(AcknowledgeRequest("o", "00000000-0000-0000-0000-000000000001"), False).decode(),
        ]
        for text in bad:
            await ws.send_str(text)
            error = json.loads(await ws.receive_str(timeout=WAIT))
            assert error["target"] == "Error", text
            assert error["arguments"][0]["message"]
        await ws.send_bytes(b"\x81binary on a JSON connection")
        assert "frames" in json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]["message"]
        # oversize: the listener closes with 1009, nothing else breaks
        await ws.send_str("x" * (300 * 1024))
        closing = await ws.receive(timeout=WAIT)
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == 1009
    async with tunnel.client() as client:
        assert (await client.get("/relay/acme/$ping/")).status_code == 200


def test_wire_messages_round_trip_in_json_and_msgpack() -> None:
    request = ClientRequest(
        "id", "origin", "app", "acme", "POST", "a?b", {"x": ["1", "2"]}, body_content=b"\x00\xff"
    )
    for binary in (False, True):
        assert decode(encode(request, binary), binary, (ClientRequest,)) == request
    text = encode(request, False)
    assert b'"bodyContent":"AP8="' in text
    assert b'"httpHeaders":{"x":["1","2"]}' in text
    with pytest.raises(WireError, match="bodyContent is not valid base64"):
        decode(text.replace(b"AP8=", b"!!"), False, (ClientRequest,))


@pytest.mark.parametrize(
    "headers",
    [b'["x"]', b'{"x":"1"}', b'{"x":[1]}', b'{"x":["1",null]}'],
    ids=["list", "string-value", "number-item", "null-item"],
)
def test_wire_headers_must_map_names_to_lists_of_strings(headers: bytes) -> None:
    request = ClientRequest("id", "origin", "app", "acme", "GET", "", {"x": ["1"]})
    text = encode(request, False).replace(b'{"x":["1"]}', headers)
    with pytest.raises(WireError, match="httpHeaders must map header names to lists of strings"):
        decode(text, False, (ClientRequest,))


async def test_metrics_count_requests_by_tenant_target_status(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with tunnel.client() as client:
        await client.get("/relay/acme/app/status/200")
        await client.get("/relay/acme/app/status/500")
        metrics = (await client.get("/metrics")).text
    assert tunnel.dialect.hub.requests.value("acme", "app", "200") == 1
    assert tunnel.dialect.hub.requests.value("acme", "app", "500") == 1
    assert 'rmb_relay_tunnel_connectors{dialect="tunnel",tenant="acme"} 1.0' in metrics
