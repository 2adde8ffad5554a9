"""`RelayLink`: one relay connection logged in as a twin.

Login with a fresh JWT (spec/rmb.md §1.2) on every (re)connect, a websocket ping once nothing
has been written for 20 s, a new connection once nothing has arrived for 40 s, a reconnect
2 s after any loss (§5.3), and outgoing envelopes batched into one write per event-loop turn.

A connection given up for silence is *retired*, not closed: the link opens a new one and goes
on reading the old one until the relay closes it (it does once the new one logs in, after
everything it wrote before) or `keep_reading` passes. A silent connection is often a cut
path, not a dead relay: what the relay wrote into it meanwhile arrives when the path is
repaired, and RMB has no acknowledgement that would let the relay write it again, so closing
it would lose those envelopes (docs/faults.md, scenario b).
`RmbClient` (client.py) puts a twin on one or more of these; the load harness drives them
directly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from rmb_relay._core import WsMessage
from rmb_relay.clock import NS, Clock, monotonic_clock, nanos
from rmb_relay.errors import (
    ClientError,
)
from rmb_relay.sdk.websocket import DEFAULT_CONNECT_TIMEOUT, WebSocketClient

log = logging.getLogger("rmb_relay.sdk")

#: ping a relay we have written nothing to for this long; give up on one silent this long (§5.3)
PING_AFTER = 20.0
DEAD_AFTER = 40.0
#: how long a connection given up for silence is still read (rmb-peer's default request TTL,
#: spec/rmb.md §5.6: what arrives later than that has expired anyway)
KEEP_READING = 300.0
#: wait this long after a lost or failed connection before the next attempt (§5.3)
RETRY_DELAY = 2.0
#: envelopes queued on a link in one loop turn that are written without waiting for its end
FLUSH_AT = 16
#: how often the keepalive runs (and, in RmbClient, expired envelopes and waiters are swept)
TICK = 1.0

MessageCallback = Callable[[WsMessage], None]
LinkCallback = Callable[["RelayLink"], None]


class RelayLink:
    """One relay connection logged in as a twin; see the module docstring.

    `connect()` makes one attempt and raises; `start()` keeps the link up in a task until
    `close()`. `send` returns False while the link is down instead of raising, so the owner can
    try another link. Time for the keepalive comes from `clock` (monotonic nanoseconds); tests
    move a fake clock and call `keepalive()`.
    """

    def __init__(
        self,
        url: str,
        token: Callable[[], str],
        on_message: MessageCallback,
        *,
        on_up: LinkCallback | None = None,
        on_down: LinkCallback | None = None,
        clock: Clock = monotonic_clock,
        ping_after: float = PING_AFTER,
        dead_after: float = DEAD_AFTER,
        keep_reading: float = KEEP_READING,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        self.url = url.split("?", 1)[0]
        self.domain = urlsplit(self.url).hostname or ""
        self.token = token
        self.on_message = on_message
        self.on_up = on_up
        self.on_down = on_down
        self.clock = clock
        self.ping_after = nanos(ping_after)
        self.dead_after = nanos(dead_after)
        self.keep_reading = keep_reading
        self.connect_timeout = connect_timeout
        self.ws: WebSocketClient | None = None
        #: connections given up for silence and still read (module docstring)
        self.retired: set[WebSocketClient] = set()
        #: resolved when the current connection is lost or retired (the run loop waits on it)
        self._gone: asyncio.Future[None] | None = None
        self.closing = False
        self._out: list[bytes] = []
        self._runner: asyncio.Task[None] | None = None
        self._ticker: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<RelayLink {self.url} {'up' if self.connected else 'down'}>"

    @property
    def connected(self) -> bool:
        return self.ws is not None and self.ws.is_open

    async def connect(self) -> None:
        """One login attempt. Raises OSError, TimeoutError or ClientError (HandshakeError)."""
        # what arrives with the upgrade (a mailbox drained at login) waits until the link is
        # up, so that answers to it can be sent through this link
        early: list[WsMessage] = []
        ws = await WebSocketClient.connect(
            f"{self.url}?{self.token()}",
            on_message=early.append,
            timeout=self.connect_timeout,
            clock=self.clock,
        )
        ws.on_message = self.on_message
        self.ws = ws
        self._gone = asyncio.get_running_loop().create_future()
        ws.closed.add_done_callback(lambda _: self._lost(ws))
        # the line operators and launch scripts wait for, exactly as rmb-peer prints it
        log.info('now connected to relay Some("%s")', self.domain)
        self._ticker = asyncio.get_running_loop().call_later(TICK, self._tick)
        if self.on_up is not None:
            self.on_up(self)
        for message in early:
            self.on_message(message)

    def _lost(self, ws: WebSocketClient) -> None:
        if ws is not self.ws:
            return
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        # frames not yet written die with the connection; the owner re-sends what matters
        self._out.clear()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if not self.closing:
            log.warning(
                "lost relay %s (%s %s)", self.url, ws.close_code or "-", ws.close_reason or ""
            )
        if self.on_down is not None:
            self.on_down(self)

    def start(self, retry_delay: float = RETRY_DELAY) -> None:
        """Keep the link up until `close()`: connect, and after any failure or loss wait
        `retry_delay` and connect again with a new token."""
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run(retry_delay))

    async def _run(self, retry_delay: float) -> None:
        while not self.closing:
            try:
                await self.connect()
            except (OSError, TimeoutError, ClientError) as err:
                log.warning("cannot connect to relay %s: %s", self.url, err or type(err).__name__)
            else:
                assert self._gone is not None
                await asyncio.shield(self._gone)
            if not self.closing:
                await asyncio.sleep(retry_delay)

    # ---- sending ---------------------------------------------------------------------------

    def send(self, wire: bytes) -> bool:
        """Queue one envelope for this turn's write; False (nothing queued) if the link is down.
        Every FLUSH_AT envelopes leave at once, so a long batch does not hold the first ones
        back until its end (the relay and the other side start on them meanwhile)."""
        if not self.connected:
            return False
        out = self._out
        if not out:
            asyncio.get_running_loop().call_soon(self._flush)
        out.append(wire)
        if len(out) >= FLUSH_AT:
            self._flush()
        return True

    def _flush(self) -> None:
        out, self._out = self._out, []
        ws = self.ws
        if out and ws is not None and ws.is_open:
            if len(out) == 1:
                ws.send_binary(out[0])
            else:
                ws.send_binaries(out)

    @property
    def congested(self) -> bool:
        return self.ws is not None and self.ws.congested

    async def drain(self) -> None:
        if self.ws is not None:
            await self.ws.drain()

    # ---- keepalive -------------------------------------------------------------------------

    def _tick(self) -> None:
        self._ticker = None
        if not self.connected:
            return
        self.keepalive()
        if self.connected:
            self._ticker = asyncio.get_running_loop().call_later(TICK, self._tick)

    def keepalive(self) -> None:
        """Retire a connection nothing has arrived on for `dead_after` (a new one follows);
        ping one nothing has been written to or received on for `ping_after`, so the relay and
        any proxy between see traffic and the pong proves the relay alive."""
        ws = self.ws
        if ws is None or not ws.is_open:
            return
        silent = self.clock() - ws.last_received
        if silent > self.dead_after:
            log.warning(
                "relay %s silent for %ds: reconnecting (still reading the old connection)",
                self.url,
                silent // NS,
            )
            self.retire(ws)
            return
        ws.keepalive(self.ping_after, self.dead_after)

    def retire(self, ws: WebSocketClient) -> None:
        """Stop using `ws` (the link is down, the run loop connects anew) but keep reading it
        until the relay closes it or `keep_reading` passes (module docstring)."""
        self._flush()  # what this turn queued goes into it too, and reaches the relay if it can
        self.retired.add(ws)
        timer = asyncio.get_running_loop().call_later(self.keep_reading, ws.abort)

        def gone(_: object) -> None:
            timer.cancel()
            self.retired.discard(ws)

        ws.closed.add_done_callback(gone)
        self._lost(ws)
        self.ws = None  # still open, but no longer this link's: sends wait for the next one

    async def close(self) -> None:
        self.closing = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        connections = [*self.retired, *([self.ws] if self.ws is not None else [])]
        await asyncio.gather(*(ws.close() for ws in connections))


# ---- what a client hands back ----------------------------------------------------------------
