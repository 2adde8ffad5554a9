"""Hostile 신경 clients against real relay processes (issue 33): each case sends too much, as a
stranger would, and asserts the refusal (op 3, op 8, close code, HTTP status), that the
relay's RSS grows by less than a stated bound, that honest clients working at the same time
lose nothing, and that the relay logs no traceback. Each fails on d7c5c1d (the refusals did
not exist there: metadata was kept, errors were one per key, queues and the target cache
grew without end, the proxy went to an address the client named, a squatter kept the id).

The bounds asserted on RSS are generous (allocator slack, the attack's transient frames); the
figures measured on the old code are in docs/hardening.md."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from rmb_relay.dialects.singyeong.metadata import DEFAULT_METADATA_BYTES
from tests.conftest import free_port
from tests.helpers import eventually, http_exchange
from tests.redis_process import RedisServer
from tests.relay_process import RelayProcess
from tests.scrape import scrape
from tests.sg_client import SgClient

StartRelay = Callable[..., RelayProcess]
Connect = Callable[..., Awaitable[SgClient]]

WORKERS = {"application": "workers"}


@pytest.fixture
def start_relay() -> Iterator[StartRelay]:
    """`rmb-relay -l 127.0.0.1:0 ARGS` processes; at the end each must have logged nothing at
    ERROR and no traceback."""
    started: list[RelayProcess] = []

    def start(*args: str) -> RelayProcess:
        relay = RelayProcess(*args)
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.close()
    for relay in started:
        assert not relay.problems, "".join(relay.problems)


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Websocket clients of a relay (`connect(relay)`, optionally with extra upgrade headers),
    all closed at the end."""
    made: list[SgClient] = []

    async def open_one(relay: RelayProcess, headers: dict[str, str] | None = None) -> SgClient:
        import websockets

        ws = await websockets.connect(
            f"ws://127.0.0.1:{relay.port}/gateway/websocket?encoding=json",
            max_size=None,
            additional_headers=headers,
        )
        client = SgClient(ws, "json")
        made.append(client)
        client.hello = await client.recv()
        return client

    yield open_one
    for client in made:
        await client.ws.close()


class Honest:
    """Two honest clients of app `honest`: a sender SENDs numbered payloads to the receiver
    while an attack runs; `check` asserts every one arrived, in order."""

    def __init__(self, sender: SgClient, receiver: SgClient, count: int) -> None:
        self.sender, self.receiver, self.count = sender, receiver, count

    @classmethod
    async def start(
        cls, connect: Connect, relay: RelayProcess, count: int = 200, **auth: Any
    ) -> Honest:
        receiver = await connect(relay)
        await receiver.identify("rx", "honest-rx", **auth)
        sender = await connect(relay)
        await sender.identify("tx", "honest-tx", **auth)
        return cls(sender, receiver, count)

    async def run(self) -> None:
        async def send() -> None:
            for i in range(self.count):
                target = {"application": "honest-rx"}
                await self.sender.dispatch("SEND", {"target": target, "nonce": i, "payload": i})
                await asyncio.sleep(0)  # interleave with the attack, not a synchronisation

        async def receive() -> list[int]:
            got = []
            while len(got) < self.count:
                frame = await self.receiver.recv()
                if frame["op"] == 4 and frame["t"] == "SEND":
                    got.append(frame["d"]["payload"])
            return got

        _, got = await asyncio.gather(send(), receive())
        assert got == list(range(self.count))


async def next_op(client: SgClient, op: int) -> dict[str, Any]:
    """The next frame with this op (heartbeat acks and dispatches in between are skipped)."""
    while True:
        frame: dict[str, Any] = await client.recv()
        if frame["op"] == op:
            return frame


