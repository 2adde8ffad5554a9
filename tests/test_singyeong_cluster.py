"""Two gateway instances in one cluster on a real Redis form one gateway (decision 12): SEND,
BROADCAST, selectors, `key`, QUERY_NODES and the HTTP query span both; a leaving or dead
instance's clients leave; a SEND that Redis refused is reported, not lost."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgpack
from redis.asyncio import Redis

from rmb_relay.cluster import keys
from rmb_relay.tasks import cancel_and_wait
from tests.conftest import WAIT, RedisServer, start_redis
from tests.helpers import eventually
from tests.sg_client import SgClient
from tests.sg_fixtures import Gateway, MakeGateway, make_gateway
from tests.test_singyeong_queues import http
from tests.test_singyeong_routing import drain, settle

__all__ = ["make_gateway"]


async def pair(make_gateway: MakeGateway, redis: RedisServer) -> tuple[Gateway, Gateway]:
    a = await make_gateway(redis_url=redis.url, node="a")
    b = await make_gateway(redis_url=redis.url, node="b")
    for gateway in (a, b):
        assert gateway.dialect.cluster is not None
        await asyncio.wait_for(gateway.dialect.cluster.ready.wait(), WAIT)
    return a, b


async def spread(a: Gateway, b: Gateway, count: int) -> list[SgClient]:
    """`count` workers alternating between the instances, each with metadata n."""
    workers = []
    for n in range(count):
        worker = await (a if n % 2 == 0 else b).client(f"w{n}", "api")
        await worker.update(n=("integer", n))
        workers.append(worker)
    await settle(*workers)
    for gateway in (a, b):
        await eventually(lambda g=gateway: _replicated(g, count))  # type: ignore[misc]
    return workers


def _replicated(gateway: Gateway, count: int) -> bool:
    clients = gateway.dialect.index.by_app.get("api", set())
    return len(clients) == count and all("n" in c.metadata for c in clients)


async def test_send_reaches_a_client_on_the_other_instance(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    a, b = await pair(make_gateway, redis_server)
    workers = await spread(a, b, 4)
    sender = await a.client("s", "caller")
    await sender.dispatch(
        "SEND",
        {
            "target": {"application": "api", "ops": [{"n": {"$eq": 3}}]},
            "nonce": "x",
            "payload": {"k": [1]},
        },
    )
    frame = await workers[3].expect(4, "SEND")  # w3 is on b
    assert frame["d"] == {"target": None, "nonce": "x", "payload": {"k": [1]}}


async def test_broadcast_selectors_and_key_span_both(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    a, b = await pair(make_gateway, redis_server)
    workers = await spread(a, b, 6)
    sender = await b.client("s", "caller")
    assert b.cluster is not None
    records = b.cluster.counters.sent
    await sender.dispatch("BROADCAST", {"target": {"application": "api"}, "payload": "all"})
    for worker in workers:
        assert (await worker.expect(4, "BROADCAST"))["d"]["payload"] == "all"
    # a's three receivers got one bus record (counted once b has read Redis's answer, which
    # may come after a delivered it)
    cluster = b.cluster
    await eventually(lambda: cluster.counters.sent - records == 1)
    # global selectors: one winner over both instances
    for selector, winner in (("$min", 0), ("$max", 5), ("$avg", 2)):
        target = {"application": "api", "selector": {selector: "n"}}
        await sender.dispatch("SEND", {"target": target, "payload": selector})
        assert (await workers[winner].expect(4, "SEND"))["d"]["payload"] == selector
    # key: both instances pick the same receiver for a key
    receivers = []
    for origin in (a, b):
        client = await origin.client(f"k-{origin.dialect.settings.node}", "caller")
        before = frames_out(a, b)
        await client.dispatch(
            "SEND", {"target": {"application": "api", "key": "user-7"}, "payload": "keyed"}
        )
        await eventually(lambda before=before: frames_out(a, b) > before)  # type: ignore[misc]
        got = [n for n, worker in enumerate(workers) if "keyed" in await drain(worker)]
        assert len(got) == 1, got
        receivers.append(got[0])
    assert receivers[0] == receivers[1]


def frames_out(*gateways: Gateway) -> int:
    """Frames the instances have written to their clients (a delivery has happened)."""
    return sum(g.dialect.metrics.frames_out() for g in gateways)


async def test_query_nodes_and_http_query_see_both(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    a, b = await pair(make_gateway, redis_server)
    await spread(a, b, 4)
    asker = await a.client("s", "caller")
    await asker.dispatch("QUERY_NODES", {"application": "api"})
    nodes = (await asker.expect(4, "QUERY_NODES"))["d"]["nodes"]
    assert {n: sorted(c["client_id"] for c in v) for n, v in nodes.items()} == {
        "a": ["w0", "w2"],
        "b": ["w1", "w3"],
    }
    status, found = await http(
        b, "POST", "/api/v1/query", {"application": "api", "ops": [{"n": {"$gt": 1}}]}
    )
    assert status == 200
    assert sorted(c["client_id"] for c in found) == ["w2", "w3"]
    assert json.dumps(found)


async def test_an_instance_that_joins_later_loads_the_others_then_follows_them(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    """The snapshot and the log position it belongs to come in one step: nothing is missed,
    nothing goes back to an older state."""
    a, b = await pair(make_gateway, redis_server)
    workers = await spread(a, b, 4)
    await workers[1].update(n=("integer", 10))  # changed after it joined: the newest counts
    await eventually(
        lambda: getattr(a.dialect.index.get("api", "w1"), "metadata", {}).get("n") == 10
    )
    c = await make_gateway(redis_url=redis_server.url, node="c")
    assert c.dialect.cluster is not None
    await asyncio.wait_for(c.dialect.cluster.ready.wait(), WAIT)
    await eventually(lambda: _replicated(c, 4))
    assert c.dialect.index.get("api", "w1").metadata["n"] == 10  # type: ignore[union-attr]
    await workers[0].close()  # a change after the snapshot reaches it through the log
    await eventually(lambda: c.dialect.index.get("api", "w0") is None)
    on_c = await c.client("w9", "api")
    await on_c.update(n=("integer", 9))
    await eventually(lambda: _replicated(a, 4) and _replicated(b, 4))


async def test_clients_of_a_stopped_instance_leave_the_other(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    a, b = await pair(make_gateway, redis_server)
    await spread(a, b, 4)
    leaver = b.clients[1]
    await leaver.close()
    await eventually(lambda: a.dialect.index.get("api", "w3") is None)
    await b.stop()
    await eventually(lambda: len(a.dialect.index.by_app.get("api", ())) == 2)


async def test_a_client_id_is_unique_across_instances(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    a, b = await pair(make_gateway, redis_server)
    await a.client("only", "api")
    await eventually(lambda: b.dialect.index.get("api", "only") is not None)
    again = await b.connect()
    await again.send(1, {"client_id": "only", "application_id": "api"})
    frame: Any = await again.expect(3)
    assert frame["d"]["error"] == "only: already registered for app api"


async def test_send_to_another_instance_while_redis_refuses_is_an_error_not_a_loss(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    """The frame for a client elsewhere goes through the cluster's bus: when Redis refuses
    it the sender hears so (op 3), and once Redis is back the same SEND arrives; a replica
    change that could not be published meanwhile is published then."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = start_redis(str(redis_dir))
    try:
        a = await make_gateway(redis_url=server.url, node="a")
        b = await make_gateway(redis_url=server.url, node="b")
        for gateway in (a, b):
            assert gateway.dialect.cluster is not None
            await asyncio.wait_for(gateway.dialect.cluster.ready.wait(), WAIT)
        workers = await spread(a, b, 2)  # w1 is on b
        sender = await a.client("s", "caller")
        send = {"target": {"application": "api", "ops": [{"n": {"$eq": 1}}]}, "payload": "p"}
        server.stop()
        await sender.dispatch("SEND", {**send, "nonce": "while down"})
        refused = await sender.expect(3)
        assert "redis is unavailable" in refused["d"]["error"], refused
        assert refused["d"]["extra_info"] == {"t": "SEND", "nonce": "while down"}
        await workers[1].update(m=("integer", 5))  # b cannot publish this now

        server = start_redis(str(redis_dir), port=server.port)
        for gateway in (a, b):
            assert gateway.dialect.cluster is not None
            await asyncio.wait_for(gateway.dialect.cluster.ready.wait(), WAIT)
        await sender.dispatch("SEND", {**send, "nonce": "back"})
        got = await workers[1].expect(4, "SEND")
        assert got["d"]["nonce"] == "back"
        # b's failed write is made good once Redis answers (its whole table, written again)
        await eventually(
            lambda: getattr(a.dialect.index.get("api", "w1"), "metadata", {}).get("m") == 5
        )
    finally:
        server.stop()


