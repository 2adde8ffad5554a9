"""Acceptance (issue 15): a relay (whose first --substrate node is down) and two rmb-peers
whose every twin comes from a devchain exchange end-to-end encrypted requests; the peers are
started with exactly the public rmb-peer flags (`-s ws://localhost:PORT --relay
ws://localhost:PORT -r redis://... --mnemonic "..." -k sr25519`), find their twins on the chain
and publish their relay and e2e key there with a signed `update_twin`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from substrateinterface import SubstrateInterface

from rmb_relay.identity import secret_from_phrase
from rmb_relay.peer.e2e import E2eKey
from tests.conftest import WAIT, RedisServer, free_port
from tests.helpers import eventually
from tests.peer_fixtures import (
    CONNECTED,
    Peer,
    Process,
    mnemonic_for,
    redis_servers,
    rmb_peer,
    rmb_relay,
    spawn,
)
from tests.test_peer_flow import ask, decoded, request, serve_once
from tests.tfchain_fixtures import DevChainNode, put_twin, start_devchain


@dataclass
class ChainCluster:
    chain: DevChainNode
    relay_port: int
    a: Peer
    b: Peer


def start_chain_relay(substrate: str) -> tuple[Process, int]:
    """A relay whose first chain node is down: it fails over to `substrate`."""
    down = f"ws://127.0.0.1:{free_port()}"
    process = spawn(
        rmb_relay("serve", "-l", "127.0.0.1:0", "--substrate", down, "--substrate", substrate),
        stream="stdout",
    )
    process.output.wait_for("rmb-relay listening on ")
    banner = next(line for line in process.output.lines if "listening on" in line)
    return process, int(banner.split()[3].rstrip(";").rpartition(":")[2])


def start_chain_peer(twin: int, chain: DevChainNode, relay_port: int, redis: RedisServer) -> Peer:
    """rmb-peer with exactly the public flags, nothing of ours."""
    args = [
        "-s", f"ws://localhost:{chain.port}",
        "--relay", f"ws://localhost:{relay_port}",
        "-r", redis.url,
        "--mnemonic", mnemonic_for(twin),
        "-k", "sr25519",
    ]  # fmt: skip
    peer = Peer(twin, spawn(rmb_peer(*args)), redis)
    peer.output.wait_for(CONNECTED)
    return peer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChainCluster]:
    tmp = tmp_path_factory.mktemp("chain-peers")
    chain = start_devchain(tmp / "twins.sqlite3")
    processes: list[Process] = [chain.process]
    try:
        # on chain before the peers start: relays they do not use, no e2e key
        put_twin(chain.url, 11, "old-relay.example")
        put_twin(chain.url, 12)
        relay, port = start_chain_relay(f"ws://localhost:{chain.port}")
        processes.append(relay)
        with redis_servers(tmp, 2) as (ra, rb):
            a = start_chain_peer(11, chain, port, ra)
            processes.append(a.process)
            b = start_chain_peer(12, chain, port, rb)
            processes.append(b.process)
            yield ChainCluster(chain, port, a, b)
            assert a.process.stop() == 0
            assert b.process.stop() == 0
    finally:
        for process in reversed(processes):
            process.stop()


def test_peers_published_their_relay_and_key_with_update_twin(cluster: ChainCluster) -> None:
    """The standard substrate client reads what the peers published, as it would on tfchain."""
    substrate = SubstrateInterface(url=cluster.chain.url)
    try:
        for peer in (cluster.a, cluster.b):
            twin = substrate.query("TfgridModule", "Twins", [peer.twin]).value
            expected = E2eKey(secret_from_phrase(mnemonic_for(peer.twin))).public_key
            assert twin["id"] == peer.twin
            assert twin["relay"] == "localhost"
            assert twin["pk"] == "0x" + expected.hex()
            assert peer.output.count(f"twin {peer.twin} updated: relays localhost") == 1
            assert peer.output.count(f"twin: {peer.twin}") == 1
    finally:
        substrate.close()


async def test_encrypted_request_and_reply_between_chain_twins(cluster: ChainCluster) -> None:
    async with Redis.from_url(cluster.a.redis.url) as redis_a:
        for i in range(5):
            message = request([12], "test.chain", f"hello {i}".encode())
            service = asyncio.create_task(serve_once(cluster.b, "test.chain"))
            (reply,) = await ask(redis_a, message)
            incoming = await service
            assert decoded(incoming) == f"hello {i}".encode()
            assert incoming["src"] == "11"
            assert (reply["src"], reply["err"]) == ("12", None)
            assert decoded(reply) == f"echo:hello {i}".encode()


def test_no_update_leaves_the_chain_alone_and_an_unknown_key_exits_1(
    cluster: ChainCluster, tmp_path: Path
) -> None:
    url = cluster.chain.url
    put_twin(url, 13, "kept.example")
    with redis_servers(tmp_path, 1) as (redis,):
        args = ["-s", url, "--relay", f"ws://localhost:{cluster.relay_port}", "-r", redis.url]
        peer = spawn(rmb_peer(*args, "-m", mnemonic_for(13), "--no-update"))
        try:
            peer.output.wait_for(CONNECTED)
        finally:
            assert peer.stop() == 0
        unknown = spawn(rmb_peer(*args, "-m", mnemonic_for(14)))
        assert unknown.popen.wait(WAIT) == 1
        unknown.output.join()
        assert "no twin found on this network with given key" in "\n".join(unknown.output.lines)
        unknown.stop()
    substrate = SubstrateInterface(url=url)
    try:
        assert substrate.query("TfgridModule", "Twins", [13]).value["relay"] == "kept.example"
    finally:
        substrate.close()


async def test_relay_saw_the_updates_through_chain_events(cluster: ChainCluster) -> None:
    """The relay's listener read the peers' TwinUpdated events (its cache was overwritten by
    them, not by the TTL), and counts blocks and events in /metrics."""

    async def counters() -> dict[str, float]:
        url = f"http://127.0.0.1:{cluster.relay_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            text = await response.text()
        return {
            family.name: family.samples[0].value
            for family in text_string_to_metric_families(text)
            if family.name.startswith("rmb_relay_chain_") and family.samples
        }

    async def both_updates_seen() -> bool:
        return (await counters()).get("rmb_relay_chain_twin_events", 0) >= 2

    await eventually(both_updates_seen)
    seen = await counters()
    assert seen["rmb_relay_chain_blocks"] >= 2
    assert seen["rmb_relay_chain_cache_flushes"] == 0
    assert seen["rmb_relay_chain_failovers"] == 1  # past the node that is down
