"""The fault scenarios: steady traffic of one or more dialects (`Flow`s) through one fault,
ending with every accepted message's fate, per dialect (`Outcome`); the tests assert on them,
`bench.faults` prints them.

One runner for all of them (`run`): each flow's clients connect and its presence settles, every
flow starts at `RATE`, the fault runs until its heal once each flow has carried
`WARMUP_ANSWERS`, then each flow's recovery is timed (a message sent after the heal got
through, and presence is single again), the traffic stops, and every message gets up to its
flow's settle time to meet its fate.

- `mixed` runs RMB, SBD, 신경 SEND, 신경 QUEUE and the HTTP tunnel at once through (a) a cut
  from Redis, (b) a cut from the clients, (c) slow, lossy Redis links or (d) a Redis Cluster
  failover: one checker per dialect, so a fault one dialect's traffic makes worse for another
  shows up too.
- (e) and (f) are RMB's alone: only RMB federates (`rmb_federation_partition`), and only RMB
  looks its twins up on the chain (`rmb_chain_slow_then_down`): SBD keys, 신경 clients and
  tunnel tenants do not use the twin directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from redis.crc import key_slot

from rmb_relay.cluster import keys
from rmb_relay.dialects.singyeong.cluster import TOPIC as SG_TOPIC
from rmb_relay.dialects.singyeong.cluster import client_key, gateway_name
from rmb_relay.dialects.tunnel.scaleout import TOPIC as TUNNEL_TOPIC
from rmb_relay.dialects.tunnel.tenants import normalize
from rmb_relay.sdk.link import DEAD_AFTER
from tests.faultlab.checker import Checker, Fates
from tests.faultlab.rmb import RmbRequests
from tests.faultlab.sbd import SbdForwards
from tests.faultlab.services import RedisNode
from tests.faultlab.singyeong import SgQueue, SgSends
from tests.faultlab.traffic import PacedTraffic
from tests.faultlab.tunnel import SECRET, TENANT, TunnelRequests
from tests.faultlab.world import (
    ClusterInstances,
    ClusterNode,
    TwoInstances,
    World,
    cluster_settled,
    cluster_view,
    node_command,
    wait_until,
)
from tests.scrape import scrape

#: messages a second of each flow's steady traffic
RATE = 100.0
#: how many messages each flow carries before the fault (traffic flowing both ways first)
WARMUP_ANSWERS = 50
#: after the traffic stops, how long accepted messages may take to meet their fate
SETTLE = 60.0
#: how long a flow may take to recover after the heal before it counts as not recovered
RECOVER_WAIT = 120.0

#: SBD clients of the lab send and receive without keepalives of their own, faster than the
#: default per-connection rate allows
SBD_FLAGS = ("--sbd-idle-ms", "600000", "--sbd-disable-rate-limit")


def tunnel_flags(ttl: float) -> tuple[str, ...]:
    """The tunnel's deadlines: its clients wait for the relay's answer (no deadline of their
    own), so these decide how soon every request meets its fate after the heal."""
    return ("--tunnel-request-ttl", f"{ttl:g}", "--tunnel-response-timeout", f"{ttl:g}")


def mixed_world(
    *, ttl: float, tunnel_ttl: float, cluster: bool = False, logs: Path | None = None
) -> TwoInstances | ClusterInstances:
    """The world `mixed` runs in: two instances on one Redis (or, `cluster`, on a Redis
    Cluster with a replica per primary), with the tunnel's tenant and SBD's flags. Every lab
    client comes from the test process's one address, where a deployment's come from many:
    the per-IP connection cap is raised past what a cut can pile up (the tunnel's client opens
    a connection per request, 100 a second, each held by a 45 s cut: 4,500 > the default 4,096,
    and the 429s, and a scrape refused with them, measured the cap, not the fault)."""
    extra = (*SBD_FLAGS, *tunnel_flags(tunnel_ttl), "--max-connections-per-ip", "100000")
    tenants = [(TENANT, SECRET)]
    if cluster:
        return ClusterInstances(ttl=ttl, extra=extra, logs=logs, tenants=tenants)
    return TwoInstances(ttl=ttl, extra=extra, logs=logs, tenants=tenants)


# ---- what a run reports ------------------------------------------------------------------


@dataclass(frozen=True)
class FlowOutcome:
    dialect: str
    fates: Fates
    #: seconds from the heal until a message sent after it got through and presence was single
    #: (None: not within `RECOVER_WAIT`)
    recover_s: float | None
    presence_single: bool

    @property
    def delivered(self) -> int:
        return self.fates.delivered_once + self.fates.delivered_more


@dataclass(frozen=True)
class Outcome:
    scenario: str
    flows: tuple[FlowOutcome, ...]
    rss_mib: float
    #: times an instance logged that Redis was back while its link was still cut
    resumed_while_cut: int = 0
    #: messages the relays dropped and counted during the run (`counted_drops`): the most a
    #: best-effort flow (SBD) may lose without a silent loss
    counted_drops: int = 0

    def __getitem__(self, dialect: str) -> FlowOutcome:
        return next(flow for flow in self.flows if flow.dialect == dialect)

    @property
    def recover_s(self) -> float | None:
        times = [flow.recover_s for flow in self.flows]
        return None if None in times else max(t for t in times if t is not None)

    def lines(self) -> list[str]:
        rss = f"RSS {self.rss_mib:.0f} MiB"
        out = [f"{self.scenario}: {rss}, counted drops {self.counted_drops}"]
        for flow in self.flows:
            recover = "-" if flow.recover_s is None else f"{flow.recover_s:.1f} s"
            single = "" if flow.presence_single else "; PRESENCE NOT SINGLE"
            out.append(f"  {flow.dialect}: {flow.fates.line()}; recovered in {recover}{single}")
        return out


# ---- flows -------------------------------------------------------------------------------


@dataclass
class Flow:
    """One dialect's steady traffic from a sender on instance `where[0]` to a receiver on
    `where[1]`, and how the runner sees it."""

    dialect: str
    traffic: PacedTraffic
    checker: Checker
    #: connect its clients until traffic can flow
    connect: Callable[[], Awaitable[None]]
    #: each of its clients held by the instance its connection is on, and by no other
    single: Callable[[], Awaitable[bool]]
    settle: float = SETTLE
    #: best effort (SBD: no refusal the sender could see): what it loses is accounted for by
    #: the relays' counted drops; settling stops once what is unknown is no more than those
    best_effort: bool = False

    def carried(self) -> int:
        checker = self.checker
        return checker.delivered_count if checker.one_way else checker.answered_count

    def through_since(self, mark: int) -> bool:
        """Whether a message numbered `mark` or later got through."""
        prefix = self.traffic.prefix
        if self.checker.one_way:
            return self.checker.delivered_since(prefix, mark)
        return self.checker.answered_since(prefix, mark)


async def _held_by(world: World, name: str, instance: str) -> bool:
    return await world.holders(name) == instance


def rmb_flow(
    world: World, where: tuple[str, str], *, dead_after: float = DEAD_AFTER, presence: bool = True
) -> Flow:
    """Twin 1 on `where[0]` asks twin 2 on `where[1]`, which answers each request; both give a
    silent connection up after `dead_after`. `presence=False`: no Redis (federated relays),
    where each twin's one connection is all there is."""
    checker = Checker()
    traffic = RmbRequests(checker, dead_after=dead_after)
    sender, responder = (world.instances[name] for name in where)

    async def connect() -> None:
        await traffic.open(sender.url, responder.url)

    async def single() -> bool:
        if not presence:
            return True
        return await _held_by(world, "r:1", where[0]) and await _held_by(world, "r:2", where[1])

    return Flow("rmb", traffic, checker, connect, single)


