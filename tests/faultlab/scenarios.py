"""The fault scenarios, each run under steady traffic and ending with every accepted message's
fate (`Outcome`); the tests assert on them, `bench.faults` prints them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.crc import key_slot

from rmb_relay.cluster import keys
from rmb_relay.sdk.link import DEAD_AFTER
from tests.faultlab.checker import Checker, Fates
from tests.faultlab.rmb import RmbRequests
from tests.faultlab.sbd import SbdForwards
from tests.faultlab.services import RedisNode
from tests.faultlab.singyeong import SgQueue, SgSends
from tests.faultlab.tunnel import TunnelRequests
from tests.faultlab.world import (
    ClusterNode,
    World,
    cluster_settled,
    cluster_view,
    node_command,
    wait_until,
)

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
    #: times an instance logged that Redis was back while its link was still cut
    resumed_while_cut: int = 0

    def line(self) -> str:
        recover = "-" if self.recover_s is None else f"{self.recover_s:.1f} s"
        rss = f"RSS {self.rss_mib:.0f} MiB"
        return f"{self.scenario}: {self.fates.line()}; recovered in {recover}; {rss}"


async def _single_presence(world: World, sender: str = "a", responder: str = "b") -> bool:
    """Twin 1 (the sender) and twin 2 (the responder) each held by the one instance its one
    connection is on, and by no other."""
    return await world.holders("r:1") == sender and await world.holders("r:2") == responder


def _resumed(world: World) -> int:
    return sum(i.relay.log.count("redis is reachable again") for i in world.instances.values())


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


#: a fault run under traffic, up to its heal; returns how often an instance said Redis was
#: back while it was not
Fault = Callable[[], Awaitable[int]]


def _cut_for(
    world: World, cut: Callable[[], None], heal: Callable[[], None], seconds: float
) -> Fault:
    async def fault() -> int:
        cut()
        resumed = _resumed(world)
        await asyncio.sleep(seconds)  # the fault's length
        early = _resumed(world) - resumed
        heal()
        return early

    return fault


async def _run_fault(
    world: World,
    scenario: str,
    where: tuple[str, str],
    fault: Fault,
    rate: float,
    *,
    presence: bool = True,
    dead_after: float = DEAD_AFTER,
) -> Outcome:
    """Steady requests from twin 1 on `where[0]` to twin 2 on `where[1]`; `fault()` runs
    under it (until its heal); then every accepted request's fate."""
    checker = Checker()
    traffic = RmbRequests(checker, dead_after=dead_after)
    sender, responder = (world.instances[name] for name in where)

    async def single() -> bool:
        # without Redis (federated relays) each twin's one connection is all there is
        return not presence or await _single_presence(world, *where)

    try:
        await traffic.open(sender.url, responder.url)
        await wait_until(single, 30)
        traffic.start(rate)
        await _warm(traffic, checker)
        early = await fault()
        recover = await _recovered(traffic, checker, 120, single)
        await traffic.stop()
        await checker.settle(SETTLE)
        fates = checker.report()
        return Outcome(scenario, fates, recover, world.rss_mib(), await single(), early)
    finally:
        await traffic.close()


async def rmb_cut_from_redis(world: World, cut: float, *, rate: float = RATE) -> Outcome:
    """(a) instance a's link to Redis black-holed for `cut` seconds while twin 1 on a asks
    twin 2 on b `rate` times a second; then healed."""
    link = world.instances["a"].to_redis
    assert link is not None
    name = f"rmb a cut from redis {cut:g} s"
    fault = _cut_for(world, link.black_hole, link.heal, cut)
    return await _run_fault(world, name, ("a", "b"), fault, rate)


async def rmb_cut_from_clients(
    world: World, cut: float, *, rate: float = RATE, dead_after: float = DEAD_AFTER
) -> Outcome:
    """(b) instance a's clients' link to it black-holed for `cut` seconds (a still reaches
    Redis) while twin 1 on b asks twin 2 on a; then healed. The clients give a silent
    connection up after `dead_after` (a cut longer than that makes them reconnect while the
    old connection still holds what a wrote)."""
    link = world.instances["a"].from_clients
    name = f"rmb a cut from its clients {cut:g} s"
    if dead_after != DEAD_AFTER:
        name += f" (clients give up after {dead_after:g} s)"
    fault = _cut_for(world, link.black_hole, link.heal, cut)
    return await _run_fault(world, name, ("b", "a"), fault, rate, dead_after=dead_after)


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
    fault = _cut_for(world, cut_links, heal_links, cut)
    return await _run_fault(world, name, ("a", "b"), fault, rate, presence=False)


