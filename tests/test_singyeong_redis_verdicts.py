"""신경 QUEUE with Redis, when a store fails (issue 35; redis_queues.py "Stored, or told it was
not", "Held while Redis is down"): held without writing while the cluster knows Redis is down
(stored once it is back, in order; refused `queue unavailable` past its deadline or past
--sg-queue-held-bytes, at once; stored even if its producer left); a store whose reply was
lost is found stored by its withdrawal (QUEUE_CONFIRM), a retried one stores nothing twice; a
withdrawal that came first refuses it (`queue unavailable`) and the store, landing later,
stores nothing; no verdict in time is `queue unknown`. A real redis-server; the gateway's
queues reach it through `Gate`, a proxy that holds or loses the bytes of the commands that
carry a given text (the cluster has a link of its own)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, TimeoutError

from rmb_relay.cluster import Cluster
from rmb_relay.cluster.workqueue import WITHDRAWN
from rmb_relay.dialects.singyeong import SgSettings, SingyeongDialect
from rmb_relay.dialects.singyeong.queues import MESSAGE_OVERHEAD, Message
from rmb_relay.dialects.singyeong.redis_queues import RedisQueues, _record
from rmb_relay.mailbox import MemoryMailbox
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import RedisServer, StartRelay
from tests.faultlab.proxy import FaultProxy, reset
from tests.helpers import eventually
from tests.sg_client import SgClient
from tests.test_singyeong_queues import WORKERS, nothing_pending, take

#: the gateway's queues give up on a command this soon (and try it once more): a held store
#: fails within a second
SOCKET_TIMEOUT = 0.25


@dataclass
class Gate:
    """A TCP proxy to Redis that picks commands by their bytes (a chunk carrying `hold` waits
    for `release`, then goes on: a cut link delivering what it held; a chunk carrying `lose`
    goes through and its reply is lost with its connection, `lose_times` times); every other
    byte passes."""

    target: tuple[str, int]
    hold: bytes | None = None
    lose: bytes | None = None
    lose_times: int = 0
    held = 0
    lost = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    #: chunks forwarded after being held
    landed = 0
    port = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        losing = asyncio.Event()
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(self._requests(reader, up_writer, losing)),
            loop.create_task(self._replies(up_reader, writer, up_writer, losing)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)
        for end in (writer, up_writer):
            end.close()

    async def _requests(
        self, reader: asyncio.StreamReader, up: asyncio.StreamWriter, losing: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            if self.hold is not None and self.hold in data:
                self.held += 1
                self.holding.set()
                await self.released.wait()  # (the client may have given up meanwhile)
                self.landed += 1
            elif self.lose is not None and self.lose in data and self.lose_times > 0:
                self.lose_times -= 1
                losing.set()
            up.write(data)
            await up.drain()

    async def _replies(
        self,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up: asyncio.StreamWriter,
        losing: asyncio.Event,
    ) -> None:
        while data := await up_reader.read(65536):
            if losing.is_set():  # the reply goes nowhere: both ends reset
                self.lost += 1
                reset(writer)
                up.transport.abort()
                return
            writer.write(data)
            await writer.drain()

    async def close(self) -> None:
        self.released.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()


@dataclass
class World:
    """A gateway whose queues reach Redis through `gate` and whose cluster through `link`."""

    gateway: SingyeongDialect
    cluster: Cluster
    gate: Gate
    link: FaultProxy
    redis: Redis
    address: tuple[str, int]
    registry: Registry
    clients: list[SgClient] = field(default_factory=list)

    @property
    def queues(self) -> RedisQueues:
        queues = self.gateway.queues
        assert isinstance(queues, RedisQueues)
        return queues

    async def client(self, client_id: str, app_id: str) -> SgClient:
        client = await SgClient.connect(*self.address, "json")
        self.clients.append(client)
        await client.identify(client_id, app_id)
        return client

    async def stored(self, name: str) -> tuple[int, int]:
        """(records, waiting ids) queue `name` holds in Redis."""
        base = f"sgq:{{{name}}}:"
        return int(await self.redis.hlen(base + "msgs")), int(
            await self.redis.llen(base + "waiting")
        )


MakeWorld = Callable[..., Awaitable[World]]


@pytest.fixture
async def make_world(
    redis_server: RedisServer, start_relay: StartRelay
) -> AsyncIterator[MakeWorld]:
    made: list[tuple[World, list[Any]]] = []

    async def make(**settings: Any) -> World:
        target = ("127.0.0.1", redis_server.port)
        gate = Gate(target)
        await gate.start()
        link = await FaultProxy.start("127.0.0.1", target)
        # the queues' client: short timeouts, one more try after a failure (as the relay's
        # client retries, sooner)
        retry = Retry(NoBackoff(), 1)
        queues_redis = Redis(
            port=gate.port,
            socket_timeout=SOCKET_TIMEOUT,
            retry=retry,
            retry_on_error=[ConnectionError, TimeoutError],
        )
        # (no retries: a refused link is known at its first failure)
        cluster_redis = Redis(port=link.address[1], retry=Retry(NoBackoff(), 0))
        registry = Registry()
        switch = Switch(MemoryMailbox())
        cluster = Cluster(cluster_redis, switch, instance_id="a", ttl=15.0, registry=registry)
        await cluster.start()
        switch.cluster = cluster
        dialect = SingyeongDialect(
            SgSettings(**settings), registry, redis=queues_redis, cluster=cluster
        )
        server = await start_relay([dialect], registry=registry)
        host, port = server.addresses[0]
        direct = Redis(port=redis_server.port)
        world = World(dialect, cluster, gate, link, direct, (host, port), registry)
        made.append((world, [queues_redis, cluster_redis]))
        return world

    yield make
    for world, clients in made:
        for client in world.clients:
            await client.close()
        await world.gateway.close()
        await world.cluster.close()
        await world.gate.close()
        await world.link.close()
        for redis in (*clients, world.redis):
            await redis.aclose()


async def send_queue(producer: SgClient, nonce: str, name: str = "jobs") -> dict[str, Any]:
    """QUEUE one message; the gateway's answer to it (QUEUE_CONFIRM or INVALID)."""
    d = {"queue": name, "target": WORKERS, "nonce": nonce, "payload": nonce}
    await producer.dispatch("QUEUE", d)
    frame: dict[str, Any] = await producer.recv()
    return frame


