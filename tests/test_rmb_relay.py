"""The RMB relay end to end: real sockets, real keys, SDK clients, the embedded directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rmb_relay._core import Envelope
from rmb_relay.dialects.rmb import RmbSettings
from rmb_relay.errors import RemoteError
from rmb_relay.identity import JWT_HEADER_B64, b64url, make_jwt
from rmb_relay.sdk import IncomingRequest, RmbClient
from rmb_relay.sdk.websocket import HandshakeError, WebSocketClient
from tests.conftest import WAIT, StartRelay
from tests.helpers import eventually
from tests.rmb_fixtures import FakeClock, RmbRelay, key_for, start_rmb_relay


@pytest.fixture
async def relay(start_relay: StartRelay, tmp_path: Path) -> RmbRelay:
    relay = await start_rmb_relay(start_relay, tmp_path)
    yield relay  # type: ignore[misc]
    await relay.close_clients()


def echo(request: IncomingRequest) -> bytes:
    return b"echo:" + request.data


# ---- login -------------------------------------------------------------------------------


@pytest.mark.parametrize(("twin", "key_type"), [(1, "sr25519"), (2, "ed25519")])
async def test_login_with_both_key_types(relay: RmbRelay, twin: int, key_type: str) -> None:
    client = await relay.client(twin, key_type=key_type)
    assert (await client.ping()).data.endswith(b"hello world")


async def login_status(relay: RmbRelay, query: str) -> tuple[int, bytes]:
    with pytest.raises(HandshakeError) as info:
        await WebSocketClient.connect(relay.url + ("?" + query if query else ""))
    return info.value.status, info.value.body


async def test_missing_token_is_400(relay: RmbRelay) -> None:
    assert await login_status(relay, "") == (400, b"missing jwt")


async def test_expired_token_is_401(relay: RmbRelay) -> None:
    token = make_jwt(key_for(1), 1, None, now=1_000_000, ttl=60)
    assert await login_status(relay, token) == (401, b"invalid jwt: jwt has expired")


async def test_token_signed_by_another_key_is_401(relay: RmbRelay) -> None:
    import time

    token = make_jwt(key_for(2, "ed25519"), 1, None, now=int(time.time()))
    status, body = await login_status(relay, token)
    assert status == 401
    assert b"signature" in body


async def test_unknown_twin_is_401(relay: RmbRelay) -> None:
    import time

    token = make_jwt(key_for(99), 99, None, now=int(time.time()))
    assert await login_status(relay, token) == (401, b"twin not found 99")


@pytest.mark.parametrize(
    "token",
    [
        "not-a-jwt",
        "a.b.c",
        b64url(b'{"alg":"HS256"}') + "." + b64url(b'{"sub":1,"iat":1,"exp":9999999999}') + ".x",
    ],
)
async def test_malformed_token_is_401(relay: RmbRelay, token: str) -> None:
    status, body = await login_status(relay, token)
    assert status == 401
    assert body.startswith(b"invalid jwt")


async def test_login_failures_are_counted_by_reason(relay: RmbRelay) -> None:
    await login_status(relay, "")
    await login_status(relay, "a.b.c")
    metrics = relay.dialect.metrics.login_failures
    assert metrics.value("missing jwt") == 1
    assert metrics.value("invalid jwt") == 1


async def test_independently_signed_jwt_is_accepted(relay: RmbRelay) -> None:
    """A token built and signed without our signer (ed25519 via `cryptography`)."""
    import hashlib
    import time

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = hashlib.sha256(b"rmb-relay test twin 2").digest()
    private = Ed25519PrivateKey.from_private_bytes(seed)
    now = int(time.time())
    claims = json.dumps({"sub": 2, "sid": None, "iat": now, "exp": now + 60}).encode()
    signed = f"{JWT_HEADER_B64}.{b64url(claims)}"
    token = f"{signed}.{b64url(b'e' + private.sign(signed.encode()))}"
    ws = await WebSocketClient.connect(f"{relay.url}?{token}")
    await ws.close()


def test_our_jwt_verifies_with_independent_sr25519() -> None:
    import sr25519

    key = key_for(1)
    token = make_jwt(key, 1, "s1", now=1_700_000_000)
    header, claims, sig = token.split(".")
    assert header == JWT_HEADER_B64
    import base64

    raw_sig = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    assert raw_sig[0:1] == b"s"
    assert len(raw_sig) == 65
    # substrate signs with the "substrate" context; py-sr25519-bindings uses the same context
    assert sr25519.verify(raw_sig[1:], f"{header}.{claims}".encode(), key.public_key)
    decoded = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
    assert decoded == {"sub": 1, "sid": "s1", "iat": 1_700_000_000, "exp": 1_700_000_300}


# ---- routing -----------------------------------------------------------------------------


async def test_request_response_between_two_clients(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    bob = await relay.client(2, key_type="ed25519")
    bob.handle("test.echo", echo)
    reply = await alice.request(2, "test.echo", b"hi", timeout=WAIT)
    assert reply.data == b"echo:hi"
    assert reply.source.twin == 2


async def test_sessions_with_sid_are_addressed_separately(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    bob_a = await relay.client(2, sid="a", key_type="ed25519")
    bob_b = await relay.client(2, sid="b", key_type="ed25519")
    bob_a.handle("who", lambda r: b"a")
    bob_b.handle("who", lambda r: b"b")
    assert (await alice.request(2, "who", dest_sid="a", timeout=WAIT)).data == b"a"
    assert (await alice.request(2, "who", dest_sid="b", timeout=WAIT)).data == b"b"


async def test_duplicate_login_replaces_the_older_connection(relay: RmbRelay) -> None:
    first = await relay.client(2, sid="x", key_type="ed25519")
    second = await relay.client(2, sid="x", key_type="ed25519")
    assert first.ws is not None
    await asyncio.wait_for(first.ws.closed, WAIT)
    assert first.ws.close_code == 1008
    assert first.ws.close_reason == "replaced by a newer connection"
    second.handle("ping", lambda r: b"pong")
    alice = await relay.client(1)
    assert (await alice.request(2, "ping", dest_sid="x", timeout=WAIT)).data == b"pong"


async def test_envelope_ping_gets_pong(relay: RmbRelay) -> None:
    client = await relay.client(1)
    reply = await client.ping(timeout=WAIT)
    assert reply.data == b"hello world"


async def test_handler_exception_becomes_error_reply(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    bob = await relay.client(2, key_type="ed25519")

    def broken(request: IncomingRequest) -> bytes:
        raise ValueError("no good")

    bob.handle("broken", broken)
    with pytest.raises(RemoteError) as info:
        await alice.request(2, "broken", timeout=WAIT)
    assert info.value.reply.error == (500, "no good")


# ---- error envelopes ---------------------------------------------------------------------


async def relay_error(client: RmbClient, wire: bytes, uid: str) -> tuple[int, str]:
    future = client.expect(uid)
    assert client.ws is not None
    client.ws.send_binary(wire)
    reply = await asyncio.wait_for(future, WAIT)
    assert reply.from_relay
    assert reply.error is not None
    return reply.error


async def test_unknown_destination_twin_gets_error(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    uid, wire = alice.request_envelope(404, "x")
    assert await relay_error(alice, wire, uid) == (0, "unknown twin destination")


async def test_missing_destination_gets_error(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    uid, wire = alice.request_envelope(0, "x")
    assert await relay_error(alice, wire, uid) == (0, "message with missing destination")


async def test_wrong_source_gets_error(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    env = alice.envelope(2)
    env.source.twin = 3
    env.request.command = "x"
    assert await relay_error(alice, alice.seal(env), env.uid) == (0, "message wrong source")


async def test_source_connection_must_match_session_sid(relay: RmbRelay) -> None:
    alice = await relay.client(1)  # sid None: a source connection "" is NOT the same session
    env = alice.envelope(2)
    env.source.connection = ""
    env.request.command = "x"
    assert await relay_error(alice, alice.seal(env), env.uid) == (0, "message wrong source")


async def test_fail_fast_to_offline_twin_gets_error(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    uid, wire = alice.request_envelope(3, "x", tags="a, fail-fast")
    assert await relay_error(alice, wire, uid) == (0, "destination offline")


async def test_twin_on_another_relay_gets_a_clear_federation_error(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(
        start_relay,
        tmp_path,
        relays={3: frozenset({"other.relay"})},
        settings=RmbSettings(domains=frozenset({"relay.test"})),
    )
    alice = await relay.client(1)
    uid, wire = alice.request_envelope(3, "x")
    _, message = await relay_error(alice, wire, uid)
    assert "other.relay" in message
    assert "does not federate" in message
    await relay.close_clients()


async def test_twin_without_relay_info_gets_error(start_relay: StartRelay, tmp_path: Path) -> None:
    relay = await start_rmb_relay(
        start_relay,
        tmp_path,
        relays={3: None},
        settings=RmbSettings(domains=frozenset({"relay.test"})),
    )
    alice = await relay.client(1)
    uid, wire = alice.request_envelope(3, "x")
    assert await relay_error(alice, wire, uid) == (0, "relay info is not set for this twin")
    await relay.close_clients()


async def test_failed_response_is_dropped_silently(relay: RmbRelay) -> None:
    alice = await relay.client(1)
    env = alice.envelope(404)
    env.response.SetInParent()
    assert alice.ws is not None
    alice.ws.send_binary(alice.seal(env))
    drops = relay.dialect.metrics.drops
    await eventually(lambda: drops.value("unknown twin") == 1)
    # the connection is still usable
    assert (await alice.ping()).data == b"hello world"


async def test_error_envelope_is_rmb_rs_shaped(relay: RmbRelay) -> None:
    """Unsigned, no source, code 0, expiration 300, addressed to the session."""
    from tests._proto import types_pb2

    alice = await relay.client(1, sid="s")
    uid, wire = alice.request_envelope(404, "x")
    raw = asyncio.get_running_loop().create_future()
    assert alice.ws is not None
    alice.ws.on_message = lambda m: raw.done() or raw.set_result(m.data)
    alice.ws.send_binary(wire)
    env = types_pb2.Envelope.FromString(await asyncio.wait_for(raw, WAIT))
    assert env.uid == uid
    assert env.expiration == 300
    assert not env.HasField("source")
    assert not env.HasField("signature")
    assert env.destination.twin == 1
    assert env.destination.connection == "s"
    assert env.WhichOneof("message") == "error"
    assert env.error.code == 0
    assert env.error.message == "unknown twin destination"


# ---- protocol violations -----------------------------------------------------------------


async def test_text_frame_disconnects(relay: RmbRelay) -> None:
    client = await relay.client(1)
    assert client.ws is not None
    client.ws.send_text("hello")
    await asyncio.wait_for(client.ws.closed, WAIT)
    assert client.ws.close_code == 1003


async def test_unparsable_envelope_disconnects(relay: RmbRelay) -> None:
    client = await relay.client(1)
    assert client.ws is not None
    client.ws.send_binary(b"\xff\xff\xff")
    await asyncio.wait_for(client.ws.closed, WAIT)
    assert client.ws.close_code == 1007


async def test_oversize_envelope_is_closed_with_1009(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    relay = await start_rmb_relay(start_relay, tmp_path)
    relay.dialect.max_message = 4096
    client = await relay.client(1)
    assert client.ws is not None
    client.ws.send_binary(b"\x00" * 5000)
    await asyncio.wait_for(client.ws.closed, WAIT)
    assert client.ws.close_code == 1009
    await relay.close_clients()


# ---- rate limiting -----------------------------------------------------------------------


async def test_rate_limit_refuses_with_error_and_keeps_connection(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    clock = FakeClock()
    relay = await start_rmb_relay(
        start_relay,
        tmp_path,
        settings=RmbSettings(limit_count=3, limit_size=1 << 20, limit_window=60),
        clock=clock,
    )
    alice = await relay.client(1)
    bob = await relay.client(2, key_type="ed25519")
    bob.handle("x", echo)
    for _ in range(3):
        await alice.request(2, "x", timeout=WAIT)
    uid, wire = alice.request_envelope(2, "x")
    assert await relay_error(alice, wire, uid) == (0, "exceeded rate limits, dropping message")
    assert relay.dialect.metrics.limited.value() == 1
    clock.advance(60)  # next window
    assert (await alice.request(2, "x", b"again", timeout=WAIT)).data == b"echo:again"
    await relay.close_clients()


async def test_rate_limit_counts_bytes(start_relay: StartRelay, tmp_path: Path) -> None:
    relay = await start_rmb_relay(
        start_relay,
        tmp_path,
        settings=RmbSettings(limit_count=1000, limit_size=2000, limit_window=60),
        clock=FakeClock(),
    )
    alice = await relay.client(1)
    uid, wire = alice.request_envelope(2, "x", b"z" * 3000)
    assert await relay_error(alice, wire, uid) == (0, "exceeded rate limits, dropping message")
    await relay.close_clients()


# ---- mailbox -----------------------------------------------------------------------------


async def test_message_to_offline_twin_is_delivered_on_connect_in_order(
    relay: RmbRelay,
) -> None:
    alice = await relay.client(1)
    futures = [alice.send_request(3, "m", str(i).encode()) for i in range(20)]
    await eventually(lambda: relay.dialect.mailbox.depth() == 20)
    seen: list[bytes] = []

    def record(request: IncomingRequest) -> bytes:
        seen.append(request.data)
        return request.data

    carol = RmbClient(3, key_for(3))
    carol.handle("m", record)
    await carol.open(relay.url)
    relay.clients.append(carol)
    replies = await asyncio.wait_for(asyncio.gather(*futures), WAIT)
    assert [r.data for r in replies] == [str(i).encode() for i in range(20)]
    assert seen == [str(i).encode() for i in range(20)]


async def test_mailbox_drops_expired_messages(start_relay: StartRelay, tmp_path: Path) -> None:
    clock = FakeClock()
    relay = await start_rmb_relay(start_relay, tmp_path, clock=clock)
    alice = await relay.client(1, clock=clock)
    alice.send_request(3, "m", b"old", expiration=5)
    await eventually(lambda: relay.dialect.mailbox.depth() == 1)
    clock.advance(10)
    fresh = alice.send_request(3, "m", b"new", expiration=300)
    await eventually(lambda: relay.dialect.mailbox.stats.stored == 2)
    carol = await relay.client(3, clock=clock)
    seen: list[bytes] = []
    carol.handle("m", lambda r: seen.append(r.data) or b"ok")
    await asyncio.wait_for(fresh, WAIT)
    assert seen == [b"new"]
    assert relay.dialect.mailbox.stats.expired == 1
    await relay.close_clients()


async def test_mailbox_max_refuses_past_the_cap(start_relay: StartRelay, tmp_path: Path) -> None:
    """Past --mailbox-max a new message is refused (its sender hears it), nothing waiting is
    dropped: a flood cannot evict the mail a twin waits for (issue 33)."""
    from rmb_relay.mailbox import MemoryMailbox

    relay = await start_rmb_relay(start_relay, tmp_path, mailbox=MemoryMailbox(max_per_session=3))
    alice = await relay.client(1)
    futures = [alice.send_request(3, "m", str(i).encode()) for i in range(5)]
    await eventually(lambda: relay.dialect.mailbox.stats.refused == 2)
    assert relay.dialect.mailbox.stats.stored == 3
    refused = await asyncio.wait_for(asyncio.gather(*futures[3:]), WAIT)
    assert [r.error for r in refused] == [(0, "destination offline and its mailbox is full")] * 2
    carol = await relay.client(3)
    carol.handle("m", lambda r: r.data)
    replies = await asyncio.wait_for(asyncio.gather(*futures[:3]), WAIT)
    assert [r.data for r in replies] == [b"0", b"1", b"2"]
    await relay.close_clients()


async def test_metrics_page_shows_rmb_counters(relay: RmbRelay) -> None:
    from tests.scrape import scrape

    alice = await relay.client(1)
    await alice.ping()
    host, port = relay.server.addresses[0]
    page = await scrape(host, port)
    assert page.value("rmb_relay_messages_in_total", dialect="rmb") == 1
    assert page.value("rmb_relay_messages_out_total", dialect="rmb") == 1
    # a ping is answered by the relay, not routed
    for path in ("local", "mailbox", "federation"):
        assert page.value("rmb_relay_messages_routed_total", dialect="rmb", path=path) == 0
    assert page.value("rmb_relay_logins_total", dialect="rmb") == 1
    assert page.value("rmb_relay_sessions", dialect="rmb") == 1
    assert page.value("rmb_relay_connections", dialect="rmb") == 1
    assert page.value("rmb_relay_mailbox_depth") == 0
    assert page.value("rmb_relay_mailbox_dropped_total", reason="full") == 0
    assert page.types["rmb_relay_messages_rate_limited"] == "counter"


async def test_envelope_signature_verifies_independently(relay: RmbRelay) -> None:
    """Our SDK's envelope signature checked with md5 + py-sr25519-bindings directly."""
    import hashlib

    import sr25519

    from tests._proto import types_pb2

    alice = await relay.client(1)
    _, wire = alice.request_envelope(2, "calc.add", b"[1,2]", tags="t", schema="application/json")
    env = types_pb2.Envelope.FromString(wire)
    stream = (
        env.uid.encode()
        + env.tags.encode()
        + str(env.timestamp).encode()
        + str(env.expiration).encode()
        + str(env.source.twin).encode()
        + str(env.destination.twin).encode()
        + env.request.command.encode()
        + env.schema.encode()
        + env.plain
    )
    digest = hashlib.md5(stream).digest()
    assert env.signature[0:1] == b"s"
    assert sr25519.verify(env.signature[1:], digest, key_for(1).public_key)
    assert Envelope.decode(wire).challenge() == digest