def sbd_flow(world: World, where: tuple[str, str]) -> Flow:
    """A client on `where[0]` forwards to a key connected to `where[1]`. SBD is best effort (no
    mailbox, no error to the sender): what the relay could not pass on is dropped and
    counted."""
    checker = Checker(one_way=True)
    traffic = SbdForwards(checker)
    sender, receiver = (world.instances[name] for name in where)

    async def connect() -> None:
        await traffic.open(sender.from_clients.address, receiver.from_clients.address)

    async def single() -> bool:
        assert traffic.sender is not None
        assert traffic.receiver is not None
        return await _held_by(
            world, keys.address_name(traffic.sender.pubkey), where[0]
        ) and await _held_by(world, keys.address_name(traffic.receiver.pubkey), where[1])

    return Flow("sbd", traffic, checker, connect, single, settle=10.0, best_effort=True)


class SgSendsApart(SgSends):
    """`SgSends` under application ids of its own, so that it shares a world with the QUEUE
    flow (`SgQueue`, applications "caller" and "api"): a SEND to "api" could reach the QUEUE
    worker, which counts QUEUE frames only."""

    APP, CALLER = "send-api", "send-caller"


#: (application, client) of the 신경 flows' sender and receiver (`SgSendsApart`, `SgQueue`)
_SG_IDS = {
    queue: ((kind.CALLER, kind.CALLER_CLIENT), (kind.APP, kind.WORKER))
    for queue, kind in ((False, SgSendsApart), (True, SgQueue))
}


