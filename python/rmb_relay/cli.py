"""Command-line entry points: `rmb-relay` (and later `rmb-peer`, `rmb-load`, `rmb-analytics`).

Every flag's help ends with its default, printed from `config.py`, so `--help` never lies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from rmb_relay import __version__
from rmb_relay.config import (
    DEFAULT_MAX_MESSAGE,
    ListenerConfig,
    parse_listen,
)
from rmb_relay.errors import ConfigError
from rmb_relay.mailbox import (
    DEFAULT_MAILBOX_MAX,
    DEFAULT_MAILBOX_TTL,
    Mailbox,
    MemoryMailbox,
    RedisMailbox,
)
from rmb_relay.protocols.base import Dialect
from rmb_relay.protocols.rmb import RmbDialect, RmbSettings
from rmb_relay.protocols.sbd import add_sbd_arguments, sbd_dialect_from_args
from rmb_relay.server.listener import RelayServer
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.cli import add_twins_subcommands, parse_twins_url, twins_main
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path

log = logging.getLogger("rmb_relay")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _relay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rmb-relay",
        description=(
            "High-performance message relay. Serves RMB (ThreeFold Reliable Message Bus) "
            "websockets at GET /?<jwt>, RMB federation at POST /, SBD at GET /<pubkey>, and "
            "GET /health and GET /metrics, all on one listener. Runs with no Redis and no chain."
        ),
        formatter_class=_HelpFormatter,
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
        "--max-message",
        type=int,
        default=DEFAULT_MAX_MESSAGE,
        metavar="BYTES",
        help="largest websocket message or HTTP body accepted",
    )
    rmb = parser.add_argument_group("RMB relay")
    rmb.add_argument(
        "-m",
        "--domain",
        action="append",
        default=[],
        metavar="DOMAIN",
        help=(
            "a domain this relay serves (repeatable); twins whose on-chain relay list shares one "
            "are kept here when offline. None given: standalone, every known twin is local"
        ),
    )
    rmb.add_argument(
        "-r",
        "--redis",
        metavar="URL",
        help="redis://HOST:PORT/DB for durable mailboxes; without it mailboxes live in memory",
    )
    rmb.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        default=None,
        help=f"embedded twin directory (default: sqlite:{default_twins_path()})",
    )
    rmb.add_argument(
        "--twin-cache-ttl",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long a twin lookup is cached",
    )
    rmb.add_argument(
        "--limit",
        nargs=2,
        type=int,
        metavar=("COUNT", "SIZE"),
        help="per-twin rate limit: at most COUNT messages and SIZE bytes per --limit-window "
        "(default: no limit)",
    )
    rmb.add_argument(
        "--limit-window",
        type=int,
        default=60,
        metavar="SECONDS",
        help="rate limit window",
    )
    rmb.add_argument(
        "--mailbox-ttl",
        type=int,
        default=DEFAULT_MAILBOX_TTL,
        metavar="SECONDS",
        help="longest time a message waits for an offline twin (its own expiry may be sooner)",
    )
    rmb.add_argument(
        "--mailbox-max",
        type=int,
        default=DEFAULT_MAILBOX_MAX,
        metavar="N",
        help="messages kept per offline session; the oldest are dropped first",
    )
    rmb.add_argument(
        "-p",
        "--ranker-period",
        type=int,
        default=3600,
        metavar="SECONDS",
        help="how long a federation failure counts against a relay (used by federation)",
    )
    add_sbd_arguments(parser)
    parser.add_argument(
        "-d",
        "--debug",
        action="count",
        default=0,
        help="more logging: -d debug for rmb_relay, -dd debug for everything",
    )
    return parser


def _setup_logging(debug: int) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if debug >= 2 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if debug == 1:
        logging.getLogger("rmb_relay").setLevel(logging.DEBUG)


def _listener_config(args: argparse.Namespace) -> ListenerConfig:
    host, port = parse_listen(args.listen)
    return ListenerConfig(
        host=host,
        port=port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        reuse_port=args.reuse_port,
        max_message=args.max_message,
    )


async def _mailbox(args: argparse.Namespace) -> Mailbox:
    if not args.redis:
        return MemoryMailbox(ttl=args.mailbox_ttl, max_per_session=args.mailbox_max)
    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    redis = Redis.from_url(args.redis)
    try:
        await redis.ping()
    except (RedisError, OSError) as err:
        await redis.aclose()
        raise ConfigError(f"cannot reach redis at {args.redis}: {err}") from None
    return RedisMailbox(redis, ttl=args.mailbox_ttl, max_per_session=args.mailbox_max)


async def _dialects(args: argparse.Namespace, registry: Registry) -> list[Dialect]:
    """The dialects this process serves, in path-matching order."""
    if args.limit is not None and min(args.limit) <= 0:
        raise ConfigError("--limit COUNT SIZE must both be positive")
    directory = CachedTwinDirectory(
        SqliteTwinDirectory(parse_twins_url(args.twins) if args.twins else default_twins_path()),
        ttl=args.twin_cache_ttl,
    )
    settings = RmbSettings(
        domains=frozenset(args.domain),
        limit_count=args.limit[0] if args.limit else None,
        limit_size=args.limit[1] if args.limit else None,
        limit_window=args.limit_window,
    )
    rmb = RmbDialect(
        settings,
        directory,
        registry,
        mailbox=await _mailbox(args),
        max_message=args.max_message,
    )
    dialects: list[Dialect] = [rmb]
    sbd = sbd_dialect_from_args(args, registry)
    if sbd is not None:
        dialects.append(sbd)
    return dialects


async def _serve(args: argparse.Namespace) -> None:
    config = _listener_config(args)
    registry = Registry()
    try:
        dialects = await _dialects(args, registry)
    except ConfigError as err:
        raise SystemExit(f"rmb-relay: {err}") from None
    server = RelayServer(config, dialects, registry)
    await server.start()
    server.install_signal_handlers()
    print(server.banner(), flush=True)
    await server.stopped.wait()
    log.info("rmb-relay stopped")


def relay_main(argv: Sequence[str] | None = None) -> None:
    parser = _relay_parser()
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_twins_subcommands(commands)
    args = parser.parse_args(argv)
    if args.command == "twins":
        raise SystemExit(twins_main(args))
    _setup_logging(args.debug)
    try:
        _listener_config(args)
    except ConfigError as err:
        raise SystemExit(f"rmb-relay: {err}") from None
    run(_serve(args))


def run(main: object) -> None:
    """Run a coroutine on uvloop (the production loop)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(main)  # type: ignore[arg-type]
        except OSError as err:
            raise SystemExit(f"rmb-relay: {err}") from None
