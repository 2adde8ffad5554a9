"""The connector's lean HTTP client (dialects/tunnel/httpclient.py) against real servers, sent
request bytes as the connector's core builds them:
aiohttp for ordinary responses, raw asyncio servers for framings aiohttp never sends
(close-delimited bodies, chunk extensions and trailers, a kept-alive connection the server
dropped, garbage)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
from aiohttp import web

from rmb_relay.dialects.tunnel.httpclient import HttpClientPool, TargetError
from tests.helpers import serve_app
from tests.tunnel_fixtures import KeepAliveThenClose, pattern

pytestmark = pytest.mark.timeout(30)


async def aiohttp_target(stack: AsyncExitStack) -> int:
    async def head_or_get(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 100)

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]))

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)  # chunked
        for _ in range(8):
            await response.write(pattern(1 << 20))
        await response.write_eof()
        return response

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def duplex(request: web.Request) -> web.StreamResponse:
        """Answers while it reads: deadlocks a client that sends the whole body first."""
        response = web.StreamResponse()
        await response.prepare(request)
        async for chunk in request.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/duplex", duplex)
    app.router.add_get("/plain", head_or_get)
    app.router.add_get("/status/{code}", empty)
    app.router.add_get("/big", big)
    app.router.add_post("/echo", echo)
    return await serve_app(stack, app)


def request(method: str, path: str, length: int = 0) -> bytes:
    """A request head (and the Content-Length of a body streamed after it)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
    if length:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_target(stack: AsyncExitStack, handler: Handler) -> int:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    stack.push_async_callback(server.wait_closed)
    stack.callback(server.close)
    return int(server.sockets[0].getsockname()[1])


async def test_heads_without_bodies_and_keep_alive_reuse() -> None:
    async with AsyncExitStack() as stack:
        port = await aiohttp_target(stack)
        pool = HttpClientPool("127.0.0.1", port, f"127.0.0.1:{port}")
        head = await pool.request(request("HEAD", "/plain"), True)
        assert head.status == 200
        assert await head.read() == b""
        for code in (204, 304):
            reply = await pool.request(request("GET", f"/status/{code}"), False)
            assert (reply.status, await reply.read()) == (code, b"")
        reply = await pool.request(request("GET", "/plain"), False)
        assert await reply.read() == b"x" * 100
        assert len(pool._idle) == 1  # one connection served all four
        pool.close()


async def test_large_chunked_response_and_streamed_request_body() -> None:
    async with AsyncExitStack() as stack:
        port = await aiohttp_target(stack)
        pool = HttpClientPool("127.0.0.1", port, f"127.0.0.1:{port}")
        reply = await pool.request(request("GET", "/big"), False)
        assert reply.content_length is None
        total = 0
        async for chunk in reply.iter():
            total += len(chunk)
        assert total == 8 << 20

        async def body() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield pattern(300_000)

        echoed = await pool.request(request("POST", "/echo", 1_200_000), False, body())
        assert await echoed.read() == pattern(300_000) * 4

        async def big_body() -> AsyncIterator[bytes]:
            for _ in range(32):
                yield pattern(1 << 20)

        duplex = await pool.request(request("POST", "/duplex", 32 << 20), False, big_body())
        received = 0
        async for chunk in duplex.iter():
            received += len(chunk)
        assert received == 32 << 20
        pool.close()


async def test_close_delimited_body_and_chunk_extensions_and_trailers() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        writer.close()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nX-A: 2\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        )
        await writer.drain()
        await reader.read()
        writer.close()

    async with AsyncExitStack() as stack:
        port = await raw_target(stack, close_delimited)
        pool = HttpClientPool("127.0.0.1", port, "x")
        reply = await pool.request(request("GET", "/"), False)
        assert await reply.read() == b"until the end"
        assert not pool._idle  # not reusable
        port = await raw_target(stack, chunked)
        pool = HttpClientPool("127.0.0.1", port, "x")
        reply = await pool.request(request("GET", "/"), False)
        assert [v for k, v in reply.headers if k == "x-a"] == ["1", "2"]
        assert await reply.read() == b"hello world"
        pool.close()


async def test_small_bodies_come_whole_with_the_head_larger_ones_stream() -> None:
    async with AsyncExitStack() as stack:
        port = await aiohttp_target(stack)
        pool = HttpClientPool("127.0.0.1", port, f"127.0.0.1:{port}")
        small = await pool.request(request("GET", "/plain"), False, whole_limit=100)
        assert (small.body, small.content_length) == (b"x" * 100, 100)
        assert await small.read() == b"x" * 100
        again = await pool.request(request("GET", "/plain"), False, whole_limit=100)
        assert [chunk async for chunk in again.iter()] == [b"x" * 100]
        assert len(pool._idle) == 1  # whole bodies leave the connection reusable
        over = await pool.request(request("GET", "/plain"), False, whole_limit=99)
        assert (over.body, over.content_length) == (None, 100)
        assert await over.read() == b"x" * 100
        chunked = await pool.request(request("GET", "/big"), False, whole_limit=1 << 30)
        assert chunked.body is None  # no length: never read whole
        total = 0
        async for chunk in chunked.iter():
            total += len(chunk)
        assert total == 8 << 20
        empty = await pool.request(request("GET", "/status/204"), False, whole_limit=100)
        assert (empty.status, await empty.read()) == (204, b"")
        pool.close()


async def test_a_whole_body_cut_short_is_a_target_error() -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
        await writer.drain()
        writer.close()

    async with AsyncExitStack() as stack:
        port = await raw_target(stack, short)
        pool = HttpClientPool("127.0.0.1", port, "x")
        with pytest.raises(TargetError):
            await pool.request(request("GET", "/"), False, whole_limit=100)
        pool.close()


async def test_stale_kept_alive_connection_is_replaced_once() -> None:
    target = KeepAliveThenClose()
    async with AsyncExitStack() as stack:
        port = await raw_target(stack, target)
        pool = HttpClientPool("127.0.0.1", port, "x")
        for _ in range(3):
            reply = await pool.request(request("GET", "/"), False)
            assert await reply.read() == b"ok"
        assert target.served == 3
        pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"NOT HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
    ],
)
async def test_broken_responses_are_target_errors(answer: bytes) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with AsyncExitStack() as stack:
        port = await raw_target(stack, broken)
        pool = HttpClientPool("127.0.0.1", port, "x")

        async def fetch() -> bytes:
            reply = await pool.request(request("GET", "/"), False)
            return await reply.read()

        with pytest.raises(TargetError):
            await fetch()
        pool.close()
