"""The tfchain twin directory against real devchain processes (twins/substrate.py,
twins/devchain.py): reads, the standard substrate client, signed extrinsics both ways,
failover across three nodes with the first down and one killed mid-run, and nodes that answer
garbage, wrong types or nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from substrateinterface import Keypair, KeypairType, SubstrateInterface

from rmb_relay.errors import ChainError, ConfigError, ExtrinsicRejected
from rmb_relay.identity import signing_key
from rmb_relay.twins import Twin
from rmb_relay.twins.chain import ChainCodec
from rmb_relay.twins.rpc import RpcConnection, RpcError
from rmb_relay.twins.substrate import SubstrateClient, SubstrateTwinDirectory
from tests.conftest import WAIT, free_port
from tests.peer_fixtures import mnemonic_for, rmb_relay
from tests.tfchain_fixtures import (
    DevChainNode,
    bad_node,
    put_twin,
    silent_tcp,
    start_devchain,
)

#: a valid key whose bytes are also UTF-8 text (how a decoder shows it must not matter)
PK = bytes([2]) + bytes(range(40, 72))


@pytest.fixture(scope="module")
def codec() -> ChainCodec:
    return ChainCodec.load()


@pytest.fixture(scope="module")
def twins_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chain") / "twins.sqlite3"


@pytest.fixture(scope="module")
def node(twins_file: Path) -> Iterator[DevChainNode]:
    """One devchain for the module, with twins 1 (two relays and a pk), 2 (nothing set)."""
    started = start_devchain(twins_file)
    try:
        put_twin(started.url, 1, "r1.example", "r2.example", pk=PK.hex())
        put_twin(started.url, 2)
        yield started
    finally:
        started.stop()


@pytest.fixture
async def directory(node: DevChainNode, codec: ChainCodec) -> AsyncIterator[SubstrateTwinDirectory]:
    chain = SubstrateTwinDirectory(SubstrateClient([node.url], timeout=WAIT), codec)
    yield chain
    await chain.close()


def account(twin: int, key_type: str = "sr25519") -> bytes:
    return signing_key(mnemonic_for(twin), key_type).public_key  # type: ignore[arg-type]


async def test_reads_twins_and_accounts(directory: SubstrateTwinDirectory) -> None:
    assert await directory.get(1) == Twin(
        1, account(1), frozenset({"r1.example", "r2.example"}), PK
    )
    assert await directory.get(2) == Twin(2, account(2), None, None)
    assert await directory.get(999) is None
    assert await directory.twin_id_by_account(account(2)) == 2
    assert await directory.twin_id_by_account(bytes(32)) is None
    found = await directory.find_account(account(1))
    assert found is not None
    assert found.id == 1


async def test_concurrent_lookups_share_one_connection(
    node: DevChainNode, codec: ChainCodec
) -> None:
    client = SubstrateClient([node.url], timeout=WAIT)
    chain = SubstrateTwinDirectory(client, codec)
    try:
        twins = await asyncio.gather(*(chain.get(1 + i % 2) for i in range(100)))
        assert [twin.id for twin in twins if twin] == [1 + i % 2 for i in range(100)]
        assert (client.connects, client.failovers) == (1, 0)
    finally:
        await chain.close()


def test_substrate_interface_query_returns_the_twin(node: DevChainNode) -> None:
    substrate = SubstrateInterface(url=node.url)
    try:
        twin = substrate.query("TfgridModule", "Twins", [1]).value
        assert twin["id"] == 1
        assert twin["relay"] in ("r1.example_r2.example", "r2.example_r1.example")
        # scalecodec shows a Vec<u8> as text when it is UTF-8, as this key happens to be
        assert twin["pk"].encode() == PK
        assert substrate.query("TfgridModule", "TwinIdByAccountID", [account(2)]).value == 2
    finally:
        substrate.close()


async def test_update_twin_signed_by_substrate_interface_is_applied(
    node: DevChainNode, directory: SubstrateTwinDirectory
) -> None:
    """The standard client's signing payload is the one the devchain checks (and ours)."""
    chain_node, chain = node, directory
    put_twin(chain_node.url, 5)
    keypair = Keypair.create_from_mnemonic(mnemonic_for(5), crypto_type=KeypairType.SR25519)
    assert keypair.public_key == account(5)
    substrate = SubstrateInterface(url=chain_node.url)
    try:
        call = substrate.compose_call(
            "TfgridModule", "update_twin", {"relay": "via-si.example", "pk": None}
        )
        extrinsic = substrate.create_signed_extrinsic(call, keypair)
        receipt = substrate.submit_extrinsic(extrinsic, wait_for_inclusion=True)
        assert receipt.is_success
    finally:
        substrate.close()
    assert await chain.get(5) == Twin(5, account(5), frozenset({"via-si.example"}), None)
    # and ours, twice (the nonce moves on)
    key = signing_key(mnemonic_for(5))
    for relay in ("ours.example", "again.example"):
        await chain.update_twin(key, frozenset({relay}), PK)
        assert await chain.get(5) == Twin(5, account(5), frozenset({relay}), PK)


