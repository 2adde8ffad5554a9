"""Forged federation against a real standalone relay process (issue 33, "federation cannot
forge"): `POST /` with an unsigned envelope claiming any source, with source twin 0, or for a
twin whose relays are elsewhere is refused; a correctly signed envelope posted alongside is
accepted and delivered to its twin, which receives nothing else; the relay logs no traceback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web
from redis.asyncio import Redis

from rmb_relay._core import MSG_REQUEST, Envelope, WsMessage
from rmb_relay.identity import make_jwt
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT
from tests.helpers import RawWebSocket, serve_app
from tests.peer_fixtures import (
    Relay,
    add_twin,
    echo_service,
    redis_servers,
    run_client,
    start_peer,
    start_relay,
)
from tests.redis_process import RedisServer
from tests.relay_process import PROBLEMS, RelayProcess
from tests.rmb_fixtures import key_for

#: the victim (served here), an honest sender, and a twin whose relay is another one
VICTIM, SENDER, ELSEWHERE = 41, 7, 55
OTHER_SENDERS = (8, 9)
#: relay RSS growth allowed over the forged posts (each is refused before it is stored)
RSS_GROWTH_MIB = 16


@pytest.fixture
def relay(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RelayProcess]:
    db = tmp_path / "twins.sqlite3"
    with SqliteTwinDirectory(db) as twins:
        for twin in (VICTIM, SENDER, *OTHER_SENDERS):
            twins.add(Twin(twin, key_for(twin).public_key, None))
        twins.add(Twin(ELSEWHERE, key_for(ELSEWHERE).public_key, frozenset({"other.example"})))
    process = RelayProcess("--twins", f"sqlite:{db}", "--no-tunnel", *getattr(request, "param", ()))
    try:
        yield process
    finally:
        process.close()


def _envelope(source: int, dest: int, body: bytes, *, sign: bool) -> bytes:
    env = Envelope(f"u-{source}-{dest}-{hashlib.sha256(body).hexdigest()[:16]}")
    env.source_twin, env.source_connection = source, None
    env.dest_twin, env.dest_connection = dest, None
    env.kind = MSG_REQUEST
    env.command = "test.cmd"
    env.timestamp = int(time.time())
    env.expiration = 300
    env.plain = body
    if sign:
        env.signature = key_for(source).sign_prefixed(env.challenge())
    return env.encode()


async def test_forged_envelopes_are_refused_and_honest_mail_arrives(relay: RelayProcess) -> None:
    base = f"http://127.0.0.1:{relay.port}"
    rss_before = relay.rss_mib()
    async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:

        async def post(data: bytes) -> httpx.Response:
            return await client.post("/", content=data)

        forged = []
        for n in range(100):
            forged.append(await post(_envelope(999_999, VICTIM, b"forged %d" % n, sign=False)))
        assert {r.status_code for r in forged} == {403}
        assert "unknown source twin 999999" in forged[0].text
        # a real twin's id without its signature
        unsigned = await post(_envelope(SENDER, VICTIM, b"unsigned", sign=False))
        assert (unsigned.status_code, unsigned.text) == (403, "envelope is not signed")
        # signed by someone else's key
        env = Envelope.decode(_envelope(SENDER, VICTIM, b"wrong key", sign=False))
        env.signature = key_for(999).sign_prefixed(env.challenge())
        wrong = await post(env.encode())
        assert (wrong.status_code, wrong.text) == (403, "invalid envelope signature")
        # source twin 0 is a relay's own error: never accepted from outside
        relay_error = await post(_envelope(0, VICTIM, b"zero", sign=False))
        assert relay_error.status_code == 400
        assert "without a source twin" in relay_error.text
        # a standalone relay serves only twins that name no relay
        elsewhere = await post(_envelope(SENDER, ELSEWHERE, b"elsewhere", sign=True))
        assert elsewhere.status_code == 403
        assert "not served by this relay" in elsewhere.text
        # the honest envelope, in the middle of it all
        honest = await post(_envelope(SENDER, VICTIM, b"honest", sign=True))
        assert honest.status_code == 202
    assert relay.rss_mib() - rss_before < RSS_GROWTH_MIB
    # the victim logs in: its mailbox holds the honest envelope and nothing else
    jwt = make_jwt(key_for(VICTIM), VICTIM, None, int(time.time()))
    ws = await RawWebSocket.connect(*relay.address, f"/?{jwt}")
    event = await ws.next_event()
    assert isinstance(event, WsMessage)
    assert Envelope.decode(event.data).plain == b"honest"
    ws.send_raw(ws.encoder.ping(b"last"))
    after = await ws.next_event()  # the pong: nothing else was queued before it
    assert not isinstance(after, WsMessage), Envelope.decode(after.data).plain
    ws.close()
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def test_rmb_peer_takes_nothing_unsigned_but_a_relay_error(tmp_path: Path) -> None:
    """A forged source-0 envelope (unsigned, as only a relay's errors are) that is a response
    or a request is dropped by rmb-peer; a relay error passes on to be matched to the request
    it answers."""
    from rmb_relay.peer.e2e import E2eKey
    from rmb_relay.peer.gateway import Gateway
    from rmb_relay.sdk.envelope import Envelope as PeerEnvelope

    directory = SqliteTwinDirectory(tmp_path / "twins.sqlite3")
    gateway = Gateway(
        VICTIM,
        key_for(VICTIM),
        E2eKey(bytes(range(32))),
        directory,
        redis_url="redis://127.0.0.1:1/0",
        relays=["ws://127.0.0.1:1"],
    )
    try:

        def from_twin_0(kind: str) -> PeerEnvelope:
            env = PeerEnvelope(uid="forged", timestamp=int(time.time()), expiration=60)
            env.destination.twin = VICTIM
            if kind == "response":
                env.response.SetInParent()
                env.plain = b"pay the attacker"
            elif kind == "request":
                env.request.command = "x"
            else:
                env.error.code = 1
                env.error.message = "relay error"
            return env

        assert gateway._accept(from_twin_0("response")) is False
        assert gateway._accept(from_twin_0("request")) is False
        assert gateway._accept(from_twin_0("error")) is True
    finally:
        await directory.close()


#: the command whose requests the hostile relay answers itself, and the one it forges
HOSTILE, FORGED = "test.hostile", "test.forged"


async def _hostile_pass_through(stack: AsyncExitStack, honest: str) -> int:
    """A relay that passes everything between a peer and the `honest` relay (its JWT too)
    but answers the peer's `HOSTILE` requests itself: first an unsigned source-0 response
    with the request's uid, then an unsigned source-0 request, then a relay error for it.
    Returns its port."""
    from rmb_relay.sdk.envelope import Envelope as PeerEnvelope

    def from_twin_0(dest: int, uid: str) -> PeerEnvelope:
        env = PeerEnvelope(uid=uid, timestamp=int(time.time()), expiration=60)
        env.destination.twin = dest
        return env

    async def forge(peer: web.WebSocketResponse, request: PeerEnvelope) -> None:
        response = from_twin_0(request.source.twin, request.uid)
        response.response.SetInParent()
        response.plain = b"pay the attacker"
        forged = from_twin_0(request.source.twin, "forged-request")
        forged.request.command = FORGED
        forged.plain = b"{}"
        error = from_twin_0(request.source.twin, request.uid)
        error.error.code = 1
        error.error.message = "relay error"
        for env in (response, forged, error):
            await peer.send_bytes(env.SerializeToString())

    async def handle(request: web.Request) -> web.StreamResponse:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(honest.rstrip("/") + request.path_qs) as upstream,
        ):
            peer = web.WebSocketResponse()
            await peer.prepare(request)

            async def down() -> None:
                async for message in upstream:
                    await peer.send_bytes(message.data)

            downstream = asyncio.ensure_future(down())
            try:
                async for message in peer:
                    env = PeerEnvelope.FromString(message.data)
                    if env.HasField("request") and env.request.command == HOSTILE:
                        await forge(peer, env)
                    else:
                        await upstream.send_bytes(message.data)
            finally:
                downstream.cancel()
            return peer

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    return await serve_app(stack, app)


async def test_rmb_peer_takes_only_a_relay_error_unsigned_from_a_hostile_relay(
    tmp_path: Path,
) -> None:
    """rmb-peer (twin 1) reaches the relay process only through a hostile relay, which
    answers one request with an unsigned response carrying its uid, sends an unsigned request,
    then the relay error: the client gets the error, the forged response and request are
    dropped (and logged); 200 echo requests to twin 2 through the same relays all come back
    right; neither peer nor relay logs a problem."""
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    add_twin(twins, 1)
    add_twin(twins, 2, "ed25519")
    relay = start_relay(twins)
    try:
        async with AsyncExitStack() as stack:
            hostile = Relay(relay.process, await _hostile_pass_through(stack, relay.url))
            with redis_servers(tmp_path, 2) as (ra, rb):
                # in a thread: it waits for the peer's link through the relay on this loop
                a = await asyncio.to_thread(start_peer, 1, twins, ra, [hostile])
                b = start_peer(2, twins, rb, [relay], key_type="ed25519")
                stop = asyncio.Event()
                service = asyncio.ensure_future(echo_service(b.redis.url, stop))
                honest = asyncio.ensure_future(run_client(a.redis.url, 200))
                try:
                    async with Redis.from_url(a.redis.url) as redis:
                        request = {
                            "ver": 1,
                            "ref": "hostile",
                            "cmd": HOSTILE,
                            "exp": 60,
                            "dat": "",
                            "tag": None,
                            "dst": [2],
                            "ret": "hostile.ret",
                            "shm": None,
                            "now": int(time.time()),
                        }
                        await redis.lpush("msgbus.system.local", json.dumps(request))
                        popped = await redis.brpop(["hostile.ret"], timeout=WAIT)
                        assert popped is not None
                        reply = json.loads(popped[1])
                        assert reply["ref"] == "hostile"
                        assert reply["err"] is not None, reply
                        assert "relay error" in json.dumps(reply["err"])
                        answered = await asyncio.wait_for(honest, 60)
                        assert len(answered) == 200
                        assert set(answered.values()) == {1}
                        assert await redis.llen("hostile.ret") == 0
                        assert await redis.llen(f"msgbus.{FORGED}") == 0
                finally:
                    stop.set()
                    await asyncio.wait_for(service, WAIT)
                    honest.cancel()
                assert a.output.count("dropping an unsigned response") == 1
                assert a.output.count("dropping an unsigned request forged-request") == 1
                assert await asyncio.to_thread(a.process.stop) == 0
                assert b.process.stop() == 0
                for peer in (a, b):
                    problems = [
                        line for line in peer.output.lines if any(p in line for p in PROBLEMS)
                    ]
                    assert problems == [], peer.twin
    finally:
        relay.process.stop()
    assert [line for line in relay.process.output.lines if any(p in line for p in PROBLEMS)] == []


@pytest.mark.parametrize("relay", [("--mailbox-source-bytes", "20000")], indirect=True)
async def test_one_posting_relay_gets_its_share_of_the_mailbox(relay: RelayProcess) -> None:
    """Signed envelopes from three source twins, all posted from one address, stop at that
    relay's share; another relay's post for the same twin is still stored."""
    base = f"http://127.0.0.1:{relay.port}"
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with (
        httpx.AsyncClient(base_url=base, timeout=WAIT) as one,
        httpx.AsyncClient(base_url=base, timeout=WAIT, transport=other) as another,
    ):
        statuses = []
        for source in (SENDER, *OTHER_SENDERS):
            answer = await one.post("/", content=_envelope(source, VICTIM, b"x" * 8000, sign=True))
            statuses.append(answer.status_code)
        assert statuses == [202, 202, 500], answer.text
        answer = await another.post("/", content=_envelope(SENDER, VICTIM, b"other", sign=True))
        assert answer.status_code == 202
    jwt = make_jwt(key_for(VICTIM), VICTIM, None, int(time.time()))
    ws = await RawWebSocket.connect(*relay.address, f"/?{jwt}")
    got = []
    for _ in range(3):
        event = await ws.next_event()
        assert isinstance(event, WsMessage)
        got.append(len(Envelope.decode(event.data).plain or b""))
    assert got == [8000, 8000, 5]
    ws.close()
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def test_a_flood_cannot_evict_a_victims_mail_in_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """With `--redis` a session's mailbox kept `--mailbox-max` entries by dropping the oldest
    (the issue: a flood evicts the mail a twin waits for): a full mailbox now refuses new mail,
    and the victim reads what was sent first."""
    db = tmp_path / "twins.sqlite3"
    with SqliteTwinDirectory(db) as twins:
        for twin in (VICTIM, SENDER, *OTHER_SENDERS):
            twins.add(Twin(twin, key_for(twin).public_key, None))
    args = ("--twins", f"sqlite:{db}", "--no-tunnel", "--redis", redis_server.url)
    relay = RelayProcess(*args, "--mailbox-max", "3")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{relay.port}", timeout=WAIT) as c:
            for n in range(2):  # the victim's real mail, stored when answered
                real = _envelope(SENDER, VICTIM, b"real %d" % n, sign=True)
                assert (await c.post("/", content=real)).status_code == 202
            flood = []
            for n in range(300):  # Redis trims MAXLEN ~ by whole nodes of 100 entries
                fake = _envelope(OTHER_SENDERS[0], VICTIM, b"flood %d" % n, sign=True)
                flood.append((await c.post("/", content=fake)).status_code)
        jwt = make_jwt(key_for(VICTIM), VICTIM, None, int(time.time()))
        ws = await RawWebSocket.connect(*relay.address, f"/?{jwt}")
        got = []
        for _ in range(3):
            event = await ws.next_event()
            assert isinstance(event, WsMessage)
            got.append(Envelope.decode(event.data).plain)
        ws.close()
        assert got == [b"real 0", b"real 1", b"flood 0"], got
        assert flood.count(202) == 1, flood
        assert relay.stop() == 0
    finally:
        relay.close()
    assert not relay.problems, relay.problems