def sg_flow(world: World, where: tuple[str, str], *, queue: bool = False) -> Flow:
    """A 신경 client on `where[0]` SENDs (or QUEUEs on "jobs", `queue`) to the one client of an
    application, on `where[1]`. Presence: each client's name claimed by its instance, and its
    entry in that instance's replicated table and no other's."""
    checker = Checker(one_way=True)
    traffic: SgSends = SgQueue(checker) if queue else SgSendsApart(checker)
    sender, receiver = (world.instances[name] for name in where)

    async def connect() -> None:
        await traffic.open(sender.from_clients.address, receiver.from_clients.address)

    async def single() -> bool:
        assert world.probe is not None
        for (app, client), at in zip(_SG_IDS[queue], where, strict=True):
            if not await _held_by(world, gateway_name(app, client), at):
                return False
            for name in world.instances:
                table = keys.table_key(SG_TOPIC, name)
                if bool(await world.probe.hexists(table, client_key(app, client))) != (name == at):
                    return False
        return True

    return Flow("신경 QUEUE" if queue else "신경 SEND", traffic, checker, connect, single)


def tunnel_flow(world: World, where: tuple[str, str]) -> Flow:
    """An HTTP client on `where[0]` POSTs through tenant "acme" to a connector on `where[1]`
    (every request crosses the tenant's work queue in Redis and every answer comes back over
    the origin's bus stream). Presence: the connector's instance, and no other, holds the
    tenant's work queue."""
    checker = Checker()
    traffic = TunnelRequests(checker)
    client, connector = (world.instances[name] for name in where)

    async def connect() -> None:
        await traffic.open(client.from_clients.address, connector.from_clients.address, world.logs)
        await traffic.ready()

    async def single() -> bool:
        assert world.probe is not None
        holders = await world.probe.smembers(keys.work_holders_key(TUNNEL_TOPIC, normalize(TENANT)))
        return {h.decode() if isinstance(h, bytes) else str(h) for h in holders} == {where[1]}

    return Flow("tunnel", traffic, checker, connect, single)


# ---- the runner --------------------------------------------------------------------------

#: a fault run under traffic, up to its heal; returns how often an instance said Redis was
#: back while it was not
Fault = Callable[[], Awaitable[int]]


def _resumed(world: World) -> int:
    return sum(i.relay.log.count("redis is reachable again") for i in world.instances.values())


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


async def counted_drops(world: World) -> int:
    """Messages the instances dropped and counted so far: cluster messages held nowhere
    (`rmb_relay_cluster_messages_total{event="dropped"}`, every dialect's) and SBD forwards to
    a key connected nowhere (`rmb_relay_messages_dropped_total{dialect="sbd"}`). Scraped from
    each instance's own address, not through a link a scenario cuts."""
    total = 0.0
    for instance in world.instances.values():
        page = await scrape(instance.relay.address, instance.relay.port)
        if page.status != 200:
            raise RuntimeError(f"scrape of {instance.relay.address}: {page.status} {page.body}")
        for (name, labels), value in page.samples.items():
            found = dict(labels)
            cluster = name == "rmb_relay_cluster_messages_total" and found.get("event") == "dropped"
            sbd = name == "rmb_relay_messages_dropped_total" and found.get("dialect") == "sbd"
            total += value if cluster or sbd else 0.0
    return int(total)


async def _recovered(flow: Flow) -> float | None:
    """Seconds from now until a message sent after now got through and presence is single."""
    started = time.monotonic()
    mark = flow.traffic.next_id
    try:
        await wait_until(lambda: flow.through_since(mark), RECOVER_WAIT)
        await wait_until(flow.single, RECOVER_WAIT)
    except TimeoutError:
        return None
    return time.monotonic() - started


async def _settle(world: World, flow: Flow, drops_before: int) -> None:
    if not flow.best_effort:
        await flow.checker.settle(flow.settle)
        return

    async def accounted() -> bool:
        return flow.checker.outstanding <= await counted_drops(world) - drops_before

    with contextlib.suppress(TimeoutError):
        await wait_until(accounted, flow.settle, step=0.25)


async def _within(what: str, predicate: object, timeout: float) -> None:
    """`wait_until`, failing with what did not happen (a bare TimeoutError reads as the test's
    own timeout)."""
    try:
        await wait_until(predicate, timeout)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout:g} s") from None


