"""Envelopes the relay could not hand on and could tell nobody about, tried again.

A request that cannot reach another instance (its Redis, or the shard holding the receiver's
stream or presence, does not answer) is refused: its sender gets the error envelope and may
try again. A response (or an error envelope) has nobody to be refused to: dropped, its
requester would never hear, which is how a Redis Cluster failover lost answers (docs/faults.md,
scenario d). Those are kept here instead and routed again, as the slow path routes any
envelope, after a pause that grows (`FIRST_DELAY` doubling to `MAX_DELAY`), until they get
through or their deadline (timestamp + expiration) passes. Bounded, because a stranger's
answers can fill it during an outage: at most `limit` bytes held (`--retry-hold-bytes`,
default `LATER_BYTES`; `rmb_relay_retry_held_bytes`); past it an envelope is refused
(`rmb_relay_retry_refused_total`), and like one past its deadline dropped and counted
(`rmb_relay_messages_dropped_total{reason="redis down"}`), as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from rmb_relay._core import MSG_REQUEST, EnvelopeRouting
from rmb_relay.clock import Clock, seconds

log = logging.getLogger("rmb_relay.rmb")

#: default bytes of envelopes held for another try (what one relay keeps through a Redis
#: outage: ~13,000 answers of 300 bytes, a minute of 200 answers/s)
LATER_BYTES = 4 << 20
#: the first pause before a try, and the longest
FIRST_DELAY = 0.25
MAX_DELAY = 2.0

S = TypeVar("S")
#: route an envelope again (`RmbDialect.route_slow`)
Route = Callable[[S, EnvelopeRouting, bytes], Awaitable[None]]


class Later(Generic[S]):
    """See the module docstring. `hold` returns False for what it does not keep (a request:
    its sender is told instead; over the budget; past its deadline)."""

    def __init__(
        self,
        route: Route[S],
        clock: Clock,
        dropped: Callable[[], None],
        limit: int = LATER_BYTES,
    ) -> None:
        self.route = route
        self.clock = clock
        self.dropped = dropped
        self.limit = limit
        #: envelopes refused because `limit` bytes were held
        self.refused = 0
        self._held: list[tuple[S, EnvelopeRouting, bytes]] = []
        self.held_bytes = 0
        self._task: asyncio.Task[None] | None = None

    def hold(self, sender: S, env: EnvelopeRouting, data: bytes) -> bool:
        if env.kind == MSG_REQUEST:
            return False
        if seconds(self.clock()) >= env.timestamp + env.expiration:
            return False
        if self.held_bytes + len(data) > self.limit:
            self.refused += 1
            self.dropped()
            return True  # counted here; not the caller's to count again
        self._held.append((sender, env, data))
        self.held_bytes += len(data)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _run(self) -> None:
        delay = FIRST_DELAY
        try:
            while self._held:
                await asyncio.sleep(delay)  # a back-off, not a synchronisation
                batch, self._held = self._held, []
                self.held_bytes -= sum(len(data) for _, _, data in batch)
                for sender, env, data in batch:
                    try:  # what fails again comes back through `hold`
                        await self.route(sender, env, data)
                    except Exception:
                        log.exception("rmb: routing an envelope again failed")
                delay = min(delay * 2, MAX_DELAY)
        finally:
            self._task = None

    async def close(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._held.clear()
        self.held_bytes = 0
