"""Queues in a real Redis (decision 11 with --redis): stored before confirm, nothing lost over a
gateway restart (waiting or unacked), dead letters, and two instances sharing one Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import WAIT, RedisServer
from tests.helpers import eventually
from tests.sg_fixtures import Gateway, MakeGateway, make_gateway
from tests.test_singyeong_queues import WORKERS, http, nothing_pending, queue, take

__all__ = ["make_gateway"]


async def depth_is(gateway: Gateway, expected: tuple[int, int, int]) -> bool:
    """Recount the Redis depths (the metrics' reading): (waiting, unacked, dead)."""
    await gateway.dialect.queues.sweep_expired(0)  # type: ignore[union-attr]
    return gateway.dialect.queues.depth() == expected


async def test_queue_in_redis_confirm_deliver_ack(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    gateway = await make_gateway(redis_url=redis_server.url)
    producer = await gateway.client("p", "producers")
    await queue(producer, {"job": 1})
    worker = await gateway.client("w", "workers")
    body = await take(worker)
    assert (body["payload"], body["attempt"]) == ({"job": 1}, 1)
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})
    await eventually(lambda: depth_is(gateway, (0, 0, 0)))


async def test_restart_loses_no_queued_or_unacked_message(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    first = await make_gateway(redis_url=redis_server.url, ack_timeout=0.3, node="first")
    producer = await first.client("p", "producers")
    for n in range(5):
        await queue(producer, n)
    worker = await first.client("w", "workers")
    held = await take(worker)  # delivered, never acked
    await first.stop()
    second = await make_gateway(redis_url=redis_server.url, ack_timeout=0.3, node="second")
    worker2 = await second.client("w", "workers")
    got: list[Any] = []
    while len(got) < 5:
        body = await take(worker2)
        got.append(body["payload"])
        await worker2.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})
    # the unacked one comes back after its ack timeout, found by the new instance's sweep
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert got.count(held["payload"]) == 1


async def test_two_instances_share_queues(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    a = await make_gateway(redis_url=redis_server.url, node="a")
    b = await make_gateway(redis_url=redis_server.url, node="b")
    await asyncio.wait_for(b.dialect.queues.listening.wait(), WAIT)  # type: ignore[union-attr]
    worker = await b.client("w", "workers")
    await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(worker)
    producer = await a.client("p", "producers")
    await queue(producer, "cross")
    frame = await worker.expect(4, "QUEUE")
    assert frame["d"]["payload"]["payload"] == "cross"


async def test_dead_letters_in_redis(redis_server: RedisServer, make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(redis_url=redis_server.url, ack_timeout=0.2, max_attempts=1)
    producer = await gateway.client("p", "producers")
    await queue(producer, "poison", {**WORKERS})
    worker = await gateway.client("w", "workers")
    await take(worker)
    await worker.close()  # disconnect: retried at once, and one attempt was the maximum
    await eventually(lambda: depth_is(gateway, (0, 0, 1)))
    status, letters = await http(gateway, "GET", "/api/v1/queues/dead-letters")
    assert status == 200
    (letter,) = letters
    assert (letter["payload"], letter["reason"]) == ("poison", "consumer disconnected")
    status, moved = await http(gateway, "POST", "/api/v1/queues/requeue", {"queue": "jobs"})
    assert (status, moved) == (200, {"requeued": 1})
    worker2 = await gateway.client("w2", "workers")
    assert (await take(worker2))["attempt"] == 1


async def test_redis_queues_without_the_cluster_go_through_the_scanner_s_frame_reader(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    """`--redis --no-cluster`: the queues live in Redis while the scanner reads
    QUEUE/REQUEST/ACK; stored, delivered, acked, and nothing lost over a
    restart of that gateway."""
    first = await make_gateway(redis_url=redis_server.url, join_cluster=False, ack_timeout=0.3)
    assert first.cluster is None
    producer = await first.client("p", "producers")
    for n in range(3):
        await queue(producer, n)
    worker = await first.client("w", "workers")
    body = await take(worker)
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})
    held = await take(worker)  # delivered, never acked
    await first.stop()
    second = await make_gateway(redis_url=redis_server.url, join_cluster=False, ack_timeout=0.3)
    worker2 = await second.client("w", "workers")
    got = [body["payload"]]
    while len(got) < 3:
        again = await take(worker2)
        got.append(again["payload"])
        await worker2.dispatch("QUEUE_ACK", {"queue": "jobs", "id": again["id"]})
    assert sorted(got) == [0, 1, 2]
    assert got.count(held["payload"]) == 1
    await eventually(lambda: depth_is(second, (0, 0, 0)))


async def test_a_store_after_redis_lost_its_scripts_is_stored(
    redis_server: RedisServer, make_gateway: MakeGateway
) -> None:
    """A Redis restart empties its script cache: the store script is loaded again and the
    messages of that batch are stored (and confirmed), not refused."""
    import redis.asyncio as aioredis

    gateway = await make_gateway(redis_url=redis_server.url)
    producer = await gateway.client("p", "producers")
    await queue(producer, {"job": 1})
    store = aioredis.Redis.from_url(redis_server.url)
    await store.script_flush()
    await queue(producer, {"job": 2})
    assert int(await store.hlen("sgq:{jobs}:msgs")) == 2
    assert int(await store.get("sgq:bytes")) == int(await store.get("sgq:{jobs}:bytes"))
    await store.aclose()
