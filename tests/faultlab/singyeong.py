"""Steady 신경 SEND traffic for the checker: a client of application "caller" sends numbered
SENDs (the number as nonce and payload) to application "api", one client on another instance.
The gateway tells the sender of a SEND it could not route (an INVALID frame naming the
nonce): that is a refusal; a SEND the receiver got is delivered. Both clients heartbeat as
the gateway's hello asks: a client that does not is closed 1.5 intervals (67.5 s by default)
after it identified, which a scenario on a loaded host outlasts (the worker closed with
messages still queued for it looked like a loss). They send no websocket pings of their own
(`keepalive=False`): a client that gives a silent connection up closes what the gateway wrote
into it unread, and SEND has no acknowledgement to send it again by (docs/faults.md, (b)); the
gateway's heartbeat limit still bounds the connection."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import websockets

from tests.faultlab.checker import Checker
from tests.faultlab.traffic import PacedTraffic
from tests.sg_client import SgClient

#: the refusal of a QUEUE the gateway cannot tell was stored or not (redis_queues.py): the
#: checker's "not known", as the tunnel's 504
UNKNOWN = "queue unknown"


class SgSends(PacedTraffic):
    #: the receiver's application and client id, the sender's (a flow sharing a world with
    #: another 신경 flow names its own)
    APP, WORKER = "api", "worker"
    CALLER, CALLER_CLIENT = "caller", "caller-1"

    def __init__(self, checker: Checker, prefix: str = "g") -> None:
        super().__init__(checker, prefix)
        self.sender: SgClient | None = None
        self.receiver: SgClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: INVALID frames naming no message (what the gateway refused without saying which)
        self.unmatched: list[dict[str, Any]] = []

    async def open(self, sender: tuple[str, int], receiver: tuple[str, int]) -> None:
        self.receiver = await SgClient.connect(*receiver, keepalive=False)
        await self.receiver.identify(self.WORKER, self.APP)
        self.sender = await SgClient.connect(*sender, keepalive=False)
        await self.sender.identify(self.CALLER_CLIENT, self.CALLER)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._read(self.receiver, self._received)))
        self._tasks.append(loop.create_task(self._read(self.sender, self._refusal)))
        for client in (self.receiver, self.sender):
            self._tasks.append(loop.create_task(self._heartbeat(client)))

    async def _heartbeat(self, client: SgClient) -> None:
        """A heartbeat every third of the interval the gateway asked for (pacing)."""
        every = client.hello["d"]["heartbeat_interval"] / 1000 / 3
        with contextlib.suppress(websockets.ConnectionClosed, OSError):
            while True:
                await asyncio.sleep(every)
                await client.send(5, None)

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
        info = d.get("extra_info")
        nonce = None
        if isinstance(info, dict):
            inner = info.get("d")
            nonce = info.get("nonce", inner.get("nonce") if isinstance(inner, dict) else None)
        error = str(d.get("error"))
        if nonce is not None and (error.startswith(UNKNOWN) or "may or may not" in error):
            # as the tunnel's 504, not a refusal: QUEUE's "queue unknown", and a SEND whose
            # bus write lost its reply
            self.checker.unknown(str(nonce))
        elif nonce is not None:
            self.checker.refused(str(nonce), error)
        else:
            self.unmatched.append(frame)

    async def send(self, message: str) -> None:
        assert self.sender is not None
        target = {"application": self.APP}
        await self.sender.dispatch("SEND", {"target": target, "nonce": message, "payload": message})

    async def close(self) -> None:
        await self.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in (self.sender, self.receiver):
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 5)


class SgQueue(SgSends):
    """신경 QUEUE: the "caller" client queues numbered messages (the number as nonce and
    payload) on queue "jobs" for application "api"; its one worker, on another instance, asks
    for one at a time (QUEUE_REQUEST), and acknowledges each (QUEUE_ACK). A QUEUE_CONFIRM is
    the gateway saying it was stored; an INVALID naming the nonce, a refusal (`queue
    unavailable`: not stored), or with `queue unknown` the gateway saying it cannot tell."""

    QUEUE = "jobs"

    async def open(self, sender: tuple[str, int], receiver: tuple[str, int]) -> None:
        await super().open(sender, receiver)
        assert self.receiver is not None
        await self.receiver.dispatch("QUEUE_REQUEST", {"queue": self.QUEUE})

    def _received(self, data: Any) -> None:
        frame = self._decode(data)
        if frame.get("op") != 4 or frame.get("t") != "QUEUE":
            return
        body = frame["d"]["payload"]
        self.checker.delivered(str(body["payload"]))
        receiver = self.receiver
        assert receiver is not None
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ack_and_ask(receiver, body["id"])))

    async def _ack_and_ask(self, receiver: SgClient, message_id: str) -> None:
        with contextlib.suppress(websockets.ConnectionClosed, OSError):
            await receiver.dispatch("QUEUE_ACK", {"queue": self.QUEUE, "id": message_id})
            await receiver.dispatch("QUEUE_REQUEST", {"queue": self.QUEUE})

    def _refusal(self, data: Any) -> None:
        frame = self._decode(data)
        if frame.get("op") == 4 and frame.get("t") == "QUEUE_CONFIRM":
            self.confirmed.add(str(frame["d"].get("nonce")))
            return
        super()._refusal(data)

    #: nonces the gateway confirmed (stored)
    confirmed: set[str]

    def __init__(self, checker: Checker, prefix: str = "g") -> None:
        super().__init__(checker, prefix)
        self.confirmed = set()

    async def send(self, message: str) -> None:
        assert self.sender is not None
        d = {"queue": self.QUEUE, "target": {"application": "api"}}
        await self.sender.dispatch("QUEUE", {**d, "nonce": message, "payload": message})
