"""The fault scenarios, each run under steady traffic and ending with every accepted message's
fate (`Outcome`); the tests assert on them, `bench.faults` prints them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tests.faultlab.checker import Checker, Fates
from tests.faultlab.rmb import RmbRequests
from tests.faultlab.world import World, wait_until

#: requests a second of the steady traffic
RATE = 100.0
#: how long the traffic runs before a fault (answers flowing both ways first)
WARMUP_ANSWERS = 50
#: after the traffic stops, how long accepted messages may take to meet their fate
SETTLE = 60.0


@dataclass(frozen=True)
class Outcome:
    scenario: str
    fates: Fates
    #: seconds from the heal until traffic was answered again and presence was single
    recover_s: float | None
    rss_mib: float
    presence_single: bool

    def line(self) -> str:
        recover = "-" if self.recover_s is None else f"{self.recover_s:.1f} s"
        rss = f"RSS {self.rss_mib:.0f} MiB"
        return f"{self.scenario}: {self.fates.line()}; recovered in {recover}; {rss}"


async def _single_presence(world: World) -> bool:
    """Twin 1 (the sender) held by "a" and twin 2 (the responder) by "b", each on exactly the
    instance its one connection is on."""
    return await world.holders("r:1") == "a" and await world.holders("r:2") == "b"


async def _warm(traffic: RmbRequests, checker: Checker) -> None:
    await wait_until(lambda: checker.answered_count >= WARMUP_ANSWERS, 30)


async def _recovered(world: World, traffic: RmbRequests, checker: Checker, timeout: float) -> float:
    """Seconds from now until a request sent after now is answered and presence is single."""
    started = time.monotonic()
    mark = traffic.next_id
    await wait_until(lambda: checker.answered_since(traffic.prefix, mark), timeout)
    await wait_until(lambda: _single_presence(world), timeout)
    return time.monotonic() - started


async def rmb_cut_from_redis(world: World, cut: float, *, rate: float = RATE) -> Outcome:
    """(a) instance a's link to Redis black-holed for `cut` seconds while twin 1 on a asks
    twin 2 on b `rate` times a second; then healed."""
    checker = Checker()
    traffic = RmbRequests(checker)
    a, b = world.instances["a"], world.instances["b"]
    try:
        await traffic.open(a.url, b.url)
        await wait_until(lambda: _single_presence(world), 30)
        traffic.start(rate)
        await _warm(traffic, checker)
        a.to_redis.black_hole()
        await asyncio.sleep(cut)  # the fault's length
        a.to_redis.heal()
        recover = await _recovered(world, traffic, checker, 120)
        await traffic.stop()
        await checker.settle(SETTLE)
        single = await _single_presence(world)
        return Outcome(
            f"rmb a cut from redis {cut:g} s", checker.report(), recover, world.rss_mib(), single
        )
    finally:
        await traffic.close()
