"""rmb-peer end to end: real relay and peer processes, each peer on its own redis-server, and
clients and services that speak only the public msgbus JSON through the plain `redis` package.

Twins: 1 (sr25519, peer A), 2 (ed25519, peer B), 3 (sr25519, peer C started with --no-update,
so it publishes no e2e key and is sent plaintext), 4 (in the directory, never connected).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from rmb_relay.peer.gateway import VERSION
from rmb_relay.sdk import RmbPeerClient
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT, free_port, start_redis
from tests.helpers import eventually
from tests.peer_fixtures import (
    CONNECTED,
    Peer,
    Relay,
    add_twin,
    redis_servers,
    start_peer,
    start_relay,
)


@dataclass
class Cluster:
    twins: str
    relay: Relay
    a: Peer
    b: Peer
    c: Peer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("peers")
    twins = f"sqlite:{tmp / 'twins.sqlite3'}"
    for twin, key_type in ((1, "sr25519"), (2, "ed25519"), (3, "sr25519"), (4, "sr25519")):
        add_twin(twins, twin, key_type)
    relay = start_relay(twins)
    peers: list[Peer] = []
    try:
        with redis_servers(tmp, 3) as (ra, rb, rc):
            peers.append(start_peer(1, twins, ra, [relay]))
            peers.append(start_peer(2, twins, rb, [relay], key_type="ed25519"))
            peers.append(start_peer(3, twins, rc, [relay], "--no-update"))
            yield Cluster(twins, relay, *peers)
            for peer in peers:
                assert peer.process.stop() == 0
    finally:
        for peer in peers:
            peer.process.stop()
        relay.process.stop()


@pytest.fixture
async def redis_a(cluster: Cluster) -> AsyncIterator[Redis]:
    async with blocking_redis(cluster.a.redis.url) as redis:
        yield redis


def blocking_redis(url: str) -> Redis:
    """A client for the tests' BLPOP/BRPOP with `timeout=WAIT`. redis-py 8 bounds every read by
    its default `socket_timeout` of 5 s, a blocking pop's too, so such a pop failed with
    "Timeout reading from ..." after 5 s instead of waiting WAIT: on a loaded machine the peer's
    Redis-restart test lost that race (once in three full runs). The server bounds the wait."""
    return Redis.from_url(url, socket_timeout=None)


def request(dst: list[int], cmd: str, data: bytes = b"", **fields: Any) -> dict[str, Any]:
    message = {
        "ver": 1,
        "ref": str(uuid.uuid4()),
        "cmd": cmd,
        "exp": 60,
        "dat": base64.b64encode(data).decode(),
        "tag": None,
        "dst": dst,
        "ret": f"ret-{uuid.uuid4()}",
        "shm": None,
        "now": int(time.time()),
    }
    message.update(fields)
    return message


async def ask(redis: Redis, message: dict[str, Any], replies: int = 1) -> list[dict[str, Any]]:
    await redis.lpush("msgbus.system.local", json.dumps(message))
    out = []
    for _ in range(replies):
        popped = await redis.blpop([message["ret"]], timeout=WAIT)
        assert popped is not None, f"no reply on {message['ret']}"
        out.append(json.loads(popped[1]))
    return out


async def serve_once(peer: Peer, cmd: str, answer: Any = None) -> dict[str, Any]:
    """Pop one request from msgbus.<cmd> on the peer's Redis and answer it the way real
    services do: no `err` key, the request's keys copied in (spec §6)."""
    async with blocking_redis(peer.redis.url) as redis:
        popped = await redis.brpop([f"msgbus.{cmd}"], timeout=WAIT)
        assert popped is not None, f"nothing on msgbus.{cmd}"
        incoming = json.loads(popped[1])
        reply = dict(incoming)  # extra keys: cmd, exp, ret, tag, src
        reply.update(dst=incoming["src"], now=int(time.time()))
        if answer is None:
            reply["dat"] = base64.b64encode(b"echo:" + base64.b64decode(incoming["dat"])).decode()
        else:
            reply.update(answer)
        await redis.lpush("msgbus.system.reply", json.dumps(reply))
    return incoming


def decoded(reply: dict[str, Any]) -> bytes:
    return base64.b64decode(reply["dat"])


async def test_request_reaches_the_service_and_the_reply_comes_back_with_the_clients_ref(
    cluster: Cluster, redis_a: Redis
) -> None:
    message = request([2], "test.echo", b"hello", shm="application/json", tag="t1")
    service = asyncio.create_task(serve_once(cluster.b, "test.echo"))
    (reply,) = await ask(redis_a, message)
    incoming = await service
    assert incoming["ver"] == 1
    assert incoming["src"] == "1"
    assert incoming["cmd"] == "test.echo"
    assert incoming["ret"] == "msgbus.system.reply"
    assert incoming["shm"] == "application/json"
    assert incoming["tag"] == "t1"
    assert incoming["ref"] != message["ref"]  # the envelope uid, not the client's ref
    assert decoded(incoming) == b"hello"
    assert reply["ref"] == message["ref"]
    assert reply["src"] == "2"
    assert reply["err"] is None
    assert decoded(reply) == b"echo:hello"


