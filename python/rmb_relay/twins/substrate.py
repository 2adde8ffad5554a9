"""The tfchain twin directory: twins read from substrate nodes over websocket JSON-RPC.

One connection at a time, to one node of the `--substrate` list. A request that fails on it
(refused, timed out, connection dropped, an answer that is not substrate JSON-RPC or not a
tfchain value) drops that connection and is retried on the next node, round-robin, up to
2 x (number of nodes) attempts (spec/rmb.md §4.2), each bounded by the per-attempt timeout
(12 s, as rmb-rs waits per connect). Only when every attempt failed does the caller get a
`ChainError` (a `TwinLookupError`: the relay answers 500 `failed to get twin`). The next
request starts from the node that failed last, so a recovered node list is walked again.

Reads are `state_getStorage` at the node's best block of `TfgridModule.Twins(id)` and
`TfgridModule.TwinIdByAccountID(account)`, keys and values as `chain.py` builds and decodes
them. Writes are one extrinsic, `update_twin(relay, pk)`, signed by the twin's key and
watched with `author_submitAndWatchExtrinsic` until its block is finalized and shows the
`TwinUpdated` event (§5.2).

Everything is asyncio; the metadata (about a second of CPU) is loaded once in a worker thread
on first use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from scalecodec.utils.ss58 import ss58_encode

from rmb_relay._core import SigningKey
from rmb_relay.errors import ChainError, ConfigError, ExtrinsicRejected, NodeError
from rmb_relay.twins import Twin, TwinDirectory, format_relays
from rmb_relay.twins.chain import ChainCodec, ChainDataError, TwinEvent
from rmb_relay.twins.rpc import RpcConnection, RpcError, Subscription

__all__ = [
    "DEFAULT_INCLUSION_TIMEOUT",
    "DEFAULT_SUBSTRATE_TIMEOUT",
    "SubstrateClient",
    "SubstrateTwinDirectory",
    "parse_hash",
]

log = logging.getLogger("rmb_relay.twins.substrate")

#: seconds one attempt (connect, or one request) may take before the next node is tried
DEFAULT_SUBSTRATE_TIMEOUT = 12.0
#: seconds an update_twin may take from submission to a finalized block (tfchain finalizes in
#: about 12-18 s; a congested chain takes longer)
DEFAULT_INCLUSION_TIMEOUT = 120.0

T = TypeVar("T")


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ConfigError(f"--substrate {url!r}: expected ws://HOST[:PORT] or wss://HOST[:PORT]")
    try:
        parts.port  # noqa: B018 - raises for a bad port
    except ValueError:
        raise ConfigError(f"--substrate {url!r}: bad port") from None
    return url


def parse_hash(value: object, what: str = "block hash") -> bytes:
    """A 0x-hex 32-byte hash from a node; ChainDataError otherwise."""
    if not isinstance(value, str) or not value.startswith("0x") or len(value) != 66:
        raise ChainDataError(f"{what}: expected 0x + 64 hex digits, got {str(value)[:80]!r}")
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise ChainDataError(f"{what}: not hex") from None


def storage_bytes(value: object) -> bytes | None:
    """A `state_getStorage` result: None (no value) or 0x-hex bytes; ChainDataError else."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("0x"):
        raise ChainDataError(
            f"state_getStorage answered {type(value).__name__} {str(value)[:60]!r}, not 0x-hex"
        )
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise ChainDataError("state_getStorage answered text that is not hex") from None


