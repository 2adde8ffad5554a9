"""`POST /` from other relays (decision 4): size limit, parse, ownership, signature, fail-fast,
and what is accepted reaching the destination (connected, or through its mailbox). Real HTTP
against a real listener; envelopes signed with real keys."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from rmb_relay.dialects.rmb import RmbDialect, RmbSettings
from rmb_relay.errors import EnvelopeError
from rmb_relay.federation.batch import (
    BATCH_HEADER,
    BATCH_TYPE,
    decode_batch,
    decode_statuses,
    encode_batch,
    encode_statuses,
)
from rmb_relay.federation.inbound import InboundFederation
from rmb_relay.sdk import IncomingRequest, RmbClient
from rmb_relay.server.listener import RelayServer
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.twins import Twin
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT, StartRelay
from tests.rmb_fixtures import key_for

OURS, THEIRS = "relay.test", "other.relay"
MAX_MESSAGE = 4096


@dataclass
class Inbound:
    server: RelayServer
    http: aiohttp.ClientSession

    @property
    def ws_url(self) -> str:
        return self.server.url + "/"

    async def post(self, body: bytes) -> tuple[int, bytes]:
        url = self.server.url.replace("ws://", "http://") + "/"
        async with self.http.post(url, data=body) as response:
            return response.status, await response.read()


async def start_inbound(
    start_relay: StartRelay, tmp_path: Path, *, verify: bool
) -> AsyncIterator[Inbound]:
    directory = SqliteTwinDirectory(tmp_path / "twins.sqlite3")
    directory.add_many(
        [
            Twin(1, key_for(1).public_key, frozenset({THEIRS})),  # a sender elsewhere
            Twin(2, key_for(2).public_key, frozenset({OURS})),
            Twin(3, key_for(3).public_key, frozenset({THEIRS})),  # not ours
        ]
    )
    registry = Registry()
    dialect = RmbDialect(
        RmbSettings(domains=frozenset({OURS})),
        CachedTwinDirectory(directory, ttl=0.0, negative_ttl=0.0),
        registry,
    )
    dialect.inbound = InboundFederation(
        dialect.directory, dialect.switch, dialect.is_ours, verify=verify, max_body=MAX_MESSAGE
    )
    server = await start_relay([dialect], registry=registry, max_message=MAX_MESSAGE)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        yield Inbound(server, http)


@pytest.fixture
async def inbound(start_relay: StartRelay, tmp_path: Path) -> AsyncIterator[Inbound]:
    async for value in start_inbound(start_relay, tmp_path, verify=False):
        yield value


@pytest.fixture
async def verifying(start_relay: StartRelay, tmp_path: Path) -> AsyncIterator[Inbound]:
    async for value in start_inbound(start_relay, tmp_path, verify=True):
        yield value


def remote_sender(twin: int = 1, *, sign: bool = True) -> RmbClient:
    """A twin of another relay, only building envelopes (its relay would post them)."""
    return RmbClient(twin, key_for(twin), sign=sign)


def next_request(client: RmbClient) -> Awaitable[bytes]:
    """The payload of the next request `client` receives."""
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def on_request(request: IncomingRequest) -> bytes:
        if not got.done():
            got.set_result(request.data)
        return b""

    client.handle_all(on_request)
    return asyncio.wait_for(got, WAIT)


async def test_accepted_envelope_reaches_the_connected_twin(inbound: Inbound) -> None:
    bob = await RmbClient.connect(inbound.ws_url, 2, key_for(2))
    arrived = next_request(bob)
    _, wire = remote_sender().request_envelope(2, "hello", b"from afar")
    assert await inbound.post(wire) == (202, b"")
    assert await arrived == b"from afar"
    await bob.close()


async def test_envelope_for_an_offline_twin_waits_in_its_mailbox(inbound: Inbound) -> None:
    _, wire = remote_sender().request_envelope(2, "later", b"kept")
    assert await inbound.post(wire) == (202, b"")
    bob = RmbClient(2, key_for(2))
    waiting = next_request(bob)
    await bob.open(inbound.ws_url)
    assert await waiting == b"kept"
    await bob.close()


async def test_fail_fast_to_an_offline_twin_is_404(inbound: Inbound) -> None:
    _, wire = remote_sender().request_envelope(2, "now", tags="fail-fast")
    assert await inbound.post(wire) == (404, b"destination offline")
    bob = await RmbClient.connect(inbound.ws_url, 2, key_for(2))
    assert await inbound.post(wire) == (202, b"")
    await bob.close()


async def test_body_over_the_size_limit_is_413(inbound: Inbound) -> None:
    _, wire = remote_sender().request_envelope(2, "big", b"x" * MAX_MESSAGE)
    status, _ = await inbound.post(wire)
    assert status == 413


async def test_body_that_is_not_an_envelope_is_400(inbound: Inbound) -> None:
    status, body = await inbound.post(b"\xff\xff\xff not protobuf")
    assert status == 400
    assert body.startswith(b"bad request: ")


async def test_envelope_without_destination_is_400(inbound: Inbound) -> None:
    sender = remote_sender()
    env = sender.envelope(0)
    env.request.command = "x"
    status, body = await inbound.post(sender.seal(env))
    assert (status, body) == (400, b"bad request: message with missing destination")


@pytest.mark.parametrize("dest", [3, 99])
async def test_destination_not_served_here_is_403(inbound: Inbound, dest: int) -> None:
    """Twin 3 is served by another relay, 99 does not exist: this relay forwards neither
    (it is not an open forwarder)."""
    _, wire = remote_sender().request_envelope(dest, "relay me")
    assert await inbound.post(wire) == (403, f"twin {dest} is not served by this relay".encode())


async def test_verify_federated_accepts_a_correct_signature(verifying: Inbound) -> None:
    _, wire = remote_sender().request_envelope(2, "signed")
    assert await verifying.post(wire) == (202, b"")


async def test_verify_federated_refuses_unsigned_and_forged(verifying: Inbound) -> None:
    _, unsigned = remote_sender(sign=False).request_envelope(2, "x")
    assert await verifying.post(unsigned) == (403, b"envelope is not signed")
    forger = RmbClient(1, key_for(3))  # claims to be twin 1, signs with twin 3's key
    _, forged = forger.request_envelope(2, "x")
    assert await verifying.post(forged) == (403, b"invalid envelope signature")
    stranger = remote_sender(99)
    _, unknown = stranger.request_envelope(2, "x")
    assert await verifying.post(unknown) == (403, b"unknown source twin 99")


async def test_refusals_are_counted_by_status(inbound: Inbound) -> None:
    from tests.scrape import scrape

    await inbound.post(b"garbage")
    _, wire = remote_sender().request_envelope(3, "x")
    await inbound.post(wire)
    host, port = inbound.server.addresses[0][:2]
    page = await scrape(host, port)
    # the relay's own federation metrics are registered by `rmb-relay serve`; here the
    # listener's request counter shows the answers
    assert page.value("rmb_relay_http_requests_total", method="POST", status="400") == 1
    assert page.value("rmb_relay_http_requests_total", method="POST", status="403") == 1


# ---- batches between rmb-relays (federation/batch.py) --------------------------------------


async def post_batch(inbound: Inbound, envelopes: list[bytes]) -> tuple[int, bytes, str | None]:
    url = inbound.server.url.replace("ws://", "http://") + "/"
    headers = {"Content-Type": BATCH_TYPE}
    async with inbound.http.post(url, data=encode_batch(envelopes), headers=headers) as response:
        return response.status, await response.read(), response.headers.get(BATCH_HEADER)


async def test_every_answer_announces_batches(inbound: Inbound) -> None:
    url = inbound.server.url.replace("ws://", "http://") + "/"
    async with inbound.http.post(url, data=b"garbage") as response:
        assert response.status == 400
        assert response.headers[BATCH_HEADER] == str(MAX_MESSAGE)


async def test_a_batch_gets_one_answer_per_envelope(inbound: Inbound) -> None:
    bob = await RmbClient.connect(inbound.ws_url, 2, key_for(2))
    arrived = next_request(bob)
    sender = remote_sender()
    envelopes = [
        sender.request_envelope(2, "hello", b"batched")[1],  # ours, connected: 202
        sender.request_envelope(3, "x")[1],  # another relay's twin: 403
        b"\xff\xff not an envelope",  # 400
        sender.request_envelope(2, "x", dest_sid="gone", tags="fail-fast")[1],  # offline: 404
    ]
    status, body, announced = await post_batch(inbound, envelopes)
    assert (status, announced) == (200, str(MAX_MESSAGE))
    answers = decode_statuses(body, len(envelopes))
    assert [code for code, _ in answers] == [202, 403, 400, 404]
    assert answers[1][1] == "twin 3 is not served by this relay"
    assert answers[3][1] == "destination offline"
    assert await arrived == b"batched"
    await bob.close()


async def test_a_batch_reaches_connected_sessions_in_order_and_offline_ones_later(
    inbound: Inbound,
) -> None:
    """The connected session's envelopes are written in one pass, the offline one goes to its
    mailbox: all answered 202, none lost, the connected ones in batch order."""
    bob = await RmbClient.connect(inbound.ws_url, 2, key_for(2))
    got: list[bytes] = []
    all_in = asyncio.get_running_loop().create_future()

    def on_request(request: IncomingRequest) -> bytes:
        got.append(request.data)
        if len(got) == 20 and not all_in.done():
            all_in.set_result(None)
        return b""

    bob.handle_all(on_request)
    sender = remote_sender()
    live = [sender.request_envelope(2, "n", b"%d" % i)[1] for i in range(20)]
    offline = sender.request_envelope(2, "n", b"kept", dest_sid="later")[1]
    status, body, _ = await post_batch(inbound, [*live[:10], offline, *live[10:]])
    assert status == 200
    assert [code for code, _ in decode_statuses(body, 21)] == [202] * 21
    await asyncio.wait_for(all_in, WAIT)
    assert got == [b"%d" % i for i in range(20)]
    later = RmbClient(2, key_for(2), sid="later")
    waiting = next_request(later)
    await later.open(inbound.ws_url)
    assert await waiting == b"kept"
    await later.close()
    await bob.close()


async def test_a_batch_with_broken_framing_is_refused_whole(inbound: Inbound) -> None:
    url = inbound.server.url.replace("ws://", "http://") + "/"
    truncated = encode_batch([b"abcdef"])[:-2]
    headers = {"Content-Type": BATCH_TYPE}
    async with inbound.http.post(url, data=truncated, headers=headers) as response:
        assert response.status == 400
        assert await response.read() == b"bad request: batch truncated in an envelope"


def test_batch_framing_round_trips_and_rejects_garbage() -> None:
    envelopes = [b"", b"a", b"x" * 70000]
    assert decode_batch(encode_batch(envelopes)) == envelopes
    with pytest.raises(EnvelopeError, match="length prefix"):
        decode_batch(b"\x00\x00")
    statuses = [(202, b""), (404, b"destination offline")]
    assert decode_statuses(encode_statuses(statuses), 2) == [
        (202, ""),
        (404, "destination offline"),
    ]
    with pytest.raises(EnvelopeError, match="truncated"):
        decode_statuses(encode_statuses(statuses), 3)
    with pytest.raises(EnvelopeError, match="trailing"):
        decode_statuses(encode_statuses(statuses), 1)