def refusal(frame: dict[str, Any]) -> tuple[str, Any, Any]:
    assert frame["op"] == 3, frame
    info = frame["d"]["extra_info"]
    return frame["d"]["error"], info["queue"], info["nonce"]


def metric(world: World, line_start: str) -> float:
    """The value of the metric line starting with `line_start` (name and labels)."""
    for line in world.registry.render().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start} in the page")


async def redis_known_down(world: World) -> None:
    world.link.refuse()  # the cluster's calls fail: it knows Redis is down
    await eventually(lambda: not world.cluster.redis_up)


async def redis_known_up(world: World) -> None:
    world.link.heal()
    await eventually(lambda: world.cluster.redis_up)


async def held(world: World, size: int) -> None:
    """Wait until the queues hold `size` bytes of QUEUEs (unwritten)."""
    await eventually(lambda: world.queues.held_stores()[0] == size)


async def test_held_while_redis_is_known_down_then_stored_once_in_order(
    make_world: MakeWorld,
) -> None:
    """QUEUEs arriving while the cluster knows Redis is down are held, nothing written; once
    it is back they are stored (each once, in arrival order) and confirmed."""
    world = await make_world()
    producer = await world.client("p", "producers")
    await redis_known_down(world)
    await producer.dispatch(
        "QUEUE", {"queue": "jobs", "target": WORKERS, "nonce": "n-0", "payload": "n-0"}
    )
    await eventually(lambda: world.queues.held_stores()[0] > 0)
    one = world.queues.held_stores()[0]
    for nonce in ("n-1", "n-2"):  # (same length: the same size)
        d = {"queue": "jobs", "target": WORKERS, "nonce": nonce, "payload": nonce}
        await producer.dispatch("QUEUE", d)
    await held(world, 3 * one)
    assert metric(world, "rmb_relay_sg_queue_held_bytes") == 3 * one
    assert world.gate.held == 0  # nothing written
    assert await world.stored("jobs") == (0, 0)
    await redis_known_up(world)
    frames = [await producer.recv() for _ in range(3)]
    assert [(f["t"], f["d"]["nonce"]) for f in frames] == [
        ("QUEUE_CONFIRM", "n-0"),
        ("QUEUE_CONFIRM", "n-1"),
        ("QUEUE_CONFIRM", "n-2"),
    ]
    assert await world.stored("jobs") == (3, 3)
    assert world.queues.held_stores() == (0, {"written": 3, "expired": 0, "refused": 0})
    assert metric(world, 'rmb_relay_sg_queue_held_total{outcome="written"}') == 3
    assert sum(world.queues.withdrawals().values()) == 0  # none failed: none to withdraw
    worker = await world.client("w", "workers")
    assert [(await take(worker))["payload"] for _ in range(3)] == ["n-0", "n-1", "n-2"]
    await nothing_pending(worker)