def test_peers_published_their_keys_except_the_no_update_one(cluster: Cluster) -> None:
    """B gets ciphertext (it published a pk), C plaintext (it did not)."""
    path = cluster.twins.removeprefix("sqlite:")
    with SqliteTwinDirectory(path) as directory:
        a, b, c = (directory.show(i) for i in (1, 2, 3))
    assert a is not None
    assert b is not None
    assert c is not None
    assert a.pk is not None
    assert a.relays == frozenset({"localhost"})
    assert b.pk is not None
    assert c.pk is None


async def test_plaintext_to_a_twin_without_a_key(cluster: Cluster, redis_a: Redis) -> None:
    message = request([3], "test.plain", b"in the clear")
    service = asyncio.create_task(serve_once(cluster.c, "test.plain"))
    (reply,) = await ask(redis_a, message)
    assert decoded(await service) == b"in the clear"
    assert (reply["src"], decoded(reply), reply["err"]) == ("3", b"echo:in the clear", None)


async def test_one_request_to_several_twins_gets_one_reply_each(
    cluster: Cluster, redis_a: Redis
) -> None:
    message = request([2, 3], "test.many", b"all")
    services = [
        asyncio.create_task(serve_once(peer, "test.many")) for peer in (cluster.b, cluster.c)
    ]
    replies = await ask(redis_a, message, replies=2)
    incoming = await asyncio.gather(*services)
    assert incoming[0]["ref"] == incoming[1]["ref"]  # one uid for all destinations
    assert sorted(r["src"] for r in replies) == ["2", "3"]
    assert {r["ref"] for r in replies} == {message["ref"]}


async def test_service_error_reaches_the_client(cluster: Cluster, redis_a: Redis) -> None:
    message = request([2], "test.fail")
    error = {"err": {"code": 42, "message": "no such thing"}, "dat": ""}
    service = asyncio.create_task(serve_once(cluster.b, "test.fail", error))
    (reply,) = await ask(redis_a, message)
    await service
    assert reply["err"] == {"code": 42, "message": "no such thing"}
    assert reply["src"] == "2"


async def test_expired_request_gets_102(cluster: Cluster, redis_a: Redis) -> None:
    (reply,) = await ask(redis_a, request([2], "test.x", now=int(time.time()) - 100, exp=10))
    assert reply["err"] == {
        "code": 102,
        "message": "envelope validation error: message has expired",
    }
    assert reply["src"] == ""


async def test_unknown_destination_gets_103(cluster: Cluster, redis_a: Redis) -> None:
    (reply,) = await ask(redis_a, request([999], "test.x"))
    assert reply["err"] == {"code": 103, "message": "unknown twin id '999'"}
    assert (reply["src"], reply["dat"], reply["now"]) == ("", "", 0)


async def test_relay_error_arrives_from_twin_0(cluster: Cluster, redis_a: Redis) -> None:
    (reply,) = await ask(redis_a, request([4], "test.x", tag="fail-fast"))
    assert reply["err"] == {"code": 0, "message": "destination offline"}
    assert reply["src"] == "0"


async def test_rmb_version_is_answered_by_the_peer(cluster: Cluster, redis_a: Redis) -> None:
    (reply,) = await ask(redis_a, request([2], "rmb.version"))
    assert reply["err"] is None
    assert json.loads(decoded(reply)) == VERSION
    assert reply["shm"] == "application/json"


async def test_bad_json_is_answered_where_possible_and_never_stops_the_peer(
    cluster: Cluster, redis_a: Redis
) -> None:
    await redis_a.lpush("msgbus.system.local", b"not json at all", b"[1]")
    await redis_a.lpush("msgbus.system.reply", b'{"ver":1}', b"\xff\xfe")
    (reply,) = await ask(redis_a, {**request([2], "test.x"), "dst": "2"})
    assert reply["err"]["code"] == 101
    assert "'dst'" in reply["err"]["message"]
    service = asyncio.create_task(serve_once(cluster.b, "test.after"))
    (reply,) = await ask(redis_a, request([2], "test.after", b"still here"))
    await service
    assert decoded(reply) == b"echo:still here"
    assert cluster.a.output.count("bad request on msgbus.system.local") >= 2
    assert cluster.a.output.count("dropping a reply on msgbus.system.reply") >= 2


async def test_sdk_peer_client_in_both_roles(cluster: Cluster) -> None:
    async with (
        await RmbPeerClient.connect(cluster.a.redis.url) as client,
        await RmbPeerClient.connect(cluster.b.redis.url) as service,
    ):
        service.serve("test.sdk", lambda r: r.data.upper())
        replies = await asyncio.gather(
            *(client.request([2], "test.sdk", f"n{i}".encode(), timeout=WAIT) for i in range(20))
        )
    assert [r[0].data for r in replies] == [f"N{i}".encode() for i in range(20)]
    assert {r[0].source for r in replies} == {"2"}