async def test_a_dead_instance_is_dropped_from_the_replicas_by_the_clusters_tick(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    """The cluster's liveness, not a gateway beat of its own: once an instance's liveness key
    is gone, the next tick of another instance drops its clients there and its entries in
    Redis. (tests/test_cluster_processes.py kills a real process.)"""
    a, b = await pair(make_gateway, redis_server)
    await spread(a, b, 4)
    assert a.cluster is not None
    assert b.cluster is not None
    b_id = b.cluster.me
    probe = Redis.from_url(redis_server.url)
    try:
        assert await probe.exists(keys.table_key("sg", b_id))
        # b stops renewing and reading without leaving, as a killed process does (were it
        # still reading, it would find itself taken for dead and publish its clients again)
        assert b.dialect.cluster is not None
        await cancel_and_wait(b.cluster._ticker, WAIT)
        await cancel_and_wait(b.dialect.cluster.table._reader, WAIT)
        await probe.delete(keys.alive_key(b_id))
        await a.cluster.tick()
        assert sorted(c.client_id for c in a.dialect.index.by_app["api"]) == ["w0", "w2"]
        await eventually(lambda: _gone(probe, b_id))
    finally:
        await probe.aclose()


async def _gone(probe: Redis, instance: str) -> bool:
    return not await probe.exists(keys.table_key("sg", instance)) and not await probe.sismember(
        keys.table_members_key("sg"), instance
    )


async def test_an_instance_whose_table_redis_lost_writes_it_again(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    """b's entries vanish from Redis (as with a primary killed before it replicated them and
    its replica promoted: the lab's failover, docs/faults.md (d)) and Redis is away long
    enough that every reader loads the snapshot again: b finds its own entries missing there
    and writes them again, so a routes to b's clients again."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = start_redis(str(redis_dir))
    try:
        a, b = await pair(make_gateway, server)
        await spread(a, b, 4)
        assert b.cluster is not None
        probe = Redis.from_url(server.url)
        await probe.delete(keys.table_key("sg", b.cluster.me))
        await probe.srem(keys.table_members_key("sg"), b.cluster.me)
        await probe.aclose()
        server.stop()
        for gateway in (a, b):
            cluster = gateway.dialect.cluster
            assert cluster is not None
            await eventually(lambda c=cluster: not c.ready.is_set())  # type: ignore[misc]
        server = start_redis(str(redis_dir), port=server.port)
        probe = Redis.from_url(server.url)
        try:
            await eventually(lambda: probe.exists(keys.table_key("sg", b.cluster.me)))
        finally:
            await probe.aclose()
        await eventually(lambda: _replicated(a, 4))
    finally:
        server.stop()


async def test_an_instance_taken_for_dead_while_alive_publishes_its_clients_again(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    """Its liveness key expired (it was cut off from Redis for longer than the TTL) and the
    others dropped its clients; it sees that in the table's log and writes them again."""
    a, b = await pair(make_gateway, redis_server)
    await spread(a, b, 4)
    assert a.cluster is not None
    assert b.cluster is not None
    probe = Redis.from_url(redis_server.url)
    try:
        await probe.delete(keys.alive_key(b.cluster.me))
        await a.cluster.tick()  # drops b's clients (b may already be writing them again)
        await eventually(lambda: _replicated(a, 4))
        ops = [
            op
            for _, fields in await probe.xrange(keys.table_log_key("sg"))
            if fields[b"i"] == b.cluster.me.encode()
            for op, _, _ in msgpack.unpackb(fields[b"b"], raw=False)
        ]
        assert ops[-2:] == ["g", "r"]  # taken for dead, then its whole table again
    finally:
        await probe.aclose()