async def _primary_of(world: World, key: str) -> tuple[RedisNode, ClusterNode]:
    """The live node serving `key`'s slot as primary, and its view entry."""
    slot = key_slot(key.encode())
    live = [node for node in world.nodes if node.process.poll() is None]
    for entry in await cluster_view(live[0]):
        if entry.master and not entry.failed and any(lo <= slot <= hi for lo, hi in entry.slots):
            node = next(n for n in live if f"{n.host.address}:{n.port}" == entry.address)
            return node, entry
    raise RuntimeError(f"no live primary serves slot {slot} of {key}")


def _failover(world: World) -> Fault:
    """(d) on a Redis Cluster with a replica per primary: the primary holding instance a's
    bus stream killed (its replica promoted), then a manual failover of the shard holding
    b's."""

    async def fault() -> int:
        node, _ = await _primary_of(world, keys.bus_key("a"))
        node.kill()  # SIGKILL: what it had not replicated yet is gone with it
        await wait_until(lambda: cluster_settled(world), 60, step=0.1)
        _, entry = await _primary_of(world, keys.bus_key("b"))
        live = [n for n in world.nodes if n.process.poll() is None]
        view = await cluster_view(live[0])
        replica = next(n for n in view if n.of == entry.node_id and not n.failed)
        target = next(n for n in live if f"{n.host.address}:{n.port}" == replica.address)
        await node_command(target, "CLUSTER", "FAILOVER")

        async def promoted() -> bool:
            mine = [n for n in await cluster_view(target) if n.node_id == replica.node_id]
            return bool(mine) and mine[0].master and await cluster_settled(world)

        await wait_until(promoted, 60, step=0.1)
        return 0

    return fault


async def rmb_cluster_failover(world: World, *, rate: float = RATE) -> Outcome:
    """(d) `_failover` while twin 1 on a asks twin 2 on b."""
    return await _run_fault(world, "rmb redis cluster failover", ("a", "b"), _failover(world), rate)


async def rmb_slow_lossy_redis(
    world: World,
    seconds: float,
    *,
    mean: float = 0.05,
    jitter: float = 0.02,
    resets: float = 0.01,
    rate: float = RATE,
) -> Outcome:
    """(c) every instance's link to Redis slowed to `mean ± jitter` s each way, and `resets`
    of the chunks crossing it resetting their connection, for `seconds`, while twin 1 on a
    asks twin 2 on b; then healed."""
    degrade, heal = _degrade_redis_links(world, mean, jitter, resets)
    name = (
        f"rmb redis links {mean * 1000:g}±{jitter * 1000:g} ms, {resets:.0%} resets {seconds:g} s"
    )
    fault = _cut_for(world, degrade, heal, seconds)
    return await _run_fault(world, name, ("a", "b"), fault, rate)


async def rmb_chain_slow_then_down(
    world: World, seconds: float, *, delay: float = 0.5, rate: float = RATE
) -> Outcome:
    """(f) the twin directory's chain node `delay` s away (each way) for `seconds`, then
    unreachable (black-holed) for `seconds`, while twin 1 on a asks twin 2 on b (the twin
    cache's entries expire meanwhile); then healed."""
    link = world.to_chain
    assert link is not None

    async def fault() -> int:
        link.latency(delay)
        await asyncio.sleep(seconds)  # the fault's length
        link.black_hole()
        await asyncio.sleep(seconds)
        link.heal()
        return 0

    name = f"rmb chain {delay * 1000:g} ms {seconds:g} s, then down {seconds:g} s"
    return await _run_fault(world, name, ("a", "b"), fault, rate)


