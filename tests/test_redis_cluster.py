"""The cluster on a real 3-master Redis Cluster started here: the same code as on one server
(the keys' hash tags keep what one command touches in one slot), RMB and SBD across two
instances and the shared mailbox, with keys spread over the three masters."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from rmb_relay.client import IncomingRequest
from tests.cluster_fixtures import (  # noqa: F401 - the fixture is used by name
    MakeInstance,
    make_instance_fixture,
)
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.redis_process import start_redis_cluster


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

    def record(request: IncomingRequest) -> bytes:
        received.append(request.data)
        if len(received) == 3:
            done.set()
        return b"ok"

    await eventually(lambda: a.rmb.mailbox.stats.stored == 3)
    await b.client(3, handlers={"m": record})
    await asyncio.wait_for(done.wait(), WAIT)
    assert received == [f"queued {i}".encode() for i in range(3)]
