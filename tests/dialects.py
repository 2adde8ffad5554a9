"""Test-only dialects: they exercise the listener without any relay protocol."""

from __future__ import annotations

from rmb_relay._core import OP_TEXT, HttpRequest, WsMessage, encode_frame
from rmb_relay.protocols.base import Dialect, WebSocketHandler
from rmb_relay.server.connection import Connection
from rmb_relay.server.http import HttpReject


class EchoHandler(WebSocketHandler):
    def on_message(self, message: WsMessage) -> None:
        if message.is_text:
            self.conn.send_frame(encode_frame(OP_TEXT, message.data))
        else:
            self.conn.send_binary(message.data)


class EchoDialect(Dialect):
    """`/echo`: every message comes back as it was sent. `/echo?deny` is refused with 403."""

    name = "echo"

    def __init__(self, max_message: int = 1 << 20) -> None:
        self.max_message = max_message
        self.opened = 0
        self.closed_codes: list[int | None] = []

    def matches(self, request: HttpRequest) -> bool:
        return request.path == "/echo"

    async def accept(self, request: HttpRequest, conn: Connection) -> WebSocketHandler:
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
    def __init__(self, conn: Connection, dialect: PipeDialect, name: str) -> None:
        super().__init__(conn)
        self.dialect = dialect
        self.name = name

    def on_open(self) -> None:
        self.dialect.members[self.name] = self.conn

    def on_message(self, message: WsMessage) -> None:
        target_name, _, payload = message.data.partition(b":")
        target = self.dialect.members.get(target_name.decode())
        if target is not None:
            target.send_binary(payload)

    def on_close(self, code: int | None) -> None:
        if self.dialect.members.get(self.name) is self.conn:
            del self.dialect.members[self.name]


class PipeDialect(Dialect):
    """`/pipe/<name>`: a binary message `target:payload` is forwarded to connection `target`."""

    name = "pipe"

    def __init__(self) -> None:
        self.members: dict[str, Connection] = {}

    def matches(self, request: HttpRequest) -> bool:
        return request.path.startswith("/pipe/")

    async def accept(self, request: HttpRequest, conn: Connection) -> WebSocketHandler:
        return PipeHandler(conn, self, request.path.removeprefix("/pipe/"))
