"""`rmb-relay serve` (also plain `rmb-relay [flags]`): the relay, every registered dialect on
one listener.

The parser is assembled from parts: the listener's flags (here), the shared services' flags
(`services.py`) and each registered dialect's (`dialects/registry.py`), so a new dialect
brings its flags without editing this file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence

from rmb_relay import __version__, gc_tuning, malloc_tuning
from rmb_relay.cli_support import HelpFormatter, run, setup_logging
from rmb_relay.cluster import workers
from rmb_relay.config import (
    DEFAULT_CLOSE_LINGER,
    DEFAULT_HTTP_IDLE_TIMEOUT,
    DEFAULT_HTTP_REQUEST_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS_PER_IP,
    DEFAULT_MAX_MESSAGE,
    ListenerConfig,
    parse_listen,
)
from rmb_relay.dialects import registry
from rmb_relay.dialects.base import Dialect
from rmb_relay.errors import ConfigError
from rmb_relay.log_budget import DEFAULT_LOG_RATE
from rmb_relay.monitoring import add_monitor_routes
from rmb_relay.server.limits import default_max_connections
from rmb_relay.server.listener import RelayServer
from rmb_relay.services import Services
from rmb_relay.services import add_arguments as add_service_arguments
from rmb_relay.telemetry import upstream_names

NAME = "serve"
HELP = "run the relay (the default command: `rmb-relay [flags]` serves too)"

log = logging.getLogger("rmb_relay")


def parser(prog: str = "rmb-relay serve", epilog: str | None = None) -> argparse.ArgumentParser:
    entries = registry.entries()
    served = "\n".join(f"  {entry.name:<8} {entry.summary}" for entry in entries)
    intro = textwrap.fill(
        "High-performance message relay. Serves every dialect below on one listener, plus "
        "GET /health and GET /metrics. Runs with no Redis and no chain.",
        width=88,
    )
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{intro}\n\ndialects:\n{served}",
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rmb-relay {__version__}")
    parser.add_argument(
        "-l",
        "--listen",
        default="[::]:8080",
        help="address to listen on, HOST:PORT or [V6]:PORT",
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain; serves wss:// with --tls-key")
    parser.add_argument("--tls-key", help="PEM private key for --tls-cert")
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="set SO_REUSEPORT so several relay processes can share the port",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="run N relay processes sharing the port (SO_REUSEPORT) and, through --redis, "
        "each other's sessions (docs/cluster.md)",
    )
    # rmb-rs's pool sizing, with its meaning: their product is how many connections are
    # served. Never a process count (`--processes` is): a unit file carried over with
    # rmb-rs's `-w 500` must not fork 500 relays.
    parser.add_argument(
        "-w",
        "--workers",
        type=int,
        default=DEFAULT_RMB_WORKERS,
        metavar="N",
        help="rmb-rs's switch workers: with --user-per-worker, at most WORKERS x "
        "USER_PER_WORKER connections are served (the smaller of that and --max-connections); "
        "relay processes are --processes",
    )
    parser.add_argument(
        "-u",
        "--user-per-worker",
        type=int,
        default=DEFAULT_USER_PER_WORKER,
        metavar="N",
        help="rmb-rs's users per switch worker (see --workers)",
    )
    parser.add_argument(
        "--max-message",
        type=int,
        default=DEFAULT_MAX_MESSAGE,
        metavar="BYTES",
        help="largest websocket message or HTTP body accepted",
    )
    parser.add_argument(
        "--http-idle-timeout",
        type=float,
        default=DEFAULT_HTTP_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that has not sent the next request head (or body bytes) for "
        "this long; restarts with every request",
    )
    parser.add_argument(
        "--http-request-timeout",
        type=float,
        default=DEFAULT_HTTP_REQUEST_TIMEOUT,
        metavar="SECONDS",
        help="a request not answered within this long gets 503 (time spent waiting for the "
        "client's body does not count)",
    )
    parser.add_argument(
        "--close-linger",
        type=float,
        default=DEFAULT_CLOSE_LINGER,
        metavar="SECONDS",
        help="a connection closed with output its peer has not read is dropped this long after "
        "the close (a peer that stops reading would hold it for ever; metric "
        "rmb_relay_close_linger_aborts_total)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections served normally; 32 more get /health and /metrics only, the "
        "rest 503 (default: the file-descriptor limit minus 288)",
    )
    parser.add_argument(
        "--max-connections-per-ip",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_IP,
        metavar="N",
        help="open connections of one client IP; more are answered 429 and closed",
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve /health, /metrics and /monitor/ on this address only (a private network), "
        "not on --listen (default: on --listen)",
    )
    parser.add_argument(
        "--log-rate",
        type=float,
        default=DEFAULT_LOG_RATE,
        metavar="LINES",
        help="the same log message at most this many times a second (bursts of ten seconds' "
        "worth); errors always pass, the rest is counted and summarized",
    )
    parser.add_argument(
        "-d",
        "--debug",
        action="count",
        default=0,
        help="more logging: -d debug for rmb_relay, -dd debug for everything",
    )
    add_service_arguments(parser)
    for entry in entries:
        entry.add_arguments(parser)
    return parser


#: rmb-rs's `-w/--workers` and `-u/--user-per-worker` defaults (500 x 1000 users)
DEFAULT_RMB_WORKERS = 500
DEFAULT_USER_PER_WORKER = 1000


def connection_limit(args: argparse.Namespace) -> int | None:
    """`--max-connections` bounded by rmb-rs's `workers x user_per_worker` (None: the
    listener's default, the file-descriptor limit minus its reserve, when that is smaller).
    One limit, the listener's: rmb-rs refuses users beyond the product, so do we."""
    if args.workers <= 0:
        raise ConfigError("-w/--workers cannot be zero (rmb-rs's meaning: switch workers)")
    if args.user_per_worker <= 0:
        raise ConfigError("-u/--user-per-worker cannot be zero")
    product = args.workers * args.user_per_worker
    limit = args.max_connections if args.max_connections is not None else default_max_connections()
    return None if args.max_connections is None and product >= limit else min(product, limit)


