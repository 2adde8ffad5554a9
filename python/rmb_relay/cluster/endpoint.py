"""A receiver of bus messages that is not a connection: what `register_kind` resolvers return
for a name that stands for something in memory (the tunnel's response waiters).

The bus reader treats every receiver as the switch does a connection (`switch.Endpoint`): it
asks its peer whether it is congested, batches its writes and may close it. A waiter has no
socket, so its peer is never congested, batches nothing and has nothing to close.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rmb_relay.contract import CloseCode


class NoPeer:
    """The peer of a receiver without a socket (see the module docstring)."""

    __slots__ = ()

    id = 0
    peer_host = ""
    peer_port = 0
    is_open = True
    congested = False

    def send(self, payload: bytes) -> None:
        return None

    def send_many(self, payloads: list[bytes]) -> None:
        return None

    def send_text(self, text: bytes) -> None:
        return None

    def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        return None

    def abort(self) -> None:
        return None

    async def writable(self) -> None:
        return None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        yield

    def hold_reading(self, held: bool) -> None:
        return None


NO_PEER = NoPeer()


class CallbackEndpoint:
    """Hands each frame to `deliver`; `mail_waiting` does nothing (mailboxes are RMB's)."""

    __slots__ = ("_deliver",)

    def __init__(self, deliver: Callable[[bytes], None]) -> None:
        self._deliver = deliver

    @property
    def peer(self) -> NoPeer:
        return NO_PEER

    def deliver(self, frame: bytes) -> None:
        self._deliver(frame)

    def mail_waiting(self) -> None:
        return None
