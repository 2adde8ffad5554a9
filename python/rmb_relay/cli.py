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
from rmb_relay.protocols.base import Dialect
from rmb_relay.server.listener import RelayServer

log = logging.getLogger("rmb_relay")


def _relay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rmb-relay",
        description=(
            "High-performance message relay. Serves RMB (ThreeFold Reliable Message Bus) "
            "websockets at GET /?<jwt>, RMB federation at POST /, SBD at GET /<pubkey>, and "
            "GET /health and GET /metrics, all on one listener. Runs with no Redis and no chain."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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


def _dialects(args: argparse.Namespace) -> list[Dialect]:
    """The dialects this process serves (each dialect issue adds its own here)."""
    return []


async def _serve(config: ListenerConfig, dialects: list[Dialect]) -> None:
    server = RelayServer(config, dialects)
    await server.start()
    server.install_signal_handlers()
    print(server.banner(), flush=True)
    await server.stopped.wait()
    log.info("rmb-relay stopped")


def relay_main(argv: Sequence[str] | None = None) -> None:
    args = _relay_parser().parse_args(argv)
    _setup_logging(args.debug)
    try:
        config = _listener_config(args)
        dialects = _dialects(args)
    except ConfigError as err:
        raise SystemExit(f"rmb-relay: {err}") from None
    run(_serve(config, dialects))


def run(main: object) -> None:
    """Run a coroutine on uvloop (the production loop)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(main)  # type: ignore[arg-type]
        except OSError as err:
            raise SystemExit(f"rmb-relay: {err}") from None