def listener_config(args: argparse.Namespace) -> ListenerConfig:
    host, port = parse_listen(args.listen)
    return ListenerConfig(
        host=host,
        port=port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        reuse_port=args.reuse_port,
        max_message=args.max_message,
        http_idle_timeout=args.http_idle_timeout,
        http_request_timeout=args.http_request_timeout,
        close_linger=args.close_linger,
        max_connections=connection_limit(args),
        max_connections_per_ip=args.max_connections_per_ip,
        ipv6_prefix=args.ipv6_prefix,
        metrics_listen=parse_listen(args.metrics_listen) if args.metrics_listen else None,
    )


async def build_dialects(args: argparse.Namespace, services: Services) -> list[Dialect]:
    """Every registered dialect the flags leave on, in registration order."""
    dialects = []
    for entry in registry.entries():
        dialect = await entry.build(args, services)
        if dialect is not None:
            dialects.append(dialect)
    return dialects


async def build_server(args: argparse.Namespace) -> tuple[RelayServer, Services]:
    """The relay the flags describe, not yet listening. Raises ConfigError."""
    config = listener_config(args)
    services = await Services.from_args(args)
    try:
        dialects = await build_dialects(args, services)
        server = RelayServer(config, dialects, services.metrics, routes=(add_monitor_routes,))
        upstream_names.register(services.metrics)
    except BaseException:
        await services.close()
        raise
    return server, services


class ShutdownDeadline:
    """A relay exits within `limit` seconds of being told to stop, whatever is stuck.

    Every step of a shutdown has a bound of its own (the listener's `shutdown_timeout`, each
    service's), but a step that waits on a task which lost its cancellation (`tasks.py`), or a
    loop blocked in a call, would still hold the process forever, and a supervisor's SIGKILL
    comes without a word. So a thread, independent of the event loop, logs what is still
    running once `limit` has passed and ends the process with status 1."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._timer: threading.Timer | None = None

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.limit, self._overdue, (loop,))
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _overdue(self, loop: asyncio.AbstractEventLoop) -> None:
        try:  # best effort from another thread: the loop is stuck or busy
            running = sorted(repr(task) for task in asyncio.all_tasks(loop))
        except RuntimeError:
            running = ["(could not list the tasks)"]
        log.error(
            "shutdown did not finish within %.0f s; exiting with %d task(s) still running:\n%s",
            self.limit,
            len(running),
            "\n".join(running),
        )
        logging.shutdown()
        os._exit(1)


#: what the services (cluster, mailbox, federation, ...) get to close after the listener's
#: `shutdown_timeout`, before `ShutdownDeadline` ends the process
SERVICES_CLOSE_TIME = 3.0


def print_banner(server: RelayServer) -> None:
    # one write for the whole line: `--processes` children share the parent's stdout, and
    # print() writes the text and its newline separately when stdout is unbuffered
    # (PYTHONUNBUFFERED), so two banners could interleave ("...A...B\n\n")
    sys.stdout.write(server.banner() + "\n")
    sys.stdout.flush()


async def serve(
    args: argparse.Namespace,
    deadline: ShutdownDeadline | None = None,
    announce: Callable[[RelayServer], None] = print_banner,
) -> None:
    """Serve until a signal (or a call) stops the listener, then close everything. With
    `deadline`, armed when stopping starts, the process exits within its limit. `announce`
    tells the world the relay serves (the banner; `sbd-serverd` prints sbd-server's lines)."""
    try:
        server, services = await build_server(args)
    except ConfigError as err:
        raise SystemExit(f"rmb-relay: {err}") from None
    try:
        await server.start()
        server.install_signal_handlers()
        gc_tuning.tune_for_serving()
        malloc_tuning.tune_for_serving()
        announce(server)
        await server.stopping.wait()
    finally:
        if deadline is not None:
            deadline.arm(asyncio.get_running_loop())
        await server.shutdown()
        await services.close()
    log.info("rmb-relay stopped")


def main(
    argv: Sequence[str],
    prog: str = "rmb-relay serve",
    epilog: str | None = None,
    announce: Callable[[RelayServer], None] = print_banner,
) -> int:
    args = parser(prog, epilog).parse_args(argv)
    if not args.log_rate > 0:
        raise SystemExit("rmb-relay: --log-rate must be positive")
    setup_logging(args.debug, args.log_rate)
    try:
        config = listener_config(args)
        workers.check(args.processes, args.redis, config.port)
    except ConfigError as err:
        raise SystemExit(f"rmb-relay: {err}") from None
    if args.processes > 1:
        return workers.run_workers(argv, args.processes, args.instance_id or workers.default_base())
    deadline = ShutdownDeadline(config.shutdown_timeout + SERVICES_CLOSE_TIME)
    try:
        run(serve(args, deadline, announce))  # (the loop's own close is covered too)
    finally:
        deadline.cancel()
    return 0
