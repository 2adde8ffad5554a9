"""Building blocks for cluster tests: in-process relay instances sharing one real Redis (or
Redis Cluster), each with the RMB and SBD dialects on one switch joined to the cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rmb_relay.cluster import Cluster
from rmb_relay.cluster.connect import RedisClient, connect_redis
from rmb_relay.dialects.rmb import RmbDialect, RmbSettings
from rmb_relay.dialects.sbd import SbdDialect, SbdSettings
from rmb_relay.mailbox import RedisMailbox
from rmb_relay.sdk import Handler, IncomingRequest, RmbClient
from rmb_relay.server.listener import RelayServer
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.telemetry.records import Recorder
from rmb_relay.twins import Twin
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT, StartRelay
from tests.rmb_fixtures import key_for
from tests.sbd_client import SbdClient

#: twins every instance knows: id -> key type
TWINS = {1: "sr25519", 2: "ed25519", 3: "sr25519", 4: "sr25519"}


@dataclass
class Instance:
    """One relay instance: listener, dialects, switch, cluster, and the clients a test opened."""

    server: RelayServer
    rmb: RmbDialect
    sbd: SbdDialect
    switch: Switch
    cluster: Cluster
    redis: RedisClient
    rmb_clients: list[RmbClient] = field(default_factory=list)
    sbd_clients: list[SbdClient] = field(default_factory=list)
    stopped: bool = False

    @property
    def url(self) -> str:
        return self.server.url + "/"

    @property
    def port(self) -> int:
        return self.server.addresses[0][1]

    async def client(
        self, twin: int, sid: str | None = None, handlers: dict[str, Handler] | None = None
    ) -> RmbClient:
        """A connected client; `handlers` are installed before it connects, so a mailbox
        delivered with the login finds them."""
        client = RmbClient(twin, key_for(twin, TWINS[twin]), sid=sid)
        for command, handler in (handlers or {}).items():
            client.handle(command, handler)
        self.rmb_clients.append(client)
        await client.open(self.url)
        return client

    async def sbd_client(self, **kwargs: Any) -> SbdClient:
        client = await SbdClient.connect("127.0.0.1", self.port, **kwargs)
        self.sbd_clients.append(client)
        return client

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for client in self.rmb_clients:  # bounded: a stuck close is a failure, not a hang
            await asyncio.wait_for(client.close(), WAIT)
        for sbd in self.sbd_clients:
            sbd.ws.close()
        await asyncio.wait_for(self.server.shutdown(), WAIT)
        await self.rmb.directory.close()
        # the cluster leaves, then the mailbox closes the client
        await asyncio.wait_for(self.switch.close(), WAIT)


MakeInstance = Callable[..., Awaitable[Instance]]


def recorder(
    into: list[bytes],
    reply: bytes = b"ok",
    *,
    done: asyncio.Event | None = None,
    expect: int = 0,
) -> Handler:
    """A request handler that appends each request's payload to `into`, and sets `done` once
    `into` holds `expect` payloads."""

    def handle(request: IncomingRequest) -> bytes:
        into.append(request.data)
        if done is not None and len(into) == expect:
            done.set()
        return reply

    return handle


def twin_directory(path: Path) -> SqliteTwinDirectory:
    directory = SqliteTwinDirectory(path)
    for twin_id, key_type in TWINS.items():
        directory.add(
            Twin(twin_id, key_for(twin_id, key_type).public_key, frozenset({"relay.test"}), None)
        )
    return directory


@pytest.fixture(name="make_instance")
async def make_instance_fixture(
    start_relay: StartRelay, tmp_path: Path
) -> AsyncIterator[MakeInstance]:
    """`await make_instance(redis_url, cluster_mode=False, clock=..., records=None,
    twin_ttl=0.0, **cluster_kwargs)`: a new instance; `clock` is the RMB dialect's and the
    cluster's, `records` the switch's route-record `Recorder` (the caller starts and closes
    it), `twin_ttl` how long its twin directory caches an answer (a cached twin lets the RMB
    slow path forward without an await, and the fast path cross to other instances)."""
    made: list[Instance] = []
    path = tmp_path / "twins.sqlite3"
    twin_directory(path)

    async def make(
        url: str,
        *,
        cluster_mode: bool = False,
        clock: Callable[[], int] = time.time_ns,
        records: Recorder | None = None,
        twin_ttl: float = 0.0,
        **kwargs: Any,
    ) -> Instance:
        redis = await connect_redis(url, cluster=cluster_mode)
        switch = Switch(RedisMailbox(redis))
        switch.records = records
        registry = Registry()
        cluster = Cluster(redis, switch, registry=registry, clock=clock, **kwargs)
        await cluster.start()
        switch.cluster = cluster
        directory = CachedTwinDirectory(SqliteTwinDirectory(path), ttl=twin_ttl, negative_ttl=0.0)
        rmb = RmbDialect(RmbSettings(), directory, registry, switch=switch, clock=clock)
        sbd = SbdDialect(SbdSettings(disable_rate_limit=True), registry, switch=switch)
        server = await start_relay([rmb, sbd], registry=registry)
        instance = Instance(server, rmb, sbd, switch, cluster, redis)
        made.append(instance)
        return instance

    yield make
    failed: list[Exception] = []
    for instance in made:  # every one, even after one failed to stop
        try:
            await instance.stop()
        except Exception as err:
            failed.append(err)
    if failed:
        raise failed[0]
