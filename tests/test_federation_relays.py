"""Federation between real relay processes over real HTTP (spec/rmb.md §3.3, decisions 4-5):
two relays both ways, a twin whose relays fail (5xx, refused, hang) until the ranker puts the
healthy one first, a remote's 4xx reaching the sender, expiry during retries, TLS verified
against a private CA, and the Redis-backed queue surviving an instance crash."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from rmb_relay.errors import RemoteError
from rmb_relay.sdk import IncomingRequest, RmbClient
from rmb_relay.telemetry.record_schema import read_table
from tests.conftest import WAIT, RedisServer
from tests.federation_fixtures import (
    Network,
    make_ca_and_cert,
    provision,
    wait_metric,
)
from tests.helpers import eventually
from tests.rmb_fixtures import key_for

A, B, C = "127.0.0.2", "127.0.0.3", "127.0.0.4"
#: stand-ins for relays that fail: 503 to everything, never answering, nothing listening
FAILING, HANGING, REFUSING = "127.0.0.5", "127.0.0.6", "127.0.0.7"


@pytest.fixture
async def network(tmp_path: Path) -> AsyncIterator[Network]:
    net = Network(tmp_path)
    try:
        yield net
    finally:
        await net.close()


async def client(url: str, twin: int) -> RmbClient:
    return await RmbClient.connect(url, twin, key_for(twin))


async def test_two_relays_federate_both_ways(network: Network, tmp_path: Path) -> None:
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [B]})
    relay_a = network.relay(A, twins)
    relay_b = network.relay(B, twins)
    alice, bob = await client(relay_a.url, 1), await client(relay_b.url, 2)
    alice.handle("reverse", lambda r: r.data[::-1])
    bob.handle("reverse", lambda r: r.data[::-1])

    async def ask(sender: RmbClient, dest: int, i: int) -> bytes:
        return (await sender.request(dest, "reverse", f"hello {i}".encode(), timeout=WAIT)).data

    # one exchange first: the answers teach each relay that the other takes batches
    assert await ask(alice, 2, -1) == b"1- olleh"
    a_to_b = [ask(alice, 2, i) for i in range(50)]
    b_to_a = [ask(bob, 1, i) for i in range(50)]
    answers = await asyncio.gather(*a_to_b, *b_to_a)
    assert answers == [f"hello {i}".encode()[::-1] for i in range(50)] * 2
    # each request and each response crossed once: 101 envelopes each way (the first
    # exchange went one way only)
    # (a sender counts its 202 after the receiver may already have answered)
    for relay in (relay_a, relay_b):
        await wait_metric(relay, "rmb_relay_federation_out_total", 101, outcome="accepted")
        page = await relay.metrics()
        assert page.value("rmb_relay_federation_out_total", outcome="accepted") == 101
        assert page.value("rmb_relay_federation_in_total", status="accepted") == 101
        assert page.value("rmb_relay_federation_batches_total") >= 1
    await alice.close()
    await bob.close()


async def test_failing_relays_are_downvoted_and_the_healthy_one_takes_the_traffic(
    network: Network, tmp_path: Path
) -> None:
    """Twin 3 lists four relays: one answers 503, one never answers, one refuses connections
    (a relay process that was killed) and B works. Priors put B last, so the first message
    tries every failing one first; each failure downvotes it, and from then on B goes first."""
    relays = [FAILING, HANGING, REFUSING, B]
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 3: relays})
    priors = tmp_path / "priors.json"
    priors.write_text(json.dumps({B: 0.9, FAILING: 0.1, HANGING: 0.1, REFUSING: 0.1}))
    relay_a = network.relay(A, twins, "--ranker-priors", str(priors), "--federation-timeout", "2")
    relay_b = network.relay(B, twins)
    network.relay(REFUSING, twins).kill()  # a third relay process, dead: connection refused
    failing = await network.bad_remote(FAILING, "503")
    hanging = await network.bad_remote(HANGING, "hang")
    alice, carol = await client(relay_a.url, 1), await client(relay_b.url, 3)
    carol.handle("echo", lambda r: r.data)

    first = await alice.request(3, "echo", b"first", timeout=WAIT * 2)
    assert first.data == b"first"
    replies = await asyncio.gather(
        *(alice.request(3, "echo", b"%d" % i, timeout=WAIT) for i in range(30))
    )
    assert [r.data for r in replies] == [b"%d" % i for i in range(30)]

    assert (failing.requests, hanging.requests) == (1, 1)
    page = await relay_a.metrics()
    for bad in (FAILING, HANGING, REFUSING):
        assert page.value("rmb_relay_federation_ranker_failures", domain=bad) == 1
    assert page.value("rmb_relay_federation_ranker_failures", domain=B) == 0
    assert page.value("rmb_relay_federation_ranker_prior", domain=B) == 0.9
    assert page.value("rmb_relay_federation_post_failures_total") == 3
    assert page.value("rmb_relay_federation_out_total", outcome="accepted") == 31
    await alice.close()
    await carol.close()


async def test_a_remote_refusal_reaches_the_sender_as_an_error(
    network: Network, tmp_path: Path
) -> None:
    """B answers 404 to a fail-fast envelope for an offline twin: permanent, not retried."""
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [B]})
    relay_a = network.relay(A, twins)
    network.relay(B, twins)
    alice = await client(relay_a.url, 1)
    with pytest.raises(RemoteError) as caught:
        await alice.request(2, "echo", b"x", tags="fail-fast", timeout=WAIT)
    reply = caught.value.reply
    assert reply.from_relay
    assert reply.error == (0, "remote relay rejected permanently: destination offline")
    page = await relay_a.metrics()
    assert page.value("rmb_relay_federation_out_total", outcome="rejected") == 1
    assert page.value("rmb_relay_federation_retries_total") == 0
    await alice.close()


async def test_an_envelope_expiring_during_retries_is_reported_to_its_sender(
    network: Network, tmp_path: Path
) -> None:
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [FAILING]})
    relay_a = network.relay(A, twins, "--federation-max-backoff", "0.2")
    failing = await network.bad_remote(FAILING, "503")
    alice = await client(relay_a.url, 1)
    uid, wire = alice.request_envelope(2, "echo", b"x", expiration=2)
    # the relay reports it once the deadline has passed; the client's own request timer would
    # give up at the deadline, so wait for the error past it
    error = alice.expect(uid, deadline=int(time.time() + WAIT))
    alice.send(wire)
    reply = await asyncio.wait_for(error, WAIT)
    assert reply.error == (0, "message has expired")
    assert failing.requests >= 2  # it was retried before it expired
    page = await relay_a.metrics()
    assert page.value("rmb_relay_federation_out_total", outcome="expired") == 1
    assert page.value("rmb_relay_federation_retries_total") >= 2
    await alice.close()


async def test_a_sender_chosen_expiration_is_capped_by_federation_max_ttl(
    network: Network, tmp_path: Path
) -> None:
    """An envelope claiming to live ten years, to a relay that always fails, is tried for
    --federation-max-ttl after it was queued, not for its own expiration (issue 33): the
    sender hears that it expired, and the queue holds nothing of it any more."""
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [FAILING]})
    relay_a = network.relay(
        A, twins, "--federation-max-backoff", "0.2", "--federation-max-ttl", "2"
    )
    failing = await network.bad_remote(FAILING, "503")
    alice = await client(relay_a.url, 1)
    uid, wire = alice.request_envelope(2, "echo", b"x", expiration=10 * 365 * 86_400)
    error = alice.expect(uid, deadline=int(time.time() + WAIT))
    started = time.monotonic()
    alice.send(wire)
    reply = await asyncio.wait_for(error, WAIT)
    assert reply.error == (0, "message has expired")
    assert time.monotonic() - started < WAIT
    assert failing.requests >= 2  # retried until the cap, not given up at once
    page = await relay_a.metrics()
    assert page.value("rmb_relay_federation_out_total", outcome="expired") == 1
    await alice.close()


async def test_route_records_name_the_remote_that_decided_each_outcome(
    network: Network, tmp_path: Path
) -> None:
    """With --records, the federation worker records each envelope when its outcome is known,
    with the remote relay actually used: twin 3 lists B (answers 503) and C, so its request is
    delivered through C, not through B (its first relay); C refuses a fail-fast request for its
    offline twin 4; twin 5's only relay is B, so its request expires retrying B."""
    records = tmp_path / "records"
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 3: [B, C], 4: [C], 5: [B]})
    relay_a = network.relay(A, twins, "--records", str(records), "--federation-max-backoff", "0.2")
    relay_c = network.relay(C, twins)
    await network.bad_remote(B, "503")
    alice, carol = await client(relay_a.url, 1), await client(relay_c.url, 3)
    carol.handle("echo", lambda r: r.data)

    assert (await alice.request(3, "echo", b"hi", timeout=WAIT * 2)).data == b"hi"
    with pytest.raises(RemoteError, match="rejected permanently"):
        await alice.request(4, "echo", b"x", tags="fail-fast", timeout=WAIT)
    uid, wire = alice.request_envelope(5, "echo", b"x" * 10, expiration=2)
    expired = alice.expect(uid, deadline=int(time.time() + WAIT))
    alice.send(wire)
    assert (await asyncio.wait_for(expired, WAIT)).error == (0, "message has expired")
    await alice.close()
    await carol.close()
    relay_a.stop()  # writes what it buffered

    rows = [r for r in read_table(records).to_pylist() if r["route"] == "federation"]
    assert sorted((r["dst"], r["outcome"], r["reason"], r["remote"]) for r in rows) == [
        ("3", "delivered", None, C),
        ("4", "rejected", "remote rejected", C),
        ("5", "expired", "federation expired", B),
    ]
    assert {r["src"] for r in rows} == {"1"}
    assert all(r["size"] > 0 for r in rows)
    # the time from queuing to the outcome: 2 s of retries for the one that expired
    times = {r["dst"]: r["relay_us"] for r in rows}
    assert times["5"] >= 1_000_000
    assert 0 < times["3"] < times["5"]


