"""spec-auth on the SBD dialect: `PUT /authenticate`, Bearer tokens, and the operator's hook
(a real HTTP server started by each test, answering the ways real servers do)."""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rmb_relay.dialects.sbd import SbdDialect, SbdSettings, call_auth_hook
from rmb_relay.dialects.sbd.settings import AUTH_HOOK_MAX_RESPONSE
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import WAIT, StartRelay, free_port
from tests.helpers import http_exchange
from tests.sbd_client import SbdClient

Reply = Callable[[bytes], bytes | None]


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
    """A tiny HTTP hook: `reply(body)` makes the raw response (None: never answer). With
    `close_after` it closes after one answer; without, it keeps the socket open and answers
    further requests on it (keep-alive), and `hung_up` is set when the client closes it."""

    def __init__(self, reply: Reply, *, close_after: bool = True) -> None:
        self.reply = reply
        self.close_after = close_after
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.hung_up = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self.hung_up.set()
                return
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            self.requests.append((head, body))
            answer = self.reply(body)
            if answer is None:
                await asyncio.Event().wait()  # never answers (cancelled by stop())
            writer.write(answer)
            await writer.drain()
            if self.close_after:
                writer.close()
                return

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
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


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


def to_eof(status: str, body: bytes) -> bytes:
    """No Content-Length, not chunked: the body runs to the close."""
    return f"HTTP/1.1 {status}\r\n\r\n".encode() + body


TOO_BIG = b'{"authToken": "' + b"t" * AUTH_HOOK_MAX_RESPONSE + b'"}'


@pytest.mark.parametrize(
    ("reply", "close_after", "match"),
    [
        (lambda _: content_length("200 OK", b'{"authToken": ""}'), True, "non-empty string"),
        (lambda _: content_length("200 OK", b'{"authToken": 7}'), True, "non-empty string"),
        (lambda _: content_length("200 OK", b'["authToken"]'), True, "no authToken"),
        (lambda _: content_length("302 Found", b""), True, "answered 302"),
        (lambda _: content_length("200 OK", TOO_BIG), True, "too large"),
        (lambda _: chunked("200 OK", TOO_BIG), False, "too large"),
        (lambda _: to_eof("200 OK", TOO_BIG), True, "too large"),
        (lambda _: b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nshort", True, "unusable"),
        (lambda _: b"not http at all\r\n\r\n", True, "unusable"),
        (lambda _: b"", True, "unusable"),  # closed without a word
    ],
    ids=[
        "empty-token",
        "number-token",
        "not-an-object",
        "redirect",
        "over-cap-by-length",
        "over-cap-chunked",
        "over-cap-to-eof",
        "truncated",
        "not-http",
        "closed-at-once",
    ],
)
async def test_unusable_hook_answer_is_a_value_error(
    hooks: Callable[..., Awaitable[str]], reply: Reply, close_after: bool, match: str
) -> None:
    url = await hooks(reply, close_after=close_after)
    with pytest.raises(ValueError, match=match):
        await asyncio.wait_for(call_auth_hook(url, b"x", timeout=WAIT), WAIT * 2)


async def test_hook_refusal_is_a_permission_error(hooks: Callable[..., Awaitable[str]]) -> None:
    url = await hooks(grant)
    with pytest.raises(PermissionError):
        await call_auth_hook(url, b"wrong")


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/auth", "127.0.0.1:80/auth", "http:///auth"])
async def test_hook_url_must_be_http(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        await call_auth_hook(url, b"x")


async def test_unreachable_hook_is_an_os_error() -> None:
    with pytest.raises(OSError, match=r"127\.0\.0\.1") as info:
        await call_auth_hook(f"http://127.0.0.1:{free_port()}/auth", b"x", timeout=WAIT)
    assert info.value.errno == errno.ECONNREFUSED


async def test_silent_hook_times_out(hooks: Callable[..., Awaitable[str]]) -> None:
    url = await hooks(lambda _: None)
    with pytest.raises(TimeoutError):
        await call_auth_hook(url, b"x", timeout=0.2)


async def test_dialect_reuses_one_connection_and_closes_it_with_the_relay(
    start_relay: StartRelay,
) -> None:
    """One aiohttp session per dialect: calls share a keep-alive connection to the hook, and
    shutting the relay down closes it (no session is left for the garbage collector)."""
    hook = Hook(grant, close_after=False)
    url = await hook.start()
    try:
        registry = Registry()
        dialect = SbdDialect(SbdSettings(auth_hook=url), registry)
        server = await start_relay([dialect], registry=registry)
        host, port = server.addresses[0]
        for body in (b"let me in", b"wrong", b"let me in"):
            await authenticate(host, port, body)
        assert [body for _, body in hook.requests] == [b"let me in", b"wrong", b"let me in"]
        assert len(hook.writers) == 1  # one TCP connection for the three calls
        await asyncio.wait_for(server.shutdown(), WAIT)
        await asyncio.wait_for(hook.hung_up.wait(), WAIT)
    finally:
        await hook.stop()
