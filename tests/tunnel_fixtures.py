"""Fixtures of the tunnel tests: a real relay with the tunnel dialect on a free port, a real
aiohttp server as the target, real connectors, httpx as the client."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from rmb_relay._core import Outboxes
from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.cluster import Cluster
from rmb_relay.cluster.connect import connect_redis
from rmb_relay.dialects.tunnel.connector import Connector
from rmb_relay.dialects.tunnel.dialect import TunnelDialect
from rmb_relay.dialects.tunnel.settings import TunnelSettings
from rmb_relay.dialects.tunnel.targets import Target, WebTarget
from rmb_relay.dialects.tunnel.tenants import Tenant, TenantStore, hash_secret
from rmb_relay.dialects.tunnel.wire import TargetResponse, encode
from rmb_relay.mailbox import MemoryMailbox
from rmb_relay.server.listener import RelayServer
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import WAIT, StartRelay
from tests.helpers import serve_app

SECRET = "correct horse battery staple"
#: one hash shared by every test tenant: scrypt is slow on purpose
_HASH = hash_secret(SECRET)


@dataclass
class TargetApp:
    """An aiohttp server standing for the service behind the connector."""

    url: str = ""
    calls: list[str] = field(default_factory=list)
    #: /slow waits for this
    release: asyncio.Event = field(default_factory=asyncio.Event)
    #: set when /slow was entered
    entered: asyncio.Event = field(default_factory=asyncio.Event)


STATE = web.AppKey("state", TargetApp)


async def _echo(request: web.Request) -> web.StreamResponse:
    """Answers the body it got (streamed through) with the request's headers as X-Got-*."""
    app: TargetApp = request.app[STATE]
    app.calls.append(f"{request.method} {request.path_qs}")
    response = web.StreamResponse(status=200)
    for name, value in request.headers.items():
        response.headers.add(f"X-Got-{name}", value)
    response.headers["X-Method"] = request.method
    response.headers["Content-Type"] = request.headers.get("Content-Type", "application/x-test")
    if request.content_length is not None:
        response.content_length = request.content_length
    await response.prepare(request)
    async for chunk in request.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


async def _sha(request: web.Request) -> web.Response:
    app: TargetApp = request.app[STATE]
    app.calls.append(f"{request.method} {request.path_qs}")
    digest = hashlib.sha256()
    size = 0
    async for chunk in request.content.iter_any():
        digest.update(chunk)
        size += len(chunk)
    return web.json_response({"sha256": digest.hexdigest(), "size": size})


async def _bytes(request: web.Request) -> web.StreamResponse:
    """GET /bytes/{n}: n pseudo-random bytes (pattern of `pattern(n)`), streamed."""
    app: TargetApp = request.app[STATE]
    app.calls.append(f"{request.method} {request.path_qs}")
    size = int(request.match_info["n"])
    response = web.StreamResponse()
    if "chunked" not in request.query:
        response.content_length = size
    await response.prepare(request)
    block = pattern(min(size, 1 << 20))
    sent = 0
    while sent < size:
        piece = block[: size - sent]
        await response.write(piece)
        sent += len(piece)
    await response.write_eof()
    return response


async def _status(request: web.Request) -> web.Response:
    app: TargetApp = request.app[STATE]
    app.calls.append(f"{request.method} {request.path_qs}")
    response = web.Response(status=int(request.match_info["code"]), text="status")
    response.headers.add("Set-Cookie", "a=1")
    response.headers.add("Set-Cookie", "b=2")
    return response


async def _slow(request: web.Request) -> web.Response:
    app: TargetApp = request.app[STATE]
    app.calls.append(f"{request.method} {request.path_qs}")
    app.entered.set()
    await app.release.wait()
    return web.Response(text="slow done")