async def test_the_receiving_relay_records_each_inbound_envelope_where_it_landed(
    network: Network, tmp_path: Path
) -> None:
    """With --records on the receiving relay B, every envelope POSTed to it gets one record
    once its answer is decided, naming the relay that posted it: A's request to bob delivered
    to his connection, A's envelope for offline twin 4 queued in its mailbox, a fail-fast one
    for twin 4 refused (404); a direct POST for a twin B does not serve refused (403) with the
    domain its header claims, and a body that is no envelope refused (400), with none."""
    records = tmp_path / "records"
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [B], 4: [B]})
    relay_a = network.relay(A, twins)
    relay_b = network.relay(B, twins, "--records", str(records))
    alice, bob = await client(relay_a.url, 1), await client(relay_b.url, 2)
    bob.handle("echo", lambda r: r.data)

    assert (await alice.request(2, "echo", b"hi", timeout=WAIT)).data == b"hi"
    _, stored = alice.request_envelope(4, "echo", b"for later" * 10, expiration=600)
    alice.send(stored)
    with pytest.raises(RemoteError, match="rejected permanently"):
        await alice.request(4, "echo", b"x", tags="fail-fast", timeout=WAIT)
    await wait_metric(relay_b, "rmb_relay_federation_in_total", 2, status="accepted")
    _, foreign = bob.request_envelope(1, "echo", b"not yours")
    url = f"http://{B}:{relay_b.port}/"
    origin = {"RMB-Relay-Domain": "Other.Example"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=foreign, headers=origin) as r:
            assert r.status == 403
        async with http.post(url, data=b"\xff not an envelope") as r:
            assert r.status == 400
    await alice.close()
    await bob.close()
    relay_b.stop()  # writes what it buffered

    rows = [r for r in read_table(records).to_pylist() if r["route"] != "federation"]
    found = sorted(
        ((r["src"], r["dst"], r["route"], r["outcome"], r["reason"], r["remote"]) for r in rows),
        key=repr,
    )
    assert found == sorted(
        [
            (None, None, "none", "rejected", "bad request", None),
            ("1", "2", "local", "delivered", None, A),
            ("1", "4", "mailbox", "queued", None, A),
            ("1", "4", "none", "rejected", "destination offline", A),
            ("2", "1", "none", "rejected", "not served here", "other.example"),
        ],
        key=repr,
    )
    assert all(r["dialect"] == "rmb" and r["relay_us"] >= 0 for r in rows)
    sizes = {(r["dst"], r["route"]): r["size"] for r in rows}
    assert sizes[("4", "mailbox")] == len(stored)
    # bob's answer went back to A through B's outbound federation: recorded there, once
    [answer] = [r for r in read_table(records).to_pylist() if r["route"] == "federation"]
    assert (answer["src"], answer["dst"], answer["outcome"], answer["remote"]) == (
        "2",
        "1",
        "delivered",
        A,
    )


