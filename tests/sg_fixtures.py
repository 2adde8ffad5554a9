"""Fixtures for the 신경 gateway tests: a gateway on a free port with a hand-moved clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from rmb_relay.clock import monotonic_clock
from rmb_relay.cluster import Cluster
from rmb_relay.cluster.connect import RedisClient, connect_redis
from rmb_relay.dialects.singyeong import SgSettings, SingyeongDialect
from rmb_relay.mailbox import MemoryMailbox
from rmb_relay.server.listener import RelayServer
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import StartRelay
from tests.helpers import FakeClock
from tests.sg_client import SgClient


@dataclass
class Gateway:
    server: RelayServer
    dialect: SingyeongDialect
    clock: Callable[[], int]
    registry: Registry
    #: the instance's membership of the cluster (with `redis_url`)
    cluster: Cluster | None = None
    clients: list[SgClient] = field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.addresses[0]
        return host, port

    async def connect(self, encoding: str = "json") -> SgClient:
        client = await SgClient.connect(*self.address, encoding)
        self.clients.append(client)
        return client

    async def stop(self) -> None:
        """Shut this instance down (its clients see 1001), as a restart's first half."""
        await self.server.shutdown()

    async def client(
        self, client_id: str, app_id: str = "app", encoding: str = "json", **extra: Any
    ) -> SgClient:
        """Connected and identified."""
        client = await self.connect(encoding)
        await client.identify(client_id, app_id, **extra)
        return client


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def make_gateway(start_relay: StartRelay) -> AsyncIterator[MakeGateway]:
    made: list[Gateway] = []

    redises: list[RedisClient] = []

    async def make(
        *,
        fake_clock: bool = False,
        redis_url: str | None = None,
        cluster_ttl: float = 15.0,
        cluster_mode: bool = False,
        join_cluster: bool = True,
        **settings: Any,
    ) -> Gateway:
        """With `redis_url`, queues live in that Redis and the gateway joins the cluster
        there, as `rmb-relay --redis` does (instance id = `node`, when given), or does not
        with `join_cluster=False` (`--redis --no-cluster`: Redis queues, no cluster);
        `cluster_mode`: the URL names a Redis Cluster node (`--redis-cluster`)."""
        clock: Callable[[], int] = FakeClock() if fake_clock else monotonic_clock
        registry = Registry()
        redis = None
        cluster = None
        if redis_url is not None:
            redis = await connect_redis(redis_url, cluster=cluster_mode)  # as rmb-relay does
            redises.append(redis)
        if redis is not None and join_cluster:
            switch = Switch(MemoryMailbox())
            cluster = Cluster(
                redis, switch, instance_id=settings.get("node"), ttl=cluster_ttl, registry=registry
            )
            await cluster.start()
            switch.cluster = cluster
        dialect = SingyeongDialect(
            SgSettings(**settings), registry, clock=clock, redis=redis, cluster=cluster
        )
        server = await start_relay([dialect], registry=registry)
        gateway = Gateway(server, dialect, clock, registry, cluster)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        for client in gateway.clients:
            await client.close()
        await gateway.dialect.close()
        if gateway.cluster is not None:
            await gateway.cluster.close()
    for redis in redises:
        await redis.aclose()