def pattern(size: int) -> bytes:
    seed = hashlib.sha256(b"tunnel").digest()
    return (seed * (size // len(seed) + 1))[:size]


async def start_target(stack: AsyncExitStack) -> TargetApp:
    state = TargetApp()
    app = web.Application(client_max_size=1 << 40)
    app[STATE] = state
    app.router.add_route("*", "/echo{tail:.*}", _echo)
    app.router.add_route("*", "/sha", _sha)
    app.router.add_get("/bytes/{n}", _bytes)
    app.router.add_route("*", "/status/{code}", _status)
    app.router.add_get("/slow", _slow)
    state.url = f"http://127.0.0.1:{await serve_app(stack, app)}"
    return state


@dataclass
class Tunnel:
    relay: RelayServer
    dialect: TunnelDialect
    store: TenantStore
    target: TargetApp
    stack: AsyncExitStack
    registry: Registry
    #: the relay's membership of the cluster (with `redis_url`)
    cluster: Cluster | None = None
    connectors: list[tuple[Connector, asyncio.Task[None]]] = field(default_factory=list)

    @property
    def base(self) -> str:
        host, port = self.relay.addresses[0]
        return f"http://{host}:{port}"

    def add_tenant(self, name: str, **fields: Any) -> Tenant:
        fields.setdefault("secret_hash", _HASH)
        return self.store.add(Tenant(name, **fields))

    async def connect(
        self,
        tenant: str = "acme",
        *,
        targets: dict[str, Target] | None = None,
        binary: bool = False,
        wait: bool = True,
        **options: Any,
    ) -> Connector:
        if targets is None:
            targets = {"app": WebTarget(self.target.url, 10.0)}
        connector = Connector(self.base, tenant, SECRET, targets, binary=binary, **options)
        task = asyncio.get_running_loop().create_task(connector.run())
        self.connectors.append((connector, task))
        if wait:
            await asyncio.wait_for(connector.connected.wait(), WAIT)
        return connector

    async def disconnect(self, connector: Connector) -> None:
        for item in self.connectors:
            if item[0] is connector:
                await connector.stop()
                await asyncio.wait_for(item[1], WAIT)
                self.connectors.remove(item)
                return

    def client(self, **options: Any) -> httpx.AsyncClient:
        options.setdefault("timeout", WAIT)
        return httpx.AsyncClient(base_url=self.base, **options)

    async def close(self) -> None:
        for connector, task in self.connectors:
            await connector.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.cluster is not None:  # the dialect leaves first, then the cluster
            await self.dialect.close()
            await self.cluster.close()


StartTunnel = Callable[..., Awaitable[Tunnel]]


@pytest.fixture
async def start_tunnel(start_relay: StartRelay, tmp_path: Path) -> AsyncIterator[StartTunnel]:
    """Start a relay with the tunnel (settings as keyword arguments) and the tenant `acme`."""
    tunnels: list[Tunnel] = []
    async with AsyncExitStack() as stack:

        async def start(
            *,
            db: Path | None = None,
            tenant: bool = True,
            target: TargetApp | None = None,
            clock: Clock = monotonic_clock,
            redis_url: str | None = None,
            cluster_ttl: float = 15.0,
            cluster_mode: bool = False,
            listener: dict[str, Any] | None = None,
            redis_timeout: float = 5.0,
            **settings: Any,
        ) -> Tunnel:
            """With `redis_url`, the relay joins the cluster there, as `rmb-relay --redis`
            (`cluster_mode`: a Redis Cluster node, `--redis-cluster`). The dialect writes into
            outboxes as `rmb-relay` gives it the switch's. `listener`: ListenerConfig fields."""
            settings.setdefault("body_store", str(tmp_path / "bodies"))
            settings.setdefault("tenant_labels", True)  # the tests read series by tenant
            store = TenantStore(db or tmp_path / "relay.sqlite3")
            registry = Registry()
            cluster = None
            if redis_url is not None:
                # as rmb-relay does
                redis = await connect_redis(redis_url, cluster=cluster_mode, timeout=redis_timeout)
                stack.push_async_callback(redis.aclose)
                switch = Switch(MemoryMailbox())
                cluster = Cluster(redis, switch, ttl=cluster_ttl, registry=registry)
                await cluster.start()
                switch.cluster = cluster
            dialect = TunnelDialect(
                TunnelSettings(**settings),
                store,
                registry,
                switch.outboxes if cluster is not None else Outboxes(),
                clock=clock,
                cluster=cluster,
            )
            relay = await start_relay([dialect], registry, **(listener or {}))
            app = target or await start_target(stack)
            tunnel = Tunnel(relay, dialect, store, app, stack, registry, cluster)
            if tenant and store.get("acme") is None:
                tunnel.add_tenant("acme")
            tunnels.append(tunnel)
            return tunnel

        yield start
        for tunnel in tunnels:
            await tunnel.close()


class KeepAliveThenClose:
    """A raw HTTP target that answers each request `200 ok` with keep-alive announced, then drops
    the connection: the tunnel's HTTP client must retry the next request on a new one. `served`
    counts the requests answered. Use as an `asyncio.start_server` handler."""

    def __init__(self) -> None:
        self.served = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.served += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()


@asynccontextmanager
async def raw_connector(
    tunnel: Tunnel, tenant: str = "acme"
) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    """A connector the test speaks for itself (JSON): logged in with a token the relay issued,
    its `Configure` already read."""
    async with raw_connector_at(tunnel.base, tunnel.dialect.tokens.issue(tenant)) as ws:
        yield ws


@asynccontextmanager
async def raw_connector_at(base: str, token: str) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    """`raw_connector` for the relay at `base` (a process: the token from its /tunnel/token)."""
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(
            base + "/tunnel/connector", headers={"Authorization": f"Bearer {token}"}
        ) as ws,
    ):
        assert json.loads(await ws.receive_str(timeout=WAIT))["target"] == "Configure"
        yield ws


#: the headers of a connector's answer trying to switch protocols
UPGRADE = {"Upgrade": ["websocket"], "Connection": ["upgrade"]}


async def answer_next(
    ws: aiohttp.ClientWebSocketResponse, status: int, headers: dict[str, list[str]]
) -> None:
    """On a raw connector: read the next `RequestTarget` and answer it with `status` and
    `headers`, no body (what a connector must not send, for instance)."""
    argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
    response = TargetResponse(argument["requestId"], argument["requestOriginId"], status, headers)
    await ws.send_str(encode(response, False).decode())


Response = tuple[int, list[tuple[str, str]], bytes]


class RawClient:
    """One keep-alive HTTP/1.1 connection; each request is written in one piece."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        *,
        chunked: bool = False,
    ) -> Response:
        """`chunked`: the body as one chunk (the hub's fast path leaves such requests to
        Python: their length is not known from the head)."""
        lines = [f"{method} {path} HTTP/1.1", "Host: test"]
        lines += [f"{name}: {value}" for name, value in headers or []]
        if chunked:
            lines.append("Transfer-Encoding: chunked")
            body = (f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
        elif body or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body)}")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")[:-2]
        status = int(status_line.split()[1])
        parsed = [
            (name.lower(), value.strip())
            for name, _, value in (line.partition(":") for line in header_lines)
        ]
        length = next((int(v) for n, v in parsed if n == "content-length"), 0)
        content = b""
        if method != "HEAD" and length:
            content = await asyncio.wait_for(self.reader.readexactly(length), WAIT)
        # the target's clock, not the path, decides these
        return status, [(n, v) for n, v in parsed if n not in ("date", "server")], content


@asynccontextmanager
async def raw_client(tunnel: Tunnel) -> AsyncIterator[RawClient]:
    host, port = tunnel.relay.addresses[0]
    reader, writer = await asyncio.open_connection(host, port)
    try:
        yield RawClient(reader, writer)
    finally:
        writer.close()


def deliver_text(argument: dict[str, str], status: int, body: bytes) -> str:
    """The JSON `Deliver` a raw connector sends for a `RequestTarget`'s arguments."""
    response = TargetResponse(
        argument["requestId"],
        argument["requestOriginId"],
        status,
        {"X-By": ["raw"]},
        body_size=len(body),
        body_content=body,
    )
    return encode(response, False).decode()


async def get_once(tunnel: Tunnel, path: str) -> Response:
    """One GET on a connection of its own."""
    async with raw_client(tunnel) as client:
        return await client.request("GET", path)
