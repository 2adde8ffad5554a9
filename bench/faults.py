"""Faults between hosts (docs/faults.md): every scenario of the fault lab under steady
traffic, per scenario and per dialect every accepted message's fate, the time to recover
after the heal and the relays' RSS; a markdown table of them all at the end.

    python -m bench.faults                   # every scenario (needs root: network namespaces)
    python -m bench.faults --only cut-10     # the ones whose name contains the text
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
    mixed,
    mixed_world,
    rmb_chain_slow_then_down,
    rmb_federation_partition,
)
from tests.faultlab.world import ClusterInstances, FederatedPair, TwoInstances, World

#: presence TTL of the relays in the bench: a 10 s cut is well past it
TTL = 3.0
#: the twin cache's TTL in the chain scenario: entries expire during the fault
CHAIN_CACHE_TTL = 2.0
#: the tunnel's deadlines: every request meets its fate within the checker's settle time
TUNNEL_TTL = 30.0

Scenario = Callable[[World], Awaitable[Outcome]]


def _mixed(fault: str, seconds: float = 0.0, *, swapped: bool = False) -> Scenario:
    return lambda world: mixed(world, fault, seconds, swapped=swapped)


SCENARIOS: dict[str, Scenario] = {
    "mixed-cut-2": _mixed("cut", 2),
    "mixed-cut-10": _mixed("cut", 10),
    "mixed-cut-60": _mixed("cut", 60),
    "mixed-cut-10-receivers-on-a": _mixed("cut", 10, swapped=True),
    "mixed-clients-cut-10": _mixed("clients", 10),
    "mixed-clients-cut-45": _mixed("clients", 45),
    "mixed-slow-lossy-redis-30": _mixed("slow", 30),
    "mixed-redis-cluster-failover": _mixed("failover"),
    "rmb-federation-partition-30": lambda world: rmb_federation_partition(world, 30),
    "rmb-chain-slow-then-down-15": lambda world: rmb_chain_slow_then_down(world, 15),
}


def _world(name: str, ttl: float) -> TwoInstances | FederatedPair | ClusterInstances:
    if name.startswith("mixed"):
        return mixed_world(ttl=ttl, tunnel_ttl=TUNNEL_TTL, cluster="redis-cluster" in name)
    if "federation" in name:
        return FederatedPair()
    return TwoInstances(ttl=ttl, chain_cache_ttl=CHAIN_CACHE_TTL)


async def run(only: str | None, ttl: float) -> list[Outcome]:
    outcomes = []
    for name, scenario in SCENARIOS.items():
        if only is not None and only not in name:
            continue
        async with _world(name, ttl) as world:
            outcome = await scenario(world)
        print("\n".join(outcome.lines()), flush=True)
        for flow in outcome.flows:
            if flow.fates.refusals:
                print(f"  {flow.dialect} refusals: {'; '.join(flow.fates.refusals)}", flush=True)
            if flow.fates.refused_delivered_why:
                done = "; ".join(flow.fates.refused_delivered_why)
                print(f"  {flow.dialect} refused, yet delivered: {done}", flush=True)
        outcomes.append(outcome)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """One row per scenario and dialect. "refused" counts the tunnel's 504s apart ("+n 504":
    the relay said it cannot tell) and names the refused that were delivered all the same;
    SBD's "lost" names the relays' counted drops of the run (its best effort's bound)."""
    head = "| scenario | dialect | accepted | once | twice+ | refused | lost | recover | RSS MiB |"
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        for i, flow in enumerate(o.flows):
            f = flow.fates
            recover = "-" if flow.recover_s is None else f"{flow.recover_s:.1f} s"
            refused = f"{f.refused}"
            if f.refused_delivered:
                refused += f" ({f.refused_delivered} delivered)"
            if f.unknown:  # the tunnel's 504, 신경's "may or may not" and "queue unknown"
                refused += f" (+{f.unknown} not known, {f.unknown_delivered} delivered)"
            lost = f"{f.lost}"
            if flow.dialect == "sbd" and f.lost:
                lost += f" (≤ {o.counted_drops} counted)"
            if not flow.presence_single:
                lost += ", presence NOT single"
            scenario = o.scenario if i == 0 else ""
            rss = f"{o.rss_mib:.0f}" if i == 0 else ""
            rows.append(
                f"| {scenario} | {flow.dialect} | {f.accepted} | {f.delivered_once} | "
                f"{f.delivered_more} | {refused} | {lost} | {recover} | {rss} |"
            )
    return "\n".join(rows)


def broken(outcome: Outcome) -> list[str]:
    """What breaks a promise of docs/faults.md: a silent loss (SBD: beyond the relays'
    counted drops, its best effort), presence not single after the heal, no recovery."""
    found = []
    for flow in outcome.flows:
        allowed = outcome.counted_drops if flow.dialect == "sbd" else 0
        if flow.fates.lost > allowed:
            found.append(f"{outcome.scenario}, {flow.dialect}: {flow.fates.lost} silently lost")
        if not flow.presence_single:
            found.append(f"{outcome.scenario}, {flow.dialect}: presence not single")
        if flow.recover_s is None:
            found.append(f"{outcome.scenario}, {flow.dialect}: not recovered")
    return found


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
    problems = [problem for outcome in outcomes for problem in broken(outcome)]
    for problem in problems:
        print(f"bench.faults: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
