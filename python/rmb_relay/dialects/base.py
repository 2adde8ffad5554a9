"""The contract between the listener and a relay dialect. It imports nothing from `server/`.

A dialect (RMB, SBD, ...) is one module or package with one `Dialect` subclass, registered in
`dialects/registry.py`. It declares the websocket paths it serves (`paths`, see
`dialects/paths.py`); the listener picks the most specific match for an upgrade, awaits
`accept` (which authenticates and may raise `HttpReject` to answer with a status before the
upgrade), then feeds the returned `WebSocketHandler` the decoded data messages of that
connection. Plain HTTP routes come from `add_routes`. A dialect never parses bytes itself, sees
its connections only as `Peer`s, and never touches another dialect.

```text
listener ──accept(request, peer)──▶ Dialect ──▶ WebSocketHandler
   ▲                                                   │ on_message / on_close
   └──────── Peer: send, send_many, close, writable ◀──┘
```
"""

from __future__ import annotations

import abc
import argparse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rmb_relay.contract import CloseCode, HttpClient, HttpResponse, Peer, reject_response
from rmb_relay.errors import HttpReject

if TYPE_CHECKING:
    from typing import TypeAlias

    from rmb_relay._core import (
        HttpData,
        HttpEnd,
        HttpRequest,
        HttpStreamParser,
        HttpViolation,
        Outboxes,
        WsDecoder,
        WsMessage,
    )
    from rmb_relay.clock import Clock
    from rmb_relay.services import Services

__all__ = [
    "CloseCode",
    "Dialect",
    "DialectEntry",
    "FastPathClient",
    "HttpClient",
    "HttpEvent",
    "HttpFastPath",
    "HttpReject",
    "HttpResponse",
    "Peer",
    "RequestBody",
    "RouteHandler",
    "Routes",
    "StreamingRouteHandler",
    "WebSocketHandler",
    "reject_response",
]


