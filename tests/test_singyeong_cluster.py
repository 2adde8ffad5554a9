"""Two gateway instances on one real Redis form one gateway (decision 12): SEND, BROADCAST,
selectors, `key`, QUERY_NODES and the HTTP query span both; a leaving node's clients leave."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.conftest import WAIT, RedisServer
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
    await sender.dispatch("BROADCAST", {"target": {"application": "api"}, "payload": "all"})
    for worker in workers:
        assert (await worker.expect(4, "BROADCAST"))["d"]["payload"] == "all"
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
    return sum(g.dialect.metrics.hot.frames_out for g in gateways)


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
