"""The fault scenarios, each run under steady traffic and ending with every accepted message's
fate (`Outcome`); the tests assert on them, `bench.faults` prints them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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


async def _single_presence(world: World, sender: str = "a", responder: str = "b") -> bool:
    """Twin 1 (the sender) and twin 2 (the responder) each held by the one instance its one
    connection is on, and by no other."""
    return await world.holders("r:1") == sender and await world.holders("r:2") == responder


async def _warm(traffic: RmbRequests, checker: Checker) -> None:
    await wait_until(lambda: checker.answered_count >= WARMUP_ANSWERS, 30)


async def _recovered(
    traffic: RmbRequests,
    checker: Checker,
    timeout: float,
    single: Callable[[], Awaitable[bool]],
) -> float:
    """Seconds from now until a request sent after now is answered and presence is single."""
    started = time.monotonic()
    mark = traffic.next_id
    await wait_until(lambda: checker.answered_since(traffic.prefix, mark), timeout)
    await wait_until(single, timeout)
    return time.monotonic() - started


async def _run_fault(
    world: World,
    scenario: str,
    where: tuple[str, str],
    cut: Callable[[], None],
    heal: Callable[[], None],
    seconds: float,
    rate: float,
    *,
    presence: bool = True,
) -> Outcome:
    """Steady requests from twin 1 on `where[0]` to twin 2 on `where[1]`; `cut()`, wait
    `seconds` (the fault's length), `heal()`; then every accepted request's fate."""
    checker = Checker()
    traffic = RmbRequests(checker)
    sender, responder = (world.instances[name] for name in where)

    async def single() -> bool:
        # without Redis (federated relays) each twin's one connection is all there is
        return not presence or await _single_presence(world, *where)

    try:
        await traffic.open(sender.url, responder.url)
        await wait_until(single, 30)
        traffic.start(rate)
        await _warm(traffic, checker)
        cut()
        await asyncio.sleep(seconds)  # the fault's length
        heal()
        recover = await _recovered(traffic, checker, 120, single)
        await traffic.stop()
        await checker.settle(SETTLE)
        return Outcome(scenario, checker.report(), recover, world.rss_mib(), await single())
    finally:
        await traffic.close()


async def rmb_cut_from_redis(world: World, cut: float, *, rate: float = RATE) -> Outcome:
    """(a) instance a's link to Redis black-holed for `cut` seconds while twin 1 on a asks
    twin 2 on b `rate` times a second; then healed."""
    link = world.instances["a"].to_redis
    name = f"rmb a cut from redis {cut:g} s"
    return await _run_fault(world, name, ("a", "b"), link.black_hole, link.heal, cut, rate)


async def rmb_cut_from_clients(world: World, cut: float, *, rate: float = RATE) -> Outcome:
    """(b) instance a's clients' link to it black-holed for `cut` seconds (a still reaches
    Redis) while twin 1 on b asks twin 2 on a; then healed."""
    link = world.instances["a"].from_clients
    name = f"rmb a cut from its clients {cut:g} s"
    return await _run_fault(world, name, ("b", "a"), link.black_hole, link.heal, cut, rate)


async def rmb_federation_partition(world: World, cut: float, *, rate: float = RATE) -> Outcome:
    """(e) two federated relays unable to reach each other for `cut` seconds (both ways)
    while twin 1 on a asks twin 2 on b; then healed."""
    links = [instance.from_peers for instance in world.instances.values()]

    def cut_links() -> None:
        for link in links:
            assert link is not None
            link.black_hole()

    def heal_links() -> None:
        for link in links:
            assert link is not None
            link.heal()

    name = f"rmb federated relays partitioned {cut:g} s"
    return await _run_fault(
        world, name, ("a", "b"), cut_links, heal_links, cut, rate, presence=False
    )