class SubstrateClient:
    """JSON-RPC over one websocket, failing over through `urls` (see the module docstring).

    `failovers` counts connections given up and `connects` connections opened (for tests and
    metrics).
    """

    def __init__(self, urls: Sequence[str], *, timeout: float = DEFAULT_SUBSTRATE_TIMEOUT) -> None:
        if not urls:
            raise ConfigError("at least one --substrate URL is needed")
        if not timeout > 0:
            raise ConfigError("--substrate-timeout must be a positive number of seconds")
        self.urls = tuple(check_url(url) for url in urls)
        self.timeout = timeout
        self._index = 0
        self._conn: RpcConnection | None = None
        self._connecting: asyncio.Task[RpcConnection] | None = None
        self._closed = False
        self.failovers = 0
        self.connects = 0

    @property
    def attempts(self) -> int:
        return 2 * len(self.urls)

    @property
    def current_url(self) -> str:
        return self.urls[self._index % len(self.urls)]

    def _advance(self, conn: RpcConnection | None, reason: str) -> None:
        """Give up on `conn` (if it is still the current one) and move to the next node."""
        if conn is not None and conn is not self._conn:
            return  # another caller already moved on
        if conn is not None:
            conn.fail(reason)
            self._conn = None
        self._index += 1
        self.failovers += 1
        log.info("substrate: failing over to %s (%s)", self.current_url, reason)

    async def connection(self) -> RpcConnection:
        """The open connection, or one attempt to open one to the current node (shared by
        every caller waiting meanwhile); NodeError (and the next node becomes current) if it
        fails."""
        if self._closed:
            raise ChainError("substrate client is closed")
        conn = self._conn
        if conn is not None:
            if conn.is_open:
                return conn
            self._advance(conn, conn.error or "connection lost")
        task = self._connecting
        if task is None or task.done():  # a finished attempt nobody collected is stale
            task = asyncio.get_running_loop().create_task(self._connect(self.current_url))
            task.add_done_callback(_consume)
            self._connecting = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _connect(self, url: str) -> RpcConnection:
        try:
            conn = await RpcConnection.connect(url, self.timeout)
        except NodeError as err:
            self._advance(None, str(err))
            raise
        if self._closed:
            await conn.close()
            raise ChainError("substrate client is closed")
        self._conn = conn
        self.connects += 1
        log.info("substrate: connected to %s", url)
        return conn

    def drop(self, conn: RpcConnection, reason: str) -> None:
        """A caller found `conn` unusable (e.g. its subscription stalled): fail over."""
        self._advance(conn, reason)

    async def call(
        self, method: str, params: list[Any], check: Callable[[Any], T] = lambda value: value
    ) -> T:
        """`method(params)` on the first node that answers it sensibly: `check` turns the
        result into the caller's value and raises ChainDataError for nonsense, which fails
        over like a dead node. Raises ChainError once every attempt failed."""
        last: Exception | None = None
        for _ in range(self.attempts):
            try:
                conn = await self.connection()
            except NodeError as err:
                last = err
                continue
            try:
                return check(await conn.request(method, params, self.timeout))
            except NodeError as err:  # also RpcError and ChainDataError
                last = err
                self._advance(conn, str(err))
        raise ChainError(
            f"tfchain did not answer {method}: {self.attempts} attempts over "
            f"{len(self.urls)} node(s) failed; last: {last}"
        )

    async def subscribe(
        self, method: str, params: list[Any], unsubscribe: str | None
    ) -> Subscription:
        """A subscription on the current connection (one attempt: the caller decides whether
        to fail over and retry, since resubscribing may need a catch-up)."""
        conn = await self.connection()
        try:
            return await conn.subscribe(method, params, unsubscribe, self.timeout)
        except RpcError:
            raise  # the node answered: it works, it said no
        except NodeError as err:
            self._advance(conn, str(err))
            raise

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


def _consume(task: asyncio.Task[RpcConnection]) -> None:
    if not task.cancelled():
        task.exception()


