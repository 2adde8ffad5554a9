"""The spec-auth hook client: `PUT /authenticate` bodies go to the operator's hook for a token."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

from rmb_relay._core import encode_request, parse_response_head
from rmb_relay.protocols.sbd.settings import AUTH_HOOK_MAX_RESPONSE, AUTH_HOOK_TIMEOUT


async def call_auth_hook(url: str, body: bytes, timeout: float = AUTH_HOOK_TIMEOUT) -> str:
    """PUT the auth bytes to the operator's hook (spec-auth); returns its `authToken`.

    A one-request HTTP/1.1 client on asyncio streams with the Rust request encoder and response
    head parser. The body is read by Content-Length, chunked, or to EOF, so a hook that keeps
    the connection open despite `Connection: close` still answers at once.

    Raises PermissionError for 401, ValueError for any other unusable answer, OSError or
    TimeoutError when the hook cannot be reached in time."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"auth hook must be an http(s) URL, got {url!r}")
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(
            host, port, ssl=parts.scheme == "https" or None
        )
        try:
            writer.write(
                encode_request(
                    "PUT",
                    target,
                    [
                        ("Host", parts.netloc),
                        ("Content-Type", "application/octet-stream"),
                        ("Connection", "close"),
                    ],
                    body,
                )
            )
            status, answer = await _read_response(reader)
        finally:
            writer.close()
    if status == 401:
        raise PermissionError("auth hook refused")
    if status != 200:
        raise ValueError(f"auth hook answered {status}")
    try:
        token = json.loads(answer)["authToken"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("auth hook answer has no authToken") from None
    if not isinstance(token, str) or not token:
        raise ValueError("auth hook authToken is not a non-empty string")
    return token


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response; ValueError when malformed or too large."""
    buffer = b""
    while (head := parse_response_head(buffer)) is None:
        if len(buffer) > AUTH_HOOK_MAX_RESPONSE:
            raise ValueError("auth hook response head too large")
        chunk = await reader.read(4096)
        if not chunk:
            raise ValueError("auth hook closed before a complete response head")
        buffer += chunk
    status, headers, head_len = head
    fields = {name: value for name, value in headers}
    rest = buffer[head_len:]
    stream = _Prefixed(rest, reader)
    if b"chunked" in fields.get("transfer-encoding", b"").lower():
        body = b""
        while True:
            size_line = await stream.readline()
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ValueError("auth hook sent a bad chunk size") from None
            if size == 0:
                return status, body
            if len(body) + size > AUTH_HOOK_MAX_RESPONSE:
                raise ValueError("auth hook response too large")
            body += await stream.readexactly(size)
            await stream.readexactly(2)  # CRLF after the chunk
    length = fields.get("content-length")
    if length is not None:
        try:
            size = int(length)
        except ValueError:
            raise ValueError("auth hook sent a bad Content-Length") from None
        if not 0 <= size <= AUTH_HOOK_MAX_RESPONSE:
            raise ValueError("auth hook response too large")
        return status, await stream.readexactly(size)
    return status, await stream.read_to_eof(AUTH_HOOK_MAX_RESPONSE)


class _Prefixed:
    """A StreamReader with bytes already read put back in front."""

    def __init__(self, prefix: bytes, reader: asyncio.StreamReader) -> None:
        self.buffer = prefix
        self.reader = reader

    async def _fill(self) -> None:
        chunk = await self.reader.read(4096)
        if not chunk:
            raise ValueError("auth hook closed mid-response")
        self.buffer += chunk

    async def readexactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    async def readline(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if len(self.buffer) > 1024:
                raise ValueError("auth hook sent an overlong line")
            await self._fill()
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    async def read_to_eof(self, limit: int) -> bytes:
        while chunk := await self.reader.read(4096):
            self.buffer += chunk
            if len(self.buffer) > limit:
                raise ValueError("auth hook response too large")
        return self.buffer
