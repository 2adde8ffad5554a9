"""Steady RMB traffic for the checker: a sender twin sends requests at a fixed rate to a
responder twin that answers each with its payload (each request's id)."""

from __future__ import annotations

import asyncio
import contextlib

from rmb_relay.sdk import IncomingRequest, Reply, RmbClient
from rmb_relay.sdk.link import DEAD_AFTER
from tests.cluster_fixtures import TWINS
from tests.faultlab.checker import Checker
from tests.faultlab.traffic import PacedTraffic
from tests.rmb_fixtures import key_for

#: long enough that a request waiting in a mailbox through the longest cut is still wanted
EXPIRATION = 900
SENDER, RESPONDER = 1, 2


class RmbRequests(PacedTraffic):
    """`sender` (twin 1) on one relay asks `responder` (twin 2) on another, `rate` a second;
    both give a silent relay connection up after `dead_after` (the SDK's default: 40 s)."""

    def __init__(
        self, checker: Checker, prefix: str = "m", *, dead_after: float = DEAD_AFTER
    ) -> None:
        super().__init__(checker, prefix)
        self.sender = RmbClient(
            SENDER, key_for(SENDER, TWINS[SENDER]), reconnect=True, dead_after=dead_after
        )
        self.responder = RmbClient(
            RESPONDER, key_for(RESPONDER, TWINS[RESPONDER]), reconnect=True, dead_after=dead_after
        )
        self.responder.handle("m", self._answer)

    async def open(self, sender_url: str, responder_url: str, timeout: float = 30.0) -> None:
        await self.responder.open(responder_url)
        await self.sender.open(sender_url)
        await self.responder.wait_connected(timeout)
        await self.sender.wait_connected(timeout)

    def _answer(self, request: IncomingRequest) -> bytes:
        self.checker.delivered(request.data.decode())
        return request.data

    async def send(self, message: str) -> None:
        future = self.sender.send_request(RESPONDER, "m", message.encode(), expiration=EXPIRATION)
        future.add_done_callback(lambda done: self._settled(message, done))

    def _settled(self, message: str, future: asyncio.Future[Reply]) -> None:
        if future.cancelled():
            return
        err = future.exception()
        if err is not None:
            self.checker.refused(message, f"{type(err).__name__}: {err}")
            return
        reply = future.result()
        if reply.error is not None:
            self.checker.refused(message, reply.error[1])
        else:
            self.checker.answered(message)

    async def close(self) -> None:
        await self.stop()
        for client in (self.sender, self.responder):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10)
