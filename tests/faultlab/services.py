"""What runs on the lab's hosts: redis-server and `rmb-relay` processes started inside a
host's namespace, each with its log read by a thread so a scenario can wait for a line (an
event: "instance ... is gone") with a bound instead of sleeping."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from tests.faultlab.netns import Host

#: ports inside a host (each namespace has its own port space)
REDIS_PORT = 6379
RELAY_PORT = 8080
#: bounded waits for a process to start
START_WAIT = 30.0


class LogWatch:
    """The lines of a process's output, kept, and awaitable (`wait_for`)."""

    def __init__(self, stream: IO[str], loop: asyncio.AbstractEventLoop, path: Path) -> None:
        self.lines: list[str] = []
        self.path = path
        self._loop = loop
        self._changed = asyncio.Event()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with self.path.open("a") as copy:
            for line in stream:
                self.lines.append(line)
                copy.write(line)
                copy.flush()
                if not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(self._changed.set)

    def count(self, text: str) -> int:
        return sum(1 for line in self.lines if text in line)

    async def wait_for(self, text: str, timeout: float, *, after: int = 0) -> str:
        """The first line from index `after` on containing `text`; TimeoutError after
        `timeout` s."""
        async with asyncio.timeout(timeout):
            index = after
            while True:
                while index < len(self.lines):
                    if text in self.lines[index]:
                        return self.lines[index]
                    index += 1
                self._changed.clear()
                await self._changed.wait()


class RedisNode:
    """A redis-server on a host (bound to the host's address)."""

    def __init__(self, host: Host, extra: Sequence[str] = (), port: int = REDIS_PORT) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: `make system-deps` installs it")
        self.host = host
        self.port = port
        self.directory = tempfile.mkdtemp(prefix=f"faultlab-redis-{host.name}-")
        self.process = host.popen(
            [
                *(exe, "--port", str(port), "--bind", host.address, "--dir", self.directory),
                *("--save", "", "--appendonly", "no", "--protected-mode", "no", *extra),
            ],
            stderr=subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        self.log = LogWatch(
            self.process.stdout, asyncio.get_running_loop(), Path(self.directory) / "out.log"
        )

    async def ready(self) -> RedisNode:
        await self.log.wait_for("Ready to accept connections", START_WAIT)
        return self

    @property
    def address(self) -> tuple[str, int]:
        return (self.host.address, self.port)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)


class RelayNode:
    """`python -m rmb_relay` on a host; `url` is its websocket address. `address`: the one it
    listens on (default the host's IPv4 one; an IPv6 one from `Host.add_ipv6`)."""

    def __init__(
        self, host: Host, args: Sequence[str], logs: Path, *, address: str | None = None
    ) -> None:
        self.host = host
        self.port = RELAY_PORT
        self.address = address or host.address
        listen = (
            f"[{self.address}]:{self.port}"
            if ":" in self.address
            else f"{self.address}:{self.port}"
        )
        env = {**os.environ, "XDG_DATA_HOME": tempfile.mkdtemp(prefix="faultlab-relay-")}
        self.process = host.popen(
            [sys.executable, "-m", "rmb_relay", "-l", listen, *args],
            env=env,
            stderr=subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        self.log = LogWatch(
            self.process.stdout, asyncio.get_running_loop(), logs / f"relay-{host.name}.log"
        )

    async def ready(self) -> RelayNode:
        await self.log.wait_for("rmb-relay listening on ", START_WAIT)
        return self

    @property
    def url(self) -> str:
        return f"ws://{self.host.address}:{self.port}/"

    def rss_mib(self) -> float:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        except FileNotFoundError:
            return 0.0
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) / 1024

    def problems(self) -> list[str]:
        return [line for line in self.log.lines if "Traceback" in line or " CRITICAL " in line]


class ChainNode:
    """`rmb-relay devchain` on a host: tfchain's JSON-RPC over the twins of a file (the one
    stand-in the tests may use, docs/tfchain.md)."""

    PORT = 9944

    def __init__(self, host: Host, twins: Path, logs: Path) -> None:
        self.host = host
        self.process = host.popen(
            [
                sys.executable,
                "-m",
                "rmb_relay",
                "devchain",
                "--twins",
                str(twins),
                "-l",
                f"{host.address}:{self.PORT}",
                "--block-time",
                "1",
            ],
            stderr=subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        self.log = LogWatch(self.process.stdout, asyncio.get_running_loop(), logs / "chain.log")

    async def ready(self) -> ChainNode:
        await self.log.wait_for("devchain listening on ", START_WAIT)
        return self

    @property
    def address(self) -> tuple[str, int]:
        return (self.host.address, self.PORT)
