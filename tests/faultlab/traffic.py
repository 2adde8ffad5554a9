"""What every steady traffic of the lab shares: numbered messages `<prefix><n>`, each told to
the checker as sent, handed to `send` `rate` times a second (paced by the loop's clock) from
`start` until `stop`. A dialect's traffic (rmb.py, sbd.py, singyeong.py, tunnel.py) says how
one message is sent and how its fate is seen."""

from __future__ import annotations

import asyncio
import contextlib

from tests.faultlab.checker import Checker


class PacedTraffic:
    def __init__(self, checker: Checker, prefix: str) -> None:
        self.checker = checker
        self.prefix = prefix
        self.next_id = 0
        self._pacer: asyncio.Task[None] | None = None

    async def send(self, message: str) -> None:
        """Send one message (the checker has been told it was sent)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stop, and close every client and task the traffic opened."""
        raise NotImplementedError

    def start(self, rate: float) -> None:
        self._pacer = asyncio.get_running_loop().create_task(self._run(rate))

    async def _run(self, rate: float) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            message = f"{self.prefix}{self.next_id}"
            self.next_id += 1
            self.checker.sent(message)
            await self.send(message)
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - loop.time()))  # pacing, not synchronisation

    async def stop(self) -> None:
        """No more messages (what was sent still meets its fate)."""
        pacer, self._pacer = self._pacer, None
        if pacer is not None:
            pacer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pacer
