"""What a connector runs a request against (spec §7): a web target (`NAME=URL`), the built-in
`$ping` and `$echo`, or any `Target` a user writes.

A target gets the request's method, URL (relative to the target), fields (less those of the hop
to the relay, plus the tracing and acknowledge-URL fields when the request has them) and body,
as bytes or as a stream (an outsourced body is fetched while the target reads it), and answers
with a `Reply` whose body is bytes or a stream, so a large body passes through the connector in
chunks. A web target over plain HTTP is reached with the connector's lean client
(`httpclient.py`, the request bytes built by the connector's core); `WebTarget.call` (aiohttp)
serves https. Web targets never follow redirects, keep no cookies and do not decompress: the
client gets the target's bytes as they were sent.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from rmb_relay.dialects.tunnel.httpclient import HttpClientPool, TargetReply
from rmb_relay.dialects.tunnel.settings import INLINE_LIMIT
from rmb_relay.errors import ConfigError

__all__ = ["EchoTarget", "PingTarget", "Reply", "Target", "WebTarget", "parse_target", "reply_of"]

Body = bytes | AsyncIterator[bytes]


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
    """Answers the requests for one target name; `call` runs as a task per request, within the
    connector's target timeout (504 beyond it; any exception is a 502)."""

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
    resolution that drops its last segment). For plain http the connector sends its core's
    request bytes on `pool`, the lean keep-alive client of `httpclient.py`; `call` (aiohttp)
    serves https."""

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
        out = list(headers)
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

    @property
    def pool(self) -> HttpClientPool | None:
        """The keep-alive pool of a plain-http target (None for https: `call` serves it)."""
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