async def test_tls_to_the_remote_is_verified_against_the_given_ca(
    network: Network, tmp_path: Path
) -> None:
    ca, cert, key = make_ca_and_cert(tmp_path, B)
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [B], 4: [C]})
    https = f"https://{{domain}}:{network.port}/"
    trusting = network.relay(
        A, twins, "--federation-url-template", https, "--federation-ca", str(ca)
    )
    untrusting = network.relay(
        C, twins, "--federation-url-template", https, "--federation-timeout", "1"
    )
    network.relay(B, twins, "--tls-cert", str(cert), "--tls-key", str(key))
    alice, dave = await client(trusting.url, 1), await client(untrusting.url, 4)
    # twin 2 is offline on B: B stores it and answers 202 (over TLS)
    alice.send(alice.request_envelope(2, "stored")[1])
    await wait_metric(trusting, "rmb_relay_federation_out_total", 1, outcome="accepted")
    # C has only the system CAs: B's certificate does not verify, the POST fails
    dave.send(dave.request_envelope(2, "refused", expiration=60)[1])
    await wait_metric(untrusting, "rmb_relay_federation_post_failures_total", 1)
    assert await untrusting.metric("rmb_relay_federation_out_total", outcome="accepted") == 0
    await alice.close()
    await dave.close()


