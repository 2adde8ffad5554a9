"""The cluster on a real 3-master Redis Cluster started here: the same code as on one server
(the keys' hash tags keep what one command touches in one slot), RMB and SBD across two
instances and the shared mailbox, the 신경 gateway's replicas and SEND, and the tunnel's work
queue, with keys spread over the three masters."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.cluster_fixtures import (  # noqa: F401 - the fixture is used by name
    MakeInstance,
    make_instance_fixture,
    recorder,
)
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.redis_process import start_redis_cluster
from tests.sg_fixtures import MakeGateway
from tests.sg_fixtures import make_gateway as make_gateway
from tests.test_singyeong_queues import queue, take
from tests.tunnel_fixtures import StartTunnel
from tests.tunnel_fixtures import start_tunnel as start_tunnel


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[str]:
    """A 3-master Redis Cluster on loopback; yields the URL of one node."""
    if shutil.which("redis-cli") is None or shutil.which("redis-server") is None:
        pytest.skip("redis-cli/redis-server are not installed: no local Redis Cluster to test")
    with tempfile.TemporaryDirectory(prefix="rmb-redis-cluster-") as directory:
        cluster = start_redis_cluster(directory)
        try:
            yield cluster.url
        finally:
            cluster.stop()


async def test_rmb_sbd_and_mailbox_across_instances_on_redis_cluster(
    redis_cluster: str, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_cluster, cluster_mode=True)
    b = await make_instance(redis_cluster, cluster_mode=True)
    # RMB request and reply across the instances
    alice = await a.client(1, sid="alice")
    bob = await b.client(2, sid="bob")
    bob.handle("echo", lambda request: request.data[::-1])
    for i in range(10):
        reply = await alice.request(2, "echo", f"hi {i}".encode(), dest_sid="bob", timeout=WAIT)
        assert reply.data == f"hi {i}".encode()[::-1]
    assert a.rmb.metrics.routed_slow["cluster"] >= 10
    # SBD across the instances, in order
    one = await a.sbd_client()
    two = await b.sbd_client()
    await a.cluster.claimed(one.pubkey)
    await b.cluster.claimed(two.pubkey)
    for i in range(5):
        one.forward(two.pubkey, b"ping %d" % i)
    for i in range(5):
        assert await two.receive_forward() == (one.pubkey, b"ping %d" % i)
    # offline: the shared mailbox, read on the other instance
    for i in range(3):
        alice.send_request(3, "m", f"queued {i}".encode())
    received: list[bytes] = []
    done = asyncio.Event()

    await eventually(lambda: a.rmb.mailbox.stats.stored == 3)
    await b.client(3, handlers={"m": recorder(received, done=done, expect=3)})
    await asyncio.wait_for(done.wait(), WAIT)
    assert received == [f"queued {i}".encode() for i in range(3)]


async def test_gateway_replicas_and_send_across_instances_on_redis_cluster(
    redis_cluster: str, make_gateway: MakeGateway
) -> None:
    """The 신경 gateway's replicated table (scripts over one slot) and its frames over the bus
    on Redis Cluster; a stopped instance's clients leave the other."""
    a = await make_gateway(redis_url=redis_cluster, cluster_mode=True, node="sg-a")
    b = await make_gateway(redis_url=redis_cluster, cluster_mode=True, node="sg-b")
    for gateway in (a, b):
        assert gateway.dialect.cluster is not None
        await asyncio.wait_for(gateway.dialect.cluster.ready.wait(), WAIT)
    worker = await b.client("w", "api")
    await worker.update(n=("integer", 1))
    await eventually(lambda: "n" in getattr(a.dialect.index.get("api", "w"), "metadata", {}))
    sender = await a.client("s", "caller")
    target = {"application": "api", "ops": [{"n": {"$eq": 1}}]}
    await sender.dispatch("SEND", {"target": target, "nonce": 1, "payload": "over"})
    assert (await worker.expect(4, "SEND"))["d"]["payload"] == "over"
    await b.stop()  # closes its dialect: it leaves the table
    await eventually(lambda: a.dialect.index.get("api", "w") is None)


async def test_tunnel_across_relays_on_redis_cluster(
    redis_cluster: str, start_tunnel: StartTunnel
) -> None:
    """The tunnel's work queue and answers over the bus on Redis Cluster."""
    a = await start_tunnel(redis_url=redis_cluster, cluster_mode=True)
    b = await start_tunnel(redis_url=redis_cluster, cluster_mode=True, target=a.target)
    await b.connect()
    await eventually(lambda: b.dialect.bridge is not None and b.dialect.bridge.consuming("ACME"))
    async with a.client() as client:
        reply = await client.post("/relay/acme/app/echo", content=b"across")
        assert (reply.status_code, reply.content) == (200, b"across")
        assert await a.dialect.reachable("ACME")


async def test_gateway_queue_across_instances_on_redis_cluster(
    redis_cluster: str, make_gateway: MakeGateway
) -> None:
    """A 신경 QUEUE stored through one instance and taken through the other on Redis Cluster
    (the store's pipeline may send neither EVALSHA nor PUBLISH there: redis-py refuses both)."""
    a = await make_gateway(redis_url=redis_cluster, cluster_mode=True, node="sgq-a")
    b = await make_gateway(redis_url=redis_cluster, cluster_mode=True, node="sgq-b")
    producer = await a.client("p", "caller")
    worker = await b.client("w", "workers")
    for n in range(3):
        await queue(producer, n, name="cluster-jobs")
    assert [(await take(worker, "cluster-jobs"))["payload"] for _ in range(3)] == [0, 1, 2]