def metadata(size: int, prefix: str = "k") -> dict[str, Any]:
    """A metadata update of about `size` bytes in 10 KiB string values."""
    return {f"{prefix}{i}": {"type": "string", "value": "v" * 10240} for i in range(size // 10240)}


# ---- metadata -------------------------------------------------------------------------------


async def test_metadata_flood_is_refused_per_client(
    start_relay: StartRelay, connect: Connect
) -> None:
    """40 clients each setting 750 KiB of metadata (the issue: +84 MiB, nothing refused): each
    update is refused whole with op 3 metadata_full naming the limit; one that sends it at
    identify gets op 8 and is closed; a client over the key count too."""
    relay = start_relay()
    honest = await Honest.start(connect, relay)
    before = relay.rss_mib()

    async def attacker(i: int) -> None:
        client = await connect(relay)
        await client.identify(f"evil{i}", "evil")
        await client.dispatch("UPDATE_METADATA", metadata(750 << 10))
        frame = await next_op(client, 3)
        assert frame["d"]["error"] == "metadata_full"
        info = frame["d"]["extra_info"]
        assert (info["limit"], info["allowed"]) == ("bytes", DEFAULT_METADATA_BYTES)
        assert "--sg-metadata-bytes" in info["reason"]
        await client.ws.close()

    await asyncio.gather(honest.run(), *(attacker(i) for i in range(40)))
    growth = relay.rss_mib() - before

    at_identify = await connect(relay)
    await at_identify.send(
        1, {"client_id": "big", "application_id": "evil", "metadata": metadata(750 << 10)}
    )
    frame = await at_identify.expect(8)
    assert frame["d"]["error"] == "initial metadata: metadata_full"
    for field in ("client_id", "application_id"):  # nor hidden in the ids
        long_id = await connect(relay)
        await long_id.send(1, {"client_id": "c", "application_id": "a", field: "i" * 500_000})
        frame = await long_id.expect(8)
        assert frame["d"]["error"] == "identify: client_id and application_id are at most 256 long"
    keys = await connect(relay)
    await keys.identify("keys", "evil")
    many = {f"k{i}": {"type": "integer", "value": i} for i in range(300)}
    await keys.dispatch("UPDATE_METADATA", many)
    frame = await next_op(keys, 3)
    assert frame["d"]["extra_info"]["limit"] == "keys"
    # within the bounds an update still applies
    await keys.update(fine=("integer", 1))
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="metadata_bytes") == 41
    assert page.value("rmb_relay_sg_refused_total", limit="metadata_keys") == 1
    assert page.value("rmb_relay_sg_refused_total", limit="id_length") == 2
    assert page.value("rmb_relay_sg_held_bytes", what="metadata") < 64 << 10
    assert growth < 24, f"relay RSS grew {growth:.1f} MiB"


async def test_metadata_of_all_clients_is_bounded(
    start_relay: StartRelay, connect: Connect
) -> None:
    """Many clients each within its own bound (thousands can come from one address) stop at
    --sg-metadata-total-bytes: op 3 metadata_full, limit total; a client that leaves gives
    its bytes back."""
    relay = start_relay("--sg-metadata-total-bytes", "250000")
    honest = await Honest.start(connect, relay)
    before = relay.rss_mib()

    async def attack() -> list[SgClient]:
        accepted = []
        for i in range(8):
            client = await connect(relay)
            await client.identify(f"many{i}", "evil")
            await client.dispatch("UPDATE_METADATA", metadata(50 << 10))
            await client.send(5, {"client_id": f"many{i}"})  # its ack follows the update's answer
            frame = await client.recv()
            if frame["op"] == 6:
                accepted.append(client)
                continue
            assert frame["d"]["error"] == "metadata_full"
            assert frame["d"]["extra_info"]["limit"] == "total"
            assert "--sg-metadata-total-bytes" in frame["d"]["extra_info"]["reason"]
        return accepted

    _, accepted = await asyncio.gather(honest.run(), attack())
    assert len(accepted) == 4  # 4 x ~56,000 bytes charged fit in 250,000 with the honest clients'
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="metadata_total") == 4
    assert page.value("rmb_relay_sg_held_bytes", what="metadata") <= 250_000
    await accepted[0].ws.close()
    await accepted[0].ws.wait_closed()

    async def room() -> bool:
        held = (await scrape(*relay.address)).value("rmb_relay_sg_held_bytes", what="metadata")
        return bool(held < 250_000 - 56_000)

    await eventually(room)
    late = await connect(relay)
    await late.identify("late", "evil")
    await late.dispatch("UPDATE_METADATA", metadata(50 << 10))
    await late.send(5, {"client_id": "late"})
    assert (await late.recv())["op"] == 6
    assert relay.rss_mib() - before < 24


async def test_many_bad_keys_get_one_bounded_answer(
    start_relay: StartRelay, connect: Connect
) -> None:
    """An UPDATE_METADATA of ~887 KiB of bad keys (the issue: answered with 994 KiB of errors)
    gets one op 3 naming the first 16 problems and counting the rest."""
    relay = start_relay()
    honest = await Honest.start(connect, relay)
    client = await connect(relay)
    await client.identify("bad", "evil")
    bad = {f"key-{i:05d}-" + "x" * 20: {"type": "t" * 10, "value": 1} for i in range(12_700)}
    assert len(json.dumps(bad)) > 880_000
    sizes = []

    async def attack() -> None:
        for _ in range(5):
            await client.dispatch("UPDATE_METADATA", bad)
            raw = await asyncio.wait_for(client.ws.recv(), 10)
            sizes.append(len(raw))
            frame = json.loads(raw)
            assert frame["op"] == 3
            errors = frame["d"]["extra_info"]
            assert len(errors) == 17
            assert errors["..."] == "12684 more problems not listed"
            assert errors[next(iter(errors))].endswith("type 'tttttttttt' doesn't exists")

    before = relay.rss_mib()
    await asyncio.gather(honest.run(), attack())
    assert max(sizes) < 4096, sizes
    assert relay.rss_mib() - before < 24
    page = await scrape(*relay.address)
    counted = page.value("rmb_relay_sg_dispatches_total", type="UPDATE_METADATA", outcome="invalid")
    assert counted == 5


