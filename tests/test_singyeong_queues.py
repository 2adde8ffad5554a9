"""Queues over real sockets (decision 11): confirm after store, delivery only on request and
only to a matching client, redelivery after an ack timeout or a consumer's disconnect, dead
letters after max attempts, and the dead-letter HTTP endpoints."""

from __future__ import annotations

import json
from typing import Any

from tests.helpers import eventually, http_exchange
from tests.sg_client import SgClient
from tests.sg_fixtures import FakeClock, Gateway, MakeGateway, make_gateway

__all__ = ["make_gateway"]

WORKERS = {"application": "workers"}


async def queue(client: SgClient, payload: Any, target: Any = None, name: str = "jobs") -> None:
    d = {"queue": name, "target": target or WORKERS, "nonce": f"n-{payload}", "payload": payload}
    await client.dispatch("QUEUE", d)
    confirm = await client.expect(4, "QUEUE_CONFIRM")
    assert confirm["d"]["queue"] == name
    assert confirm["d"]["payload"] == {"queue": name}
    assert confirm["d"]["nonce"] == f"n-{payload}"


async def take(client: SgClient, name: str = "jobs") -> dict[str, Any]:
    await client.dispatch("QUEUE_REQUEST", {"queue": name})
    frame = await client.expect(4, "QUEUE")
    body: dict[str, Any] = frame["d"]["payload"]
    return body


async def nothing_pending(client: SgClient) -> None:
    await client.send(5)
    await client.expect(6)


async def http(gateway: Gateway, method: str, path: str, body: Any = None, auth: str = "") -> Any:
    host, port = gateway.address
    raw = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if auth:
        head += f"Authorization: {auth}\r\n"
    head += f"Content-Length: {len(raw)}\r\n\r\n"
    reply = await http_exchange(host, port, head.encode() + raw)
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1])


async def test_confirm_then_deliver_on_request_then_ack(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    await queue(producer, {"job": 1})
    worker = await gateway.client("w", "workers")
    body = await take(worker)
    assert body["queue"] == "jobs"
    assert body["payload"] == {"job": 1}
    assert body["attempt"] == 1
    assert isinstance(body["id"], str)
    assert gateway.dialect.queues.depth() == (0, 1, 0)
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})
    await nothing_pending(worker)
    assert gateway.dialect.queues.depth() == (0, 0, 0)