async def test_update_twin_without_a_twin_fails_on_chain(
    directory: SubstrateTwinDirectory,
) -> None:
    with pytest.raises(ExtrinsicRejected, match="without a TwinUpdated event"):
        await directory.update_twin(signing_key("0x" + "09" * 32), frozenset({"x.example"}), None)


async def test_extrinsic_with_a_bad_signature_is_refused(
    node: DevChainNode, codec: ChainCodec
) -> None:
    genesis_hex = await _request(node.url, "chain_getBlockHash", [0])
    key = signing_key(mnemonic_for(1))
    data = bytearray(
        codec.signed_extrinsic(key, "update_twin", {"relay": None, "pk": None}, 0, bytes(32))
    )  # signed for another genesis
    assert genesis_hex != "0x" + "00" * 32
    with pytest.raises(RpcError, match="bad signature") as caught:
        await _request(node.url, "author_submitAndWatchExtrinsic", ["0x" + data.hex()])
    assert caught.value.code == 1010


async def _request(url: str, method: str, params: list[object]) -> object:
    connection = await RpcConnection.connect(url, WAIT)
    try:
        return await connection.request(method, params, WAIT)
    finally:
        await connection.close()


async def test_failover_with_the_first_node_down_and_one_killed_mid_run(
    twins_file: Path, node: DevChainNode, codec: ChainCodec
) -> None:
    """Three nodes on one twin file: the first refuses connections, the second is killed
    (SIGKILL) after ten lookups; every one of the forty lookups is answered."""
    second = start_devchain(twins_file)
    third = start_devchain(twins_file)
    down = f"ws://127.0.0.1:{free_port()}"
    client = SubstrateClient([down, second.url, third.url], timeout=WAIT)
    chain = SubstrateTwinDirectory(client, codec)
    try:
        for i in range(40):
            if i == 10:
                second.process.popen.send_signal(signal.SIGKILL)
                second.process.popen.wait(WAIT)
            twin = await chain.get(1 + i % 2)
            assert twin is not None
            assert twin.id == 1 + i % 2
        assert client.current_url == third.url
        assert client.failovers == 2  # the down node, then the killed one
    finally:
        await chain.close()
        second.stop()
        third.stop()


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        ("garbage", "not JSON"),
        ("wrong-types", "answered int '42', not 0x-hex"),
        ("rpc-error", "node error -32601: Method not found"),
        ("hang", "no answer to state_getStorage within 0.5 s"),
    ],
)
async def test_a_bad_node_is_a_clear_error_and_the_next_node_answers(
    node: DevChainNode, codec: ChainCodec, behaviour: str, reason: str
) -> None:
    async with bad_node(behaviour) as bad_url:
        alone = SubstrateTwinDirectory(SubstrateClient([bad_url], timeout=0.5), codec)
        try:
            with pytest.raises(ChainError, match=f"2 attempts over 1 node.*{reason}"):
                await alone.get(1)
        finally:
            await alone.close()
        client = SubstrateClient([bad_url, node.url], timeout=0.5)
        chain = SubstrateTwinDirectory(client, codec)
        try:
            twin = await chain.get(1)
            assert twin is not None
            assert twin.id == 1
            assert client.failovers == 1
            assert client.current_url == node.url
        finally:
            await chain.close()