async def test_query_answers_list_a_bounded_number_of_clients(
    start_relay: StartRelay, connect: Connect
) -> None:
    """QUERY_NODES and POST /api/v1/query list every matching client with its metadata (up
    to --sg-metadata-bytes each: on d7c5c1d a broad query over many clients was one reply of
    all of it): a query matching more than --sg-query-max-results is refused saying how many
    it matched; a narrower one is answered."""
    relay = start_relay("--sg-query-max-results", "10")
    honest = await Honest.start(connect, relay)
    for i in range(15):
        member = await connect(relay)
        await member.identify(f"m{i}", "many", metadata={"n": {"type": "integer", "value": i}})
    asker = await connect(relay)
    await asker.identify("asker", "askers")

    async def attack() -> None:
        for _ in range(20):
            await asker.dispatch("QUERY_NODES", {"application": "many", "nonce": "q"})
            frame = await next_op(asker, 3)
            assert frame["d"]["error"] == "too_many_results"
            assert frame["d"]["extra_info"]["reason"] == (
                "the query matches 15 clients, 10 allowed (--sg-query-max-results)"
            )

    await asyncio.gather(honest.run(), attack())
    narrow = {"application": "many", "ops": [{"n": {"$lt": 5}}]}
    await asker.dispatch("QUERY_NODES", {**narrow, "nonce": "ok"})
    answer = await next_op(asker, 4)
    assert sum(len(found) for found in answer["d"]["nodes"].values()) == 5
    body = json.dumps({"application": "many"}).encode()
    head = b"POST /api/v1/query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    raw = await http_exchange(
        *relay.address, head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    assert raw.startswith(b"HTTP/1.1 400")
    assert b"--sg-query-max-results" in raw
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="query_results") == 21


async def test_a_query_costs_at_most_what_the_flags_allow(
    start_relay: StartRelay, connect: Connect
) -> None:
    """From a client with no credentials, SENDs whose targets match a worker through a
    100,000-value `$in`, 64 nested `$or` or 2,000 conditions: each op 3 `invalid query` naming
    its flag, refused before anything is matched (d7c5c1d evaluated each against every client
    and delivered it); an ordinary SEND still arrives, honest clients are served meanwhile."""
    relay = start_relay()
    honest = await Honest.start(connect, relay)
    worker = await connect(relay)
    await worker.identify("w", "api", metadata={"n": {"type": "integer", "value": 1}})
    sender = await connect(relay)
    await sender.identify("s", "caller")
    nested: dict[str, Any] = {"n": {"$eq": 1}}
    for _ in range(64):
        nested = {"$or": [nested]}
    too_much = [
        ([{"n": {"$in": list(range(100_000))}}], "--sg-query-max-list"),
        ([nested], "--sg-query-max-depth"),
        ([{"n": {"$ne": -k}} for k in range(1, 2001)], "--sg-query-max-ops"),
    ]

    async def attack() -> None:
        for ops, flag in too_much:
            target = {"application": "api", "ops": ops}
            await sender.dispatch("SEND", {"target": target, "nonce": flag, "payload": "x"})
            frame = await next_op(sender, 3)
            assert frame["d"]["error"] == "invalid query", frame
            assert flag in frame["d"]["extra_info"], frame

    await asyncio.gather(honest.run(), attack())
    target = {"application": "api", "ops": [{"n": {"$in": [1, 2, 3]}}]}
    await sender.dispatch("SEND", {"target": target, "nonce": "ok", "payload": "fine"})
    assert (await next_op(worker, 4))["d"]["payload"] == "fine"


# ---- queues ---------------------------------------------------------------------------------


async def test_queue_count_is_bounded_per_app_and_in_all(
    start_relay: StartRelay, connect: Connect
) -> None:
    """QUEUE_REQUESTs and QUEUEs naming new queues without end: the 1,001st queue of one app
    (the default) and the one past --sg-queues-total get op 3 too_many_queues; queues that
    exist keep working for everyone; an emptied queue stops counting."""
    relay = start_relay("--sg-queues-total", "1500")
    honest = await Honest.start(connect, relay)
    worker = await connect(relay)
    await worker.identify("w", "workers")
    producer = await connect(relay)
    await producer.identify("p", "producers")
    before = relay.rss_mib()

    async def flood(app: str, count: int) -> list[dict[str, Any]]:
        client = await connect(relay)
        await client.identify(app, app)
        for i in range(count):
            await client.dispatch("QUEUE_REQUEST", {"queue": f"{app}-{i}"})
        await client.dispatch("QUEUE", {"queue": f"{app}-x", "target": WORKERS, "payload": 1})
        refusals = []
        while len(refusals) < count - 1000 + 1:
            frame = await next_op(client, 3)
            refusals.append(frame["d"])
        return refusals

    async def attack() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        # one after the other: which app reaches which bound first is then known
        return await flood("evil-a", 1100), await flood("evil-b", 1000)

    _, (first, second) = await asyncio.gather(honest.run(), attack())
    assert {d["error"] for d in first} == {"too_many_queues"}
    assert {d["extra_info"]["limit"] for d in first} == {"per_app"}
    assert first[0]["extra_info"]["queue"] in {f"evil-a-{i}" for i in range(1000, 1100)}
    assert "--sg-queues-per-app" in first[0]["extra_info"]["reason"]
    # evil-b got what was left of the 1,500 (500) and refusals for the rest
    assert second[0]["extra_info"]["limit"] == "total"
    assert second[0]["extra_info"]["queue"] == "evil-b-500"
    # a new queue for an honest app is refused now, an existing one still works
    await producer.dispatch("QUEUE", {"queue": "evil-a-0", "target": WORKERS, "payload": "ok"})
    assert (await next_op(producer, 4))["t"] == "QUEUE_CONFIRM"
    await worker.dispatch("QUEUE_REQUEST", {"queue": "evil-a-0"})
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_queues") == 1500
    assert page.value("rmb_relay_sg_refused_total", limit="queues_per_app") == 101
    assert relay.rss_mib() - before < 24