class RequestBody(Protocol):
    """The body of the request being served, read as it arrives (`Routes.add_streaming`).

    `async for chunk in body` yields the bytes as the client sends them; the listener stops
    reading the socket while more than a few hundred KiB wait unread, so a handler that reads
    slowly slows the client down instead of filling memory. The first read is what answers
    `Expect: 100-continue`: a handler that refuses before reading saves the client the upload.
    Raises HttpReject(408) when the client stalls for the listener's idle timeout; time spent
    waiting for the client does not count against the request deadline."""

    @property
    def length(self) -> int | None:
        """The announced length (0: no body), None when chunked."""

    @property
    def trailers(self) -> list[tuple[str, bytes]]:
        """Trailer fields of a chunked body, once it has been read to the end."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def read(self, limit: int | None = None) -> bytes:
        """The whole (rest of the) body; HttpReject(413) past `limit` bytes (default: the
        listener's `max_message`), before reading when the announced length is already over."""

    def lift_deadline(self) -> None:
        """Exempt this request from the listener's request deadline (`http_request_timeout`):
        for handlers that bound their own waits, such as a tunnel waiting for its connector."""

    def throttle(self, charge: Callable[[int], float]) -> None:
        """Charge this body's bytes to an upload rate as they are read (`charge(bytes)` returns
        how many seconds the connection must not read: throttle.py's `UploadRate`); what
        arrived before is charged with the next read. The sender is slowed, not refused, and
        time the connection does not read for it does not count as the client's idleness."""


RouteHandler = Callable[["HttpRequest", HttpClient], Awaitable[HttpResponse]]
#: a route that reads its body as it arrives (the request's `body` is b"")
StreamingRouteHandler = Callable[["HttpRequest", RequestBody, HttpClient], Awaitable[HttpResponse]]


#: what an HTTP connection's parser gives for a read
HttpEvent: TypeAlias = "HttpRequest | HttpData | HttpEnd | HttpViolation"


class FastPathClient(Protocol):
    """A client connection as an `HttpFastPath` sees it."""

    #: the connection's id in the switch's outboxes (the answer is written there)
    conn_id: int

    def fast_answer(self, response: HttpResponse, method: str) -> None:
        """Python's answer to a request the fast path took (an error: the connection closes
        after it)."""

    def adopt_fast(self, request: HttpRequest, response: HttpResponse) -> None:
        """The request the fast path took is answered by Python after all: it becomes the
        connection's request being served and `response` is sent (nothing if the client is
        gone)."""


class HttpFastPath(Protocol):
    """Serves a client's whole request from the read, in the Rust core (the tunnel's hub);
    the answer comes back through the switch's outboxes."""

    def feed(
        self, conn: FastPathClient, parser: HttpStreamParser, data: bytes
    ) -> list[HttpEvent] | None:
        """None: taken; else the parser's events for the connection to act on."""

    def client_done(self, conn: FastPathClient) -> None:
        """The client half-closed while its request is served there."""

    def closed(self, conn: FastPathClient, pending: bool) -> None:
        """The connection is gone (`pending`: with a request served there)."""


class Routes(Protocol):
    """Where dialects register plain HTTP routes (the listener's router implements it)."""

    def add(self, method: str, path: str, handler: RouteHandler) -> None:
        """`path` is a `dialects/paths.py` pattern: `/exact`, `/prefix/*` or `/{segment}`.
        A path served for other methods only answers 405; a pattern claimed twice for the
        same method is refused at startup. The handler gets the whole body in
        `request.body` (at most the listener's `max_message`, else the client gets 413)."""

    def add_streaming(
        self,
        method: str,
        path: str,
        handler: StreamingRouteHandler,
    ) -> None:
        """Like `add`, but the handler reads the body itself, as it arrives (`RequestBody`),
        with no size limit: uploads, tunnels. Its response may stream too
        (`HttpResponse.stream`)."""


class WebSocketHandler(abc.ABC):
    """Per-connection state of one dialect. Methods run on the event loop and must not block."""

    #: set by `bind_decoder` when the dialect's scanner forwards local messages itself (the
    #: switch's outboxes): the listener then queues all of this connection's output there
    outboxes: Outboxes | None = None

    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    def on_open(self) -> None:  # noqa: B027 - optional hook
        """The 101 has been queued; messages sent from here follow it."""

    @abc.abstractmethod
    def on_message(self, message: WsMessage) -> None:
        """One complete data message (text or binary)."""

    def bind_decoder(self, decoder: WsDecoder) -> None:  # noqa: B027 - optional hook
        """The connection's frame decoder exists; give it this dialect's scanner (before
        `on_open`), so routing fields are read in the same call that decodes the frames."""

    def on_discarded(self, message: WsMessage) -> None:  # noqa: B027 - optional hook
        """A message decoded in the same read as others but never passed to `on_message` (the
        connection started closing first): undo what its scan did (e.g. a route record)."""

    def on_pong(self, data: bytes) -> None:  # noqa: B027 - optional hook
        """A websocket pong arrived (pings are answered by the listener)."""

    def on_close(self, code: int | None) -> None:  # noqa: B027 - optional hook
        """The connection is gone (called exactly once); `code` is the peer's close code, if any."""


class Dialect(abc.ABC):
    """One relay protocol served on the shared listener."""

    #: short name used in the banner, logs and the `dialect` metric label
    name: str = "dialect"
    #: websocket upgrade paths this dialect serves (`dialects/paths.py` patterns)
    paths: tuple[str, ...] = ()
    #: largest websocket message accepted from a peer of this dialect (bytes)
    max_message: int = 1 << 20
    #: drop the TCP connection on a protocol violation instead of sending a close frame
    #: (SBD requires this: "drop immediately with no closing frame")
    abort_on_violation: bool = False
    #: a clock (`clock.py`) whose reading the listener passes to the decoder's scanner on every
    #: read, for dialects whose scanner charges a rate limiter inside `feed`
    scan_clock: Clock | None = None
    #: serves whole HTTP requests of this dialect's routes in the Rust core from the client's
    #: read (the tunnel's hub), if it does
    http_fast_path: HttpFastPath | None = None

    @abc.abstractmethod
    async def accept(self, request: HttpRequest, peer: Peer) -> WebSocketHandler:
        """Authenticate the upgrade and return the connection's handler, or raise HttpReject."""

    def add_routes(self, router: Routes) -> None:  # noqa: B027 - optional hook
        """Register plain HTTP routes this dialect serves (e.g. federation inbound)."""

    def open_surfaces(self) -> list[str]:
        """What this dialect lets anyone use without credentials, one short phrase each
        (the listener logs them in one line at startup, so an operator sees what the
        internet reaches); empty when everything asks for a credential."""
        return []

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release background tasks and clients at shutdown."""


@dataclass(frozen=True, slots=True)
class DialectEntry:
    """How a dialect joins `rmb-relay serve`: its flags and how to build it from them.

    `add_arguments` adds an argument group to the serve parser (flag names must not clash with
    other dialects'); `build` returns the dialect, or None when the flags switch it off. Adding a
    dialect is one new module with one of these plus one line in `dialects/registry.py`."""

    name: str
    #: one line for `rmb-relay serve --help`
    summary: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.Namespace, Services], Awaitable[Dialect | None]]