async def test_devchain_answers_bad_requests_with_json_rpc_errors(node: DevChainNode) -> None:
    bad_twin = {"id": 0, "account": "0x00"}
    cases = [
        ("}{", -32700),
        (json.dumps([1, 2]), -32600),
        (_call("no_such_method", []), -32601),
        (_call("state_getStorage", ["zz"]), -32602),
        (_call("chain_getHeader", ["0x" + "00" * 32]), 4003),
        (_call("devchain_putTwin", [bad_twin]), -32602),
        (_call("author_submitExtrinsic", ["0x1234"]), 1010),
    ]
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(node.url) as ws:
            for text, code in cases:
                await ws.send_str(text)
                answer = json.loads((await ws.receive(WAIT)).data)
                assert answer["error"]["code"] == code, (text, answer)
            # the connection still serves after all that
            await ws.send_str(_call("chain_getBlockHash", [0]))
            assert json.loads((await ws.receive(WAIT)).data)["result"].startswith("0x")
        async with session.post(node.url.replace("ws://", "http://"), data="}{") as response:
            assert (await response.json())["error"]["code"] == -32700


def _call(method: str, params: list[object]) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    dead = f"ws://127.0.0.1:{free_port()}"
    added = _cli("twins", "add", "--devchain", dead, "--id", "1", "--account", "00" * 32)
    assert added.returncode == 2
    assert "the devchain did not take the twin" in added.stderr
    chain = _cli("devchain", "--twins", str(tmp_path / "t.sqlite3"), "--block-time", "0")
    assert chain.returncode != 0
    assert "--block-time must be a positive number" in chain.stderr
    for result in (added, chain):
        assert "Traceback" not in result.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(rmb_relay(*args), capture_output=True, text=True, timeout=WAIT)


async def test_a_node_that_never_upgrades_is_failed_over_after_the_timeout(
    node: DevChainNode, codec: ChainCodec
) -> None:
    async with silent_tcp() as silent:
        client = SubstrateClient([silent, node.url], timeout=0.5)
        chain = SubstrateTwinDirectory(client, codec)
        try:
            assert await chain.get(2) is not None
            assert (client.failovers, client.current_url) == (1, node.url)
        finally:
            await chain.close()
        alone = SubstrateTwinDirectory(SubstrateClient([silent], timeout=0.5), codec)
        try:
            with pytest.raises(ChainError, match=r"no websocket within 0\.5 s"):
                await alone.get(2)
        finally:
            await alone.close()


def test_bad_substrate_urls_are_refused() -> None:
    with pytest.raises(ConfigError, match="expected ws://HOST"):
        SubstrateClient(["http://localhost:9944"])
    with pytest.raises(ConfigError, match="at least one"):
        SubstrateClient([])


def test_the_flag_defaults_are_the_modules_defaults() -> None:
    """services.py and peer/cli.py repeat them so a relay without --substrate stays light."""
    from rmb_relay import services
    from rmb_relay.peer import cli
    from rmb_relay.twins import events, substrate

    assert services.DEFAULT_SUBSTRATE_TIMEOUT == substrate.DEFAULT_SUBSTRATE_TIMEOUT
    assert cli.DEFAULT_SUBSTRATE_TIMEOUT == substrate.DEFAULT_SUBSTRATE_TIMEOUT
    assert services.DEFAULT_CATCHUP_THRESHOLD == events.DEFAULT_CATCHUP_THRESHOLD
