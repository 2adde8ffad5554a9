"""What a connector runs a request against (spec §7): a web target (`NAME=URL`), or the built-in
`$ping` and `$echo`.

A target gets the request body as bytes or as a stream (an outsourced body is fetched while the
target reads it) and answers with bytes or a stream, so a large body passes through the
connector in chunks. Web targets never follow redirects, keep no cookies and do not decompress:
the client gets the target's bytes as they were sent.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from rmb_relay.dialects.tunnel.httpclient import (
    HttpClientPool,
    OnHead,
    TargetReply,
    _Connection,
)
from rmb_relay.errors import ConfigError

__all__ = ["EchoTarget", "PingTarget", "Reply", "Target", "WebTarget", "parse_target", "reply_of"]

Body = bytes | AsyncIterator[bytes]
#: bodies up to this size are read whole (they travel inline)
INLINE_LIMIT = 16 * 1024
#: request fields a connector does not pass on (they describe the hop to the relay)
SKIP_REQUEST = frozenset(("host", "content-length", "transfer-encoding", "connection", "expect"))


@dataclass(slots=True)
class Reply:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: Body = b""
    #: the body's length when known
    length: int | None = 0
    #: called when the reply has been passed on (closes a target response)
    release: aiohttp.ClientResponse | None = None
    closer: Callable[[], None] | None = None

    def done(self) -> None:
        """The reply has been passed on: free the target connection."""
        if self.release is not None:
            self.release.release()
        if self.closer is not None:
            self.closer()


class Target(abc.ABC):
    @abc.abstractmethod
    async def call(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Body, length: int
    ) -> Reply: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class PingTarget(Target):
    """RelayServer's `$ping`: GET answers 200 `PONG`, other methods 404."""

    async def call(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Body, length: int
    ) -> Reply:
        if method not in ("GET", "HEAD"):
            return Reply(404)
        return Reply(200, [("Content-Type", "text/plain")], b"PONG", 4)


class EchoTarget(Target):
    """RelayServer's `$echo`: a POST or PUT answers its own body (streamed), others 204."""

    async def call(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Body, length: int
    ) -> Reply:
        if method not in ("POST", "PUT"):
            return Reply(204)
        content_type = next((v for k, v in headers if k.lower() == "content-type"), None)
        out = [("Content-Type", content_type)] if content_type else []
        return Reply(200, out, body, length)


class WebTarget(Target):
    """An HTTP server: `{base}/{url}` (the base's path kept, unlike RelayServer's relative
    resolution that drops its last segment). Plain http goes through the lean keep-alive
    client of `httpclient.py`; https through aiohttp."""

    def __init__(self, base: str, timeout: float) -> None:
        self.base = base.rstrip("/")
        self.timeout = timeout
        parts = urlsplit(self.base)
        self._prefix = parts.path
        self._pool: HttpClientPool | None = None
        if parts.scheme == "http":
            self._pool = HttpClientPool(
                parts.hostname or "localhost", parts.port or 80, parts.netloc
            )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout),
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def call(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Body, length: int
    ) -> Reply:
        out = [(k, v) for k, v in headers if k.lower() not in SKIP_REQUEST]
        if self._pool is not None:
            return await self._call_lean(self._pool, method, url, out, body, length)
        if length:
            out.append(("Content-Length", str(length)))
        response = await self._client().request(
            method,
            f"{self.base}/{url}",
            headers=out,
            data=body if length else None,
            allow_redirects=False,
        )
        reply_headers = [(k, v) for k, v in response.headers.items()]
        known = response.content_length
        if known is not None and known <= INLINE_LIMIT:
            content = await response.read()
            response.release()
            return Reply(response.status, reply_headers, content, len(content))
        return Reply(
            response.status, reply_headers, response.content.iter_any(), known, release=response
        )

    async def _call_lean(
        self,
        pool: HttpClientPool,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: Body,
        length: int,
    ) -> Reply:
        target = f"{self._prefix}/{url}"
        reply = await pool.request(
            method, target, headers, body if length else b"", length, whole_limit=INLINE_LIMIT
        )
        return await reply_of(reply)

    def try_start(
        self,
        method: str,
        url: str,
        headers: dict[str, list[str]],
        body: bytes,
        on_head: OnHead,
    ) -> tuple[HttpClientPool, _Connection] | None:
        """Send a request with a small body in hand on a kept-alive connection, its answer to
        `on_head` (`HttpClientPool.try_send`; `headers` the message's map, hop-by-hop fields
        left out in Rust); None when that is not possible here (https, no idle connection):
        use `call`. Raises TargetError for a request that cannot be sent."""
        pool = self._pool
        if pool is None:
            return None
        conn = pool.try_send(method, f"{self._prefix}/{url}", headers, body, INLINE_LIMIT, on_head)
        return None if conn is None else (pool, conn)

    @property
    def lean_pool(self) -> HttpClientPool | None:
        """The keep-alive pool of a plain-http target (None for https: aiohttp serves it)."""
        return self._pool

    @property
    def prefix(self) -> str:
        """The base URL's path, put before every request's `url`."""
        return self._prefix

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._pool is not None:
            self._pool.close()


async def reply_of(reply: TargetReply) -> Reply:
    """A target response as a Reply: its body whole when it is small (read with the head, or
    already complete, e.g. an empty chunked body), else a stream to upload."""
    reply_headers = reply.headers
    if reply.body is not None:
        reply.release()
        return Reply(reply.status, reply_headers, reply.body, len(reply.body))
    known = reply.content_length
    if known is not None and known <= INLINE_LIMIT:
        content = await reply.read()
        return Reply(reply.status, reply_headers, content, len(content))
    return Reply(reply.status, reply_headers, reply.iter(), known, closer=reply.release)


def parse_target(text: str, timeout: float) -> tuple[str, Target]:
    """`NAME=URL` from the command line."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ConfigError(f"--target {text!r}: expected NAME=http(s)://HOST[:PORT][/PATH]")
    return name, WebTarget(url, timeout)
