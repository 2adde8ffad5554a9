"""The contract between the listener and a relay dialect.

A dialect (RMB, SBD, ...) is one module with one `Dialect` subclass. The listener picks the
dialect whose `matches` accepts an upgrade request, awaits `accept` (which authenticates and may
raise `HttpReject` to answer with a status before the upgrade), then feeds the returned
`WebSocketHandler` the decoded data messages of that connection. A dialect never parses
websocket bytes itself and never touches another dialect.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest, WsDecoder, WsMessage
    from rmb_relay.server.connection import Connection
    from rmb_relay.server.http import Router


class WebSocketHandler(abc.ABC):
    """Per-connection state of one dialect. Methods run on the event loop and must not block."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def on_open(self) -> None:  # noqa: B027 - optional hook
        """The 101 has been queued; frames sent from here follow it."""

    @abc.abstractmethod
    def on_message(self, message: WsMessage) -> None:
        """One complete data message (text or binary)."""

    def bind_decoder(self, decoder: WsDecoder) -> None:  # noqa: B027 - optional hook
        """The connection's frame decoder exists; configure it (before `on_open`)."""

    def on_pong(self, data: bytes) -> None:  # noqa: B027 - optional hook
        """A websocket pong arrived (pings are answered by the listener)."""

    def on_close(self, code: int | None) -> None:  # noqa: B027 - optional hook
        """The connection is gone (called exactly once); `code` is the peer's close code, if any."""


class Dialect(abc.ABC):
    """One relay protocol served on the shared listener."""

    #: short name used in the banner, logs and the `dialect` metric label
    name: str = "dialect"
    #: largest websocket message accepted from a peer of this dialect (bytes)
    max_message: int = 1 << 20
    #: drop the TCP connection on a protocol violation instead of sending a close frame
    #: (SBD requires this: "drop immediately with no closing frame")
    abort_on_violation: bool = False
    #: have the codec scan binary messages as RMB envelopes in the same call that decodes them
    #: (`WsMessage.routing`), so a read costs one call into Rust however many messages it holds
    scan_envelopes: bool = False

    @abc.abstractmethod
    def matches(self, request: HttpRequest) -> bool:
        """Whether an upgrade request is for this dialect (by path)."""

    @abc.abstractmethod
    async def accept(self, request: HttpRequest, conn: Connection) -> WebSocketHandler:
        """Authenticate the upgrade and return the connection's handler, or raise HttpReject."""

    def add_routes(self, router: Router) -> None:  # noqa: B027 - optional hook
        """Register plain HTTP routes this dialect serves (e.g. federation inbound)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release background tasks and clients at shutdown."""
