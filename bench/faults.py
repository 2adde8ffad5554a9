"""Faults between hosts (docs/faults.md): every scenario of the fault lab under steady
traffic, one line per scenario with every accepted message's fate, the time to recover after
the heal and the relays' RSS.

    python -m bench.faults                 # every scenario (needs root: network namespaces)
    python -m bench.faults --only cut-10   # the ones whose name contains the text
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable

from tests.faultlab.netns import LabUnavailable, check_available
from tests.faultlab.scenarios import (
    Outcome,
    rmb_chain_slow_then_down,
    rmb_cluster_failover,
    rmb_cut_from_clients,
    rmb_cut_from_redis,
    rmb_federation_partition,
    rmb_slow_lossy_redis,
    sbd_cut_from_redis,
    sg_send_cut_from_redis,
    tunnel_cut_from_redis,
)
from tests.faultlab.tunnel import SECRET, TENANT
from tests.faultlab.world import ClusterInstances, FederatedPair, TwoInstances, World

#: presence TTL of the relays in the bench: a 10 s cut is well past it
TTL = 3.0

#: the twin cache's TTL in the chain scenario: entries expire during the fault
CHAIN_CACHE_TTL = 2.0

#: SBD clients of the bench send and receive without keepalives of their own, faster than
#: the default per-connection rate allows
SBD_FLAGS = ("--sbd-idle-ms", "600000", "--sbd-disable-rate-limit")

#: the tunnel's clients wait for the relay's answer (no deadline of their own): deadlines short
#: enough that every request meets its fate within the checker's settle time
TUNNEL_FLAGS = ("--tunnel-request-ttl", "30", "--tunnel-response-timeout", "30")

Scenario = Callable[[World], Awaitable[Outcome]]


def _cut(seconds: float) -> Scenario:
    return lambda world: rmb_cut_from_redis(world, seconds)


SCENARIOS: dict[str, Scenario] = {
    "rmb-cut-2": _cut(2),
    "rmb-cut-10": _cut(10),
    "rmb-cut-60": _cut(60),
    "rmb-slow-lossy-redis-30": lambda world: rmb_slow_lossy_redis(world, 30),
    "rmb-clients-cut-10": lambda world: rmb_cut_from_clients(world, 10),
    "rmb-clients-cut-45": lambda world: rmb_cut_from_clients(world, 45),
    "rmb-federation-partition-30": lambda world: rmb_federation_partition(world, 30),
    "rmb-redis-cluster-failover": rmb_cluster_failover,
    "rmb-chain-slow-then-down-15": lambda world: rmb_chain_slow_then_down(world, 15),
    "sbd-cut-10": lambda world: sbd_cut_from_redis(world, 10),
    "sg-send-cut-10": lambda world: sg_send_cut_from_redis(world, 10),
    "sg-queue-cut-10": lambda world: sg_send_cut_from_redis(world, 10, queue=True),
    "tunnel-cut-10": lambda world: tunnel_cut_from_redis(world, 10),
    "sbd-redis-cluster-failover": lambda world: sbd_cut_from_redis(world, 0, fault="failover"),
    "sg-send-redis-cluster-failover": lambda world: sg_send_cut_from_redis(
        world, 0, fault="failover"
    ),
    "sg-queue-redis-cluster-failover": lambda world: sg_send_cut_from_redis(
        world, 0, queue=True, fault="failover"
    ),
    "tunnel-redis-cluster-failover": lambda world: tunnel_cut_from_redis(
        world, 0, fault="failover"
    ),
    "sbd-slow-redis-30": lambda world: sbd_cut_from_redis(world, 30, fault="slow"),
    "sg-send-slow-redis-30": lambda world: sg_send_cut_from_redis(world, 30, fault="slow"),
}


def _world(name: str, ttl: float) -> TwoInstances | FederatedPair | ClusterInstances:
    if "federation" in name:
        return FederatedPair()
    if "redis-cluster" in name:
        if name.startswith("sbd"):
            return ClusterInstances(ttl=ttl, extra=SBD_FLAGS)
        if name.startswith("tunnel"):
            return ClusterInstances(ttl=ttl, tenants=[(TENANT, SECRET)], extra=TUNNEL_FLAGS)
        return ClusterInstances(ttl=ttl)
    if name.startswith("sbd"):
        return TwoInstances(ttl=ttl, extra=SBD_FLAGS)
    if name.startswith("tunnel"):
        return TwoInstances(ttl=ttl, tenants=[(TENANT, SECRET)], extra=TUNNEL_FLAGS)
    if "chain" in name:
        return TwoInstances(ttl=ttl, chain_cache_ttl=CHAIN_CACHE_TTL)
    return TwoInstances(ttl=ttl)


#: scenarios where losing messages is what the dialect allows (docs/faults.md): SBD is best
#: effort
MAY_LOSE = ("sbd-cut-10", "sbd-slow-redis-30", "sbd-redis-cluster-failover")


async def run(only: str | None, ttl: float) -> list[tuple[str, Outcome]]:
    outcomes = []
    for name, scenario in SCENARIOS.items():
        if only is not None and only not in name:
            continue
        async with _world(name, ttl) as world:
            outcome = await scenario(world)
        print(outcome.line(), flush=True)
        if outcome.fates.refusals:
            print(f"  refusals: {'; '.join(outcome.fates.refusals)}", flush=True)
        if outcome.fates.refused_delivered_why:
            done = "; ".join(outcome.fates.refused_delivered_why)
            print(f"  refused, yet delivered: {done}", flush=True)
        outcomes.append((name, outcome))
    return outcomes


def table(outcomes: list[tuple[str, Outcome]]) -> str:
    head = "| scenario | accepted | once | twice+ | refused | lost | recover | RSS MiB |"
    rows = [head, "|---|---|---|---|---|---|---|---|"]
    for _, o in outcomes:
        f = o.fates
        recover = "-" if o.recover_s is None else f"{o.recover_s:.1f} s"
        refused = f"{f.refused}" + (f" (+{f.unknown} 504)" if f.unknown else "")
        rows.append(
            f"| {o.scenario} | {f.accepted} | {f.delivered_once} | {f.delivered_more} | "
            f"{refused} | {f.lost} | {recover} | {o.rss_mib:.0f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the scenarios whose name contains this")
    parser.add_argument("--ttl", type=float, default=TTL, help="the relays' --cluster-ttl")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        check_available()
    except LabUnavailable as err:
        print(f"bench.faults: cannot run: {err}", file=sys.stderr)
        return 2
    outcomes = asyncio.run(run(args.only, args.ttl))
    print(table(outcomes))
    broken = [name for name, o in outcomes if o.fates.lost and name not in MAY_LOSE]
    if broken:
        print(f"bench.faults: silent loss where none is allowed: {', '.join(broken)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
