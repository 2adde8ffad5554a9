"""The twin cache kept fresh by chain events (twins/events.py) against a real devchain: an
`update_twin` reaches the cache through its `TwinUpdated` event (the TTL is an hour and the
backend is not asked again), missed blocks are caught up, too many missed blocks clear the
cache, and a node without new heads counts as stalled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rmb_relay.identity import signing_key
from rmb_relay.twins import Twin
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.chain import ChainCodec
from rmb_relay.twins.events import TwinEventListener
from rmb_relay.twins.substrate import SubstrateClient, SubstrateTwinDirectory
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.peer_fixtures import mnemonic_for
from tests.tfchain_fixtures import DevChainNode, put_twin, start_devchain

PK = bytes([3]) + bytes(range(200, 232))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevChainNode]:
    started = start_devchain(tmp_path_factory.mktemp("events") / "twins.sqlite3", block_time=0.2)
    try:
        for twin in (1, 2, 3):
            put_twin(started.url, twin, "before.example")
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def codec() -> ChainCodec:
    return ChainCodec.load()


@pytest.fixture
async def chain(node: DevChainNode, codec: ChainCodec) -> AsyncIterator[SubstrateTwinDirectory]:
    directory = SubstrateTwinDirectory(SubstrateClient([node.url], timeout=WAIT), codec)
    yield directory
    await directory.close()


async def test_update_twin_reaches_the_cache_through_its_event(
    chain: SubstrateTwinDirectory,
) -> None:
    cache = CachedTwinDirectory(chain, ttl=3600)
    blocks: asyncio.Queue[int] = asyncio.Queue()

    async def on_block(number: int) -> None:
        blocks.put_nowait(number)

    listener = TwinEventListener(chain, cache, on_block=on_block)
    listener.start()
    try:
        await asyncio.wait_for(blocks.get(), WAIT)  # subscribed
        before = await cache.get(1)
        assert before is not None
        assert before.relays == frozenset({"before.example"})
        lookups = cache.lookups
        key = signing_key(mnemonic_for(1))
        await chain.update_twin(key, frozenset({"after.example"}), PK)

        async def changed() -> bool:
            await asyncio.wait_for(blocks.get(), WAIT)
            return cache.peek(1) == (
                True,
                Twin(1, key.public_key, frozenset({"after.example"}), PK),
            )

        await eventually(changed)
        assert cache.lookups == lookups  # the event, not a new read, refreshed it
        assert listener.events_applied >= 1
    finally:
        await listener.close()


async def test_missed_blocks_are_caught_up(chain: SubstrateTwinDirectory) -> None:
    """The listener last saw a block before the update; the next head it sees is later: the
    blocks in between are read and their events applied."""
    cache = CachedTwinDirectory(chain, ttl=3600)
    listener = TwinEventListener(chain, cache)
    head = await _head(chain)
    key = signing_key(mnemonic_for(2))
    await chain.update_twin(key, frozenset({"caught-up.example"}), None)
    listener.last = head
    later = await _head(chain) + 1
    await _wait_for_block(chain, later)
    await listener._on_header({"number": hex(later)})
    assert cache.peek(2) == (True, Twin(2, key.public_key, frozenset({"caught-up.example"}), None))
    assert listener.blocks_seen == later - head
    assert listener.flushes == 0


async def test_too_many_missed_blocks_clear_the_cache(chain: SubstrateTwinDirectory) -> None:
    cache = CachedTwinDirectory(chain, ttl=3600)
    assert await cache.get(3) is not None
    listener = TwinEventListener(chain, cache, catchup_threshold=2)
    head = await _head(chain)
    listener.last = head - 5
    await listener._on_header({"number": hex(head)})
    assert len(cache) == 0
    assert listener.flushes == 1
    assert listener.blocks_seen == 1  # only the head itself


async def test_a_head_at_or_below_the_last_one_is_processed_too(
    chain: SubstrateTwinDirectory,
) -> None:
    """A re-org on the best chain announces a height seen before: its events count."""
    cache = CachedTwinDirectory(chain, ttl=3600)
    listener = TwinEventListener(chain, cache)
    head = await _head(chain)
    listener.last = head
    await listener._on_header({"number": hex(head)})
    await listener._on_header({"number": hex(head - 1)})
    assert (listener.blocks_seen, listener.last, listener.flushes) == (2, head - 1, 0)


async def test_a_node_without_new_heads_is_dropped_as_stalled(
    tmp_path: Path, codec: ChainCodec
) -> None:
    quiet = start_devchain(tmp_path / "twins.sqlite3", block_time=3600)
    client = SubstrateClient([quiet.url], timeout=WAIT)
    chain = SubstrateTwinDirectory(client, codec)
    listener = TwinEventListener(chain, CachedTwinDirectory(chain), stall_timeout=0.3)
    listener.start()
    try:
        await eventually(lambda: client.failovers >= 2)  # dropped, resubscribed, dropped
        assert listener.blocks_seen >= 2  # each subscription's first head
    finally:
        await listener.close()
        await chain.close()
        quiet.stop()


async def _head(chain: SubstrateTwinDirectory) -> int:
    header = await chain.client.call("chain_getHeader", [], lambda value: value)
    return int(header["number"], 16)


async def _wait_for_block(chain: SubstrateTwinDirectory, number: int) -> None:
    async def there() -> bool:
        return await _head(chain) >= number

    await eventually(there)
