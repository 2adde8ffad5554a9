"""Shared fixtures: the production event loop (uvloop), an in-process relay on a free port,
and a real `redis-server` on a free port."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from typing import Any

import pytest

from rmb_relay.config import ListenerConfig
from rmb_relay.dialects.base import Dialect
from rmb_relay.monitoring import add_monitor_routes
from rmb_relay.server.listener import RelayServer
from rmb_relay.telemetry.metrics import Registry
from tests import hang_guard
from tests.redis_process import RedisServer as RedisServer
from tests.redis_process import free_port as free_port
from tests.redis_process import start_redis as start_redis

#: every wait in a test is bounded by this (a hang is a failure, not a stuck CI)
WAIT = 10.0


def pytest_configure(config: pytest.Config) -> None:
    # a failing or stuck test fails; it never hangs the run (why pytest-timeout is not enough:
    # tests/hang_guard.py)
    config.pluginmanager.register(hang_guard, "rmb-relay-hang-guard")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test runs on uvloop, the loop the relay runs on in production (closing it
    cannot hang: `hang_guard.new_event_loop`)."""
    return {"uvloop": hang_guard.new_event_loop}


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
        server = RelayServer(
            ListenerConfig(**config), dialects or [], registry, routes=(add_monitor_routes,)
        )
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await asyncio.wait_for(server.shutdown(), WAIT)


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