def _degrade_redis_links(
    world: World, mean: float, jitter: float, resets: float
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(degrade, heal) of (c): every instance's Redis link slowed and resetting."""
    links = [i.to_redis for i in world.instances.values() if i.to_redis is not None]

    def degrade() -> None:
        for link in links:
            link.latency(mean, jitter)
            link.resets(resets)

    def heal() -> None:
        for link in links:
            link.heal()

    return degrade, heal


def _redis_fault(world: World, fault: str, seconds: float) -> tuple[str, Fault]:
    """A one-way scenario's Redis fault: "cut" (a) a's link black-holed, "slow" (c) every
    link 50 ± 20 ms and 1% resets, "failover" (d) on a Redis Cluster; (its name, the
    fault)."""
    if fault == "failover":
        return "redis cluster failover", _failover(world)
    if fault == "slow":
        degrade, heal = _degrade_redis_links(world, 0.05, 0.02, 0.01)
        label = f"redis links 50±20 ms, 1% resets {seconds:g} s"
        return label, _cut_for(world, degrade, heal, seconds)
    link = world.instances["a"].to_redis
    assert link is not None
    return f"a cut from redis {seconds:g} s", _cut_for(world, link.black_hole, link.heal, seconds)


async def _run_one_way(
    world: World,
    scenario: str,
    traffic: SbdForwards | SgSends,
    checker: Checker,
    fault: Fault,
    rate: float,
    single: Callable[[], Awaitable[bool]] | None,
    settle: float,
) -> Outcome:
    """`traffic` (opened) at `rate` while `fault()` runs; then every message's fate."""
    try:
        traffic.start(rate)
        await wait_until(lambda: checker.delivered_count >= WARMUP_ANSWERS, 30)
        early = await fault()
        started = time.monotonic()
        mark = traffic.next_id
        await wait_until(lambda: checker.delivered_since(traffic.prefix, mark), 120)
        recover = time.monotonic() - started
        await traffic.stop()
        await checker.settle(settle)
        ok = True if single is None else await single()
        return Outcome(scenario, checker.report(), recover, world.rss_mib(), ok, early)
    finally:
        await traffic.close()


async def sbd_cut_from_redis(
    world: World, cut: float, *, rate: float = RATE, fault: str = "cut"
) -> Outcome:
    """(a) for SBD: a's link to Redis black-holed for `cut` seconds while a client on a
    forwards to a key connected to b; then healed (`fault="slow"`: (c) instead; `"failover"`:
    (d), on a Redis Cluster). SBD is best effort (no mailbox, no error to the sender): what
    the relay could not pass on is dropped and counted."""
    checker = Checker(one_way=True)
    traffic = SbdForwards(checker)
    a, b = world.instances["a"], world.instances["b"]
    label, fault_run = _redis_fault(world, fault, cut)
    try:
        await traffic.open(a.from_clients.address, b.from_clients.address)
    except BaseException:
        await traffic.close()
        raise
    assert traffic.receiver is not None
    name = keys.address_name(traffic.receiver.pubkey)
    await wait_until(lambda: _held_by(world, name, "b"), 30)
    return await _run_one_way(
        world,
        f"sbd {label}",
        traffic,
        checker,
        fault_run,
        rate,
        lambda: _held_by(world, name, "b"),
        10.0,
    )


async def _held_by(world: World, name: str, instance: str) -> bool:
    return await world.holders(name) == instance


async def sg_send_cut_from_redis(
    world: World, cut: float, *, rate: float = RATE, queue: bool = False, fault: str = "cut"
) -> Outcome:
    """(a) for the 신경 gateway: a's link to Redis black-holed for `cut` seconds while a client
    on a SENDs (or QUEUEs, `queue`) to the one client of application "api", on b; then
    healed (`fault="slow"`: (c) instead; `"failover"`: (d), on a Redis Cluster)."""
    checker = Checker(one_way=True)
    traffic = SgQueue(checker) if queue else SgSends(checker)
    a, b = world.instances["a"], world.instances["b"]
    label, fault_run = _redis_fault(world, fault, cut)
    try:
        await traffic.open(a.from_clients.address, b.from_clients.address)
    except BaseException:
        await traffic.close()
        raise
    name = f"신경 {'QUEUE' if queue else 'SEND'} {label}"
    return await _run_one_way(world, name, traffic, checker, fault_run, rate, None, SETTLE)


async def tunnel_cut_from_redis(
    world: World, cut: float, *, rate: float = RATE, fault: str = "cut"
) -> Outcome:
    """(a) for the HTTP tunnel: a's link to Redis black-holed for `cut` seconds while a client
    on a POSTs through tenant "acme" to a connector on b (every request crosses the tenant's
    work queue in Redis and every answer comes back through it); then healed
    (`fault="failover"`: (d) instead). Each request is answered, refused with an error
    status, told not known (504), or silently lost (no answer ever)."""
    checker = Checker()
    traffic = TunnelRequests(checker)
    a, b = world.instances["a"], world.instances["b"]
    label, fault_run = _redis_fault(world, fault, cut)
    try:
        await traffic.open(a.from_clients.address, b.from_clients.address, world.logs)
        await traffic.ready()
        traffic.start(rate)
        await wait_until(lambda: checker.answered_count >= WARMUP_ANSWERS, 30)
        early = await fault_run()
        started = time.monotonic()
        mark = traffic.next_id
        await wait_until(lambda: checker.answered_since(traffic.prefix, mark), 120)
        recover = time.monotonic() - started
        await traffic.stop()
        await checker.settle(SETTLE)
        name = f"tunnel {label}"
        return Outcome(name, checker.report(), recover, world.rss_mib(), True, early)
    finally:
        await traffic.close()