async def test_held_past_its_deadline_is_refused_and_never_written(
    make_world: MakeWorld,
) -> None:
    """Redis stays down past --sg-queue-verdict-timeout: the held QUEUE is refused `queue
    unavailable`, certain since it was never written (no claim, no record, even after)."""
    world = await make_world(verdict_timeout=1.0)
    producer = await world.client("p", "producers")
    await redis_known_down(world)
    frame = await send_queue(producer, "n-late")
    assert refusal(frame) == ("queue unavailable: the message was not stored", "jobs", "n-late")
    assert world.queues.held_stores() == (0, {"written": 0, "expired": 1, "refused": 0})
    await redis_known_up(world)
    body = await send_queue(producer, "n-next")
    assert body["t"] == "QUEUE_CONFIRM"
    assert world.gate.held == 0
    assert await world.stored("jobs") == (1, 1)
    claims = [key async for key in world.redis.scan_iter(match="sgq:{jobs}:c:*")]
    assert len(claims) == 1  # n-next's only
    worker = await world.client("w", "workers")
    assert (await take(worker))["payload"] == "n-next"
    await nothing_pending(worker)


async def test_past_held_bytes_a_queue_is_refused_at_once(
    make_world: MakeWorld, caplog: pytest.LogCaptureFixture
) -> None:
    """--sg-queue-held-bytes room for one QUEUE: the next ones are refused at once (not
    stored), counted, logged once for the outage; the held one is stored once Redis is back."""
    world = await make_world(held_bytes=1000)
    producer = await world.client("p", "producers")
    await redis_known_down(world)
    d = {"queue": "jobs", "target": WORKERS, "nonce": "n-held", "payload": "n-held"}
    await producer.dispatch("QUEUE", d)
    await eventually(lambda: world.queues.held_stores()[0] > 0)
    one = world.queues.held_stores()[0]
    assert 2 * one > 1000
    with caplog.at_level("WARNING", logger="rmb_relay.singyeong"):
        for nonce in ("n-over", "n-over2"):
            frame = await send_queue(producer, nonce)  # answered while n-held waits
            assert refusal(frame) == (
                "queue unavailable: the message was not stored",
                "jobs",
                nonce,
            )
    warned = [r for r in caplog.records if "--sg-queue-held-bytes" in r.getMessage()]
    assert len(warned) == 1  # once per outage
    assert metric(world, "rmb_relay_sg_queue_held_bytes") == one
    assert metric(world, 'rmb_relay_sg_queue_held_total{outcome="refused"}') == 2
    await redis_known_up(world)
    frame = await producer.recv()
    assert (frame["t"], frame["d"]["nonce"]) == ("QUEUE_CONFIRM", "n-held")
    assert metric(world, "rmb_relay_sg_queue_held_bytes") == 0
    assert await world.stored("jobs") == (1, 1)


