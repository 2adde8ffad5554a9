"""Steady SBD traffic for the checker: a sender forwards numbered payloads at a fixed rate to
a receiver's key. SBD has no acknowledgement and no error the sender could see (spec: best
effort), so the checker counts each message delivered (`one_way`) or not."""

from __future__ import annotations

import asyncio
import contextlib

from rmb_relay._core import SBD_COMMAND, WsMessage, sbd_classify
from tests.faultlab.checker import Checker
from tests.faultlab.traffic import PacedTraffic
from tests.sbd_client import SbdClient


class SbdForwards(PacedTraffic):
    def __init__(self, checker: Checker, prefix: str = "s") -> None:
        super().__init__(checker, prefix)
        self.sender: SbdClient | None = None
        self.receiver: SbdClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self, sender: tuple[str, int], receiver: tuple[str, int]) -> None:
        self.receiver = await SbdClient.connect(*receiver)
        self.sender = await SbdClient.connect(*sender)
        self._tasks.append(asyncio.get_running_loop().create_task(self._receive()))

    async def _receive(self) -> None:
        """Every forward the receiver gets, for as long as its connection lasts (no read
        timeout: a cut can keep it silent for longer than the test client's)."""
        receiver = self.receiver
        assert receiver is not None
        ws = receiver.ws
        with contextlib.suppress(OSError):
            while True:
                chunk = await ws.reader.read(65536)
                if not chunk:
                    return
                for event in ws.decoder.feed(chunk):
                    if (
                        isinstance(event, WsMessage)
                        and sbd_classify(event.data).kind != SBD_COMMAND
                    ):
                        self.checker.delivered(event.data[32:].decode())

    async def send(self, message: str) -> None:
        assert self.sender is not None
        assert self.receiver is not None
        self.sender.forward(self.receiver.pubkey, message.encode())

    async def close(self) -> None:
        await self.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in (self.sender, self.receiver):
            if client is not None:
                client.close()
