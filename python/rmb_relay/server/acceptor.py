"""Accepting connections in the relay's own loop callback, so accepting can pause near the
file-descriptor limit instead of resetting clients.

Why not `loop.create_server`: uvloop accepts inside libuv, and when the process is out of file
descriptors libuv's "EMFILE trick" accepts and at once closes every waiting connection, silently
(no log line, no count): a client arriving a moment before a descriptor frees up gets a reset,
and an operator sees nothing. Here the listening sockets' readiness callback accepts (one
`accept` per new connection: microseconds, nothing per message), hands each socket to the loop
as a transport, and stops reading the listening sockets when the process is near its limit:
clients wait in the kernel's listen backlog instead of being reset, one log line says so,
`rmb_relay_accept_pauses_total` counts it, and accepting resumes as soon as a connection closes
(or after `retry_delay`, for descriptors freed by something else).

"Near the limit" costs nothing to measure: Linux gives every new descriptor the lowest free
number, so an accepted socket numbered N proves at least N descriptors are open. Once that comes
within `headroom` of the soft RLIMIT_NOFILE, accepting pauses (the socket just accepted is still
served); `EMFILE`/`ENFILE` from `accept` itself pauses too. The headroom is what Redis
reconnects, the twin directory, body files and outbound HTTP keep for themselves.

The connection caps of `limits.py` normally refuse long before this (the default cap leaves
`FD_RESERVE` descriptors free); pausing is the backstop for a cap set above the process limit
or descriptors held by something else.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import ssl
from collections.abc import Callable, Sequence

__all__ = ["ACCEPT_RETRY_DELAY", "FD_HEADROOM", "Acceptor", "bind_sockets", "fd_limit"]

log = logging.getLogger("rmb_relay.server")

#: descriptors kept free below the soft limit: accepting pauses when a new socket's number
#: reaches the limit minus this
FD_HEADROOM = 32
#: how long accepting stays paused when no connection of ours closes meanwhile (seconds)
ACCEPT_RETRY_DELAY = 0.5
#: new connections accepted per readiness callback before yielding to the loop, so a connect
#: flood cannot starve reads and writes of established connections
ACCEPT_BATCH = 64
BACKLOG = 4096

_OUT_OF_DESCRIPTORS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


def fd_limit() -> int:
    """The process's soft file-descriptor limit (a large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def open_descriptors() -> int | None:
    """How many descriptors the process has open (Linux's /proc; None elsewhere). O(open
    descriptors): called only when a pause ends, never per connection."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError:
        return None


def bind_sockets(host: str, port: int, *, reuse_port: bool) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to, non-blocking, SO_REUSEADDR;
    raises OSError naming the address when one cannot bind.

    IPv6 sockets are IPv6-only (as `loop.create_server` makes them) except the one case where
    the operator asked for `[::]` alone: that socket is dual-stack, so the default `[::]:8080`
    serves IPv4 clients too, as rmb-rs's does (they appear as `::ffff:a.b.c.d`)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    dual_stack = host == "::" and all(info[0] == socket.AF_INET6 for info in infos)
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
            try:
                sock.bind(address)
            except OSError as err:
                where = f"{address[0]!s}:{address[1]!s}"
                raise OSError(err.errno, f"cannot listen on {where}: {err.strerror}") from None
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Acceptor:
    """Accepts from `sockets` and makes each new connection a transport with `protocol_factory`'s
    protocol; pauses near the file-descriptor limit (module docstring)."""

    def __init__(
        self,
        sockets: Sequence[socket.socket],
        protocol_factory: Callable[[], asyncio.Protocol],
        *,
        ssl_context: ssl.SSLContext | None = None,
        limit: int | None = None,
        headroom: int = FD_HEADROOM,
        retry_delay: float = ACCEPT_RETRY_DELAY,
    ) -> None:
        self.sockets = list(sockets)
        self.protocol_factory = protocol_factory
        self.ssl_context = ssl_context
        self.limit = fd_limit() if limit is None else limit
        self.headroom = headroom
        self.retry_delay = retry_delay
        self.paused = False
        #: times accepting paused (a metric)
        self.pauses = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._handshakes: set[asyncio.Task[object]] = set()
        # log the first pause of an episode and its end, not every pause inside one
        self._in_episode = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch()

    def close(self) -> None:
        """Stop accepting and close the listening sockets (established connections stay)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._loop is not None and not self.paused:
            for sock in self.sockets:
                self._loop.remove_reader(sock.fileno())
        self.paused = True
        for sock in self.sockets:
            sock.close()
        for task in list(self._handshakes):
            task.cancel()

    def resume(self) -> None:
        """Accept again if paused (called whenever one of our connections closes: cheap)."""
        if not self.paused or self._loop is None or self.sockets[0].fileno() < 0:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self.paused = False
        self._watch()
        self._end_episode()

    def _end_episode(self) -> None:
        """Log the end of a pause episode once descriptors are well clear of the limit; until
        then look again every `retry_delay` (a pause in between keeps the episode going)."""
        if not self._in_episode or self.paused or self._loop is None:
            return
        open_now = open_descriptors()
        if open_now is None or open_now < self.limit - 2 * self.headroom:
            self._in_episode = False
            log.warning("accepting normally again (%s descriptors open)", open_now or "few")
        else:
            self._loop.call_later(self.retry_delay, self._end_episode)

    # ---- internals ---------------------------------------------------------------------------

    def _watch(self) -> None:
        assert self._loop is not None
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept_ready, sock)

    def _pause(self, why: str) -> None:
        assert self._loop is not None
        self.paused = True
        self.pauses += 1
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
        if not self._in_episode:
            self._in_episode = True
            log.warning(
                "accepting paused: %s (file-descriptor limit %d); new connections wait in the "
                "listen backlog until descriptors free up; raise `ulimit -n` or lower "
                "--max-connections",
                why,
                self.limit,
            )
        self._retry = self._loop.call_later(self.retry_delay, self.resume)

    def _accept_ready(self, listening: socket.socket) -> None:
        threshold = self.limit - self.headroom
        accepted: list[socket.socket] = []
        try:
            for _ in range(ACCEPT_BATCH):
                try:
                    sock, _ = listening.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as err:
                    if err.errno in _OUT_OF_DESCRIPTORS:
                        self._pause(f"accept failed: {err.strerror}")
                        return
                    log.warning("accept failed: %s", err)
                    return
                accepted.append(sock)
                if sock.fileno() >= threshold:
                    self._pause(f"{sock.fileno() + 1} descriptors open")
                    return
        finally:
            if accepted:
                self._serve(accepted)

    def _serve(self, accepted: list[socket.socket]) -> None:
        """Make transports of the sockets one `accept_ready` took: one task for all of a plain
        batch (each becomes a transport within a loop turn), one per socket with TLS, whose
        handshakes must not wait for each other."""
        assert self._loop is not None
        if self.ssl_context is None:
            coroutines = [self._plain(accepted)]
        else:
            coroutines = [self._tls(sock) for sock in accepted]
        for coroutine in coroutines:
            task: asyncio.Task[object] = self._loop.create_task(coroutine)
            self._handshakes.add(task)
            task.add_done_callback(self._handshake_done)

    async def _plain(self, accepted: list[socket.socket]) -> None:
        assert self._loop is not None
        for sock in accepted:
            try:
                await self._loop.connect_accepted_socket(self.protocol_factory, sock)
            except OSError as err:
                # the client reset before its transport existed; the transport closed the socket
                log.debug("connection not established: %s", err)

    async def _tls(self, sock: socket.socket) -> None:
        assert self._loop is not None
        await self._loop.connect_accepted_socket(self.protocol_factory, sock, ssl=self.ssl_context)

    def _handshake_done(self, task: asyncio.Task[object]) -> None:
        self._handshakes.discard(task)
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            # a TLS handshake that failed or a client gone before the transport existed: the
            # transport closed the socket; nothing for an operator to act on
            log.debug("connection not established: %s", err)
