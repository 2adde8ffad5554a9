"""Steady 신경 SEND traffic for the checker: a client of application "caller" sends numbered
SENDs (the number as nonce and payload) to application "api", one client on another instance.
The gateway tells the sender of a SEND it could not route (an INVALID frame naming the
nonce): that is a refusal; a SEND the receiver got is delivered."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import websockets

from tests.faultlab.checker import Checker
from tests.sg_client import SgClient


class SgSends:
    def __init__(self, checker: Checker, prefix: str = "g") -> None:
        self.checker = checker
        self.prefix = prefix
        self.next_id = 0
        self.sender: SgClient | None = None
        self.receiver: SgClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self, sender: tuple[str, int], receiver: tuple[str, int]) -> None:
        self.receiver = await SgClient.connect(*receiver)
        await self.receiver.identify("worker", "api")
        self.sender = await SgClient.connect(*sender)
        await self.sender.identify("caller-1", "caller")
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._read(self.receiver, self._received)))
        self._tasks.append(loop.create_task(self._read(self.sender, self._refusal)))

    async def _read(self, client: SgClient, on_frame: Any) -> None:
        with contextlib.suppress(websockets.ConnectionClosed, OSError):
            while True:  # no read timeout: a cut may keep a client silent for long
                on_frame(await client.ws.recv())

    def _decode(self, data: Any) -> dict[str, Any]:
        import json

        frame = json.loads(data)
        return frame if isinstance(frame, dict) else {}

    def _received(self, data: Any) -> None:
        frame = self._decode(data)
        if frame.get("op") == 4 and frame.get("t") == "SEND":
            self.checker.delivered(str(frame["d"]["nonce"]))

    def _refusal(self, data: Any) -> None:
        frame = self._decode(data)
        if frame.get("op") != 3:
            return
        d = frame.get("d") or {}
        info = d.get("extra_info") or {}
        nonce = info.get("nonce", (info.get("d") or {}).get("nonce"))
        if nonce is not None:
            self.checker.refused(str(nonce), str(d.get("error")))

    def start(self, rate: float) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._run(rate)))

    async def _run(self, rate: float) -> None:
        sender = self.sender
        assert sender is not None
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            message = f"{self.prefix}{self.next_id}"
            self.next_id += 1
            self.checker.sent(message)
            target = {"application": "api"}
            await sender.dispatch("SEND", {"target": target, "nonce": message, "payload": message})
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - loop.time()))  # pacing

    async def stop(self) -> None:
        if len(self._tasks) > 2:
            sending = self._tasks.pop()
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in (self.sender, self.receiver):
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 5)
