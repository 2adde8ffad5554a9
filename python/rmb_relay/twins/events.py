"""Keep the twin cache fresh from chain events (spec/rmb.md §4.4), instead of waiting out TTLs.

The listener subscribes to BEST (not finalized) heads on the directory's one connection: a
twin that publishes new relays or a new key is served the change one block (6 s) after it,
not one finalization (12-18 s) or one cache TTL later. For each new head it reads the block's
`System.Events` and, for every `TfgridModule.TwinStored` / `TwinUpdated`, overwrites the
cached twin with the one the event carries.

Rules (rmb-rs's, §4.4):
- no new head for `stall_timeout` (7 s) means the node is stuck: drop the connection (the
  client fails over to the next node) and resubscribe;
- after a reconnect, blocks missed since the last one seen are caught up (events of
  last+1 .. head-1, `CATCHUP_PARALLEL` fetched at a time), unless more than
  `catchup_threshold` (600) were missed: then the whole cache is cleared and the listener
  jumps to the head (reading 600+ blocks would take longer than the cache takes to refill);
- resubscribing waits 1 s, doubling to 6 s, between failed attempts;
- a head at or below the last one seen (a re-org on the best chain) is processed as well.

A block whose events cannot be read (every node failed) is not retried: that twin is stale at
most until its cache TTL, which is the bound without events anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rmb_relay.errors import ChainError, NodeError
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.chain import ChainDataError, TwinEvent
from rmb_relay.twins.substrate import SubstrateTwinDirectory, parse_hash

__all__ = [
    "CATCHUP_PARALLEL",
    "DEFAULT_CATCHUP_THRESHOLD",
    "DEFAULT_STALL_TIMEOUT",
    "TwinEventListener",
]

log = logging.getLogger("rmb_relay.twins.events")

#: seconds without a new best head before the node counts as stalled (rmb-rs: 7)
DEFAULT_STALL_TIMEOUT = 7.0
#: missed blocks above which the cache is flushed instead of caught up (rmb-rs: 600)
DEFAULT_CATCHUP_THRESHOLD = 600
#: blocks whose events are fetched at once while catching up (rmb-rs: 20)
CATCHUP_PARALLEL = 20
#: resubscribe backoff, seconds: first wait and cap (rmb-rs: 1 doubling to 6)
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 6.0


class TwinEventListener:
    """See the module docstring. `start()` runs it as a task; `close()` stops it.

    `blocks_seen` counts processed blocks and `events_applied` cache overwrites, for tests and
    metrics; `on_block` (if given) is awaited after each processed block with its number.
    """

    def __init__(
        self,
        directory: SubstrateTwinDirectory,
        cache: CachedTwinDirectory,
        *,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        catchup_threshold: int = DEFAULT_CATCHUP_THRESHOLD,
        on_block: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.directory = directory
        self.cache = cache
        self.stall_timeout = stall_timeout
        self.catchup_threshold = catchup_threshold
        self.on_block = on_block
        self.last: int | None = None
        self.blocks_seen = 0
        self.events_applied = 0
        self.flushes = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="twin-events")

    async def run(self) -> None:
        client = self.directory.client
        backoff = BACKOFF_FIRST
        while not self._stop.is_set():
            try:
                subscription = await client.subscribe(
                    "chain_subscribeNewHeads", [], "chain_unsubscribeNewHeads"
                )
            except (NodeError, ChainError) as err:
                log.warning("twin events: cannot subscribe to new heads: %s", err)
                await self._pause(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_FIRST
            try:
                while True:
                    try:
                        async with asyncio.timeout(self.stall_timeout):
                            header = await subscription.next()
                    except TimeoutError:
                        client.drop(
                            subscription.connection,
                            f"no new block for {self.stall_timeout:g} s (stalled)",
                        )
                        break
                    await self._on_header(header)
            except NodeError as err:
                log.warning("twin events: subscription ended: %s", err)
                client.drop(subscription.connection, str(err))
            await subscription.close(client.timeout)

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if the listener is being stopped."""
        try:
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        except TimeoutError:
            pass

    async def _on_header(self, header: object) -> None:
        number = _block_number(header)
        last = self.last
        if last is not None and number > last + 1:
            missed = number - last - 1
            if missed > self.catchup_threshold:
                log.warning(
                    "twin events: %d blocks missed (more than %d): clearing the twin cache",
                    missed,
                    self.catchup_threshold,
                )
                self.cache.clear()
                self.flushes += 1
            else:
                await self._catch_up(range(last + 1, number))
        await self._process(number)
        self.last = number
        if self.on_block is not None:
            await self.on_block(number)

    async def _catch_up(self, numbers: range) -> None:
        log.info("twin events: catching up blocks %d..%d", numbers.start, numbers.stop - 1)
        for start in range(numbers.start, numbers.stop, CATCHUP_PARALLEL):
            chunk = range(start, min(start + CATCHUP_PARALLEL, numbers.stop))
            found = await asyncio.gather(*(self._events(n) for n in chunk))
            for number, events in zip(chunk, found, strict=True):
                self._apply(number, events)

    async def _process(self, number: int) -> None:
        self._apply(number, await self._events(number))

    async def _events(self, number: int) -> list[TwinEvent]:
        try:
            block_hash = await self.directory.client.call(
                "chain_getBlockHash", [number], parse_hash
            )
            return await self.directory.block_events(block_hash)
        except ChainError as err:
            log.warning("twin events: block %d skipped: %s", number, err)
            return []

    def _apply(self, number: int, events: list[TwinEvent]) -> None:
        for event in events:
            log.debug("twin events: block %d: %s twin %d", number, event.name, event.twin.id)
            self.cache.put(event.twin)
            self.events_applied += 1
        self.blocks_seen += 1

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _block_number(header: object) -> int:
    if not isinstance(header, dict):
        raise ChainDataError(f"a new head must be a header object, got {type(header).__name__}")
    number = header.get("number")
    try:
        if isinstance(number, str):
            return int(number, 16)
        if isinstance(number, int) and not isinstance(number, bool):
            return number
    except ValueError:
        pass
    raise ChainDataError(f"a header's number must be hex text, got {number!r}")
