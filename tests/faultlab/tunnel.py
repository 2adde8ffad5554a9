"""Steady HTTP tunnel traffic for the checker: a client on one instance POSTs numbered
bodies at a fixed rate through `/relay/acme/app/echo` to a connector on another instance,
which hands each to an echo target that counts it (delivered) and answers it. The client
counts a 2xx echo as answered, a 504 (gateway timeout: the relay cannot say whether it ran)
as not known, any other status or a failed connection as refused (the sender saw an error),
and waits without a deadline of its own: the relay's (`--tunnel-request-ttl`,
`--tunnel-response-timeout`) decide."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import BinaryIO

import aiohttp
from aiohttp import web

from tests.faultlab.checker import Checker
from tests.faultlab.traffic import PacedTraffic
from tests.helpers import eventually
from tests.processes import relay_env

TENANT = "acme"
SECRET = "faultlab-secret-0123456789"


class TunnelRequests(PacedTraffic):
    def __init__(self, checker: Checker, prefix: str = "t") -> None:
        super().__init__(checker, prefix)
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._connector: asyncio.subprocess.Process | None = None
        self._log: BinaryIO | None = None
        self._session: aiohttp.ClientSession | None = None
        self._requests: set[asyncio.Task[None]] = set()

    async def open(self, client: tuple[str, int], connector: tuple[str, int], logs: Path) -> None:
        """The echo target on loopback, the connector (a process of this host) on the
        instance at `connector`, the client's session for the instance at `client`."""

        async def echo(request: web.Request) -> web.Response:
            body = await request.read()
            self.checker.delivered(body.decode())
            return web.Response(body=body)

        app = web.Application()
        app.router.add_route("POST", "/echo", echo)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log = self._log = (logs / "connector.log").open("wb")
        self._connector = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "rmb_relay", "connector"),
            *("--server", f"http://{connector[0]}:{connector[1]}"),
            *("--tenant", TENANT, "--secret", SECRET),
            *("--target", f"app=http://127.0.0.1:{port}"),
            env=relay_env(),
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self.url = f"http://{client[0]}:{client[1]}/relay/{TENANT}/app/echo"

    async def ready(self, timeout: float = 30.0) -> None:
        """Until one request goes through (the connector says nothing when it is up)."""
        session = self._session
        assert session is not None

        async def through() -> bool:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(self.url, data=b"probe") as reply:
                    return reply.status == 200
            return False

        await eventually(through, timeout)

    async def send(self, message: str) -> None:
        task = asyncio.get_running_loop().create_task(self._request(message))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _request(self, message: str) -> None:
        assert self._session is not None
        try:
            async with self._session.post(self.url, data=message.encode()) as reply:
                body = await reply.read()
                if reply.status == 200 and body == message.encode():
                    self.checker.answered(message)
                elif reply.status == 504:
                    self.checker.unknown(message)
                else:
                    self.checker.refused(message, f"{reply.status} {body[:80]!r}")
        except (aiohttp.ClientError, OSError) as err:
            self.checker.refused(message, f"{type(err).__name__}: {err}")

    async def close(self) -> None:
        await self.stop()
        for task in list(self._requests):
            task.cancel()
        if self._session is not None:
            await self._session.close()
        if self._connector is not None and self._connector.returncode is None:
            self._connector.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._connector.wait(), 10)
            if self._connector.returncode is None:
                self._connector.kill()
                await self._connector.wait()
        if self._log is not None:
            self._log.close()
        if self._runner is not None:
            await self._runner.cleanup()
