"""Faults between hosts, HTTP tunnel (docs/faults.md): a client on instance a POSTs through a
tenant whose connector is on instance b (every request crosses the tenant's work queue in
Redis), a's link to Redis cut under that traffic. Every request is answered or refused with
an error status, and a request refused is never run: a publish the relay gave up on may land
when the link heals, so it is withdrawn before the client hears of it
(`dialects/tunnel/scaleout.py`). The bench runs the same scenario with longer deadlines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.faultlab.netns import LabUnavailable, check_available
from tests.faultlab.scenarios import tunnel_cut_from_redis
from tests.faultlab.tunnel import SECRET, TENANT
from tests.faultlab.world import TwoInstances, World

#: the relays' presence TTL: the cut is past it (b declares a gone, reaps its bus stream)
TTL = 2.0
#: deadlines short enough that every request meets its fate soon after the heal
FLAGS = ("--tunnel-request-ttl", "15", "--tunnel-response-timeout", "15")


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    try:
        check_available()
    except LabUnavailable as err:
        pytest.skip(f"fault lab unavailable: {err}")
    async with TwoInstances(
        ttl=TTL, logs=tmp_path, tenants=[(TENANT, SECRET)], extra=FLAGS
    ) as made:
        yield made


@pytest.mark.timeout(120)
async def test_a_tunnel_request_refused_during_a_redis_cut_is_never_run(world: World) -> None:
    """(a) a's link to Redis held for 10 s while its client sends 100 requests a second to
    b's connector: each is answered or refused, none silently lost, and none of the refused
    reached the target."""
    outcome = await tunnel_cut_from_redis(world, 10.0)
    fates = outcome.fates
    assert fates.lost == 0, f"{fates.line()}; lost {fates.lost_ids}"
    assert fates.refused_delivered == 0, f"{fates.line()}: {fates.refused_delivered_why}"
    assert fates.refused > 0, fates.line()  # the cut was felt
    assert fates.delivered_once + fates.delivered_more > 0, fates.line()