async def test_a_producer_gone_while_its_queue_is_held_has_it_stored(
    make_world: MakeWorld,
) -> None:
    """The producer's message was accepted: its connection closing does not unsay it (as a
    store already on its way to Redis); it is stored once Redis is back, and delivered."""
    world = await make_world()
    producer = await world.client("p", "producers")
    await redis_known_down(world)
    d = {"queue": "jobs", "target": WORKERS, "nonce": "n-gone", "payload": "n-gone"}
    await producer.dispatch("QUEUE", d)
    await eventually(lambda: world.queues.held_stores()[0] > 0)
    await producer.close()
    world.clients.remove(producer)
    await redis_known_up(world)
    await eventually(lambda: world.queues.held_stores()[1]["written"] == 1)

    async def stored() -> bool:
        return await world.stored("jobs") == (1, 1)

    await eventually(stored)
    worker = await world.client("w", "workers")
    assert (await take(worker))["payload"] == "n-gone"
    await nothing_pending(worker)


async def test_a_store_whose_replies_were_lost_is_found_stored_and_confirmed(
    make_world: MakeWorld,
) -> None:
    """Every try of the store reached Redis and lost its reply: the withdrawal finds it stored
    (its claim holds ours), and the tries after the first stored nothing more."""
    world = await make_world()
    world.gate.lose, world.gate.lose_times = b"n-lost", 2  # the first try and redis-py's retry
    producer = await world.client("p", "producers")
    frame = await send_queue(producer, "n-lost")
    assert (frame["op"], frame["t"], frame["d"]["nonce"]) == (4, "QUEUE_CONFIRM", "n-lost")
    assert world.gate.lost == 2
    assert await world.stored("jobs") == (1, 1)
    assert world.queues.withdrawals()["stored"] == 1
    page = world.registry.render()
    assert 'rmb_relay_sg_queue_withdrawals_total{verdict="stored"} 1.0' in page
    worker = await world.client("w", "workers")
    assert (await take(worker))["payload"] == "n-lost"


async def test_a_retried_store_that_finds_its_own_claim_stores_nothing_twice(
    make_world: MakeWorld,
) -> None:
    world = await make_world()
    world.gate.lose, world.gate.lose_times = b"n-again", 1  # redis-py's retry gets the reply
    producer = await world.client("p", "producers")
    frame = await send_queue(producer, "n-again")
    assert (frame["op"], frame["t"], frame["d"]["nonce"]) == (4, "QUEUE_CONFIRM", "n-again")
    assert world.gate.lost == 1
    assert await world.stored("jobs") == (1, 1)
    assert sum(world.queues.withdrawals().values()) == 0  # confirmed by the retry itself
    worker = await world.client("w", "workers")
    assert (await take(worker))["payload"] == "n-again"
    await nothing_pending(worker)


async def test_an_ack_whose_replies_were_lost_is_tried_again_and_the_message_is_done(
    make_world: MakeWorld,
) -> None:
    """The ack reached Redis and lost its reply, on the first try and redis-py's retry: the
    queues try it again (the script is idempotent), so the message is done at once, not
    delivered again after its ack timeout."""
    world = await make_world()
    producer = await world.client("p", "producers")
    worker = await world.client("w", "workers")
    assert (await send_queue(producer, "n-ack"))["t"] == "QUEUE_CONFIRM"
    body = await take(worker)
    world.gate.lose, world.gate.lose_times = str(body["id"]).encode(), 2
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})

    async def done() -> bool:
        unacked = await world.redis.zcard("sgq:{jobs}:unacked")
        return world.queues.ack_retries() >= 1 and unacked == 0

    await eventually(done)
    assert world.gate.lost == 2
    assert await world.stored("jobs") == (0, 0)
    assert metric(world, "rmb_relay_sg_queue_ack_retries_total") >= 1
    await nothing_pending(worker)