async def test_outstanding_queue_requests_are_bounded(
    start_relay: StartRelay, connect: Connect
) -> None:
    """QUEUE_REQUESTs that wait for a message cost memory until answered: beyond
    --sg-queue-requests-per-client (over all queues) and --sg-queue-requests-total they get
    op 3; a client that leaves gives its share back, and a consumer then gets its message."""
    relay = start_relay("--sg-queue-requests-per-client", "300", "--sg-queue-requests-total", "500")
    honest = await Honest.start(connect, relay)
    before = relay.rss_mib()

    flooders: list[SgClient] = []

    async def flood(name: str, count: int, refusals: int) -> list[dict[str, Any]]:
        client = await connect(relay)
        flooders.append(client)
        await client.identify(name, "evil")
        for i in range(count):
            await client.dispatch("QUEUE_REQUEST", {"queue": f"q{i % 7}"})
        return [(await next_op(client, 3))["d"] for _ in range(refusals)]

    async def attack() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return await flood("a", 400, 100), await flood("b", 300, 100)

    _, (first, second) = await asyncio.gather(honest.run(), attack())
    assert {d["error"] for d in first + second} == {"too many outstanding QUEUE_REQUESTs"}
    assert {d["extra_info"]["limit"] for d in first} == {"client"}
    assert {d["extra_info"]["limit"] for d in second} == {"total"}
    assert "--sg-queue-requests-total" in second[0]["extra_info"]["reason"]
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="requests_client") == 100
    assert page.value("rmb_relay_sg_refused_total", limit="requests_total") == 100
    worker = await connect(relay)
    await worker.identify("w", "workers")
    await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
    assert (await next_op(worker, 3))["d"]["extra_info"]["limit"] == "total"
    await flooders[0].ws.close()  # its 300 requests are withdrawn
    producer = await connect(relay)
    await producer.identify("p", "producers")

    async def accepted() -> bool:
        """A request that waits is not answered: the heartbeat's ack comes first."""
        await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
        await worker.send(5, {"client_id": "w"})
        if (await worker.recv())["op"] == 6:
            return True
        while (await worker.recv())["op"] != 6:  # refused (op 3), then the ack
            pass
        return False

    await eventually(accepted)
    await producer.dispatch("QUEUE", {"queue": "jobs", "target": WORKERS, "payload": "job"})
    assert (await next_op(worker, 4))["d"]["payload"]["payload"] == "job"
    assert relay.rss_mib() - before < 24


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


async def test_redis_queues_are_under_the_byte_budget(
    redis_url: str, start_relay: StartRelay, connect: Connect
) -> None:
    """Redis-backed queues (the issue: no budget at all) are charged in Redis: QUEUEs beyond
    --sg-queue-bytes, --sg-queue-total-bytes or --sg-queues-total get op 3 (queue_full,
    too_many_queues) and nothing is stored; acks give the bytes back; what was confirmed is
    all delivered."""
    relay = start_relay(
        "--redis",
        redis_url,
        "--sg-queue-bytes",
        "200000",
        "--sg-queue-total-bytes",
        "300000",
        "--sg-queues-total",
        "3",
    )
    store = aioredis.Redis.from_url(redis_url)
    honest = await Honest.start(connect, relay)
    producer = await connect(relay)
    await producer.identify("p", "producers")
    payload = "x" * 10_000
    before_rss = relay.rss_mib()

    async def flood(name: str, count: int) -> tuple[int, list[dict[str, Any]]]:
        for i in range(count):
            await producer.dispatch(
                "QUEUE", {"queue": name, "target": WORKERS, "nonce": i, "payload": payload}
            )
        confirmed, refused = 0, []
        while confirmed + len(refused) < count:
            frame = await producer.recv()
            if frame["op"] == 4 and frame["t"] == "QUEUE_CONFIRM":
                confirmed += 1
            elif frame["op"] == 3:
                refused.append(frame["d"])
        return confirmed, refused

    _, (confirmed, refused) = await asyncio.gather(honest.run(), flood("jobs", 100))
    # a message is charged its record (~10,070 bytes) + MESSAGE_OVERHEAD: 18 fit in 200,000
    assert confirmed == 18
    assert {d["error"] for d in refused} == {"queue_full"}
    assert {d["extra_info"]["limit"] for d in refused} == {"key"}
    assert int(await store.hlen("sgq:{jobs}:msgs")) == confirmed
    assert 190_000 < int(await store.get("sgq:{jobs}:bytes")) <= 200_000
    # the total: what is left of 300,000 takes 10 more, in another queue
    more, refused = await flood("other", 20)
    assert more == 10
    assert {d["extra_info"]["limit"] for d in refused} == {"total"}
    assert int(await store.get("sgq:bytes")) <= 300_000
    # the names: a third queue is made, a fourth is not
    await producer.dispatch("QUEUE", {"queue": "q3", "target": WORKERS, "payload": 1})
    assert (await next_op(producer, 4))["t"] == "QUEUE_CONFIRM"
    await producer.dispatch("QUEUE", {"queue": "q4", "target": WORKERS, "payload": 1})
    frame = await next_op(producer, 3)
    assert (frame["d"]["error"], frame["d"]["extra_info"]["limit"]) == ("too_many_queues", "total")
    assert not await store.exists("sgq:{q4}:msgs")
    worker = await connect(relay)
    await worker.identify("w", "workers")
    for _ in range(confirmed):
        await worker.dispatch("QUEUE_REQUEST", {"queue": "jobs"})
        body = (await next_op(worker, 4))["d"]["payload"]
        assert body["payload"] == payload
        await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})

    async def given_back() -> bool:
        return int(await store.get("sgq:{jobs}:bytes")) == 0

    await eventually(given_back)
    await producer.dispatch("QUEUE", {"queue": "jobs", "target": WORKERS, "payload": "again"})
    assert (await next_op(producer, 4))["t"] == "QUEUE_CONFIRM"
    assert relay.rss_mib() - before_rss < 24
    await store.aclose()


