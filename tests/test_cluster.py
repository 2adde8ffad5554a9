"""The cluster with in-process relay instances on one real redis-server: RMB and SBD across
instances, mailboxes shared, duplicate logins, presence renewal and expiry (injected clock),
reaping a dead instance's stream, bad records, Redis going away."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import cast

import pytest
from redis.asyncio import Redis

from rmb_relay.clock import monotonic_clock
from rmb_relay.cluster import keys, wire
from rmb_relay.cluster.bus import Bus
from rmb_relay.cluster.node import Cluster
from rmb_relay.cluster.workqueue import (
    WITHDRAWN,
    WorkQueues,
    set_claims,
    taker,
    withdraw_claims,
)
from rmb_relay.errors import RemoteError
from rmb_relay.mailbox import RedisMailbox, stream_key
from rmb_relay.sdk import IncomingRequest
from rmb_relay.switch import Switch
from rmb_relay.telemetry.record_schema import read_table
from rmb_relay.telemetry.records import Recorder
from tests.cluster_fixtures import (  # noqa: F401 - the fixture is used by name
    MakeInstance,
    make_instance_fixture,
    recorder,
)
from tests.conftest import WAIT, RedisServer, start_redis
from tests.faultlab.proxy import FaultProxy
from tests.helpers import eventually
from tests.rmb_fixtures import FakeClock

# ---- names and records -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "address", [(7, None), (7, "sid"), (7, ""), (7, "a:b}{c"), bytes(range(32))]
)
def test_address_names_round_trip(address: tuple[int, str | None] | bytes) -> None:
    assert keys.parse_address_name(keys.address_name(address)) == address


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("nokind", "no kind prefix"),
        ("r:x", "twin must be a number"),
        ("r:0", "twin must be a number"),
        ("s:AAAA", "must be 32 bytes"),
        ("s:***", "not base64url"),
        ("q:1", "unknown kind"),
    ],
)
def test_bad_address_names_say_what_is_wrong(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        keys.parse_address_name(name)


def test_every_key_carries_a_hash_tag() -> None:
    for key in (
        keys.presence_key("r:1"),
        keys.bus_key("i"),
        keys.alive_key("i"),
        keys.INSTANCES_KEY,
        keys.table_key("sg", "i"),
        keys.table_log_key("sg"),
        keys.table_members_key("sg"),
        keys.work_key("tunnel", "ACME"),
        keys.work_holders_key("tunnel", "ACME"),
    ):
        assert key.index("{") < key.index("}")
    # an instance's stream and liveness key share a slot
    assert keys.bus_key("i").split("}")[0] == keys.alive_key("i").split("}")[0]
    # a replicated table's keys share one (one script touches them together), and so do a
    # work queue's
    tags = {key.split("}")[0] for key in (keys.table_key("sg", "i"), keys.table_log_key("sg"))}
    assert tags == {keys.table_members_key("sg").split("}")[0]}
    assert (
        keys.work_key("tunnel", "A").split("}")[0]
        == keys.work_holders_key("tunnel", "A").split("}")[0]
    )


def test_a_message_encoded_without_a_record_is_the_same_bytes() -> None:
    record = wire.Record(wire.MESSAGE, "r:7:sid", b"frame", 1234)
    assert wire.encode_message("r:7:sid", b"frame", 1234) == wire.encode(record)


def test_records_round_trip_in_one_entry() -> None:
    records = [
        wire.Record(wire.MESSAGE, "r:1:x", b"frame", 1234, 2),
        wire.Record(wire.DISPLACED, "s:" + "A" * 43),
        wire.Record(wire.MAIL, "r:9"),
    ]
    assert wire.decode(b"".join(map(wire.encode, records))) == records


# ---- across instances ------------------------------------------------------------------------


async def test_rmb_request_and_reply_cross_instances(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    alice = await a.client(1, sid="alice")
    bob = await b.client(2, sid="bob")
    bob.handle("echo", lambda request: request.data[::-1])
    for i in range(20):
        reply = await alice.request(2, "echo", f"hello {i}".encode(), dest_sid="bob", timeout=WAIT)
        assert reply.data == f"hello {i}".encode()[::-1]
    # (a reply can overtake the callback that counts its request as sent)
    await eventually(lambda: a.cluster.counters.sent == b.cluster.counters.sent == 20)
    assert a.cluster.counters.received == b.cluster.counters.received == 20
    assert a.rmb.metrics.routed_slow["cluster"] >= 20


async def test_a_burst_to_another_instance_goes_out_in_a_few_stream_entries(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """The sender's slow path does not wait for Redis per message: what one read brings in is
    queued and written together (one XADD per batch, not per message), in order."""
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    got: list[bytes] = []
    done = asyncio.Event()

    await b.client(3, handlers={"m": recorder(got, done=done, expect=200)})
    await b.cluster.claimed((3, None))
    alice = await a.client(1)
    assert (await alice.request(3, "m", b"warm", timeout=WAIT)).data == b"ok"  # presence cached
    got.clear()
    entries = a.cluster.bus.sent_entries
    for i in range(200):
        alice.send_request(3, "m", b"burst %d" % i)
    await asyncio.wait_for(done.wait(), WAIT)
    assert got == [b"burst %d" % i for i in range(200)]
    # batches (as many as the reads and bus rounds that brought them in: fewer on a quiet host,
    # more on a busy one), never one per message; the sends above are one write of 200 frames
    assert a.cluster.bus.sent_entries - entries < 200


async def test_sbd_forwards_between_instances_through_the_same_bus(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    one = await a.sbd_client()
    two = await b.sbd_client()
    await a.cluster.claimed(one.pubkey)
    await b.cluster.claimed(two.pubkey)
    for i in range(10):  # per-sender order is kept across instances
        one.forward(two.pubkey, b"ping %d" % i)
    for i in range(10):
        assert await two.receive_forward() == (one.pubkey, b"ping %d" % i)
    two.forward(one.pubkey, b"pong")
    assert await one.receive_forward() == (two.pubkey, b"pong")
    # to a key nobody holds: dropped (SBD keeps no mailbox) and counted
    one.forward(os.urandom(32), b"nobody")
    await eventually(lambda: a.cluster.counters.dropped == 1)


async def test_offline_twin_gets_its_mail_on_whichever_instance_it_reaches(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    alice = await a.client(1)
    for i in range(5):
        alice.send_request(3, "m", f"queued {i}".encode())
    await eventually(lambda: a.rmb.mailbox.stats.stored == 5)
    received: list[bytes] = []
    done = asyncio.Event()

    await b.client(3, handlers={"m": recorder(received, done=done, expect=5)})
    await asyncio.wait_for(done.wait(), WAIT)
    assert received == [f"queued {i}".encode() for i in range(5)]


async def test_mail_stored_while_the_twin_logs_in_elsewhere_is_announced(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    carol = await b.client(3)
    got = asyncio.Event()
    carol.handle("m", lambda request: (got.set(), b"ok")[1])
    await b.cluster.claimed((3, None))
    # as if A had found nobody holding carol and stored the message: it then tells B
    alice = await a.client(1)
    _, envelope = alice.request_envelope(3, "m", b"late")
    await a.switch.mailbox.put((3, None), envelope, a.switch.mailbox.deadline(0, 60))
    await a.cluster.mail_stored((3, None))
    await asyncio.wait_for(got.wait(), WAIT)


async def test_login_on_another_instance_closes_the_older_connection(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    old = await a.client(3, sid="s")
    await a.cluster.claimed((3, "s"))
    new = await b.client(3, sid="s")
    await eventually(lambda: not old.connected and not a.rmb.sessions)
    new.handle("m", lambda request: b"from the new one")
    alice = await a.client(1)
    reply = await alice.request(3, "m", dest_sid="s", timeout=WAIT)
    assert reply.data == b"from the new one"


async def test_a_message_for_an_address_that_moved_is_passed_on_then_stored(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    c = await make_instance(redis_server.url)
    alice = await a.client(1)
    carol = await c.client(3)
    got: list[bytes] = []
    carol.handle("m", recorder(got))
    await c.cluster.claimed((3, None))
    # a stale sender hands B a message for carol, whom B never held: B passes it on to C
    _, envelope = alice.request_envelope(3, "m", b"moved")
    record = wire.Record(wire.MESSAGE, "r:3", envelope, a.switch.mailbox.deadline(0, 60))
    assert await a.cluster.bus.send(b.cluster.me, wire.encode(record))
    # (the counter moves once the bus took it, which can be after carol already got it)
    await eventually(lambda: got == [b"moved"] and b.cluster.counters.passed_on == 1)
    # held nowhere: B stores it in the mailbox, where carol finds it at her next login
    await carol.close()
    await eventually(lambda: not c.rmb.sessions)
    # (her release reaches Redis after the session is gone: until then B would pass it on)
    probe = Redis.from_url(redis_server.url)
    await eventually(lambda: _absent(probe, keys.presence_key("r:3")))
    await probe.aclose()
    _, envelope = alice.request_envelope(3, "m", b"stored")
    record = wire.Record(wire.MESSAGE, "r:3", envelope, a.switch.mailbox.deadline(0, 60))
    assert await a.cluster.bus.send(b.cluster.me, wire.encode(record))
    await eventually(lambda: b.cluster.counters.stored == 1)
    got.clear()
    await a.client(3, handlers={"m": recorder(got)})
    await eventually(lambda: got == [b"stored"])


async def _absent(redis: Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_a_message_queued_for_an_instance_that_left_is_routed_again(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """A forwards without waiting for Redis; when the batch finds B's stream gone (B left),
    the message is routed again, to where carol is now."""
    # its presence cache holds; no tick of its own meanwhile (one during B's leave could find
    # B gone and drop the cached answer first: then nothing is left to route again)
    a = await make_instance(redis_server.url, clock=FakeClock(), ttl=600)
    b = await make_instance(redis_server.url)
    c = await make_instance(redis_server.url)
    carol = await b.client(3)
    carol.handle("m", lambda request: b"on b")
    await b.cluster.claimed((3, None))
    alice = await a.client(1)
    assert (await alice.request(3, "m", timeout=WAIT)).data == b"on b"  # A now caches "B"
    await b.stop()  # B leaves: its stream is deleted
    got: list[bytes] = []
    await c.client(3, handlers={"m": recorder(got)})
    await c.cluster.claimed((3, None))
    alice.send_request(3, "m", b"after B left")
    await eventually(lambda: got == [b"after B left"])
    # A counts it passed on once Redis has answered its XADD; C's blocking read may hand it to
    # carol before A's coroutine resumes (the race that made this test flaky)
    await eventually(lambda: a.cluster.counters.passed_on == 1)
    assert b.cluster.me in a.cluster.presence.dead


async def test_a_malformed_entry_is_skipped_and_the_bus_goes_on(
    redis_server: RedisServer, make_instance: MakeInstance, caplog: pytest.LogCaptureFixture
) -> None:
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    probe = Redis.from_url(redis_server.url)
    await probe.xadd(keys.bus_key(b.cluster.me), {b"m": b"\x00garbage"})
    one = await a.sbd_client()
    two = await b.sbd_client()
    await b.cluster.claimed(two.pubkey)
    one.forward(two.pubkey, b"after the garbage")
    assert await two.receive_forward() == (one.pubkey, b"after the garbage")
    assert b.cluster.bus.bad_entries == 1
    assert "malformed bus entry" in caplog.text
    await probe.aclose()


# ---- presence with an injected clock, and reaping ----------------------------------------------


async def test_presence_is_renewed_restored_and_given_up_by_tick(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    clock = FakeClock()
    a = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    probe = Redis.from_url(redis_server.url)
    carol = await a.client(3)
    await a.cluster.claimed((3, None))
    key = keys.presence_key("r:3")
    claim = await probe.get(key)
    assert claim == f"{a.cluster.me}/1".encode()  # the instance and its claim's number
    await probe.pexpire(key, 1000)
    await a.cluster.tick()  # renewed to the full TTL
    assert await probe.pttl(key) > 20_000
    await probe.delete(key)  # expired during an outage: set again
    await a.cluster.tick()
    assert await probe.get(key) == claim
    await probe.set(key, b"someone-else/1")  # a newer login elsewhere whose notice was lost
    await a.cluster.tick()
    await eventually(lambda: not carol.connected)
    assert await probe.get(key) == b"someone-else/1"
    await probe.aclose()


async def test_a_dead_instance_is_reaped_and_nothing_it_held_back_is_lost(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    clock = FakeClock()
    b = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    # the dead one: an instance that joined, read one entry without acknowledging it, and died
    redis = Redis.from_url(redis_server.url)
    dead = Cluster(redis, Switch(RedisMailbox(redis)), instance_id="dead")
    await dead.bus.create()
    sender = await b.client(1)
    deadline = b.switch.mailbox.deadline(0, 60)

    def message(text: bytes) -> bytes:
        _, envelope = sender.request_envelope(3, "m", text)
        return wire.encode(wire.Record(wire.MESSAGE, "r:3", envelope, deadline))

    stream = keys.bus_key("dead")
    await redis.xadd(stream, {b"m": message(b"read, never acknowledged")})
    assert await dead.bus.read(stream)  # pending now
    await redis.xadd(stream, {b"m": message(b"never read")})
    # its liveness key is gone (expired): B's next tick takes both over
    await b.cluster.tick()
    assert "dead" in b.cluster.presence.dead
    probe = Redis.from_url(redis_server.url)
    assert await probe.xlen(stream_key((3, None))) == 2  # both in carol's mailbox
    assert await probe.exists(stream)  # kept for two TTLs: a late sender must not fail
    clock.advance(61)
    await b.cluster.tick()
    assert not await probe.exists(stream)
    assert b"dead" not in await probe.smembers(keys.INSTANCES_KEY)
    # senders never recreate a reaped stream
    assert not await b.cluster.bus.send("dead", message(b"late"))
    got: list[bytes] = []
    await b.client(3, handlers={"m": recorder(got)})
    await eventually(lambda: got == [b"read, never acknowledged", b"never read"])
    await probe.aclose()
    await redis.aclose()


async def test_an_instance_back_from_an_outage_gives_nobody_up_for_one_ttl(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """An outage of our own may have cut the others off too (a Redis Cluster shard without a
    primary fails every instance's calls), so their liveness keys may have expired while
    they live: for one TTL after we resume, nobody is given up (docs/faults.md, (d))."""
    clock = FakeClock()
    b = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    redis = Redis.from_url(redis_server.url)
    await redis.sadd(keys.INSTANCES_KEY, "cut-off")  # a member whose liveness key expired
    b.cluster._health(ConnectionError("redis cut"))  # what a failed call of the tick does
    await b.cluster.tick()  # reaches Redis: resumes
    assert "cut-off" not in b.cluster.presence.dead
    clock.advance(31)
    await b.cluster.tick()
    assert "cut-off" in b.cluster.presence.dead
    await redis.aclose()


async def _instance_with_stream(redis: Redis, name: str, records: bytes) -> None:
    """Instance `name` in the instance set, with no liveness key (so given up at the next
    tick) and one bus entry carrying `records`."""
    await Cluster(redis, Switch(RedisMailbox(redis)), instance_id=name).bus.create()
    await redis.sadd(keys.INSTANCES_KEY, name)
    await redis.xadd(keys.bus_key(name), {b"m": records})


async def test_what_a_given_up_instance_held_is_kept_for_it_and_sent_once_it_is_back(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """A message reaped from a given-up instance's stream that nobody else can take (an SBD
    forward, a 신경 frame: no mailbox) is kept for that instance, which may only have been cut
    off with its clients still connected, and written to its stream once it is alive again;
    kept at most HOLD_FOR, then dropped and counted (docs/faults.md, finding 12)."""
    clock = FakeClock()
    b = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    redis = Redis.from_url(redis_server.url)
    record = wire.encode(wire.Record(wire.MESSAGE, keys.address_name(b"\x01" * 32), b"hi", 0))
    for name in ("cut-off", "dead"):
        await _instance_with_stream(redis, name, record)
    await b.cluster.tick()  # both given up, their streams reaped
    assert {"cut-off", "dead"} <= b.cluster.presence.dead
    assert b.cluster.held_bytes == 4
    assert await redis.xlen(keys.bus_key("cut-off")) == 0
    await redis.set(keys.alive_key("cut-off"), b"1")  # it was only cut off
    await b.cluster.tick()
    assert b.cluster.held_bytes == 2
    entries = await redis.xrange(keys.bus_key("cut-off"))
    assert [fields[b"m"] for _, fields in entries] == [record]
    dropped = b.cluster.counters.dropped
    clock.advance(301)
    await b.cluster.tick()  # "dead" never came back
    assert b.cluster.held_bytes == 0
    assert b.cluster.counters.dropped == dropped + 1
    await redis.aclose()


async def test_what_a_given_up_instance_held_is_bounded_by_cluster_held_bytes(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """Strangers' messages fill what is kept for given-up instances: past --cluster-held-bytes
    a reaped message is dropped and counted at once, not kept."""
    b = await make_instance(redis_server.url, ttl=30.0, clock=FakeClock(), held_bytes=5)
    redis = Redis.from_url(redis_server.url)
    name = keys.address_name(b"\x01" * 32)
    records = [wire.encode(wire.Record(wire.MESSAGE, name, b"abc", 0)) for _ in range(2)]
    await _instance_with_stream(redis, "cut-off", b"".join(records))
    dropped = b.cluster.counters.dropped
    await b.cluster.tick()  # given up, its stream reaped: 3 bytes kept, the next 3 not
    assert "cut-off" in b.cluster.presence.dead
    assert b.cluster.held_bytes == 3
    assert b.cluster.counters.dropped == dropped + 1
    await redis.aclose()


async def test_a_reaper_never_takes_what_a_live_instance_is_working_on(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """Of a dead instance's stream, B takes what the dead one read and never acknowledged and
    what nobody read, but not an entry another live reaper is still handling (taking it would
    deliver it twice); once that reaper dies too, B takes its entry. The stream is deleted
    only when nothing is left in it."""
    clock = FakeClock()
    b = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    redis = Redis.from_url(redis_server.url)
    dead = Cluster(redis, Switch(RedisMailbox(redis)), instance_id="dead")
    await dead.bus.create()
    other = Bus(redis, "other", _never_called)  # a live reaper, mid-way through an entry
    await redis.set(keys.alive_key("other"), b"1")
    sender = await b.client(1)
    deadline = b.switch.mailbox.deadline(0, 60)

    def message(text: bytes) -> dict[bytes, bytes]:
        _, envelope = sender.request_envelope(3, "m", text)
        return {b"m": wire.encode(wire.Record(wire.MESSAGE, "r:3", envelope, deadline))}

    stream = keys.bus_key("dead")
    await redis.xadd(stream, message(b"read by the dead one"))
    assert await dead.bus.read(stream)
    await redis.xadd(stream, message(b"being handled by a live reaper"))
    assert await other.read(stream)
    await redis.xadd(stream, message(b"never read"))
    got: list[bytes] = []
    carol = await b.client(3, handlers={"m": recorder(got)})
    await b.cluster.claimed((3, None))

    await b.cluster.tick()
    await eventually(lambda: sorted(got) == [b"never read", b"read by the dead one"])
    assert (await carol.ping()).data == b"hello world"  # anything more would be here by now
    assert len(got) == 2
    clock.advance(61)
    await b.cluster.tick()
    assert await redis.xlen(stream) == 1  # kept: the live reaper's entry is still in it

    await redis.delete(keys.alive_key("other"))  # that reaper died before it finished
    await b.cluster.tick()
    await eventually(lambda: len(got) == 3)
    assert got[2] == b"being handled by a live reaper"
    assert not await redis.exists(stream)
    await redis.aclose()


async def _never_called(records: list[wire.Record]) -> None:
    raise AssertionError("this bus is only read from by hand")


@pytest.mark.parametrize("reaper", ["the instance she logged in on", "another instance"])
async def test_taking_over_a_dead_instance_spares_the_session_that_just_logged_in(
    redis_server: RedisServer, make_instance: MakeInstance, reaper: str
) -> None:
    """The race of the kill test, in a fixed order: carol was on an instance that died; she
    logs in on C before anyone noticed, so C's claim replaces the dead one's and C sends the
    dead one a notice to close its (long gone) connection, into the dead one's stream. Then a
    live instance takes that stream over: the notice names the dead claim, so it must not close
    carol's new session, and what waited for her is delivered once."""
    clock = FakeClock()
    c = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    b = await make_instance(redis_server.url, ttl=30.0, clock=clock)
    redis = Redis.from_url(redis_server.url)
    dead = Cluster(redis, Switch(RedisMailbox(redis)), instance_id="dead")
    await dead.bus.create()  # joined, then died: no liveness key
    assert await dead.presence.claim("r:3") is None  # carol's presence still names it
    sender = await c.client(1)
    deadline = c.switch.mailbox.deadline(0, 60)

    def message(text: bytes) -> bytes:
        _, envelope = sender.request_envelope(3, "m", text)
        return wire.encode(wire.Record(wire.MESSAGE, "r:3", envelope, deadline))

    stream = keys.bus_key("dead")
    await redis.xadd(stream, {b"m": message(b"read, never acknowledged")})
    assert await dead.bus.read(stream)  # pending for the dead one
    await redis.xadd(stream, {b"m": message(b"never read")})

    got: list[bytes] = []
    carol = await c.client(3, handlers={"m": recorder(got)})
    await c.cluster.claimed((3, None))
    # C's claim replaced the dead one's: the notice for it lands in the dead one's stream
    await eventually(lambda: _stream_length(redis, stream, 3))
    claim = await redis.get(keys.presence_key("r:3"))

    await (c if reaper == "the instance she logged in on" else b).cluster.tick()

    assert carol.connected
    assert (await carol.ping()).data == b"hello world"
    await eventually(lambda: sorted(got) == [b"never read", b"read, never acknowledged"])
    assert "r:3" in c.cluster.presence.held
    assert await redis.get(keys.presence_key("r:3")) == claim
    await c.cluster.tick()  # her next renewal finds her claim in place: nothing to close
    assert carol.connected
    assert (await carol.ping()).data == b"hello world"
    assert len(got) == 2  # once each
    await redis.aclose()