async def test_redis_queue_survives_an_instance_crash(
    redis_server: RedisServer, network: Network, tmp_path: Path
) -> None:
    """Two instances share a Redis; B is down. Alice's envelopes are queued and read by the
    instances; one is killed (SIGKILL) while it holds some. Once B is up, every envelope
    arrives: the survivor claims what the dead one held."""
    a2 = "127.0.0.8"
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A, a2], 2: [B]})
    shared = ("--redis", redis_server.url, "--federation-claim-idle", "1")
    fast = ("--federation-max-backoff", "0.2")
    first = network.relay(A, twins, *shared, *fast)
    network.relay(a2, twins, *shared, *fast)
    relay_b = network.relay(B, twins, start=False)
    alice = await client(first.url, 1)
    count = 40
    sent = set()
    for i in range(count):
        uid, wire = alice.request_envelope(2, "work", b"%d" % i, expiration=120)
        sent.add(uid)
        alice.send(wire)

    redis = Redis.from_url(redis_server.url)
    assert first.process is not None
    mine = f"-{first.process.pid}-"

    async def all_queued() -> bool:
        groups = await redis.xinfo_groups("relay.federation.stream")
        return bool(groups) and int(groups[0]["entries-read"] or 0) >= count

    async def first_holds_some() -> bool:
        consumers = await redis.xinfo_consumers("relay.federation.stream", "federation")
        return any(mine in c["name"].decode() and c["pending"] > 0 for c in consumers)

    await eventually(all_queued, WAIT)  # accepted into Redis (what was not can be lost)
    await eventually(first_holds_some, WAIT)
    first.kill()
    await alice.close()

    relay_b.start()
    received: set[str] = set()
    all_in = asyncio.Event()

    def work(request: IncomingRequest) -> bytes:
        received.add(request.uid)
        if received >= sent:
            all_in.set()
        return b""

    bob = RmbClient(2, key_for(2))
    bob.handle("work", work)  # before connecting: the mailbox is delivered on login
    await bob.open(relay_b.url)
    await asyncio.wait_for(all_in.wait(), WAIT * 3)
    assert received == sent
    survivor = network.relays[1]
    assert await survivor.metric("rmb_relay_federation_claimed_total") >= 1
    # everything acknowledged and deleted: the stream does not grow
    await eventually(lambda: _stream_empty(redis), WAIT)
    await bob.close()
    await redis.aclose()


async def _stream_empty(redis: Redis) -> bool:
    return int(await redis.xlen("relay.federation.stream")) == 0


async def test_an_envelope_the_redis_queue_could_not_take_reaches_its_sender_as_an_error(
    redis_server: RedisServer, network: Network, tmp_path: Path
) -> None:
    """`put` returns before the XADD (the pipeline of the next round trip): when Redis is gone
    by then, the sender of a request still hears that its envelope was not queued."""
    twins = await provision(tmp_path / "twins.sqlite3", {1: [A], 2: [B]})
    relay_a = network.relay(A, twins, "--redis", redis_server.url, "--redis-timeout", "1")
    alice = await client(relay_a.url, 1)
    redis_server.stop()
    with pytest.raises(RemoteError) as caught:
        await alice.request(2, "lost", b"x", timeout=WAIT)
    reply = caught.value.reply
    assert reply.from_relay
    assert reply.error is not None
    # with Redis gone before the send, the cluster's presence lookup (which runs first with
    # --redis) may be what fails; either way the sender hears that the relay's Redis is down
    assert reply.error[1].startswith(
        ("federation queue unavailable", "destination unreachable: the relay's redis")
    ), reply.error
    await alice.close()