async def test_queue_target_cache_stays_in_its_budget(
    start_relay: StartRelay, connect: Connect
) -> None:
    """QUEUEs with distinct ~900 KiB targets (the issue: 4,096 cached entries of up to ~2 MiB
    outside every budget): targets that large are parsed each time and never kept."""
    relay = start_relay("--sg-queue-bytes", "2000000", "--sg-queue-total-bytes", "4000000")
    honest = await Honest.start(connect, relay)
    producer = await connect(relay)
    await producer.identify("p", "producers")
    before = relay.rss_mib()

    async def flood() -> None:
        for i in range(80):
            target = {"application": f"{i:04d}" + "a" * 900_000}
            await producer.dispatch("QUEUE", {"queue": "q", "target": target, "payload": 1})
        answered = 0
        while answered < 80:
            frame = await producer.recv()
            answered += frame["op"] in (3, 4)

    await asyncio.gather(honest.run(), flood())
    growth = relay.rss_mib() - before  # first: what a relay without the bound shows
    assert growth < 40, f"relay RSS grew {growth:.1f} MiB"
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_held_bytes", what="target_cache") <= 8 << 20


# ---- proxy ----------------------------------------------------------------------------------


@pytest.fixture
async def services() -> AsyncIterator[int]:
    """One port with an HTTP service on 127.0.0.1 ("the client's") and one on 127.0.0.2 ("an
    internal service" the proxy must not reach), each saying which it is."""
    port = free_port()
    runners = []
    for host in ("127.0.0.1", "127.0.0.2"):

        async def who(request: web.Request, host: str = host) -> web.Response:
            return web.json_response({"service": host, "host": request.headers.get("Host")})

        app = web.Application()
        app.router.add_get("/who", who)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        runners.append(runner)
    yield port
    for runner in runners:
        await runner.cleanup()


async def proxy(relay: RelayProcess, app: str) -> tuple[int, Any]:
    return await _post(relay, {"method": "GET", "route": "/who", "query": {"application": app}})


async def test_proxy_connects_only_to_the_address_it_saw(
    start_relay: StartRelay, connect: Connect, services: int
) -> None:
    """A client connected from 127.0.0.1 that declares 127.0.0.2 (inside --sg-proxy-allow: on
    d7c5c1d that was enough) is refused 403; declaring a name that resolves to its address is
    connected by that address with the name as Host; with --trusted-ip-header the header's
    address is the one the proxy may reach."""
    port = services
    relay = start_relay("--sg-proxy-allow", "127.0.0.0/8")
    honest = await Honest.start(connect, relay)
    evil = await connect(relay)
    await evil.identify("e", "evil", ip=f"http://127.0.0.2:{port}")
    own = await connect(relay)
    await own.identify("o", "own", ip=f"http://localhost:{port}")

    async def attack() -> list[tuple[int, Any]]:
        return [await proxy(relay, "evil") for _ in range(20)]

    _, answers = await asyncio.gather(honest.run(), attack())
    for status, answer in answers:
        assert status == 403
        assert answer["errors"][0].startswith("127.0.0.2 is not the address the gateway saw")
    status, answer = await proxy(relay, "own")
    assert (status, answer) == (200, {"service": "127.0.0.1", "host": f"localhost:{port}"})
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="proxy_target") == 20

    behind = start_relay(
        "--trusted-ip-header", "X-Forwarded-For", "--sg-proxy-allow", "127.0.0.2/32"
    )
    forwarded = await connect(behind, {"X-Forwarded-For": "10.9.9.9, 127.0.0.2"})
    await forwarded.identify("f", "fwd", ip=f"http://127.0.0.2:{port}")
    status, answer = await proxy(behind, "fwd")
    assert (status, answer["service"]) == (200, "127.0.0.2")