async def _stream_length(redis: Redis, stream: str, length: int) -> bool:
    return int(await redis.xlen(stream)) == length


async def test_a_late_notice_naming_an_older_claim_does_not_close_the_newer_session(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """Carol left A for B and came back to A; B's notice to close her first connection on A
    arrives after that: it names her first claim, so her current session stays."""
    a = await make_instance(redis_server.url)
    b = await make_instance(redis_server.url)
    probe = Redis.from_url(redis_server.url)
    first = await a.client(3)
    await a.cluster.claimed((3, None))
    first_claim = await probe.get(keys.presence_key("r:3"))
    await first.close()
    await eventually(lambda: "r:3" not in a.cluster.presence.held)
    got: list[bytes] = []
    again = await a.client(3, handlers={"m": recorder(got)})
    await a.cluster.claimed((3, None))
    current = await probe.get(keys.presence_key("r:3"))
    sender = await b.client(1)
    _, envelope = sender.request_envelope(3, "m", b"after the late notice")
    deadline = a.switch.mailbox.deadline(0, 60)
    late = wire.Record(wire.DISPLACED, "r:3", first_claim)
    after = wire.Record(wire.MESSAGE, "r:3", envelope, deadline)
    # one batch, read in order: when the message arrives the notice was handled
    sent = [b.cluster.bus.send(a.cluster.me, wire.encode(record)) for record in (late, after)]
    assert await asyncio.gather(*sent) == [True, True]
    await eventually(lambda: got == [b"after the late notice"])
    assert again.connected
    assert "r:3" in a.cluster.presence.held
    assert current != first_claim  # each claim is told apart from the ones before it
    # a notice naming her current claim does close it
    notice = wire.Record(wire.DISPLACED, "r:3", current)
    assert await b.cluster.bus.send(a.cluster.me, wire.encode(notice))
    await eventually(lambda: not again.connected)
    assert "r:3" not in a.cluster.presence.held
    await probe.aclose()


# ---- shutdown ----------------------------------------------------------------------------------


async def test_closing_the_bus_stops_a_reader_that_lost_its_cancellation(
    redis_server: RedisServer,
) -> None:
    """The relay that did not exit on SIGTERM: its bus reader was cancelled while a command
    it sent for a record completed, and on Python 3.11 redis-py's `wait_for` swallowed the
    cancellation (tests/test_tasks.py); the reader read on and `close` waited for ever. Here
    the handler swallows it the same way, at the same place."""
    redis = Redis.from_url(redis_server.url)
    handling = asyncio.Event()
    lost: list[bool] = []

    async def handle(records: list[bytes]) -> None:
        handling.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.append(True)  # carries on, as if the command had just completed

    bus = Bus(redis, "closing", handle)
    await bus.create()
    bus.start()
    assert await bus.send("closing", wire.encode(wire.Record(wire.MESSAGE, "r:1", b"x")))
    await asyncio.wait_for(handling.wait(), WAIT)
    closing = asyncio.get_running_loop().create_task(bus.close())
    done, _ = await asyncio.wait([closing], timeout=WAIT)
    assert closing in done, "close() still waits for the reader"
    assert lost == [True]
    await redis.aclose()


# ---- Redis going away ------------------------------------------------------------------------


async def test_redis_down_mid_run_refuses_with_an_error_and_loses_nothing_accepted(
    make_instance: MakeInstance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = start_redis(str(redis_dir))
    try:
        a = await make_instance(server.url)
        b = await make_instance(server.url)
        alice = await a.client(1)
        bob = await b.client(2)
        bob.handle("echo", lambda request: request.data)
        assert (await alice.request(2, "echo", b"up", timeout=WAIT)).data == b"up"
        for i in range(5):  # accepted: in carol's mailbox, in Redis (appendfsync always)
            alice.send_request(3, "m", f"kept {i}".encode())
        await eventually(lambda: a.rmb.mailbox.stats.stored == 5)
        caplog.set_level(logging.WARNING, "rmb_relay")
        server.stop()
        with pytest.raises(RemoteError, match="destination unreachable: the relay's redis is"):
            await alice.request(2, "echo", b"down", timeout=WAIT)
        await eventually(lambda: "cluster: redis unavailable" in caplog.text)
        assert (await alice.ping()).data == b"hello world"  # still connected

        server = start_redis(str(redis_dir), port=server.port)
        await eventually(lambda: "redis is reachable again" in caplog.text)
        assert (await alice.request(2, "echo", b"back", timeout=WAIT)).data == b"back"
        got: list[bytes] = []
        await b.client(3, handlers={"m": recorder(got)})
        await eventually(lambda: got == [f"kept {i}".encode() for i in range(5)])
    finally:
        server.stop()


async def test_a_forward_redis_refuses_after_queuing_it_has_one_route_record(
    make_instance: MakeInstance, tmp_path: Path
) -> None:
    """A message for a session on another instance is queued for the next Redis batch and its
    sender goes on; its route record waits for the batch's outcome: `cluster delivered` once
    Redis took it, or only the refusal (`redis down`) when Redis refused it, never both."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = start_redis(str(redis_dir))
    records = Recorder(tmp_path / "records", "a")
    records.start()
    try:
        # the holder's answer stays cached: the forward is queued without asking Redis
        a = await make_instance(server.url, records=records, cache_ttl=3600.0)
        b = await make_instance(server.url)
        alice = await a.client(1)
        bob = await b.client(2)
        bob.handle("echo", lambda request: request.data)
        assert (await alice.request(2, "echo", b"up", timeout=WAIT)).data == b"up"
        server.stop()
        with pytest.raises(RemoteError, match="destination unreachable: the relay's redis is"):
            await alice.request(2, "echo", b"down!", timeout=WAIT)
    finally:
        server.stop()
        await records.close()
    rows = read_table(tmp_path / "records").sort_by("time").to_pylist()
    found = [(r["src"], r["dst"], r["route"], r["outcome"], r["reason"]) for r in rows]
    assert found == [
        ("1", "2", "cluster", "delivered", None),
        ("1", "2", "none", "rejected", "redis down"),
    ]
    assert rows[0]["relay_us"] >= 0


async def test_an_answer_that_cannot_reach_the_requesters_instance_is_tried_again(
    redis_server: RedisServer, make_instance: MakeInstance
) -> None:
    """A response has nobody to be refused to: when Redis fails as the answering instance
    hands it on (here its link to Redis refuses connections, as a dead Redis Cluster primary
    would), it is kept and routed again once Redis answers, not dropped (the requester would
    never hear: docs/faults.md, scenario d)."""
    link = await FaultProxy.start("127.0.0.1", ("127.0.0.1", redis_server.port))
    try:
        a = await make_instance(redis_server.url)
        b = await make_instance(f"redis://127.0.0.1:{link.address[1]}/0")
        asked, answer = asyncio.Event(), asyncio.Event()

        async def slow(request: IncomingRequest) -> bytes:
            asked.set()
            await answer.wait()
            return b"answered"

        await b.client(2, handlers={"m": slow})
        await b.cluster.claimed((2, None))
        carol = await a.client(3)
        await a.cluster.claimed((3, None))
        reply = carol.send_request(2, "m", b"q")
        await asyncio.wait_for(asked.wait(), WAIT)
        link.refuse()
        answer.set()
        await eventually(lambda: b.rmb.later.held_bytes > 0)  # held, not dropped
        assert not reply.done()
        link.heal()
        assert (await asyncio.wait_for(reply, WAIT * 2)).data == b"answered"
    finally:
        await link.close()


# ---- work queues: claims and pending entries -------------------------------------------------


class _Member:
    """What `WorkQueues` reads of its cluster: a stand-in with a short TTL (pending entries
    looked at every ttl/3)."""

    def __init__(self, redis: Redis, me: str, ttl: float = 0.3) -> None:
        self.redis = redis
        self.me = me
        self.ttl = ttl
        self.clock = monotonic_clock
        self.redis_up = True

    async def alive(self, instances: list[str]) -> set[str]:
        return set(instances)


async def test_a_retried_claim_that_finds_its_own_value_is_won(redis_server: RedisServer) -> None:
    """redis-py sends a command again after a connection reset: the retried `SET NX` of a
    claim finds the claim its first try set. That is ours (won; it was counted lost, and the
    tunnel answered its request 504), and a withdrawal found again is withdrawn."""
    redis = Redis.from_url(redis_server.url)
    try:
        claim = [("t:claim:1", b"t:me", 60_000)]
        assert await set_claims(redis, claim) == [b"t:me"]
        assert await set_claims(redis, claim) == [b"t:me"]  # the retry: still ours
        assert await set_claims(redis, [("t:claim:1", b"t:other", 60_000)]) == [b"t:me"]
        assert await withdraw_claims(redis, [("t:claim:1", 60_000)]) == [b"t:me"]  # taken
        assert await withdraw_claims(redis, [("t:claim:2", 60_000)]) == [WITHDRAWN]
        assert await withdraw_claims(redis, [("t:claim:2", 60_000)]) == [WITHDRAWN]
    finally:
        await redis.aclose()


async def test_an_entry_whose_read_reply_was_lost_is_handed_on(redis_server: RedisServer) -> None:
    """The consumer's blocking XREADGROUP reached Redis, which handed it the entry; the reply
    was lost (the link held it, then reset the connection). The entry is pending for our
    consumer and `>` never returns it again: the consumer's look at its pending entries (after
    the failure, or its periodic one) hands it on, once, its claim set."""
    direct = Redis.from_url(redis_server.url)
    link = await FaultProxy.start("127.0.0.1", ("127.0.0.1", redis_server.port))
    via = Redis(host="127.0.0.1", port=link.address[1], socket_timeout=WAIT)
    producer = WorkQueues(cast("Cluster", _Member(direct, "producer")), "test")
    consumer = WorkQueues(cast("Cluster", _Member(via, "consumer")), "test")
    got: list[bytes] = []
    handed = asyncio.Event()

    def handle(fields: dict[bytes, bytes]) -> None:
        got.append(fields[b"n"])
        handed.set()

    stream = keys.work_key("test", "q")

    async def blocked_reader() -> bool:
        return any(c["cmd"] == "xreadgroup" for c in await direct.client_list())

    async def pending_for_consumer() -> bool:
        return int((await direct.xpending(stream, keys.GROUP))["pending"]) == 1

    try:
        consumer.consume("q", handle)
        await eventually(blocked_reader)  # its first read of new entries waits in Redis
        link.black_hole()  # the reply will be held...
        await producer.put("q", {"n": b"1"}, ("c1", 60_000))
        await eventually(pending_for_consumer)  # ...Redis handed the entry to that read
        link.reset_all()  # ...and lost with its connection
        link.heal()
        await asyncio.wait_for(handed.wait(), WAIT)
        assert got == [b"1"]
        claim = await direct.get(keys.work_claim_key("test", "q", "c1"))
        assert taker(claim) == "consumer"
        assert int((await direct.xpending(stream, keys.GROUP))["pending"]) == 0
    finally:
        await consumer.close()
        await producer.close()
        await via.aclose()
        await link.close()
        await direct.aclose()


async def test_a_copy_of_an_entry_is_dropped_even_by_the_consumer_that_took_it(
    redis_server: RedisServer,
) -> None:
    """A producer's XADD sent again (its reply lost) makes a second entry with the same claim.
    The consumer that took the first finds its own claim on the copy, but naming another
    entry: the copy is dropped, the request does not run twice."""
    redis = Redis.from_url(redis_server.url)
    producer = WorkQueues(cast("Cluster", _Member(redis, "producer")), "test")
    consumer = WorkQueues(cast("Cluster", _Member(redis, "consumer")), "test")
    got: list[bytes] = []
    try:
        for _ in range(2):
            await producer.put("q", {"n": b"1"}, ("c1", 60_000))
        consumer.consume("q", lambda fields: got.append(fields[b"n"]))
        await eventually(lambda: consumer.withdrawn == 1)
        assert got == [b"1"]
        assert taker(b"t:1-0:a:b") == "a:b"  # an instance id may hold colons
        assert taker(b"t:old-style") == "old-style"  # an older relay's value
    finally:
        await consumer.close()
        await producer.close()
        await redis.aclose()
