"""Shared fixtures: the production event loop (uvloop), an in-process relay on a free port,
and a real `redis-server` on a free port."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from rmb_relay.config import ListenerConfig
from rmb_relay.protocols.base import Dialect
from rmb_relay.server.listener import RelayServer
from rmb_relay.telemetry.metrics import Registry

#: every wait in a test is bounded by this (a hang is a failure, not a stuck CI)
WAIT = 10.0


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test runs on uvloop, the loop the relay runs on in production."""
    return {"uvloop": uvloop.new_event_loop}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


StartRelay = Callable[..., Awaitable[RelayServer]]


@pytest.fixture
async def start_relay() -> AsyncIterator[StartRelay]:
    """Start RelayServer instances on 127.0.0.1:0; all are shut down after the test."""
    servers: list[RelayServer] = []

    async def start(
        dialects: list[Dialect] | None = None, registry: Registry | None = None, **config: Any
    ) -> RelayServer:
        config.setdefault("host", "127.0.0.1")
        config.setdefault("port", 0)
        server = RelayServer(ListenerConfig(**config), dialects or [], registry)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await asyncio.wait_for(server.shutdown(), WAIT)


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]
    directory: str
    drain: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(WAIT)
        if self.drain is not None:
            self.drain.join(WAIT)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_redis(directory: str, port: int | None = None) -> RedisServer:
    """A real redis-server on loopback; returns once it logs that it accepts connections."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run `make test`, which installs it")
    port = port or free_port()
    process = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            directory,
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--loglevel",
            "notice",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdout is not None
    seen = []
    for line in iter(process.stdout.readline, b""):
        seen.append(line)
        if b"Ready to accept connections" in line:
            break
    else:
        pytest.fail("redis-server exited early:\n" + b"".join(seen).decode(errors="replace"))
    # keep reading its log so a full pipe never blocks redis
    drain = threading.Thread(target=lambda: deque(process.stdout, maxlen=0), daemon=True)
    drain.start()
    return RedisServer(port, process, directory, drain)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="rmb-redis-") as directory:
        server = start_redis(directory)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
async def exit_stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as stack:
        yield stack