async def test_one_message_per_request_in_order(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    for n in range(3):
        await queue(producer, n)
    worker = await gateway.client("w", "workers")
    assert [(await take(worker))["payload"] for _ in range(3)] == [0, 1, 2]
    await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(worker)  # asked, but the queue is empty: waits
    await queue(producer, 3)
    assert (await worker.expect(4, "QUEUE"))["d"]["payload"]["payload"] == 3


async def test_a_message_no_waiting_client_matches_stays_queued(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    await queue(producer, "for-gpu", {"application": "workers", "ops": [{"gpu": {"$eq": True}}]})
    await queue(producer, "for-anyone")
    cpu = await gateway.client("cpu", "workers")
    assert (await take(cpu))["payload"] == "for-anyone"  # passes the one it cannot take
    await cpu.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(cpu)
    assert gateway.dialect.queues.depth()[0] == 1  # not dropped, not dead
    gpu = await gateway.client(
        "gpu", "workers", metadata={"gpu": {"type": "boolean", "value": True}}
    )
    assert (await take(gpu))["payload"] == "for-gpu"


async def test_targets_equal_in_python_but_not_in_json_are_told_apart(
    make_gateway: MakeGateway,
) -> None:
    """QUEUE targets are parsed once per distinct text (dialect `_queue_target`): `true`, `1`
    and `1.0` are equal in Python, but a boolean never equals a number (decision 4), so the
    message for `true` must not reuse the query parsed for `1`."""
    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    for payload, value in (("for-one", 1), ("for-true", True), ("for-one-again", 1.0)):
        await queue(producer, payload, {"application": "workers", "ops": [{"v": {"$eq": value}}]})
    number = await gateway.client("n", "workers", metadata={"v": {"type": "integer", "value": 1}})
    boolean = await gateway.client(
        "b", "workers", metadata={"v": {"type": "boolean", "value": True}}
    )
    assert (await take(boolean))["payload"] == "for-true"
    assert (await take(number))["payload"] == "for-one"
    assert (await take(number))["payload"] == "for-one-again"
    await boolean.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(boolean)


async def test_a_waiting_consumer_whose_metadata_changes_gets_what_it_now_matches(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    await queue(producer, "for-gpu", {"application": "workers", "ops": [{"gpu": {"$eq": True}}]})
    worker = await gateway.client("w", "workers")
    await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(worker)
    await worker.update(gpu=("boolean", True))
    assert (await worker.expect(4, "QUEUE"))["d"]["payload"]["payload"] == "for-gpu"


async def test_ack_timeout_redelivers_with_an_attempt_count(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(fake_clock=True, ack_timeout=5.0, max_attempts=5)
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    producer = await gateway.client("p", "producers")
    await queue(producer, "slow")
    worker = await gateway.client("w", "workers")
    first = await take(worker)
    await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(worker)
    clock.advance(4.9)
    gateway.dialect.sweep(clock())
    await nothing_pending(worker)
    clock.advance(0.2)
    gateway.dialect.sweep(clock())
    again = (await worker.expect(4, "QUEUE"))["d"]["payload"]
    assert again["id"] == first["id"]
    assert again["attempt"] == 2


async def test_ack_timeouts_expire_in_delivery_order_and_acked_ones_never(
    make_gateway: MakeGateway,
) -> None:
    """Deliveries a second apart: each comes back at its own deadline, in order, and the one
    acked in between never does (the sweep reads expired deliveries from the front)."""
    gateway = await make_gateway(fake_clock=True, ack_timeout=5.0, max_attempts=5)
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    producer = await gateway.client("p", "producers")
    for payload in ("a", "b", "c"):
        await queue(producer, payload)
    worker = await gateway.client("w", "workers")
    taken = []
    for _ in range(3):
        taken.append(await take(worker))
        clock.advance(1.0)
    assert [m["payload"] for m in taken] == ["a", "b", "c"]
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": taken[1]["id"]})
    for _ in range(3):
        await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(worker)
    clock.advance(2.5)  # "a" was delivered 5.5 s ago, "b" (acked) 4.5 s, "c" 3.5 s
    gateway.dialect.sweep(clock())
    again = (await worker.expect(4, "QUEUE"))["d"]["payload"]
    assert (again["payload"], again["attempt"]) == ("a", 2)
    await nothing_pending(worker)
    clock.advance(2.0)
    gateway.dialect.sweep(clock())
    again = (await worker.expect(4, "QUEUE"))["d"]["payload"]
    assert (again["payload"], again["attempt"]) == ("c", 2)
    await nothing_pending(worker)


async def test_consumer_disconnect_redelivers_to_another(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    await queue(producer, "work")
    doomed = await gateway.client("doomed", "workers")
    got = await take(doomed)
    survivor = await gateway.client("survivor", "workers")
    await survivor.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await nothing_pending(survivor)
    await doomed.close()
    frame = await survivor.expect(4, "QUEUE")
    assert frame["d"]["payload"]["id"] == got["id"]
    assert frame["d"]["payload"]["attempt"] == 2


async def test_max_attempts_then_dead_letters_then_requeue_over_http(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway(fake_clock=True, ack_timeout=1.0, max_attempts=2, auth="pw")
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    producer = await gateway.client("p", "producers", auth="pw")
    await queue(producer, "poison")
    worker = await gateway.client("w", "workers", auth="pw")
    for attempt in (1, 2):
        assert (await take(worker))["attempt"] == attempt
        clock.advance(1.5)
        gateway.dialect.sweep(clock())
    assert gateway.dialect.queues.depth() == (0, 0, 1)
    status, _ = await http(gateway, "GET", "/api/v1/queues/dead-letters?queue=jobs")
    assert status == 401
    status, letters = await http(
        gateway, "GET", "/api/v1/queues/dead-letters?queue=jobs", auth="pw"
    )
    assert status == 200
    (letter,) = letters
    assert (letter["payload"], letter["attempts"], letter["reason"]) == ("poison", 2, "ack timeout")
    status, moved = await http(
        gateway, "POST", "/api/v1/queues/requeue", {"queue": "jobs", "ids": None}, auth="pw"
    )
    assert (status, moved) == (200, {"requeued": 1})
    body = await take(worker)
    assert (body["payload"], body["attempt"]) == ("poison", 1)
    status, error = await http(gateway, "POST", "/api/v1/queues/requeue", {"q": 1}, auth="pw")
    assert status == 400
    assert error == {"errors": ['expected {"queue": NAME, "ids": [ID, ...] | null}']}


async def test_invalid_queue_dispatches_are_op3(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    client = await gateway.client("c")
    await client.dispatch("QUEUE", {"queue": "", "target": {}, "payload": 1})
    assert "queue name" in (await client.expect(3))["d"]["error"]
    await client.dispatch("QUEUE", {"queue": "q", "payload": 1})
    assert (await client.expect(3))["d"]["error"] == "QUEUE needs queue, target and payload"
    await client.dispatch("QUEUE", {"queue": "q", "target": {"ops": 1}, "payload": 1})
    assert (await client.expect(3))["d"]["error"] == "invalid query"
    await client.dispatch("QUEUE_ACK", {"queue": "q"})
    assert (await client.expect(3))["d"]["error"] == "QUEUE_ACK needs queue and id"


async def test_cancel_withdraws_requests(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    worker = await gateway.client("w", "workers")
    await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    await worker.dispatch("QUEUE_REQUEST_CANCEL", {"queue": "jobs"})
    producer = await gateway.client("p", "producers")
    await queue(producer, "later")
    await nothing_pending(worker)
    await eventually(lambda: gateway.dialect.queues.depth() == (1, 0, 0))


async def test_ten_thousand_messages_with_a_consumer_killed_mid_run(
    make_gateway: MakeGateway,
) -> None:
    """Every message is acked exactly once or sits in dead letters; none is lost."""
    gateway = await make_gateway(max_attempts=3)
    producer = await gateway.client("p", "producers")
    total = 10_000
    for start in range(0, total, 500):
        for n in range(start, start + 500):
            await producer.dispatch(
                "QUEUE", {"queue": "bulk", "target": WORKERS, "nonce": None, "payload": n}
            )
        for _ in range(500):
            await producer.expect(4, "QUEUE_CONFIRM")
    acked: dict[int, int] = {}

    async def consume(worker: SgClient, limit: int | None) -> None:
        taken = 0
        await worker.dispatch("QUEUE_REQUEST", {"queue": "bulk"})
        while limit is None or taken < limit:
            if limit is None and sum(acked.values()) == total:
                return
            frame = await worker.expect(4, "QUEUE")
            body = frame["d"]["payload"]
            taken += 1
            if limit is not None and taken == limit:
                return  # dies holding this one, unacked
            acked[body["payload"]] = acked.get(body["payload"], 0) + 1
            await worker.dispatch("QUEUE_ACK", {"queue": "bulk", "id": body["id"]})
            await worker.dispatch("QUEUE_REQUEST", {"queue": "bulk"})

    doomed = await gateway.client("doomed", "workers")
    await consume(doomed, 3000)
    doomed.ws.transport.abort()  # killed: no close frame, one message held unacked
    survivor = await gateway.client("survivor", "workers")
    await consume(survivor, None)
    dead = {letter.message.payload for letter in gateway.dialect.queues.dead_letters("bulk")}
    assert set(acked) | dead == set(range(total))
    assert all(count == 1 for count in acked.values())


async def test_a_client_keeps_a_bounded_number_of_queue_names(make_gateway: MakeGateway) -> None:
    """The names a client asked for outlive its requests; a client that asks for new queue
    after new queue (each made, answered and gone) keeps at most `CLIENT_QUEUE_NAMES`, the
    gone ones forgotten first (issue 33)."""
    from rmb_relay.dialects.singyeong.dialect import CLIENT_QUEUE_NAMES

    gateway = await make_gateway()
    producer = await gateway.client("p", "producers")
    worker = await gateway.client("w", "workers")
    for i in range(CLIENT_QUEUE_NAMES + 5):
        await queue(producer, i, name=f"q{i}")
        body = await take(worker, f"q{i}")
        await worker.dispatch("QUEUE_ACK", {"queue": f"q{i}", "id": body["id"]})
    await nothing_pending(worker)
    held = gateway.dialect.index.get("workers", "w")
    assert held is not None
    assert len(held.queues) <= CLIENT_QUEUE_NAMES
    assert f"q{CLIENT_QUEUE_NAMES + 4}" in held.queues
    assert gateway.dialect.queues.queue_count() == 0