async def test_a_peer_whose_redis_restarts_loses_nothing(
    cluster: Cluster, redis_a: Redis, tmp_path: Path
) -> None:
    """D's Redis goes away with a request on its way to D: the peer holds the write, and
    delivers it once Redis is back; D's service answers and the reply reaches A's client."""
    add_twin(cluster.twins, 5)
    port = free_port()
    redis = start_redis(str(tmp_path), port)
    d = start_peer(5, cluster.twins, redis, [cluster.relay])
    try:
        message = request([5], "test.restart", b"first")
        service = asyncio.create_task(serve_once(d, "test.restart"))
        (reply,) = await ask(redis_a, message)
        await service
        assert decoded(reply) == b"echo:first"
        redis.stop()
        message = request([5], "test.restart", b"during")
        await redis_a.lpush("msgbus.system.local", json.dumps(message))
        d.output.wait_for("redis write failed")
        redis = start_redis(str(tmp_path), port)
        service = asyncio.create_task(serve_once(d, "test.restart"))
        popped = await redis_a.blpop([message["ret"]], timeout=WAIT)
        assert popped is not None
        assert decoded(json.loads(popped[1])) == b"echo:during"
        assert decoded(await service) == b"during"
        assert d.output.count(CONNECTED) == 1  # the relay connection never dropped
    finally:
        assert d.process.stop() == 0
        redis.stop()


async def test_request_that_expires_waiting_for_a_relay_gets_500(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A peer whose only relay is down holds requests; one that expires before any relay
    comes up is answered with rmb-peer's error, `src` ""."""
    add_twin(cluster.twins, 6)
    port = free_port()
    redis = start_redis(str(tmp_path), port)
    down = Relay(cluster.relay.process, free_port())  # nothing listens there
    e = start_peer(6, cluster.twins, redis, [down], connected=False)
    try:
        e.output.wait_for("cannot connect to relay")
        async with blocking_redis(redis.url) as client:
            # a `now` ahead of the peer's clock is replaced by it: a full second left at intake
            ahead = int(time.time()) + 60
            (reply,) = await ask(client, request([2], "test.x", exp=1, now=ahead))
        assert reply["err"] == {
            "code": 500,
            "message": "other: response has expired before sending!",
        }
        assert reply["src"] == ""
    finally:
        assert e.process.stop() == 0
        redis.stop()


async def test_ttl_is_clamped_as_rmb_peer_clamps_it(cluster: Cluster, redis_a: Redis) -> None:
    """exp 0 is the default 300 s, more than 1800 s is cut to 1800 (spec §5.6)."""
    for exp, seen in ((0, 300), (5000, 1800), (60, 60)):
        service = asyncio.create_task(serve_once(cluster.b, "test.ttl"))
        now = int(time.time()) + 60  # ahead of the peer's clock: replaced by it, nothing lost
        await ask(redis_a, request([2], "test.ttl", exp=exp, now=now))
        assert (await service)["exp"] == seen


async def test_backlog_lives_while_the_request_waits_and_goes_with_the_reply(
    cluster: Cluster, redis_a: Redis
) -> None:
    from rmb_relay._proto.peer_pb2 import Backlog

    message = request([2], "test.backlog", exp=120)
    await redis_a.lpush("msgbus.system.local", json.dumps(message))
    async with blocking_redis(cluster.b.redis.url) as redis_b:
        popped = await redis_b.brpop(["msgbus.test.backlog"], timeout=WAIT)
        assert popped is not None
        incoming = json.loads(popped[1])
        key = f"msgbus.backlog.{incoming['ref']}"
        backlog = Backlog.FromString(await redis_a.get(key))
        assert (backlog.uid, backlog.reply_to, backlog.reference) == (
            incoming["ref"],
            message["ret"],
            message["ref"],
        )
        assert 0 < await redis_a.ttl(key) <= 120
        reply = {"ver": 1, "ref": incoming["ref"], "dat": "", "dst": "1", "now": 0}
        await redis_b.lpush("msgbus.system.reply", json.dumps(reply))
    assert await redis_a.blpop([message["ret"]], timeout=WAIT) is not None

    async def gone() -> bool:  # the DEL follows the reply, in its pipeline or the next
        return not await redis_a.exists(key)

    await eventually(gone)


async def test_command_queue_is_capped_at_ten_thousand(cluster: Cluster, redis_a: Redis) -> None:
    async with blocking_redis(cluster.b.redis.url) as redis_b:
        await redis_b.lpush("msgbus.test.cap", *[b"old"] * 10_000)
        message = request([2], "test.cap", b"newest")
        await redis_a.lpush("msgbus.system.local", json.dumps(message))

        async def arrived() -> bool:
            return bool(await redis_b.lindex("msgbus.test.cap", 0) != b"old")

        await eventually(arrived)
        head = await redis_b.lindex("msgbus.test.cap", 0)
        assert decoded(json.loads(head)) == b"newest"
        assert await redis_b.llen("msgbus.test.cap") == 10_000
        await redis_b.delete("msgbus.test.cap")
