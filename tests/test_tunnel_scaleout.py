"""Two relays in one cluster on a real Redis: a client of relay A reaches a connector of relay B
(requests over the tenant's work queue, answers over A's bus stream), bodies of every size byte
for byte, the TTL across relays, the local shortcut, and a relay that dies with a request."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from rmb_relay.cluster import keys
from rmb_relay.dialects.tunnel.scaleout import waiter_name
from rmb_relay.tasks import cancel_and_wait
from tests.conftest import WAIT, RedisServer
from tests.conftest import redis_server as redis_server
from tests.faultlab.proxy import FaultProxy
from tests.helpers import eventually
from tests.scrape import scrape
from tests.tunnel_fixtures import StartTunnel, Tunnel, pattern
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)


async def two_relays(
    start_tunnel: StartTunnel, redis_server: RedisServer, **settings: object
) -> tuple[Tunnel, Tunnel]:
    a = await start_tunnel(redis_url=redis_server.url, **settings)
    b = await start_tunnel(redis_url=redis_server.url, target=a.target, **settings)
    return a, b


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_client_of_one_relay_reaches_the_connector_of_the_other(
    start_tunnel: StartTunnel, redis_server: RedisServer, binary: bool
) -> None:
    a, b = await two_relays(start_tunnel, redis_server)
    connector = await b.connect(binary=binary)
    await eventually(lambda: b.dialect.bridge is not None and b.dialect.bridge.consuming("ACME"))
    async with a.client() as client:
        for method in ("GET", "POST", "PUT", "DELETE"):
            reply = await client.request(method, "/relay/acme/app/echo/x?y=1", content=b"hi")
            assert (reply.status_code, reply.content) == (200, b"hi")
            assert reply.headers["x-method"] == method
        for size in (0, 16 * 1024 + 1, 10 << 20):
            up = await client.post("/relay/acme/app/echo", content=pattern(size))
            assert up.content == pattern(size)
            down = await client.get(f"/relay/acme/app/bytes/{size}")
            assert down.content == pattern(size)
        assert (await client.post("/queue/acme/app/sha", content=b"q")).status_code == 202
        await eventually(lambda: "POST /sha" in a.target.calls)
        # the origin let go of every request, the queued one (nobody waits for it) too
        await eventually(lambda: not a.dialect.hub.core.published())
    assert connector.requests_received == 4 + 6 + 1
    # every body file was cleaned up by one relay or the other
    await eventually(lambda: a.dialect.store.count() == 0 and b.dialect.store.count() == 0)
    assert not list((a.dialect.store.directory).iterdir())


async def test_ttl_holds_across_relays(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    a, b = await two_relays(start_tunnel, redis_server, request_ttl=0.3)
    async with a.client() as client:
        reply = await client.post("/relay/acme/app/sha", content=pattern(40_000))
        assert reply.status_code == 408
        connector = await b.connect()
        await eventually(
            lambda: b.dialect.bridge is not None and b.dialect.bridge.consuming("ACME")
        )
        assert (await client.get("/relay/acme/$ping/")).status_code == 200
    assert a.target.calls == []
    assert connector.requests_received == 1
    # a withdrew the expired request (its claim) before answering 408: b read it and dropped it
    assert b.dialect.bridge is not None
    assert b.dialect.bridge.queues.withdrawn == 1


async def test_local_connector_is_used_directly(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    a, b = await two_relays(start_tunnel, redis_server, require_connection=True)
    on_b = await b.connect()
    await eventually(
        lambda: not a.dialect.hub.sessions and b.dialect.hub.core.has_connector("ACME")
    )
    async with a.client() as client:
        await eventually(lambda: _reachable(a))
        assert (await client.get("/relay/acme/$ping/")).status_code == 200  # via B
        on_a = await a.connect()
        for _ in range(4):
            assert (await client.get("/relay/acme/$ping/")).status_code == 200
    assert (on_a.requests_received, on_b.requests_received) == (4, 1)


async def _reachable(tunnel: Tunnel) -> bool:
    return await tunnel.dialect.reachable("ACME")


async def test_redis_down_is_503(start_tunnel: StartTunnel, redis_server: RedisServer) -> None:
    """Redis known down (the cluster saw a call fail): refused at once, nothing sent."""
    a, _ = await two_relays(start_tunnel, redis_server)
    redis_server.stop()
    await eventually(lambda: a.cluster is not None and not a.cluster.redis_up)
    async with a.client() as client:
        reply = await client.get("/relay/acme/app/echo")
    assert reply.status_code == 503


async def test_a_request_whose_publish_failed_is_refused_only_if_it_never_runs(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    """A's link to Redis holds its bytes (delivered at the heal, as a repaired cut does): the
    request's XADD times out on A and lands later. A withdraws it before answering: first,
    the client gets 503 and B drops the request when it lands; else B took it and the client
    gets its answer. Never both, never neither."""
    proxy = await FaultProxy.start("127.0.0.1", ("127.0.0.1", redis_server.port))
    try:
        host, port = proxy.address
        a = await start_tunnel(redis_url=f"redis://{host}:{port}", redis_timeout=2.0)
        b = await start_tunnel(redis_url=redis_server.url, target=a.target)
        await b.connect()
        assert a.dialect.bridge is not None
        assert b.dialect.bridge is not None
        await eventually(
            lambda: b.dialect.bridge is not None and b.dialect.bridge.consuming("ACME")
        )
        async with a.client() as client:
            # through first: the XADD below goes out on a connection opened before the cut
            assert (
                await client.post("/relay/acme/app/echo/first", content=b"1")
            ).status_code == 200
            proxy.black_hole()
            loop = asyncio.get_running_loop()
            waiting = loop.create_task(client.post("/relay/acme/app/echo", content=b"once"))
            # the XADD's attempts timed out: a withdraws before answering
            await eventually(lambda: a.dialect.bridge is not None and a.dialect.bridge._withdrawing)
            assert not waiting.done()
            proxy.heal()
            reply = await asyncio.wait_for(waiting, 3 * WAIT)
        if reply.status_code == 503:
            await eventually(
                lambda: b.dialect.bridge is not None and b.dialect.bridge.queues.withdrawn == 1
            )
            assert "POST /echo" not in a.target.calls
            assert a.dialect.bridge.counts["withdrawn"] == 1
        else:
            assert (reply.status_code, reply.content) == (200, b"once")
            assert a.target.calls.count("POST /echo") == 1
    finally:
        await proxy.close()


async def test_a_request_taken_by_a_relay_that_dies_is_answered_504(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    """B took A's request (its connector is running it) and dies: the cluster's liveness
    tells A, which answers 504 at once (it may have run) instead of letting the client wait
    for the response timeout. (B's death: it stops renewing its liveness key, as a killed
    process does.)"""
    a, b = await two_relays(start_tunnel, redis_server)
    await b.connect()
    assert a.dialect.bridge is not None
    assert a.cluster is not None
    assert b.cluster is not None
    await eventually(lambda: b.dialect.bridge is not None and b.dialect.bridge.consuming("ACME"))
    async with a.client() as client:
        waiting = asyncio.get_running_loop().create_task(client.get("/relay/acme/app/slow"))
        await asyncio.wait_for(a.target.entered.wait(), WAIT)
        core = a.dialect.hub.core
        await eventually(
            lambda: b.cluster is not None and b.cluster.me in [i for _, i in core.published()]
        )
        await cancel_and_wait(b.cluster._ticker, WAIT)
        probe = Redis.from_url(redis_server.url)
        await probe.delete(keys.alive_key(b.cluster.me))
        await probe.aclose()
        await a.cluster.tick()
        reply = await asyncio.wait_for(waiting, WAIT)
        assert reply.status_code == 504
        assert core.published() == []
        a.target.release.set()
    # nobody else holds the tenant's connectors: the dead relay is no holder any more
    assert not await a.dialect.reachable("ACME")
    probe = Redis.from_url(redis_server.url)
    assert not await probe.smembers(keys.work_holders_key("tunnel", "ACME"))
    await probe.aclose()


async def test_answers_held_for_a_given_up_relay_are_bounded(
    start_tunnel: StartTunnel, redis_server: RedisServer
) -> None:
    """Answers found reaping the stream of a relay the cluster gave up (it may only be cut off
    from Redis, its clients still waiting) are held for it, `--tunnel-answers-held-bytes` at
    most: past that an answer is dropped (its client gets 504 at its deadline) and counted,
    and what is held stays within the bound however many arrive."""
    a = await start_tunnel(redis_url=redis_server.url, answers_held_bytes=1000)
    assert a.cluster is not None
    frame = b"s" + b"5" * 299
    for n in range(10):
        endpoint = a.cluster.resolve(waiter_name(f"request-{n}", "given-up-relay"))
        assert endpoint is not None
        endpoint.deliver(frame)
    page = await scrape(*a.relay.addresses[0])
    assert page.value("rmb_relay_tunnel_answers_held_bytes", dialect="tunnel") == 900
    assert page.value("rmb_relay_tunnel_answers_dropped_total", dialect="tunnel") == 7