class HeldService:
    """An HTTP service on 127.0.0.1 whose `/hold` answers only once `release` is set;
    `arrived` is set when `expected` requests are waiting in it."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.waiting = 0
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.port = free_port()

    async def hold(self, request: web.Request) -> web.Response:
        self.waiting += 1
        if self.waiting >= self.expected:
            self.arrived.set()
        await self.release.wait()
        return web.json_response({"held": True})


async def test_proxy_requests_in_flight_are_bounded(
    start_relay: StartRelay, connect: Connect
) -> None:
    """Proxied requests to a client that never answers (each may hold a 16 MiB answer): at
    most --sg-proxy-concurrency wait; more get 503 at once; the held ones are answered when
    the client answers."""
    service = HeldService(expected=4)
    app = web.Application()
    app.router.add_get("/hold", service.hold)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", service.port).start()
    try:
        relay = start_relay("--sg-proxy-concurrency", "4", "--sg-proxy-allow", "127.0.0.1/32")
        honest = await Honest.start(connect, relay)
        slow = await connect(relay)
        await slow.identify("s", "slow", ip=f"http://127.0.0.1:{service.port}")
        before = relay.rss_mib()

        async def call() -> tuple[int, Any]:
            body = {"method": "GET", "route": "/hold", "query": {"application": "slow"}}
            return await _post(relay, body)

        held = [asyncio.ensure_future(call()) for _ in range(4)]
        await asyncio.wait_for(service.arrived.wait(), 10)

        async def attack() -> list[tuple[int, Any]]:
            return [await call() for _ in range(30)]

        _, refused = await asyncio.gather(honest.run(), attack())
        for status, answer in refused:
            assert status == 503
            assert "--sg-proxy-concurrency" in answer["errors"][0]
        service.release.set()
        assert [await task for task in held] == [(200, {"held": True})] * 4
        page = await scrape(*relay.address)
        assert page.value("rmb_relay_sg_refused_total", limit="proxy_concurrency") == 30
        assert relay.rss_mib() - before < 24
    finally:
        service.release.set()
        await runner.cleanup()


async def _post(relay: RelayProcess, value: Any) -> tuple[int, Any]:
    body = json.dumps(value).encode()
    head = b"POST /api/v1/proxy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    raw = await http_exchange(
        *relay.address, head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    return int(raw.split(b" ", 2)[1]), json.loads(raw.split(b"\r\n\r\n", 1)[1])


# ---- names under --sg-auth ------------------------------------------------------------------


async def test_a_restricted_squatter_is_displaced_by_the_authenticated_client(
    start_relay: StartRelay,
    connect: Connect,
) -> None:
    """Under --sg-auth a client without the password that takes a service's (app, client id)
    first (on d7c5c1d the real service was then refused as a duplicate) is told (op 3
    `displaced`) and closed (1008) when the authenticated client identifies; the reverse
    (a restricted client after an authenticated one) is refused as a duplicate."""
    relay = start_relay("--sg-auth", "s3cret")
    honest = await Honest.start(connect, relay, auth="s3cret")
    before = relay.rss_mib()

    async def squat(i: int) -> None:
        squatter = await connect(relay)
        ready = await squatter.identify(f"worker-{i}", "api")
        assert ready["d"]["restricted"] is True
        service = await connect(relay)
        ready = await service.identify(
            f"worker-{i}", "api", auth="s3cret", metadata={"n": {"type": "integer", "value": i}}
        )
        assert ready["d"]["restricted"] is False
        frame = await next_op(squatter, 3)
        assert frame["d"]["error"] == "displaced"
        await squatter.ws.wait_closed()
        assert squatter.ws.close_code == 1008
        late = await connect(relay)
        await late.send(1, {"client_id": f"worker-{i}", "application_id": "api"})
        frame = await late.expect(3)
        assert frame["d"]["error"] == f"worker-{i}: already registered for app api"
        # the service holds its name and gets its messages
        target = {"application": "api", "ops": [{"n": {"$eq": i}}]}
        await honest.sender.dispatch("SEND", {"target": target, "nonce": "n", "payload": i})
        assert (await next_op(service, 4))["d"]["payload"] == i

    await asyncio.gather(honest.run(), *(squat(i) for i in range(20)))
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="restricted_displaced") == 20
    assert relay.rss_mib() - before < 24


async def _query(relay: RelayProcess, target: Any, password: str) -> list[dict[str, Any]]:
    body = json.dumps(target).encode()
    head = (
        b"POST /api/v1/query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: " + password.encode() + b"\r\n"
    )
    raw = await http_exchange(
        *relay.address, head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    answer: list[dict[str, Any]] = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    return answer


async def test_a_squatter_on_another_instance_is_displaced_too(
    redis_url: str, start_relay: StartRelay, connect: Connect
) -> None:
    """Two instances sharing --redis: a restricted squatter on one; the authenticated service
    on the other is told to identify again while the squatter's instance closes it (op 3
    displaced, 1008); once the id is free the service takes it."""
    a = start_relay("--redis", redis_url, "--sg-auth", "s3cret")
    b = start_relay("--redis", redis_url, "--sg-auth", "s3cret")
    honest = await Honest.start(connect, a, auth="s3cret")
    squatter = await connect(a)
    await squatter.identify("worker", "api")
    # queries see restricted clients only when they ask for them
    target = {"application": "api", "restricted": True}

    async def seen_on_b() -> bool:
        return len(await _query(b, target, "s3cret")) == 1

    await eventually(seen_on_b)

    async def take() -> None:
        service = await connect(b)
        await service.send(1, {"client_id": "worker", "application_id": "api", "auth": "s3cret"})
        frame = await service.expect(3)
        assert frame["d"]["error"].endswith("being closed: identify again")
        told = await next_op(squatter, 3)
        assert told["d"]["error"] == "displaced"
        await squatter.ws.wait_closed()
        assert squatter.ws.close_code == 1008

        async def free() -> bool:
            return not await _query(b, target, "s3cret")

        await eventually(free)
        again = await connect(b)
        ready = await again.identify("worker", "api", auth="s3cret")
        assert ready["d"]["restricted"] is False

    await asyncio.gather(honest.run(), take())
    page = await scrape(*a.address)
    assert page.value("rmb_relay_sg_refused_total", limit="restricted_displaced") == 1


# ---- dead letters ---------------------------------------------------------------------------


async def get_dead_page(relay: RelayProcess, path: str) -> tuple[int, dict[str, str], Any]:
    """GET `path` on the relay: (status, headers by lower-case name, the JSON body)."""
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    reply = await http_exchange(*relay.address, head)
    head_text, _, body = reply.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    headers = dict(
        (name.strip().lower(), value.strip())
        for name, _, value in (line.partition(":") for line in lines[1:])
    )
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(body)


async def fill_dead_letters_and_page(
    relay: RelayProcess, connect: Connect, count: int, page: int
) -> None:
    """`count` messages that fail their only attempt (their consumer leaves) become dead
    letters; the listing answers `page` at a time, each cut page naming the next in its Link
    header, until all are listed once; the cut pages are counted."""
    honest = await Honest.start(connect, relay)
    producer = await connect(relay)
    await producer.identify("p", "producers")
    payload = "x" * 1000
    for i in range(count):
        await producer.dispatch(
            "QUEUE", {"queue": "poison", "target": WORKERS, "nonce": i, "payload": payload}
        )
    for _ in range(count):
        assert (await next_op(producer, 4))["t"] == "QUEUE_CONFIRM"
    worker = await connect(relay)
    await worker.identify("w", "workers")
    for _ in range(count):
        await worker.dispatch("QUEUE_REQUEST", {"queue": "poison"})
    for _ in range(count):
        assert (await next_op(worker, 4))["t"] == "QUEUE"
    await worker.ws.close()  # never acked: each spent its one attempt

    async def all_dead() -> bool:
        page = await scrape(*relay.address)
        return page.value("rmb_relay_sg_queue_messages", state="dead") == count

    await asyncio.gather(honest.run(), eventually(all_dead))
    seen: list[str] = []
    path = "/api/v1/queues/dead-letters?queue=poison"
    pages = 0
    while True:
        status, headers, letters = await get_dead_page(relay, path)
        assert status == 200
        pages += 1
        assert 0 < len(letters) <= page
        assert {letter["reason"] for letter in letters} == {"consumer disconnected"}
        seen.extend(letter["id"] for letter in letters)
        link = headers.get("link")
        if link is None:
            break
        assert len(letters) == page
        assert link.endswith('>; rel="next"')
        assert link.startswith("</api/v1/queues/dead-letters?")
        path = link[1 : link.index(">")]
    assert len(seen) == len(set(seen)) == count
    assert seen == sorted(seen)
    assert pages == -(-count // page)
    # every queue's letters (no queue named) are paged the same way
    status, headers, letters = await get_dead_page(relay, "/api/v1/queues/dead-letters")
    assert (status, len(letters)) == (200, page)
    assert "link" in headers
    status, _, errors = await get_dead_page(relay, "/api/v1/queues/dead-letters?after=junk")
    assert status == 400
    assert "after" in errors["errors"][0]
    scraped = await scrape(*relay.address)
    assert scraped.value("rmb_relay_sg_refused_total", limit="dead_letters_page") == pages


async def test_dead_letter_listing_is_paged(start_relay: StartRelay, connect: Connect) -> None:
    """250 dead letters (the listing was one answer of all of them, as large as
    --sg-dead-letter-bytes lets them be) with --sg-dead-letters-page 100: three pages of at
    most 100, each cut one naming the next; nothing listed twice or left out."""
    relay = start_relay("--sg-max-attempts", "1", "--sg-dead-letters-page", "100")
    await fill_dead_letters_and_page(relay, connect, 250, 100)


async def test_redis_dead_letter_listing_is_paged(
    redis_url: str, start_relay: StartRelay, connect: Connect
) -> None:
    """The same with the queues in Redis."""
    relay = start_relay(
        "--redis", redis_url, "--sg-max-attempts", "1", "--sg-dead-letters-page", "100"
    )
    await fill_dead_letters_and_page(relay, connect, 250, 100)


async def test_redis_queues_are_counted_per_application(
    redis_url: str, start_relay: StartRelay, connect: Connect
) -> None:
    """QUEUEs to new names stored in Redis (the issue: only the in-memory queues counted per
    application) with --sg-queues-per-app 3: a fourth and fifth name of one application get
    op 3 too_many_queues (per_app) and nothing is stored; another application still makes
    queues; another instance on the same Redis refuses that application's next name too (the
    names' applications are in Redis); an emptied queue stops counting."""
    flags = ("--redis", redis_url, "--sg-queues-per-app", "3", "--sg-ack-timeout", "2")
    relay = start_relay(*flags)
    other = start_relay(*flags)
    store = aioredis.Redis.from_url(redis_url)
    honest = await Honest.start(connect, relay)
    evil = await connect(relay)
    await evil.identify("e", "evil")

    async def flood() -> tuple[int, list[dict[str, Any]]]:
        for i in range(5):
            await evil.dispatch("QUEUE", {"queue": f"evil-{i}", "target": WORKERS, "payload": i})
        confirmed, refused = 0, []
        while confirmed + len(refused) < 5:
            frame = await evil.recv()
            if frame["op"] == 4 and frame["t"] == "QUEUE_CONFIRM":
                confirmed += 1
            elif frame["op"] == 3:
                refused.append(frame["d"])
        return confirmed, refused

    _, (confirmed, refused) = await asyncio.gather(honest.run(), flood())
    assert confirmed == 3
    assert {d["error"] for d in refused} == {"too_many_queues"}
    assert {d["extra_info"]["limit"] for d in refused} == {"per_app"}
    assert "--sg-queues-per-app" in refused[0]["extra_info"]["reason"]
    assert not await store.exists("sgq:{evil-3}:msgs", "sgq:{evil-4}:msgs")
    assert await store.hget("sgq:apps", "evil-0") == b"evil"
    producer = await connect(relay)
    await producer.identify("p", "producers")
    await producer.dispatch("QUEUE", {"queue": "jobs", "target": WORKERS, "payload": 1})
    assert (await next_op(producer, 4))["t"] == "QUEUE_CONFIRM"
    page = await scrape(*relay.address)
    assert page.value("rmb_relay_sg_refused_total", limit="queues_per_app") == 2

    # the other instance learns the names' applications from Redis at its sweep
    async def swept() -> bool:
        return (await scrape(*other.address)).value("rmb_relay_sg_queues") == 4

    await eventually(swept)
    elsewhere = await connect(other)
    await elsewhere.identify("e2", "evil")
    await elsewhere.dispatch("QUEUE", {"queue": "evil-9", "target": WORKERS, "payload": 9})
    frame = await next_op(elsewhere, 3)
    assert (frame["d"]["error"], frame["d"]["extra_info"]["limit"]) == (
        "too_many_queues",
        "per_app",
    )
    # draining one of them gives the application room again, on every instance
    worker = await connect(relay)
    await worker.identify("w", "workers")
    await worker.dispatch("QUEUE_REQUEST", {"queue": "evil-0"})
    body = (await next_op(worker, 4))["d"]["payload"]
    await worker.dispatch("QUEUE_ACK", {"queue": "evil-0", "id": body["id"]})

    async def forgotten() -> bool:
        return not await store.hexists("sgq:apps", "evil-0") and (
            (await scrape(*other.address)).value("rmb_relay_sg_queues") == 3
        )

    await eventually(forgotten)
    await elsewhere.dispatch("QUEUE", {"queue": "evil-9", "target": WORKERS, "payload": 9})
    assert (await next_op(elsewhere, 4))["t"] == "QUEUE_CONFIRM"
    await store.aclose()


