"""Faults between hosts, RMB alone (docs/faults.md): (e), two federated relays partitioned
under steady request/response traffic, each relay and its clients on their own network
namespace; nothing a relay accepted may be silently lost. Only RMB federates, so (e) is not
in the mixed scenarios (tests/test_faults_mixed.py); the longer variants run in
`python -m bench.faults`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.faultlab.netns import skip_unless_available
from tests.faultlab.scenarios import rmb_federation_partition
from tests.faultlab.world import FederatedPair, World


def _logs(world: World) -> str:
    return "".join(
        f"\n--- {name} ---\n" + "".join(instance.relay.log.lines[-40:])
        for name, instance in world.instances.items()
    )


@pytest.fixture
async def federated(tmp_path: Path) -> AsyncIterator[World]:
    skip_unless_available()
    async with FederatedPair(logs=tmp_path) as made:
        yield made


@pytest.mark.timeout(120)
async def test_federated_relays_partitioned_lose_nothing(federated: World) -> None:
    """(e) two federated relays unable to reach each other for 30 s while twin 1 on a asks
    twin 2 on b: the outbound queues keep what they accepted and post it once the link is
    back; duplicates only of the batches in flight when the link was cut."""
    outcome = await rmb_federation_partition(federated, 30.0)
    rmb = outcome["rmb"]
    fates = rmb.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}" + _logs(federated)
    assert rmb.delivered > fates.accepted // 2, fates.line()
    assert rmb.recover_s is not None, fates.line() + _logs(federated)