class SubstrateTwinDirectory(TwinDirectory):
    """Twins from tfchain (see the module docstring). Put `CachedTwinDirectory` in front."""

    def __init__(self, client: SubstrateClient, codec: ChainCodec | None = None) -> None:
        self.client = client
        self._codec = codec
        self._loading: asyncio.Task[ChainCodec] | None = None

    async def codec(self) -> ChainCodec:
        """The metadata codec, loaded once in a worker thread."""
        if self._codec is None:
            if self._loading is None:
                self._loading = asyncio.get_running_loop().create_task(ChainCodec.load_async())
            self._codec = await asyncio.shield(self._loading)
        return self._codec

    async def get(self, twin_id: int) -> Twin | None:
        codec = await self.codec()

        def decode(value: object) -> Twin | None:
            data = storage_bytes(value)
            if data is None:
                return None
            twin = codec.decode_twin(data)
            if twin.id != twin_id:
                raise ChainDataError(f"asked for twin {twin_id}, the node's Twin has id {twin.id}")
            return twin

        return await self.client.call(
            "state_getStorage", ["0x" + codec.twin_key(twin_id).hex()], decode
        )

    async def twin_id_by_account(self, account: bytes) -> int | None:
        """`TwinIdByAccountID(account)`: the twin this key controls, if any."""
        codec = await self.codec()

        def decode(value: object) -> int | None:
            data = storage_bytes(value)
            return None if data is None else codec.decode_twin_id(data)

        return await self.client.call(
            "state_getStorage", ["0x" + codec.account_key(account).hex()], decode
        )

    async def find_account(self, account: bytes) -> Twin | None:
        twin_id = await self.twin_id_by_account(account)
        return None if twin_id is None else await self.get(twin_id)

    async def block_events(self, block_hash: bytes) -> list[TwinEvent]:
        """The twin events of one block (for the event listener and `update_twin`)."""
        codec = await self.codec()

        def decode(value: object) -> list[TwinEvent]:
            data = storage_bytes(value)
            return [] if data is None else codec.decode_twin_events(data)

        return await self.client.call(
            "state_getStorage", ["0x" + codec.events_key().hex(), "0x" + block_hash.hex()], decode
        )

    async def update_twin(
        self,
        key: SigningKey,
        relays: frozenset[str] | None,
        pk: bytes | None,
        *,
        timeout: float = DEFAULT_INCLUSION_TIMEOUT,
    ) -> bytes:
        """Submit `update_twin(relay, pk)` signed by `key` and wait until a finalized block
        shows its `TwinUpdated`; returns that block's hash. ExtrinsicRejected when the chain
        refuses or fails it, ChainError when no node takes it."""
        codec = await self.codec()
        genesis = await self.client.call("chain_getBlockHash", [0], parse_hash)
        nonce = await self.client.call(
            "system_accountNextIndex", [ss58_encode(key.public_key)], _nonce
        )
        relay = format_relays(relays)
        # bytes, not text: scalecodec reads text starting with "0x" as hex
        args = {"relay": None if relay is None else relay.encode(), "pk": pk}
        extrinsic = codec.signed_extrinsic(key, "update_twin", args, nonce, genesis)
        block = await self._submit_and_watch(extrinsic, timeout)
        for event in await self.block_events(block):
            if event.name == "TwinUpdated" and event.twin.account == key.public_key:
                return block
        raise ExtrinsicRejected(
            f"update_twin was finalized in block 0x{block.hex()} without a TwinUpdated event "
            "(it failed on chain)"
        )

    async def _submit_and_watch(self, extrinsic: bytes, timeout: float) -> bytes:
        """Submit once (a retry on another node could apply it twice if the first got it)
        and follow its status to `finalized`."""
        try:
            subscription = await self.client.subscribe(
                "author_submitAndWatchExtrinsic",
                ["0x" + extrinsic.hex()],
                "author_unwatchExtrinsic",
            )
        except RpcError as err:
            raise ExtrinsicRejected(f"the chain refused the extrinsic: {err.message}") from None
        except NodeError as err:
            raise ChainError(f"could not submit the extrinsic: {err}") from None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    status = await subscription.next()
                    if isinstance(status, dict) and "finalized" in status:
                        return parse_hash(status["finalized"])
                    if isinstance(status, dict) and "inBlock" in status:
                        log.info("update_twin in block %s", status["inBlock"])
                        continue
                    if status in ("future", "ready") or (
                        isinstance(status, dict) and "broadcast" in status
                    ):
                        continue
                    raise ExtrinsicRejected(f"the chain dropped the extrinsic: {status!r}")
        except TimeoutError:
            raise ChainError(f"update_twin not finalized within {timeout:g} s") from None
        except NodeError as err:
            raise ChainError(f"lost the node while waiting for update_twin: {err}") from None
        finally:
            await subscription.close(self.client.timeout)

    async def close(self) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        await self.client.close()


def _nonce(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ChainDataError(f"system_accountNextIndex answered {value!r}, not a nonce")
    return value
