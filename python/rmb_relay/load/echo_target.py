"""A lean HTTP/1.1 echo server for `rmb-load tunnel --start-target` and `bench/tunnel.py`: one
asyncio Protocol on uvloop that answers every request with its own body (`200`,
`application/octet-stream`, `Content-Length`).

Why: the tunnel benchmark measures the tunnel, and aiohttp's server spends more CPU per small
request (and its generator more wall time) than the relay and the connector together, so with
aiohttp as the target the figures on a 2-core host say mostly how fast aiohttp is. This server
costs a few microseconds per request and still speaks real HTTP/1.1 over TCP:

- keep-alive (HTTP/1.1 by default, `Connection: close` honoured, HTTP/1.0 closes unless it asks
  for keep-alive) and pipelining (requests are answered in order, one at a time);
- request bodies framed by `Content-Length` or `Transfer-Encoding: chunked` (a chunked request
  is buffered and answered with its length; trailers are skipped);
- a small request whose body came with its head is answered with one write; a larger
  `Content-Length` body is echoed as it arrives (the head goes out at once, each piece
  follows), so a 1 MiB body costs no buffering, and reading pauses while the socket is over
  its write high-water mark: a client that does not read slows the echo down;
- malformed requests (no Content-Length number, a head over 64 KiB, an unknown transfer
  coding) get `400` and the connection closes.

    python -m rmb_relay.load.echo_target --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import uvloop

#: a request head larger than this is refused (no legitimate benchmark request comes close)
MAX_HEAD = 64 * 1024
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "
_CLOSE = b"\r\nConnection: close"
_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class BadRequest(ValueError):
    """The client broke HTTP/1.1: answered 400, connection closed."""


class EchoProtocol(asyncio.Protocol):
    """One connection. States: reading a head; echoing `remaining` bytes of a Content-Length
    body; collecting a chunked body."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        #: bytes of the current Content-Length body still to echo (-1: between requests)
        self.remaining = -1
        #: the current request asked for the connection to close after its answer
        self.close_after = False
        #: a chunked body being collected (None when the body is not chunked)
        self.chunked: bytearray | None = None
        self.chunk_left = -1
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        if self.remaining > 0 and not self.buffer:
            # the common case of a large body: echo the piece without copying it
            take = min(len(data), self.remaining)
            transport.write(data[:take] if take < len(data) else data)
            self.remaining -= take
            if self.remaining:
                return
            self._request_done()
            data = data[take:]
            if not data:
                return
        self.buffer += data
        try:
            self._process()
        except BadRequest:
            transport.write(_BAD)
            transport.close()
            self.buffer.clear()

    def _process(self) -> None:
        transport = self.transport
        assert transport is not None
        buffer = self.buffer
        while buffer and not transport.is_closing():
            if self.remaining > 0:
                take = min(len(buffer), self.remaining)
                transport.write(bytes(buffer[:take]))
                del buffer[:take]
                self.remaining -= take
                if not self.remaining:
                    self._request_done()
            elif self.chunked is not None:
                if not self._chunk_step():
                    return
            else:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > MAX_HEAD:
                        raise BadRequest("head too large")
                    return
                head = bytes(buffer[:end])
                del buffer[: end + 4]
                self._start(head)

    def _start(self, head: bytes) -> None:
        """A request head: answer it (a Content-Length body follows the answer's head)."""
        lines = head.split(b"\r\n")
        request_line = lines[0].split(b" ")
        if len(request_line) != 3 or not request_line[2].startswith(b"HTTP/1."):
            raise BadRequest("not an HTTP/1.x request line")
        http10 = request_line[2] == b"HTTP/1.0"
        length = 0
        chunked = False
        connection = b""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise BadRequest("header line without a colon")
            name = name.strip().lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit():
                    raise BadRequest("Content-Length is not a number")
                length = int(value)
            elif name == b"transfer-encoding":
                if value.strip().lower() != b"chunked":
                    raise BadRequest("only the chunked transfer coding is understood")
                chunked = True
            elif name == b"connection":
                connection = value.strip().lower()
        if http10:
            self.close_after = connection != b"keep-alive"
        else:
            self.close_after = connection == b"close"
        if chunked:  # RFC 9112 §6.3: chunked wins over Content-Length
            self.chunked = bytearray()
            self.chunk_left = -1
            return
        buffer = self.buffer
        if len(buffer) >= length:
            # the whole body is here (every small request): head and body in one write
            self._write_head(length, bytes(buffer[:length]))
            del buffer[:length]
            self._request_done()
            return
        self._write_head(length)
        self.remaining = length

    def _write_head(self, length: int, body: bytes = b"") -> None:
        transport = self.transport
        assert transport is not None
        close = _CLOSE if self.close_after else b""
        transport.write(b"%s%d%s\r\n\r\n%s" % (_HEAD, length, close, body))

    def _chunk_step(self) -> bool:
        """One step of a chunked body; False when more bytes are needed."""
        buffer = self.buffer
        body = self.chunked
        assert body is not None
        if self.chunk_left == -1:  # a chunk-size line
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > 4096:
                    raise BadRequest("chunk size line too long")
                return False
            try:
                size = int(bytes(buffer[:end]).split(b";")[0].strip(), 16)
            except ValueError:
                raise BadRequest("malformed chunk size") from None
            del buffer[: end + 2]
            if size == 0:
                self.chunk_left = -2  # trailers follow
            else:
                self.chunk_left = size
            return True
        if self.chunk_left == -2:  # trailers, ended by an empty line
            if buffer[:2] == b"\r\n":
                del buffer[:2]
            else:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return False
                del buffer[: end + 4]
            self.chunked = None
            self._write_head(len(body), bytes(body))
            self._request_done()
            return True
        if len(buffer) < self.chunk_left + 2:
            return False
        if buffer[self.chunk_left : self.chunk_left + 2] != b"\r\n":
            raise BadRequest("chunk data not followed by CRLF")
        body += buffer[: self.chunk_left]
        del buffer[: self.chunk_left + 2]
        self.chunk_left = -1
        return True

    def _request_done(self) -> None:
        self.remaining = -1
        if self.close_after and self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            self.transport.resume_reading()


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoProtocol, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    uvloop.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
