"""Outbound federation inside one relay process: the in-memory queue's bound, the per-remote
concurrency bound, and bad configuration refused with a clear error."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rmb_relay.commands import serve
from rmb_relay.dialects.rmb import RmbSettings
from rmb_relay.errors import ConfigError, RemoteError
from rmb_relay.federation.outbound import OutboundFederation
from rmb_relay.federation.queue import MemoryQueue
from rmb_relay.federation.ranker import Ranker
from rmb_relay.federation.sender import Sender, check_url_template, client_tls
from tests.conftest import WAIT, StartRelay, free_port
from tests.federation_fixtures import BadRemote
from tests.helpers import eventually
from tests.rmb_fixtures import RmbRelay, start_rmb_relay

REMOTE = "127.0.0.9"


@pytest.fixture
async def hanging() -> AsyncIterator[tuple[BadRemote, int]]:
    remote, port = BadRemote("hang"), free_port()
    await remote.start(REMOTE, port)
    yield remote, port
    await remote.close()


async def federating_relay(
    start_relay: StartRelay, tmp_path: Path, port: int, *, max_held: int, concurrency: int
) -> tuple[RmbRelay, OutboundFederation]:
    relay = await start_rmb_relay(
        start_relay,
        tmp_path,
        relays={1: frozenset({"relay.test"}), 2: frozenset({REMOTE})},
        settings=RmbSettings(domains=frozenset({"relay.test"})),
    )
    dialect = relay.dialect
    outbound = OutboundFederation(
        MemoryQueue(max_held),
        Sender(f"http://{{domain}}:{port}/", concurrency=concurrency, timeout=WAIT * 3),
        Ranker(),
        dialect.directory,
        dialect.switch,
        workers=8,
    )
    dialect.federation = dialect.switch.federation = outbound
    return relay, outbound


async def test_a_full_memory_queue_refuses_with_an_error_to_the_sender(
    start_relay: StartRelay, tmp_path: Path, hanging: tuple[BadRemote, int]
) -> None:
    remote, port = hanging
    relay, outbound = await federating_relay(start_relay, tmp_path, port, max_held=2, concurrency=4)
    alice = await relay.client(1)
    for _ in range(2):
        alice.send(alice.request_envelope(2, "held")[1])
    await eventually(lambda: remote.requests == 2)  # both held, in flight to a remote that hangs
    with pytest.raises(RemoteError) as caught:
        await alice.request(2, "one too many", timeout=WAIT)
    assert caught.value.reply.error == (
        0,
        "federation queue full (2 envelopes waiting for other relays)",
    )
    assert outbound.queue.depth() == 2
    await relay.close_clients()


async def test_requests_in_flight_to_one_remote_are_bounded(
    start_relay: StartRelay, tmp_path: Path, hanging: tuple[BadRemote, int]
) -> None:
    remote, port = hanging
    relay, outbound = await federating_relay(
        start_relay, tmp_path, port, max_held=100, concurrency=2
    )
    queue = outbound.queue
    assert isinstance(queue, MemoryQueue)
    alice = await relay.client(1)
    for _ in range(6):
        alice.send(alice.request_envelope(2, "x")[1])
    # every item has been taken by a worker, and two of them reached the remote: the other
    # four wait for a slot, which the hanging remote never frees
    await eventually(lambda: queue.depth() == 6 and queue.ready() == 0 and remote.requests == 2)
    assert remote.requests == 2
    assert len(remote.connections) == 2  # one pooled keep-alive connection per slot
    await relay.close_clients()


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("ftp://{domain}/", "must start with http"),
        ("https://relay.example.com/", "must contain {domain}"),
        ("https://{domain}/{port}", "only {domain} may be substituted"),
    ],
)
def test_bad_url_template_is_refused(template: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_url_template(template)
    assert message in str(caught.value)


def test_unreadable_ca_bundle_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match="--federation-ca"):
        client_tls(str(bad))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--federation-workers", "0"], "--federation-workers"),
        (["--federation-concurrency", "0"], "--federation-concurrency"),
        (["--federation-timeout", "0"], "--federation-timeout"),
        (["--federation-queue-max", "0"], "--federation-queue-max"),
        (["--federation-claim-idle", "0"], "--federation-claim-idle"),
        (["--ranker-period", "0"], "--ranker-period"),
        (["--ranker-priors", "/nonexistent/priors.json"], "--ranker-priors"),
    ],
)
async def test_bad_federation_flags_stop_the_relay_with_a_clear_error(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    args: argparse.Namespace = serve.parser().parse_args(
        ["-l", "127.0.0.1:0", "--twins", f"sqlite:{tmp_path / 't.sqlite3'}", *flags]
    )
    with pytest.raises(ConfigError, match=message):
        await serve.build_server(args)
