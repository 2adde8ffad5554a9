"""SEND, BROADCAST and QUERY_NODES over real sockets (decisions 4-6), in every encoding."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import http_exchange
from tests.sg_client import SgClient
from tests.sg_fixtures import Gateway, MakeGateway, make_gateway

__all__ = ["make_gateway"]


async def settle(*clients: SgClient) -> None:
    """Every frame each client sent before has been handled (a heartbeat round trip)."""
    for client in clients:
        await client.send(5)
        await client.expect(6)


async def fleet(gateway: Gateway, count: int, app: str = "api", **kw: Any) -> list[SgClient]:
    clients = []
    for n in range(count):
        client = await gateway.client(f"w{n}", app, **kw)
        await client.update(n=("integer", n), region=("string", "eu" if n % 2 else "us"))
        clients.append(client)
    await settle(*clients)
    return clients


@pytest.mark.parametrize("encoding", ["json", "msgpack", "etf"])
async def test_send_by_eq_reaches_the_one_matching_client(
    make_gateway: MakeGateway, encoding: str
) -> None:
    gateway = await make_gateway()
    workers = await fleet(gateway, 4)
    sender = await gateway.client("sender", "caller", encoding=encoding)
    target = {"application": "api", "ops": [{"n": {"$eq": 2}}]}
    await sender.dispatch("SEND", {"target": target, "nonce": "n1", "payload": {"hi": [1, 2.5]}})
    frame = await workers[2].expect(4, "SEND")
    assert frame["d"] == {"target": None, "nonce": "n1", "payload": {"hi": [1, 2.5]}}
    await settle(*workers)  # nobody else got anything before the heartbeat ack


async def test_range_query_and_in_query(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    workers = await fleet(gateway, 6)
    sender = await gateway.client("s", "caller")
    await sender.dispatch(
        "BROADCAST",
        {
            "target": {"application": "api", "ops": [{"n": {"$gte": 2}}, {"n": {"$lt": 4}}]},
            "payload": "range",
        },
    )
    for n in (2, 3):
        assert (await workers[n].expect(4, "BROADCAST"))["d"]["payload"] == "range"
    await sender.dispatch(
        "BROADCAST",
        {
            "target": {"ops": [{"path": "/n", "op": "$in", "to": {"value": [0, 5]}}]},
            "payload": "in",
        },
    )
    for n in (0, 5):
        assert (await workers[n].expect(4, "BROADCAST"))["d"]["payload"] == "in"
    await settle(*workers)


async def test_no_route_is_op3_with_the_original_unless_droppable(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    sender = await gateway.client("s")
    d = {"target": {"application": "ghost", "ops": [{"a": {"$eq": 1}}]}, "nonce": "x", "payload": 1}
    await sender.dispatch("SEND", d)
    frame = await sender.expect(3)
    assert frame["d"]["error"] == "no_route"
    extra = frame["d"]["extra_info"]
    assert (extra["op"], extra["t"], extra["d"]) == (4, "SEND", d)
    await sender.dispatch("SEND", {**d, "target": {**d["target"], "droppable": True}})
    await settle(sender)  # nothing came back


async def test_invalid_target_is_op3_invalid_query(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    sender = await gateway.client("s")
    await sender.dispatch("SEND", {"target": {"ops": [{"a": {"$in": 3}}]}, "payload": 1})
    frame = await sender.expect(3)
    assert frame["d"] == {"error": "invalid query", "extra_info": "$in takes a list, got 3"}
    await sender.dispatch("SEND", {"payload": 1})
    assert (await sender.expect(3))["d"]["error"] == "SEND needs target and payload"


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_a_query_over_the_bounds_is_refused_and_counted(
    make_gateway: MakeGateway, encoding: str
) -> None:
    """A stranger's query may not cost more than the flags allow: a long `$in`, deep nesting
    or many conditions get op 3 naming the flag, are counted by the bound, and the gateway
    (and the sender's connection) keep serving."""
    from rmb_relay.dialects.singyeong.query import QueryLimits

    gateway = await make_gateway(query_limits=QueryLimits(max_depth=4, max_ops=50, max_list=100))
    (worker,) = await fleet(gateway, 1)
    sender = await gateway.client("s", "caller", encoding=encoding)
    nested: dict[str, Any] = {"n": {"$eq": 0}}
    for _ in range(6):
        nested = {"$or": [nested]}
    too_much = [
        ({"ops": [{"n": {"$in": list(range(10_000))}}]}, "--sg-query-max-list"),
        ({"ops": [nested]}, "--sg-query-max-depth"),
        ({"ops": [{"n": {"$ne": k}} for k in range(51)]}, "--sg-query-max-ops"),
    ]
    for target, flag in too_much:
        await sender.dispatch("SEND", {"target": target, "payload": 1})
        frame = await sender.expect(3)
        assert frame["d"]["error"] == "invalid query"
        assert flag in frame["d"]["extra_info"]
    refused = gateway.dialect.metrics.queries_refused
    assert [refused.value(limit) for limit in ("list", "depth", "ops")] == [1, 1, 1]
    target = {"application": "api", "ops": [{"n": {"$in": list(range(100))}}]}
    await sender.dispatch("SEND", {"target": target, "payload": 2})
    assert (await worker.expect(4, "SEND"))["d"]["payload"] == 2


async def test_optional_falls_back_to_the_whole_application(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    workers = await fleet(gateway, 1)
    sender = await gateway.client("s", "caller")
    target = {"application": "api", "optional": True, "ops": [{"n": {"$eq": 99}}]}
    await sender.dispatch("SEND", {"target": target, "payload": "anyone"})
    assert (await workers[0].expect(4, "SEND"))["d"]["payload"] == "anyone"


@pytest.mark.parametrize(("selector", "winner"), [("$min", 0), ("$max", 4), ("$avg", 2)])
async def test_selectors_pick_one_client(
    make_gateway: MakeGateway, selector: str, winner: int
) -> None:
    gateway = await make_gateway()
    workers = await fleet(gateway, 5)
    sender = await gateway.client("s", "caller")
    target = {"application": "api", "selector": {selector: "n"}}
    await sender.dispatch("BROADCAST", {"target": target, "payload": selector})
    assert (await workers[winner].expect(4, "BROADCAST"))["d"]["payload"] == selector
    await settle(*workers)
    # no client has a number there: the routing-failure path, not a crash
    await sender.dispatch("SEND", {"target": {"selector": {"$min": "region"}}, "payload": 0})
    assert (await sender.expect(3))["d"]["error"] == "no_route"


async def test_key_routes_to_the_same_client_until_it_leaves(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    workers = await fleet(gateway, 5)
    sender = await gateway.client("s", "caller")

    async def receiver_of(key: str) -> int:
        await sender.dispatch(
            "SEND", {"target": {"application": "api", "key": key}, "payload": key}
        )
        await settle(sender)  # routed before the heartbeat was read
        hits = [n for n, worker in enumerate(workers) if key in await drain(worker)]
        assert len(hits) == 1, hits
        return hits[0]

    first = {key: await receiver_of(key) for key in ("a", "b", "c", "d", "e", "f")}
    again = {key: await receiver_of(key) for key in first}
    assert first == again


async def drain(client: SgClient) -> list[Any]:
    """The SEND payloads a client has received, up to a heartbeat round trip."""
    await client.send(5)
    payloads = []
    while (frame := await client.recv())["op"] != 6:
        payloads.append(frame["d"]["payload"])
    return payloads


async def test_restricted_clients_only_when_the_query_asks(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(auth="pw")
    restricted = await gateway.client("r", "api")
    sender = await gateway.client("s", "caller", auth="pw")
    await sender.dispatch("SEND", {"target": {"application": "api"}, "payload": 1})
    assert (await sender.expect(3))["d"]["error"] == "no_route"
    target = {"application": "api", "restricted": True}
    await sender.dispatch("SEND", {"target": target, "payload": 2})
    assert (await restricted.expect(4, "SEND"))["d"]["payload"] == 2


async def test_query_nodes_answers_json(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(node="n1")
    await fleet(gateway, 2)
    asker = await gateway.client("s", "caller")
    await asker.dispatch("QUERY_NODES", {"application": "api", "ops": [{"n": {"$eq": 1}}]})
    frame = await asker.expect(4, "QUERY_NODES")
    nodes = frame["d"]["nodes"]
    assert frame["d"]["payload"] == {"nodes": nodes}
    (described,) = nodes["n1"]
    assert described["client_id"] == "w1"
    assert described["metadata"]["region"] == "eu"
    assert described["metadata_types"]["n"] == "integer"


async def test_http_query_with_authorization(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(auth="pw")
    await fleet(gateway, 3, auth="pw")
    host, port = gateway.address
    body = json.dumps({"application": "api", "ops": [{"region": {"$eq": "eu"}}]}).encode()

    async def post(auth: bytes) -> bytes:
        return await http_exchange(
            host,
            port,
            b"POST /api/v1/query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + auth
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body,
        )

    refused = await post(b"")
    assert refused.startswith(b"HTTP/1.1 401")
    assert refused.endswith(b'{"status":"error","error":"not authorized"}')
    answer = await post(b"Authorization: pw\r\n")
    assert answer.startswith(b"HTTP/1.1 200")
    found = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert sorted(c["client_id"] for c in found) == ["w1"]
    assert set(found[0]) == {
        "app_id",
        "client_id",
        "metadata",
        "metadata_types",
        "queues",
        "socket_ip",
    }