async def run(
    world: World, scenario: str, flows: Sequence[Flow], fault: Fault, *, rate: float = RATE
) -> Outcome:
    """Every flow at `rate` while `fault()` runs (until its heal); then every accepted
    message's fate, per flow."""
    async with AsyncExitStack() as stack:
        for flow in flows:
            stack.push_async_callback(flow.traffic.close)  # also when a later connect fails
            await flow.connect()
        for flow in flows:
            await _within(f"{flow.dialect}: presence single", flow.single, 30)
        drops = await counted_drops(world)
        for flow in flows:
            flow.traffic.start(rate)
        await _within(
            "warm-up of every flow", lambda: all(f.carried() >= WARMUP_ANSWERS for f in flows), 30
        )
        early = await fault()
        recovered = await asyncio.gather(*(_recovered(flow) for flow in flows))
        for flow in flows:
            await flow.traffic.stop()
        await asyncio.gather(*(_settle(world, flow, drops) for flow in flows))
        results = []
        for flow, recover in zip(flows, recovered, strict=True):
            single = await flow.single()
            results.append(FlowOutcome(flow.dialect, flow.checker.report(), recover, single))
        dropped = await counted_drops(world) - drops
        return Outcome(scenario, tuple(results), world.rss_mib(), early, dropped)


# ---- the faults --------------------------------------------------------------------------


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


#: the faults `mixed` runs through
FAULTS = ("cut", "clients", "slow", "failover")


def _fault(world: World, fault: str, seconds: float) -> tuple[str, Fault, tuple[str, str]]:
    """(its label, the fault, (the senders' instance, the receivers')) of one of `FAULTS`:
    "cut" (a) a's link to Redis black-holed, the senders on a; "clients" (b) the link between
    a and its clients black-holed (a still reaches Redis), the receivers on a, so that what a
    writes to them waits in the cut; "slow" (c) every instance's Redis link 50 ± 20 ms each
    way with 1% of chunks resetting their connection; "failover" (d) `_failover`, on a Redis
    Cluster."""
    a = world.instances["a"]
    if fault == "cut":
        link = a.to_redis
        assert link is not None
        label = f"a cut from redis {seconds:g} s"
        return label, _cut_for(world, link.black_hole, link.heal, seconds), ("a", "b")
    if fault == "clients":
        label = f"a cut from its clients {seconds:g} s"
        cut = _cut_for(world, a.from_clients.black_hole, a.from_clients.heal, seconds)
        return label, cut, ("b", "a")
    if fault == "slow":
        degrade, heal = _degrade_redis_links(world, 0.05, 0.02, 0.01)
        label = f"redis links 50±20 ms, 1% resets {seconds:g} s"
        return label, _cut_for(world, degrade, heal, seconds), ("a", "b")
    if fault == "failover":
        return "redis cluster failover", _failover(world), ("a", "b")
    raise ValueError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")


# ---- the scenarios -----------------------------------------------------------------------


async def mixed(
    world: World,
    fault: str,
    seconds: float = 0.0,
    *,
    dead_after: float = DEAD_AFTER,
    swapped: bool = False,
    rate: float = RATE,
) -> Outcome:
    """RMB, SBD, 신경 SEND, 신경 QUEUE and tunnel traffic at `rate` each, all at once, through
    one of `FAULTS` lasting `seconds` (`_fault` says where the senders and receivers are;
    `swapped`: the other way round; a failover takes as long as it takes). `world` is a
    `mixed_world`. The RMB clients give a silent connection up after `dead_after` (a cut from
    the clients longer than that makes them reconnect while the old connection still holds
    what a wrote)."""
    label, run_fault, where = _fault(world, fault, seconds)
    if swapped:
        where = (where[1], where[0])
        label += f", receivers on {where[1]}"
    if dead_after != DEAD_AFTER:
        label += f" (clients give up after {dead_after:g} s)"
    flows = [
        rmb_flow(world, where, dead_after=dead_after),
        sbd_flow(world, where),
        sg_flow(world, where),
        sg_flow(world, where, queue=True),
        tunnel_flow(world, where),
    ]
    return await run(world, f"mixed {label}", flows, run_fault, rate=rate)


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
    flow = rmb_flow(world, ("a", "b"), presence=False)
    return await run(world, name, [flow], fault, rate=rate)


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
    return await run(world, name, [rmb_flow(world, ("a", "b"))], fault, rate=rate)
