"""The shared listener: accepts TCP (optionally TLS), owns every connection, routes plain
HTTP to the router and websocket upgrades to the dialect with the most specific path pattern
(`dialects/paths.py`); two dialects claiming the same pattern are refused at startup.

Shutdown (SIGINT/SIGTERM or `shutdown()`): stop accepting, send every websocket a 1001 close,
wait (bounded) for the close handshakes, drop what is left, close the dialects.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from rmb_relay import log_budget
from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.config import ListenerConfig
from rmb_relay.contract import REPLY_PAUSES
from rmb_relay.dialects.base import CloseCode, HttpResponse
from rmb_relay.dialects.paths import PathTable
from rmb_relay.errors import ConfigError
from rmb_relay.server.acceptor import Acceptor, bind_sockets
from rmb_relay.server.connection_base import (
    ActivityClock,
    ConnectionBase,
    OutputBatcher,
    State,
)
from rmb_relay.server.http import Router
from rmb_relay.server.http_connection import HttpConnection
from rmb_relay.server.limits import Admission, ConnectionLimits, default_max_connections
from rmb_relay.server.traffic import Retired
from rmb_relay.server.ws_connection import WebSocketConnection
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.throttle import ip_key

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.base import (
        Dialect,
        HttpClient,
        HttpFastPath,
        RequestBody,
    )

log = logging.getLogger("rmb_relay.server")


#: the HTTP `method` label takes these (RFC 9110 and PATCH); any other method a client sends
#: is counted as `other`, so clients cannot create series
HTTP_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)


class ServerMetrics:
    """Listener-level metrics (dialects register their own in the same registry)."""

    def __init__(self, registry: Registry, server: RelayServer) -> None:
        self.connections = registry.gauge(
            "rmb_relay_connections",
            "Open connections by dialect (http = not upgraded)",
            ("dialect",),
            read=server.connection_counts,
        )
        self.http_requests = registry.counter(
            "rmb_relay_http_requests_total",
            "Plain HTTP requests served, by method (unknown ones as other) and status",
            ("method", "status"),
            allowed={"method": HTTP_METHODS},
        )
        self.http_errors = registry.counter(
            "rmb_relay_http_parse_errors_total",
            "HTTP requests refused as malformed",
            ("status",),
        )
        self.ws_violations = registry.counter(
            "rmb_relay_ws_protocol_violations_total",
            "WebSocket connections closed for protocol violations",
            ("dialect", "code"),
        )
        self.dropped = registry.counter(
            "rmb_relay_messages_dropped_total",
            "Messages dropped without delivery, by dialect and reason",
            ("dialect", "reason"),
        )
        registry.counter_of(
            "rmb_relay_connections_refused_total",
            "Connections refused at accept by the connection caps, by reason (limit, per-ip limit)",
            lambda: [((reason,), n) for reason, n in server.limits.refused.items()],
            ("reason",),
        )
        registry.counter_of(
            "rmb_relay_accept_pauses_total",
            "Times accepting new connections paused because the process neared its "
            "file-descriptor limit (clients wait in the listen backlog)",
            lambda: [((), sum(a.pauses for a in server.acceptors))],
        )
        registry.gauge(
            "rmb_relay_accept_paused",
            "1 while accepting is paused near the file-descriptor limit",
            (),
            lambda: [((), float(any(a.paused for a in server.acceptors)))],
        )
        self.backpressure_pauses = registry.counter(
            "rmb_relay_backpressure_pauses_total",
            "Times a sender was paused because a receiver was over its write high-water mark",
            ("dialect",),
        )
        registry.counter_of(
            "rmb_relay_log_lines_suppressed_total",
            "Log lines left out because the same message was logged more than --log-rate "
            "times a second (a flood of refusals is not a flood of lines)",
            lambda: [((), log_budget.suppressed())],
        )
        self.reply_pauses = registry.counter(*REPLY_PAUSES, ("dialect",))
        self.linger_aborts = registry.counter(
            "rmb_relay_close_linger_aborts_total",
            "Connections dropped because their peer had not read what was left to write "
            "within --close-linger of their close (a peer that stopped reading)",
            ("dialect",),
        )


#: adds routes to a server's router (`RelayServer(routes=...)`)
RouteSource = Callable[[Router, "RelayServer"], None]


class RelayServer:
    def __init__(
        self,
        config: ListenerConfig,
        dialects: Sequence[Dialect] = (),
        registry: Registry | None = None,
        *,
        clock: Clock = monotonic_clock,
        routes: Sequence[RouteSource] = (),
    ) -> None:
        """`routes`: operations routes the program adds beside /health and /metrics (served
        where they are: the operations listener with --metrics-listen), each given the router
        and this server (the monitoring views: monitoring/ sits above this layer)."""
        self.config = config
        #: connections' open and activity times (the monitor's age and idle)
        self.clock = clock
        self.activity = ActivityClock(clock)
        self.started_at = clock()
        self.dialects = list(dialects)
        self.registry = registry if registry is not None else Registry()
        self.limits = ConnectionLimits(
            config.max_connections or default_max_connections(), config.max_connections_per_ip
        )
        self.metrics = ServerMetrics(self.registry, self)
        self.batcher = OutputBatcher()
        #: serves whole client requests in the Rust core (the tunnel's hub), if any
        self.http_fast_path: HttpFastPath | None = next(
            (d.http_fast_path for d in self.dialects if d.http_fast_path is not None), None
        )
        #: every open connection by id: its HTTP life, then its websocket after an upgrade
        self.connections: dict[int, HttpConnection | WebSocketConnection] = {}
        #: the traffic of the connections that closed (the monitor's totals)
        self.retired = Retired()
        self.upgrades: PathTable[Dialect] = PathTable()
        for dialect in self.dialects:
            if not dialect.paths:
                raise ConfigError(f"dialect {dialect.name} declares no websocket path")
            for path in dialect.paths:
                self.upgrades.add(path, dialect, describe=f"by dialect {dialect.name}")
        self.router = Router()
        #: the operations routes: on their own listener with --metrics-listen (and then not
        #: on the public one), else on the public router
        self.ops_router = Router() if config.metrics_listen is not None else self.router
        self.ops_router.add("GET", "/health", self._health)
        self.ops_router.add("GET", "/metrics", self._metrics)
        for add in routes:
            add(self.ops_router, self)
        for dialect in self.dialects:
            dialect.add_routes(self.router)
        self.acceptors: list[Acceptor] = []
        self._stopping = False
        #: set when a shutdown starts (a signal, or a call), and when it is done
        self.stopping = asyncio.Event()
        self.stopped = asyncio.Event()
        self.addresses: list[tuple[str, int]] = []
        #: where the operations listener is bound (`--metrics-listen`), if it is
        self.ops_addresses: list[tuple[str, int]] = []

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> list[tuple[str, int]]:
        """Bind and start accepting; returns the bound (host, port) pairs (port 0 resolved)."""
        sockets = bind_sockets(
            self.config.host, self.config.port, reuse_port=self.config.reuse_port
        )
        acceptor = Acceptor(sockets, lambda: HttpConnection(self), ssl_context=self._ssl_context())
        acceptor.start()
        self.acceptors.append(acceptor)
        self.activity.start(asyncio.get_running_loop())
        self.addresses = [sock.getsockname()[:2] for sock in sockets]
        ops = self.config.metrics_listen
        if ops is not None:
            ops_sockets = bind_sockets(ops[0], ops[1], reuse_port=self.config.reuse_port)
            ops_acceptor = Acceptor(ops_sockets, lambda: HttpConnection(self, ops=True))
            ops_acceptor.start()
            self.acceptors.append(ops_acceptor)
            self.ops_addresses = [sock.getsockname()[:2] for sock in ops_sockets]
        line = self.open_surfaces_line()
        (log.warning if line.startswith("open to strangers (") else log.info)("%s", line)
        return self.addresses

    def open_surfaces_line(self) -> str:
        """One line naming what accepts strangers (each dialect's `open_surfaces`), so an
        operator sees at startup what the internet can reach without credentials."""
        surfaces = [f"{d.name}: {s}" for d in self.dialects for s in d.open_surfaces()]
        if self.config.metrics_listen is None:
            surfaces.append("/metrics, /health and /monitor/ on the public listener")
        if not surfaces:
            return "open to strangers: nothing beyond what each dialect authenticates"
        return "open to strangers (no credentials needed): " + "; ".join(surfaces)

    @property
    def url(self) -> str:
        """`ws://` (or `wss://`) URL of the first bound address."""
        host, port = self.addresses[0]
        if ":" in host:
            host = f"[{host}]"
        scheme = "wss" if self.config.tls_cert else "ws"
        return f"{scheme}://{host}:{port}"

    def banner(self) -> str:
        dialects = ", ".join(d.name for d in self.dialects) or "none"
        where = " ".join(f"{h}:{p}" for h, p in self.addresses)
        tls = " (TLS)" if self.config.tls_cert else ""
        ops = ""
        if self.ops_addresses:
            ops = "; operations on " + " ".join(f"{h}:{p}" for h, p in self.ops_addresses)
        return f"rmb-relay listening on {where}{tls}; dialects: {dialects}{ops}"

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.config.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return context

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("received %s: shutting down", sig.name)
        asyncio.get_running_loop().create_task(self.shutdown())

    async def shutdown(self) -> None:
        """Stop accepting, close websockets with 1001, wait for them (bounded), exit cleanly."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        self.stopping.set()
        self.activity.stop()
        for acceptor in self.acceptors:
            acceptor.close()
        conns = list(self.connections.values())
        for conn in conns:
            if isinstance(conn, WebSocketConnection) and conn.state is State.WEBSOCKET:
                conn.close(CloseCode.GOING_AWAY, "server shutting down")
            elif conn.transport is not None:
                conn.transport.close()
        waiting = [c.closed for c in conns if not c.closed.done()]
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=self.config.shutdown_timeout)
            if pending:
                log.warning("dropping %d connections that did not close in time", len(pending))
                for conn in conns:
                    if conn.transport is not None:
                        conn.transport.abort()
        for dialect in self.dialects:
            try:
                await dialect.close()
            except Exception:
                log.exception("dialect %s failed to close", dialect.name)
        self.stopped.set()

    # ---- connection bookkeeping ------------------------------------------------------------

    def connection_opened(self, conn: ConnectionBase) -> None:
        assert isinstance(conn, HttpConnection)
        self.connections[conn.conn_id] = conn
        if self._stopping and conn.transport is not None:
            conn.transport.close()
        if conn.ops_listener:
            return  # the operations listener's clients are the operator's: never capped
        admission = self.limits.admit(self.ip_key(conn.peer_host))
        if admission is Admission.OPS_ONLY:
            conn.ops_only = True
        elif admission is Admission.FULL:
            conn.refuse_at_once(503, "connection limit reached: try again later")
        elif admission is Admission.IP_FULL:
            conn.refuse_at_once(429, "too many connections from this address")

    def connection_closed(self, conn: ConnectionBase) -> None:
        if self.connections.pop(conn.conn_id, None) is not None and not conn.ops_listener:
            self.limits.release(self.ip_key(conn.peer_host))
            self.retired.add(conn)
            for acceptor in self.acceptors:
                acceptor.resume()

    def websocket_opened(self, conn: ConnectionBase) -> None:
        assert isinstance(conn, WebSocketConnection)
        self.connections[conn.conn_id] = conn
        if self._stopping:
            conn.close(CloseCode.GOING_AWAY, "server shutting down")

    def connection_counts(self) -> Iterable[tuple[tuple[str, ...], float]]:
        tally = Tally(c.dialect_name for c in self.connections.values())
        for dialect in self.dialects:
            tally.setdefault(dialect.name, 0)
        return [((name,), float(n)) for name, n in tally.items()]

    def dialect_for(self, path: str) -> Dialect | None:
        return self.upgrades.find(path)

    def ip_key(self, host: str) -> str:
        """What the per-IP caps count a client as (IPv6 by `--ipv6-prefix`)."""
        return ip_key(host, self.config.ipv6_prefix)

    async def dispatch(
        self, request: HttpRequest, body: RequestBody, client: HttpClient
    ) -> HttpResponse:
        ops = isinstance(client, HttpConnection) and client.ops_listener
        return await (self.ops_router if ops else self.router).dispatch(request, body, client)

    # ---- operations endpoints --------------------------------------------------------------

    async def _health(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return HttpResponse(200, b"ok\n")

    async def _metrics(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        """The exposition in the format the scraper's Accept header asks for (prometheus_client
        picks the encoder and its content type: OpenMetrics or the Prometheus text format)."""
        accept = request.header("accept")
        body, content_type = self.registry.exposition(
            accept.decode("latin-1") if accept is not None else None
        )
        return HttpResponse(200, body, content_type=content_type)
