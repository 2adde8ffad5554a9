"""`POST /api/v1/proxy` against a real HTTP server standing in for a client's service: the
request arrives, redirects come back unfollowed, targets outside the client's address are
refused, a silent client times out, malformed requests say what is missing."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.conftest import free_port
from tests.helpers import http_exchange
from tests.sg_fixtures import MakeGateway, make_gateway
from tests.test_singyeong_queues import http

__all__ = ["make_gateway"]


@pytest.fixture
async def service() -> AsyncIterator[int]:
    never = asyncio.Event()

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "method": request.method,
                "path": request.path,
                "body": await request.text(),
                "x": request.headers.get("X-Test"),
            },
            headers={"X-Upstream": "yes"},
        )

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://198.51.100.7/elsewhere")

    async def slow(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/echo", echo)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    never.set()
    await runner.cleanup()


LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


async def test_proxy_reaches_the_client_service(make_gateway: MakeGateway, service: int) -> None:
    gateway = await make_gateway(proxy_timeout=0.5, proxy_allow=LOOPBACK)
    await gateway.client("svc", "api", ip=f"http://127.0.0.1:{service}")
    target = {"application": "api"}
    status, answer = await http(
        gateway,
        "POST",
        "/api/v1/proxy",
        {
            "method": "POST",
            "route": "/echo",
            "query": target,
            "body": {"a": 1},
            "headers": {"X-Test": "t"},
        },
    )
    assert status == 200
    assert answer == {"method": "POST", "path": "/echo", "body": '{"a": 1}', "x": "t"}
    body = json.dumps({"method": "GET", "route": "redirect", "query": target}).encode()
    host, port = gateway.address
    head = b"POST /api/v1/proxy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    raw = await http_exchange(host, port, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert raw.startswith(b"HTTP/1.1 302")  # handed back, not followed to another host
    assert b"location: http://198.51.100.7/elsewhere" in raw
    status, answer = await http(
        gateway, "POST", "/api/v1/proxy", {"method": "GET", "route": "slow", "query": target}
    )
    assert (status, answer) == (504, {"errors": ["the client did not answer in time"]})


async def test_proxy_refuses_targets_outside_the_client(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(proxy_allow=LOOPBACK)
    await gateway.client("evil", "api", ip="http://10.9.8.7:80")
    status, answer = await http(
        gateway,
        "POST",
        "/api/v1/proxy",
        {"method": "GET", "route": "/", "query": {"application": "api"}},
    )
    assert status == 403
    assert answer["errors"][0].startswith(
        "10.9.8.7 is not the address the gateway saw for the client (127.0.0.1)"
    )


@pytest.mark.parametrize("declared", ["http://[::1", "http://127.0.0.1:99999", "ftp://127.0.0.1"])
async def test_proxy_refuses_a_malformed_declared_address(
    make_gateway: MakeGateway, declared: str
) -> None:
    gateway = await make_gateway(proxy_allow=LOOPBACK)
    await gateway.client("odd", "api", ip=declared)
    request = {"method": "GET", "route": "/", "query": {"application": "api"}}
    status, answer = await http(gateway, "POST", "/api/v1/proxy", request)
    assert status == 403
    assert answer["errors"][0].startswith(("not a valid address", "not an http(s) URL"))


async def test_proxy_refuses_this_hosts_addresses_by_default(
    make_gateway: MakeGateway, service: int
) -> None:
    """Without --sg-proxy-allow a client seen at a loopback address (this host: a front proxy
    on it makes every client look so) is not proxied to."""
    gateway = await make_gateway()
    await gateway.client("svc", "api", ip=f"http://127.0.0.1:{service}")
    request = {"method": "GET", "route": "/echo", "query": {"application": "api"}}
    status, answer = await http(gateway, "POST", "/api/v1/proxy", request)
    assert status == 403
    assert answer["errors"][0].startswith("127.0.0.1 is this host or its link")
    assert "--trusted-ip-header" in answer["errors"][0]


async def test_proxy_allow_list_bounds_the_client_addresses(
    make_gateway: MakeGateway, service: int
) -> None:
    """The allow-list names the networks the proxy may reach at all: a client's own address
    outside it is refused; and even inside it a client cannot name another address."""
    request = {"method": "GET", "route": "/echo", "query": {"application": "api"}}
    elsewhere = await make_gateway(proxy_allow=(ipaddress.ip_network("10.0.0.0/8"),))
    await elsewhere.client("svc", "api", ip=f"http://127.0.0.1:{service}")
    status, answer = await http(elsewhere, "POST", "/api/v1/proxy", request)
    assert (status, answer) == (403, {"errors": ["127.0.0.1 is not in --sg-proxy-allow"]})
    gateway = await make_gateway(proxy_allow=(ipaddress.ip_network("127.0.0.0/8"),))
    await gateway.client("svc", "api", ip=f"http://127.0.0.1:{service}")
    status, _ = await http(gateway, "POST", "/api/v1/proxy", request)
    assert status == 200
    await gateway.client("other", "api2", ip=f"http://127.0.0.2:{service}")
    request["query"] = {"application": "api2"}
    status, _ = await http(gateway, "POST", "/api/v1/proxy", request)
    assert status == 403


@pytest.mark.parametrize(
    ("body", "status", "answer"),
    [
        ({"route": "/", "query": {}}, 400, {"method": ["no method provided"]}),
        ({"method": "GET", "query": {}}, 400, {"route": ["no route provided"]}),
        ({"method": "GET", "route": "/"}, 400, {"query": ["no query provided"]}),
        (
            {"method": "TRACE", "route": "/", "query": {}},
            400,
            {"errors": ["method must be one of DELETE, GET, HEAD, PATCH, POST, PUT"]},
        ),
        (
            {"method": "GET", "route": "/", "query": {}, "body": ""},
            400,
            {"errors": ["GET requests must not have a body"]},
        ),
        (
            {"method": "POST", "route": "/", "query": {}},
            400,
            {"errors": ['POST requests need a body (send "" for none)']},
        ),
        (
            {"method": "GET", "route": "/", "query": {"application": "nobody"}},
            400,
            {"errors": ["no matches"]},
        ),
    ],
)
async def test_proxy_says_what_is_wrong(
    make_gateway: MakeGateway, body: dict[str, object], status: int, answer: object
) -> None:
    gateway = await make_gateway()
    assert await http(gateway, "POST", "/api/v1/proxy", body) == (status, answer)
    assert json.dumps(answer)