async def test_a_withdrawn_store_is_refused_and_never_delivered(make_world: MakeWorld) -> None:
    """The store is held on its way (both tries) and times out; the withdrawal, on another
    connection, comes first: refused. The held tries land afterwards, find the claim withdrawn
    and store nothing: the worker gets the next message, never this one."""
    world = await make_world()
    world.gate.hold = b"n-held"
    producer = await world.client("p", "producers")
    worker = await world.client("w", "workers")
    frame = await send_queue(producer, "n-held")
    assert refusal(frame) == ("queue unavailable: the message was not stored", "jobs", "n-held")
    assert world.queues.withdrawals()["withdrawn"] == 1
    held = world.gate.held
    assert held >= 1

    async def evalsha_calls() -> int:
        return int((await world.redis.info("commandstats"))["cmdstat_evalsha"]["calls"])

    before = await evalsha_calls()

    async def landed() -> bool:  # the held tries ran in Redis
        return world.gate.landed == held and await evalsha_calls() >= before + held

    world.gate.released.set()
    await eventually(landed)
    assert await world.stored("jobs") == (0, 0)
    claims = [key async for key in world.redis.scan_iter(match="sgq:{jobs}:c:*")]
    assert [await world.redis.get(key) for key in claims] == [WITHDRAWN]
    body = await send_queue(producer, "n-next")
    assert body["t"] == "QUEUE_CONFIRM"
    assert (await take(worker))["payload"] == "n-next"
    await nothing_pending(worker)


async def test_no_verdict_in_time_is_queue_unknown(make_world: MakeWorld) -> None:
    """The store and every withdrawal are held (the claim's key is in each): past
    --sg-queue-verdict-timeout the producer is told the gateway cannot tell."""
    world = await make_world(verdict_timeout=1.0)
    world.gate.hold = b"sgq:{held-jobs}:c:"
    producer = await world.client("p", "producers")
    frame = await send_queue(producer, "n-unknown", "held-jobs")
    assert refusal(frame) == (
        "queue unknown: cannot tell whether it was stored",
        "held-jobs",
        "n-unknown",
    )
    assert world.queues.withdrawals()["unknown"] == 1
    assert world.gate.held >= 2  # the store's try and at least one withdrawal


async def test_a_batch_that_finds_redis_down_is_held_ahead_of_later_queues(
    redis_server: RedisServer,
) -> None:
    """Two stores queued while Redis was up (the first two looks at `redis_up`); a third
    arrives as it is known down and is held; then the first two's batch goes out, finds Redis
    down and is held ahead of the third (it arrived first). Once Redis is back all three are
    stored in arrival order."""
    looks = iter([True, True])
    up = asyncio.Event()

    def redis_up() -> bool:
        return next(looks, up.is_set())

    redis = Redis(port=redis_server.port)
    queues = RedisQueues(
        redis,
        node="n",
        ack_timeout_ns=10**10,
        max_attempts=3,
        wall_ms=lambda: 0,
        redis_up=redis_up,
        redis_back=up.wait,
    )
    loop = asyncio.get_running_loop()
    messages = [Message(f"id-{i}", "jobs", f"n-{i}", WORKERS, f"p-{i}") for i in range(3)]
    try:
        # (tasks run in order: the two stores, the third, then the batch's writer)
        tasks = [loop.create_task(queues.store(m, "producers")) for m in messages]
        size = len(_record(messages[0])) + MESSAGE_OVERHEAD  # (same lengths: the same size)
        await eventually(lambda: queues.held_stores()[0] == 3 * size)
        up.set()
        await asyncio.gather(*tasks)
        raw = await redis.lrange("sgq:{jobs}:waiting", 0, -1)
        waiting = [i.decode() if isinstance(i, bytes) else i for i in raw]
        assert waiting == ["id-0", "id-1", "id-2"]
        assert queues.held_stores() == (0, {"written": 3, "expired": 0, "refused": 0})
    finally:
        await queues.close()
        await redis.aclose()
