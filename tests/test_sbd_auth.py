"""spec-auth on the SBD dialect: `PUT /authenticate`, Bearer tokens, and the operator's hook
(a real HTTP server started by each test, answering the ways real servers do)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rmb_relay.protocols.sbd import SbdDialect, SbdSettings, call_auth_hook
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import WAIT, StartRelay, free_port
from tests.helpers import http_exchange
from tests.sbd_client import SbdClient

Reply = Callable[[bytes], bytes]


def content_length(status: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def chunked(status: str, body: bytes) -> bytes:
    half = len(body) // 2
    parts = [body[:half], body[half:]]
    encoded = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p)
    return (
        f"HTTP/1.1 {status}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + encoded + b"0\r\n\r\n"
    )


class Hook:
    """A tiny HTTP hook: `reply(body)` makes the raw response; it may keep the socket open."""

    def __init__(self, reply: Reply, *, close_after: bool = True) -> None:
        self.reply = reply
        self.close_after = close_after
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        writer.write(self.reply(body))
        await writer.drain()
        if self.close_after:
            writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/authenticate"

    async def stop(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def hooks() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    started: list[Hook] = []

    async def start(reply: Reply, **kwargs: bool) -> str:
        hook = Hook(reply, **kwargs)
        started.append(hook)
        return await hook.start()

    yield start
    for hook in started:
        await hook.stop()


def grant(body: bytes) -> bytes:
    if body == b"let me in":
        return content_length("200 OK", b'{"authToken":"granted"}')
    return content_length("401 Unauthorized", b"")


async def authenticate(host: str, port: int, body: bytes, headers: str = "") -> tuple[int, bytes]:
    request = (
        b"PUT /authenticate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + headers.encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    reply = await http_exchange(host, port, request)
    return int(reply.split(b" ", 2)[1]), reply.partition(b"\r\n\r\n")[2]


async def relay_with_hook(start_relay: StartRelay, url: str | None) -> tuple[str, int]:
    registry = Registry()
    dialect = SbdDialect(SbdSettings(auth_hook=url), registry)
    server = await start_relay([dialect], registry=registry)
    host, port = server.addresses[0]
    return host, port


async def test_hook_gets_the_body_as_octet_stream_put(
    hooks: Callable[..., Awaitable[str]],
) -> None:
    hook = Hook(grant)
    url = await hook.start()
    try:
        assert await call_auth_hook(url, b"let me in") == "granted"
        head, body = hook.requests[0]
        assert head.startswith(b"PUT /authenticate HTTP/1.1\r\n")
        assert b"content-type: application/octet-stream" in head.lower()
        assert body == b"let me in"
    finally:
        await hook.stop()


@pytest.mark.parametrize("keep_open", [False, True])
@pytest.mark.parametrize("framing", [content_length, chunked])
async def test_hook_answer_is_read_by_its_framing(
    hooks: Callable[..., Awaitable[str]], framing: Callable[[str, bytes], bytes], keep_open: bool
) -> None:
    """A hook that ignores `Connection: close` must not make the relay wait for EOF."""
    url = await hooks(
        lambda _: framing("200 OK", b'{"authToken": "t0k"}'), close_after=not keep_open
    )
    assert await asyncio.wait_for(call_auth_hook(url, b"x", timeout=WAIT), WAIT / 2) == "t0k"


async def test_hook_refusal_is_401_and_mandatory_token(
    start_relay: StartRelay, hooks: Callable[..., Awaitable[str]]
) -> None:
    host, port = await relay_with_hook(start_relay, await hooks(grant))
    assert await authenticate(host, port, b"wrong") == (401, b"Unauthorized")
    status, body = await authenticate(host, port, b"let me in")
    assert (status, json.loads(body)) == (200, {"authToken": "granted"})
    with pytest.raises(ConnectionError, match="401"):
        await SbdClient.connect(host, port)  # a hook makes the token mandatory
    with pytest.raises(ConnectionError, match="401"):
        await SbdClient.connect(host, port, headers=[("Authorization", "granted")])  # no Bearer
    client = await SbdClient.connect(host, port, headers=[("Authorization", "Bearer granted")])
    client.forward(client.pubkey, b"in")
    assert await client.receive_forward() == (client.pubkey, b"in")
    client.close()


@pytest.mark.parametrize(
    "reply",
    [
        lambda _: content_length("200 OK", b"not json"),
        lambda _: content_length("200 OK", b'{"token": "wrong field"}'),
        lambda _: content_length("500 Internal Server Error", b"oops"),
        lambda _: b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nshort",
    ],
    ids=["not-json", "no-authToken", "hook-error", "truncated"],
)
async def test_unusable_hook_answer_is_502(
    start_relay: StartRelay, hooks: Callable[..., Awaitable[str]], reply: Reply
) -> None:
    host, port = await relay_with_hook(start_relay, await hooks(reply))
    status, body = await authenticate(host, port, b"x")
    assert status == 502
    assert body.startswith(b"BAD_GATEWAY")


async def test_unreachable_hook_is_502(start_relay: StartRelay) -> None:
    host, port = await relay_with_hook(start_relay, f"http://127.0.0.1:{free_port()}/auth")
    status, _ = await authenticate(host, port, b"x")
    assert status == 502


async def test_authenticate_needs_no_content_type_and_refuses_over_1024_bytes(
    start_relay: StartRelay,
) -> None:
    host, port = await relay_with_hook(start_relay, None)
    status, body = await authenticate(host, port, bytes(1024))
    assert status == 200
    assert json.loads(body)["authToken"]
    status, _ = await authenticate(
        host, port, bytes(1025), headers="Content-Type: application/octet-stream\r\n"
    )
    assert status == 413
