"""The views of the parts behind the connections: the byte budgets and caps (`budgets`), the
federation's peer relays and queue, the HTTP tunnel's tenants and connectors, the cluster's
instances. Each reads the part's own books when asked; none keeps state of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rmb_relay.budget import ByteBudget
from rmb_relay.clock import NS
from rmb_relay.dialects.rmb.dialect import RmbDialect
from rmb_relay.dialects.singyeong.dialect import SingyeongDialect
from rmb_relay.dialects.tunnel.dialect import TunnelDialect
from rmb_relay.federation.outbound import OutboundFederation
from rmb_relay.mailbox import MemoryMailbox, RedisMailbox

if TYPE_CHECKING:
    from rmb_relay.cluster import Cluster
    from rmb_relay.dialects.base import Dialect
    from rmb_relay.switch import Switch

D = TypeVar("D")

#: how long the cluster view waits for Redis
CLUSTER_TIMEOUT = 2.0


def _switch(dialects: Sequence[Dialect]) -> Switch | None:
    for dialect in dialects:
        switch = getattr(dialect, "switch", None)
        if switch is not None:
            return switch  # type: ignore[no-any-return]
    return None


def _of(dialects: Sequence[Dialect], kind: type[D]) -> D | None:
    """The dialect of that class, if it is on (typed, so that mypy checks what is read)."""
    return next((d for d in dialects if isinstance(d, kind)), None)


def _budget(name: str, used: int, limit: int | None, unit: str = "bytes") -> dict[str, Any]:
    share = round(used / limit, 4) if limit else None
    return {"name": name, "used": used, "limit": limit, "unit": unit, "share": share}


def _byte_budget(name: str, budget: ByteBudget) -> dict[str, Any]:
    entry = _budget(name, budget.held, budget.total_bytes)
    entry["keys"] = len(budget)
    entry["refused"] = dict(budget.refused)
    return entry


def budgets(
    dialects: Sequence[Dialect], connections: int, max_connections: int
) -> list[dict[str, Any]]:
    """Every bound the relay keeps on what others make it hold, with what is used now."""
    out = [_budget("connections", connections, max_connections, "connections")]
    switch = _switch(dialects)
    if switch is not None:
        mailbox = switch.mailbox
        if isinstance(mailbox, MemoryMailbox):
            out.append(_byte_budget("mailbox", mailbox.books))
        elif isinstance(mailbox, RedisMailbox):
            out.append(
                _budget("mailbox redis in flight", mailbox.held_bytes(), mailbox.max_inflight_bytes)
            )
    rmb = _of(dialects, RmbDialect)
    if rmb is not None:
        out.append(_budget("rmb slow path", rmb.slow_bytes, rmb.settings.slow_total_bytes))
        federation = rmb.federation
        if isinstance(federation, OutboundFederation):
            max_held = getattr(federation.queue, "max_held", None)
            out.append(_budget("federation queue", federation.queue.depth(), max_held, "envelopes"))
    sg = _of(dialects, SingyeongDialect)
    if sg is not None:
        queues = sg.queues
        for name, attr in (
            ("singyeong queues", "budget"),
            ("singyeong dead letters", "dead_budget"),
        ):
            budget = getattr(queues, attr, None)
            if isinstance(budget, ByteBudget):
                out.append(_byte_budget(name, budget))
    tunnel = _of(dialects, TunnelDialect)
    if tunnel is not None:
        hub = tunnel.hub
        out.append(_budget("tunnel requests held", hub.core.held_total, hub.settings.total_bytes))
        out.append(_byte_budget("tunnel body store", hub.store.disk))
    return out


def mailbox_depth(dialects: Sequence[Dialect]) -> dict[str, int] | None:
    switch = _switch(dialects)
    if switch is None:
        return None
    return {"messages": switch.mailbox.depth(), "bytes": switch.mailbox.held_bytes()}


def federation(dialects: Sequence[Dialect], wall_now: int) -> dict[str, Any]:
    """The peer relays this relay posted to or failed, and its outbound queue."""
    rmb = _of(dialects, RmbDialect)
    outbound = rmb.federation if rmb is not None else None
    if not isinstance(outbound, OutboundFederation):
        return {"enabled": False, "peers": [], "queue": None}
    ranker = outbound.ranker
    failures = ranker.snapshot()
    by_peer = outbound.stats.peers
    peers = []
    for domain in sorted(set(by_peer) | set(failures)):
        accepted, failed = by_peer.get(domain, (0, 0, 0))[:2]  # [2]: failed rounds (metrics)
        window_failures, rate = failures.get(domain, (0, 0.0))
        peers.append(
            {
                "relay": domain,
                "accepted": accepted,
                "failed": failed,
                "window_failures": window_failures,
                # the ranker's score: failures per hour in its window (lower is tried first)
                "score": round(rate, 3),
                "prior": ranker.priors.get(domain),
            }
        )
    queue = outbound.queue
    oldest = queue.oldest_queued()
    stats = outbound.stats
    return {
        "enabled": True,
        "peers": peers,
        "queue": {
            "depth": queue.depth(),
            "ready": queue.ready(),
            "oldest_age": None if oldest is None else round(max(0, wall_now - oldest) / NS, 3),
        },
        "totals": {
            "accepted": stats.accepted,
            "rejected": stats.rejected,
            "expired": stats.expired,
            "dropped": stats.dropped,
            "retries": stats.retries,
            "failed_posts": stats.failed_posts,
        },
    }


def tunnel(dialects: Sequence[Dialect]) -> dict[str, Any]:
    """Tenants with something here (connectors, requests in flight or queued, bytes held) and
    the connectors connected here."""
    dialect = _of(dialects, TunnelDialect)
    if dialect is None:
        return {"enabled": False, "tenants": [], "connectors": []}
    hub = dialect.hub
    gauges = hub.core.tenant_gauges()
    tenants: list[dict[str, Any]] = [
        {
            "tenant": name,
            "inflight": inflight,
            "queued": queued,
            "connectors": connectors,
            "held_bytes": held,
        }
        for _, name, inflight, queued, connectors, held in gauges
    ]
    connectors = [
        {"id": conn_id, "tenant": s.tenant_name, "connector": s.connection_id}
        for conn_id, s in hub.sessions.items()
    ]
    return {
        "enabled": True,
        "tenants": sorted(tenants, key=lambda t: str(t["tenant"])),
        "connectors": connectors,
        "inflight": sum(g[2] for g in gauges),
        "queued": sum(g[3] for g in gauges),
    }


async def cluster(dialects: Sequence[Dialect]) -> dict[str, Any]:
    """This instance, every instance Redis knows and whether it is alive (asked now, within
    `CLUSTER_TIMEOUT`), and the presence entries this instance holds."""
    switch = _switch(dialects)
    node: Cluster | None = getattr(switch, "cluster", None) if switch is not None else None
    sessions = switch.session_count if switch is not None else 0
    if node is None:
        return {"enabled": False, "me": None, "instances": [], "presence_here": sessions}
    from rmb_relay.cluster import keys

    out: dict[str, Any] = {
        "enabled": True,
        "me": node.me,
        "live_instances": node.live_instances,
        "presence_here": len(node.presence.held),
        "sessions_here": sessions,
        "dead_known": sorted(node.presence.dead),
        "counters": {name: getattr(node.counters, name) for name in node.counters.__slots__},
    }
    try:
        async with asyncio.timeout(CLUSTER_TIMEOUT):
            members = sorted(
                m.decode() if isinstance(m, bytes) else str(m)
                for m in await node.redis.smembers(keys.INSTANCES_KEY)
            )
            alive = await node.alive(members)
    except Exception as err:  # Redis down or slow: say so, the rest of the view stands
        out["instances"] = []
        out["error"] = f"redis: {type(err).__name__}: {err}"
        return out
    out["instances"] = [{"instance": m, "alive": m in alive, "me": m == node.me} for m in members]
    return out