# ---- replicas of other instances' clients --------------------------------------------------


async def test_replicas_of_another_instance_are_bounded(
    redis_url: str, start_relay: StartRelay, connect: Connect
) -> None:
    """Instance A runs with larger metadata bounds than B (or sends too much for any reason):
    B keeps replicas of A's clients only within its own per-client bounds and
    --sg-replica-total-bytes; the others are not listed by B's queries and are counted; a
    client that shrinks its metadata is replicated again."""
    a = start_relay(
        "--redis", redis_url, "--sg-metadata-bytes", "300000", "--sg-metadata-keys", "1000"
    )
    b = start_relay(
        "--redis", redis_url, "--sg-replica-total-bytes", "150000", "--sg-metadata-bytes", "105000"
    )
    honest = await Honest.start(connect, b)
    before = b.rss_mib()

    async def identify(client_id: str, app: str, **extra: Any) -> SgClient:
        client = await connect(a)
        await client.identify(client_id, app, **extra)
        return client

    small = await identify("small", "ok")
    big = await identify("big", "evil", metadata=metadata(102_400))  # ~109 KB charged > B's 105,000
    many = {f"k{i}": {"type": "integer", "value": i} for i in range(300)}
    await identify("many", "evil", metadata=many)  # 300 keys > B's 256
    for i in range(3):  # ~65 KB charged each: two fit in 150,000
        await identify(f"fat{i}", "fat", metadata=metadata(61_440))

    async def replicated() -> bool:
        seen = {c["client_id"] for c in await _query(b, {"application": "ok"}, "")}
        fat = {c["client_id"] for c in await _query(b, {"application": "fat"}, "")}
        return seen == {"small"} and len(fat) == 2

    await asyncio.gather(honest.run(), eventually(replicated))
    assert not await _query(b, {"application": "evil"}, "")
    page = await scrape(*b.address)
    # each refusal of an entry is counted: one B read in its snapshot and again in the log
    # (B joining while A's clients identify) counts twice
    assert page.value("rmb_relay_sg_refused_total", limit="replica_bytes") >= 1
    assert page.value("rmb_relay_sg_refused_total", limit="replica_keys") >= 1
    assert page.value("rmb_relay_sg_refused_total", limit="replica_total") >= 1
    assert 120_000 < page.value("rmb_relay_sg_held_bytes", what="replicas") <= 150_000
    # A still answers for all of its own clients
    assert {c["client_id"] for c in await _query(a, {"application": "evil"}, "")} == {
        "big",
        "many",
    }
    # within bounds again: replicated at the change
    await big.dispatch(
        "UPDATE_METADATA", {f"k{i}": {"type": "string", "value": ""} for i in range(10)}
    )

    async def shrunk() -> bool:
        return [c["client_id"] for c in await _query(b, {"application": "evil"}, "")] == ["big"]

    await eventually(shrunk)
    await small.ws.close()
    assert b.rss_mib() - before < 24
