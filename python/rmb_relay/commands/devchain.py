"""`rmb-relay devchain`: a local tfchain-like node serving twins from a file (twins/devchain.py).

Prints one line, `devchain listening on ws://HOST:PORT`, once it accepts connections (scripts
and tests wait for it), then serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence
from pathlib import Path

from rmb_relay.cli_support import HelpFormatter, run, setup_logging
from rmb_relay.config import parse_listen
from rmb_relay.errors import ConfigError

NAME = "devchain"
HELP = "run a local tfchain-like node serving twins from a file (for offline development)"

log = logging.getLogger("rmb_relay.devchain")


def parser(prog: str) -> argparse.ArgumentParser:
    from rmb_relay.twins.devchain import DEFAULT_BLOCK_TIME

    parser = argparse.ArgumentParser(
        prog=prog,
        description="A local node speaking the part of substrate's JSON-RPC that rmb-relay, "
        "rmb-peer and substrate clients use for tfchain twins. Point --substrate at the URL "
        "it prints.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--twins",
        required=True,
        metavar="FILE",
        help="twin file (the embedded directory's SQLite format; created if missing); "
        "`rmb-relay twins add --twins sqlite:FILE` edits it too",
    )
    parser.add_argument(
        "-l", "--listen", default="127.0.0.1:9944", help="HOST:PORT to serve (port 0: any free)"
    )
    parser.add_argument(
        "--block-time",
        type=float,
        default=DEFAULT_BLOCK_TIME,
        metavar="SECONDS",
        help="seconds between empty blocks",
    )
    parser.add_argument("-d", "--debug", action="count", default=0, help="more logging")
    return parser


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from rmb_relay.twins.chain import ChainCodec
    from rmb_relay.twins.devchain import DevChain
    from rmb_relay.twins.local import SqliteTwinDirectory

    host, port = parse_listen(args.listen)
    chain = DevChain(
        await ChainCodec.load_async(),
        SqliteTwinDirectory(args.twins),
        block_time=args.block_time,
    )
    runner = web.AppRunner(chain.app(), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=1.0)
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    shown = f"[{host}]" if ":" in host else host
    chain.start()
    print(f"devchain listening on ws://{shown}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await chain.stop()
        await runner.cleanup()


def main(argv: Sequence[str], prog: str = "rmb-relay devchain") -> int:
    args = parser(prog).parse_args(argv)
    # the file is opened on the event loop: the path is resolved before it runs
    args.twins = Path(args.twins.removeprefix("sqlite:")).expanduser()
    setup_logging(args.debug)
    try:
        parse_listen(args.listen)
        if not args.block_time > 0:
            raise ConfigError("--block-time must be a positive number of seconds")
        run(serve(args))
    except ConfigError as err:
        raise SystemExit(f"{prog}: {err}") from None
    return 0
