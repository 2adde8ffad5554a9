"""A userspace TCP fault proxy on one link (asyncio, in the test process).

A process that should reach a service through a faulty link is given the proxy's address
instead of the service's. The proxy's behaviour is switched while traffic runs:

- `heal()`: bytes pass as they come;
- `black_hole()`: a cut link between hosts: connections stay open, bytes are *held* (not read
  on, not forwarded, nothing reset) in both directions; `heal()` releases what was held, in
  order (as TCP's retransmissions do once a cut link is repaired: commands a client sent
  during the cut reach the server late). A connection opened during the cut is accepted (the
  kernel answers the handshake; a userspace proxy cannot hold a SYN) but never reaches the
  far side, whose SYN a cut link would have lost: nothing it sent is forwarded, and the heal
  resets it;
- `latency(mean, jitter)`: every chunk is held `mean ± jitter` seconds (order kept);
- `bandwidth(bytes_per_s)`: each direction of the link carries that many bytes a second, shared
  by every connection on it (a chunk waits until the link has sent what came before it, as a
  slow link's queue does; `Wire`);
- `resets(p)`: each chunk forwarded resets its connection (RST both ways) with probability p;
- `reset_all()`: RST every open connection now;
- `refuse()`: a server that is gone (its host up, nothing listening): every connection reset,
  new ones reset at once, until `heal()`.

Why a proxy: the kernel has no netem (see netns.py); a proxy also lets a scenario cut one link
of a host (to Redis) while its other links (to its clients) stay up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from dataclasses import dataclass, field


class Wire:
    """One direction of a link with a bandwidth cap: when each chunk has crossed it. Chunks of
    every connection take turns on it in the order they are ready (a serialising queue, no
    drops), so `rate` bytes a second cross it in all; `rate` 0 is no cap. The clock is the
    caller's (`at` values), so the schedule is checked without waiting on it."""

    __slots__ = ("free_at", "rate")

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = rate
        #: when the link has sent everything scheduled on it so far
        self.free_at = 0.0

    def crossed(self, size: int, at: float) -> float:
        """When a chunk of `size` bytes ready at `at` has crossed the link."""
        if not self.rate:
            return at
        self.free_at = max(self.free_at, at) + size / self.rate
        return self.free_at


@dataclass(eq=False)
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close `writer`'s connection with a TCP reset (SO_LINGER 0), as a reset link does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """`await FaultProxy.start(listen_host, target_host, target_port)`; see the module
    docstring. `address` is what to give the client side."""

    def __init__(self, target: tuple[str, int], *, seed: int = 0) -> None:
        self.target = target
        self._open = asyncio.Event()
        self._open.set()
        self.mean = 0.0
        self.jitter = 0.0
        self.reset_probability = 0.0
        self.refusing = False
        #: the bandwidth cap of each direction (towards the target, towards the client)
        self._wires = {True: Wire(), False: Wire()}
        self._random = random.Random(seed)
        self._pairs: set[_Pair] = set()
        self._server: asyncio.Server | None = None
        self.address: tuple[str, int] = ("", 0)
        self.connections = 0
        self.resets_done = 0

    @classmethod
    async def start(
        cls, listen: str, target: tuple[str, int], *, seed: int = 0, port: int = 0
    ) -> FaultProxy:
        proxy = cls(target, seed=seed)
        proxy._server = await asyncio.start_server(proxy._accept, listen, port)
        host, port = proxy._server.sockets[0].getsockname()[:2]
        proxy.address = (host, port)
        return proxy

    # ---- switches --------------------------------------------------------------------------

    def heal(self) -> None:
        self.refusing = False
        self.mean = self.jitter = self.reset_probability = 0.0
        for wire in self._wires.values():
            wire.rate = 0.0
        self._open.set()

    def black_hole(self) -> None:
        self._open.clear()

    def refuse(self) -> None:
        self.refusing = True
        self.reset_all()

    @property
    def cut(self) -> bool:
        return not self._open.is_set()

    def latency(self, mean: float, jitter: float = 0.0) -> None:
        self.mean, self.jitter = mean, jitter

    def bandwidth(self, bytes_per_s: float) -> None:
        """Each direction carries `bytes_per_s` at most from now on (0: no cap)."""
        for wire in self._wires.values():
            wire.rate = bytes_per_s

    def resets(self, probability: float) -> None:
        self.reset_probability = probability

    def reset_all(self) -> None:
        for pair in list(self._pairs):
            self._reset(pair)

    # ---- the pumps -------------------------------------------------------------------------

    def _reset(self, pair: _Pair) -> None:
        self.resets_done += 1
        reset(pair.client)
        if pair.upstream is not None:
            reset(pair.upstream)
        self._pairs.discard(pair)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pair = _Pair(writer)
        self._pairs.add(pair)
        self.connections += 1
        try:
            if self.refusing:
                reset(writer)
                return
            if self.cut:  # its SYN would have been lost: it never gets through (docstring)
                await self._open.wait()
                reset(writer)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                reset(writer)
                return
            pair.upstream = up_writer
            loop = asyncio.get_running_loop()
            pair.tasks = [
                loop.create_task(self._pump(pair, reader, up_writer)),
                loop.create_task(self._pump(pair, up_reader, writer)),
            ]
            await asyncio.gather(*pair.tasks, return_exceptions=True)
        finally:
            self._pairs.discard(pair)
            for end in (writer, pair.upstream):
                if end is not None:
                    end.close()

    async def _pump(
        self, pair: _Pair, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # chunks wait in `held` for their release time (latency), in order
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writing = asyncio.get_running_loop().create_task(self._release(pair, held, writer))
        try:
            last = 0.0
            while True:
                await self._open.wait()  # a black hole holds what is not read yet
                data = await reader.read(65536)
                if not data:
                    break
                delay = self.mean + (self._random.uniform(-1, 1) * self.jitter)
                last = max(last, time.monotonic() + max(0.0, delay))
                held.put_nowait((last, data))
            held.put_nowait((last, b""))
            await writing
        except (OSError, asyncio.IncompleteReadError):
            # one end failed: the other is reset too, as a broken path would
            for end in (pair.client, pair.upstream):
                if end is not None:
                    end.transport.abort()
        finally:
            writing.cancel()

    async def _release(
        self, pair: _Pair, held: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        while True:
            at, data = await held.get()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the link's latency, not a synchronisation
            await self._open.wait()
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            wire = self._wires[writer is not pair.client]
            crossed = wire.crossed(len(data), time.monotonic())
            if crossed > time.monotonic():
                await asyncio.sleep(crossed - time.monotonic())  # the link's rate, as latency
            if self.reset_probability and self._random.random() < self.reset_probability:
                self._reset(pair)
                return
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                self._reset(pair)
                return

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pair in list(self._pairs):
            for end in (pair.client, pair.upstream):
                if end is not None:
                    end.transport.abort()
            for task in pair.tasks:
                task.cancel()
        self._pairs.clear()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
