"""Faults between hosts, RMB (docs/faults.md): relay instances, Redis and clients on their own
network namespaces, one link made faulty under steady request/response traffic; nothing the
relay accepted may be silently lost, and once healed every twin is held by exactly one
instance. The longer variants run in `python -m bench.faults`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.faultlab.netns import LabUnavailable, check_available
from tests.faultlab.scenarios import (
    rmb_cluster_failover,
    rmb_cut_from_clients,
    rmb_cut_from_redis,
    rmb_federation_partition,
)
from tests.faultlab.world import ClusterInstances, FederatedPair, TwoInstances, World

#: the relays' presence TTL: a 10 s cut is five of them
TTL = 2.0


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    try:
        check_available()
    except LabUnavailable as err:
        pytest.skip(f"fault lab unavailable: {err}")
    async with TwoInstances(ttl=TTL, logs=tmp_path) as made:
        yield made


def _logs(world: World) -> str:
    return "".join(
        f"\n--- {name} ---\n" + "".join(instance.relay.log.lines[-40:])
        for name, instance in world.instances.items()
    )


@pytest.mark.timeout(90)
async def test_an_instance_cut_from_redis_past_the_ttl_loses_nothing(world: World) -> None:
    """(a) a's link to Redis held for 10 s (b declares a gone and takes its stream over) while
    twin 1 on a asks twin 2 on b 100 times a second; healed, every request was answered or
    refused with an error the sender saw, and each twin is held by its own instance."""
    outcome = await rmb_cut_from_redis(world, 10.0)
    fates = outcome.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}" + _logs(world)
    assert fates.delivered_once + fates.delivered_more > fates.accepted // 2, fates.line()
    assert outcome.presence_single, _logs(world)
    assert not outcome.resumed_while_cut, _logs(world)
    assert "is gone; taking over" in "".join(world.instances["b"].relay.log.lines)


@pytest.mark.timeout(90)
async def test_an_instance_cut_from_its_clients_loses_nothing(world: World) -> None:
    """(b) the link between a and its clients held for 10 s (a still reaches Redis) while twin
    1 on b asks twin 2 on a: what a wrote meanwhile reaches twin 2 at the heal, every request
    is answered, nothing moves."""
    outcome = await rmb_cut_from_clients(world, 10.0)
    fates = outcome.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}" + _logs(world)
    assert fates.delivered_once + fates.delivered_more > fates.accepted // 2, fates.line()
    assert outcome.presence_single, _logs(world)


@pytest.mark.timeout(90)
async def test_clients_that_give_up_on_a_cut_connection_lose_nothing(world: World) -> None:
    """(b) past the clients' give-up time: the link between a and its clients held for 10 s
    while the clients give a silent connection up after 4 s (the SDK's default is 40 s; the
    bench runs a 45 s cut with it). Twin 2 reconnects, keeps reading the connection it gave
    up, and at the heal gets what a wrote into it before a closes it for the new login."""
    outcome = await rmb_cut_from_clients(world, 10.0, dead_after=4.0)
    fates = outcome.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}" + _logs(world)
    assert fates.delivered_once + fates.delivered_more > fates.accepted // 2, fates.line()
    assert outcome.presence_single, _logs(world)
    assert "replaced by a newer connection" in "".join(world.instances["a"].relay.log.lines)


@pytest.fixture
async def federated(tmp_path: Path) -> AsyncIterator[World]:
    try:
        check_available()
    except LabUnavailable as err:
        pytest.skip(f"fault lab unavailable: {err}")
    async with FederatedPair(logs=tmp_path) as made:
        yield made


@pytest.mark.timeout(120)
async def test_federated_relays_partitioned_lose_nothing(federated: World) -> None:
    """(e) two federated relays unable to reach each other for 30 s while twin 1 on a asks
    twin 2 on b: the outbound queues keep what they accepted and post it once the link is
    back; duplicates only of the batches in flight when the link was cut."""
    outcome = await rmb_federation_partition(federated, 30.0)
    fates = outcome.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}" + _logs(federated)
    assert fates.delivered_once + fates.delivered_more > fates.accepted // 2, fates.line()


@pytest.fixture
async def on_cluster(tmp_path: Path) -> AsyncIterator[World]:
    try:
        check_available()
    except LabUnavailable as err:
        pytest.skip(f"fault lab unavailable: {err}")
    async with ClusterInstances(ttl=TTL, logs=tmp_path) as made:
        yield made


@pytest.mark.timeout(150)
async def test_a_redis_cluster_failover_loses_nothing(on_cluster: World) -> None:
    """(d) Redis Cluster, a replica per primary: the primary holding a's bus stream killed
    and its replica promoted, then a manual failover of another shard, while twin 1 on a asks
    twin 2 on b: what Redis could not take while a shard had no primary is refused with an
    error the sender sees, the rest answered; each twin held by its own instance after."""
    outcome = await rmb_cluster_failover(on_cluster)
    fates = outcome.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}" + _logs(on_cluster)
    assert fates.delivered_once + fates.delivered_more > 0, fates.line()
    assert outcome.presence_single, _logs(on_cluster)
