"""Test-only dialects: they exercise the listener without any relay protocol."""

from __future__ import annotations

from rmb_relay._core import HttpRequest, WsMessage
from rmb_relay.dialects.base import Dialect, Peer, WebSocketHandler
from rmb_relay.errors import HttpReject


class EchoHandler(WebSocketHandler):
    def on_message(self, message: WsMessage) -> None:
        if message.is_text:
            self.peer.send_text(message.data)
        else:
            self.peer.send(message.data)


class EchoDialect(Dialect):
    """`/echo`: every message comes back as it was sent. `/echo?deny` is refused with 403."""

    name = "echo"
    paths = ("/echo",)

    def __init__(self, max_message: int = 1 << 20) -> None:
        self.max_message = max_message
        self.opened = 0
        self.closed_codes: list[int | None] = []

    async def accept(self, request: HttpRequest, conn: Peer) -> WebSocketHandler:
        if request.query == "deny":
            raise HttpReject(403, "denied by test")
        dialect = self

        class Tracked(EchoHandler):
            def on_open(self) -> None:
                dialect.opened += 1

            def on_close(self, code: int | None) -> None:
                dialect.closed_codes.append(code)

        return Tracked(conn)


class PipeHandler(WebSocketHandler):
    def __init__(self, conn: Peer, dialect: PipeDialect, name: str) -> None:
        super().__init__(conn)
        self.dialect = dialect
        self.name = name

    def on_open(self) -> None:
        self.dialect.members[self.name] = self.peer

    def on_message(self, message: WsMessage) -> None:
        target_name, _, payload = message.data.partition(b":")
        target = self.dialect.members.get(target_name.decode())
        if target is not None:
            target.send(payload)

    def on_close(self, code: int | None) -> None:
        if self.dialect.members.get(self.name) is self.peer:
            del self.dialect.members[self.name]


class PipeDialect(Dialect):
    """`/pipe/<name>`: a binary message `target:payload` is forwarded to connection `target`."""

    name = "pipe"
    paths = ("/pipe/*",)

    def __init__(self) -> None:
        self.members: dict[str, Peer] = {}

    async def accept(self, request: HttpRequest, conn: Peer) -> WebSocketHandler:
        return PipeHandler(conn, self, request.path.removeprefix("/pipe/"))
