"""What the layers under the dialects share with them about a connection: the websocket close
codes, a plain HTTP answer, and a connection as a dialect sees it (`Peer`).

A leaf module (it imports only `errors`): the switch, the cluster, federation and the websocket
client use these names without importing the dialect contract (`dialects/base.py`), which
builds on them.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, Awaitable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from rmb_relay.errors import HttpReject

__all__ = ["REPLY_PAUSES", "CloseCode", "HttpClient", "HttpResponse", "Peer", "reject_response"]

#: the counter of connections no longer read (or served) because their own answers are over
#: their write high-water mark: the listener counts its pauses, a dialect whose answers come
#: from a task (RMB's slow path) its waits, in one family (name, help)
REPLY_PAUSES = (
    "rmb_relay_reply_backpressure_pauses_total",
    "Times a connection stopped being read because its own answers (pongs, errors, "
    "HTTP responses to pipelined requests) were over its write high-water mark",
)


class CloseCode(enum.IntEnum):
    """The websocket close codes rmb-relay sends (RFC 6455 §7.4.1): the one table of them."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    INVALID_PAYLOAD = 1007
    POLICY = 1008
    TOO_BIG = 1009
    INTERNAL = 1011


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """A complete answer to a plain HTTP request.

    `body` is sent with a Content-Length; a response whose body is produced over time sets
    `stream` instead (written as it comes, chunked unless `length` is known)."""

    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = field(default=())
    stream: AsyncIterable[bytes] | None = None
    #: the stream's total length when known (sent as Content-Length instead of chunked)
    length: int | None = None

    def header_list(self) -> list[tuple[str, str]]:
        headers = list(self.headers)
        # a plain loop: once per answer, and a generator for `any` cost a tunnelled request
        # ~3% of the relay's CPU (py-spy)
        for name, _ in headers:
            if name.lower() == "content-type":
                return headers
        if self.body or self.stream is not None or self.status not in (202, 204):
            headers.append(("Content-Type", self.content_type))
        return headers


def reject_response(reject: HttpReject) -> HttpResponse:
    """The response a refusal is answered with: its reason as the body (client and log agree)."""
    return HttpResponse(reject.status, reject.reason.encode(), headers=reject.headers)


class Peer(Protocol):
    """One websocket connection as a dialect sees it. Sends made while the listener processes a
    socket read are queued and written once per destination when the read is done."""

    @property
    def id(self) -> int:
        """Unique per process for the life of the process (the route tables store it)."""

    @property
    def peer_host(self) -> str:
        """The TCP peer's address (IPv4-mapped on a dual-stack listener)."""

    @property
    def peer_port(self) -> int: ...

    @property
    def is_open(self) -> bool:
        """Still carrying messages (not closing or closed)."""

    def send(self, payload: bytes) -> None:
        """Queue one binary message."""

    def send_many(self, payloads: list[bytes]) -> None:
        """Queue several binary messages, in order."""

    def send_text(self, text: bytes) -> None:
        """Queue one text message (`text` is UTF-8 already)."""

    def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        """Start the close handshake (what is queued is written first)."""

    def abort(self) -> None:
        """Drop the connection at once without a close frame."""

    @property
    def congested(self) -> bool:
        """Over its write high-water mark: a producer outside a read awaits `writable()`."""

    def writable(self) -> Awaitable[None]:
        """Resolves when this peer's socket is under its write high-water mark. Producers that
        run outside a socket read (mailbox drains, stream consumers) await it before each batch;
        senders inside a read are paused by the listener instead."""

    def batch(self) -> AbstractContextManager[None]:
        """Defer the sends to every connection made inside the block and write each touched
        connection once when it ends, as the listener does for a socket read: for a producer
        outside a read that hands out many messages at once. The block must not await (other
        connections' writes wait for it); no sender is paused for a congested receiver in it,
        so the producer looks at `congested` itself."""

    def hold_reading(self, held: bool) -> None:
        """Stop (True) or restart (False) reading this peer's socket, for the dialect's own
        backpressure: e.g. while too much of what it sent waits for a slow dependency. Reading
        restarts only when neither the dialect nor a congested receiver holds it."""


class HttpClient(Protocol):
    """The connection of a plain HTTP request, as a route handler sees it."""

    @property
    def peer_host(self) -> str: ...

    @property
    def peer_port(self) -> int: ...

    def batch(self) -> AbstractContextManager[None]:
        """The same block as `Peer.batch`, for an HTTP handler delivering many messages (a
        federation batch): sends to websocket peers inside go out once per peer at its end. The
        block must not await and must skip `congested` peers (no sender is paused for them)."""
