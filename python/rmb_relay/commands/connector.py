"""`rmb-relay connector --server URL --tenant T --secret S --target NAME=URL [...]`: the HTTP
tunnel's connector (dialects/tunnel/connector.py), with `$ping` and `$echo` built in."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rmb_relay.cli_support import HelpFormatter, run, setup_logging
from rmb_relay.errors import ConfigError

if TYPE_CHECKING:
    # imported when this command runs, not when `rmb-relay` lists its commands: the
    # connector's aiohttp costs ~11 MB of RSS a relay would carry for nothing (as devchain)
    from rmb_relay.dialects.tunnel.connector import Connector
    from rmb_relay.dialects.tunnel.targets import Target

NAME = "connector"
HELP = "run an HTTP tunnel connector: carry requests from a relay to local HTTP servers"


def parser(prog: str) -> argparse.ArgumentParser:
    from rmb_relay.dialects.tunnel.connector import DEFAULT_TARGET_TIMEOUT

    p = argparse.ArgumentParser(
        prog=prog,
        description="Hold an outbound websocket to a relay and answer the requests sent to "
        "/relay/TENANT/NAME/... from local targets. Built-in targets: $ping, $echo.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--server", required=True, metavar="URL", help="the relay, http(s)://HOST:PORT")
    p.add_argument("--tenant", required=True, help="tenant name")
    p.add_argument("--secret", required=True, help="tenant secret (rmb-relay tenants add)")
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a web target (repeatable), e.g. api=http://127.0.0.1:8000",
    )
    p.add_argument(
        "--target-timeout",
        type=float,
        default=DEFAULT_TARGET_TIMEOUT,
        metavar="SECONDS",
        help="a target that has not answered within this long gets the client a 504",
    )
    p.add_argument("--msgpack", action="store_true", help="speak msgpack instead of JSON")
    p.add_argument("-d", "--debug", action="count", default=0, help="more logging")
    return p


async def _serve(connector: Connector) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(connector.stop()))
    await connector.run()


def main(argv: Sequence[str], prog: str) -> int:
    from rmb_relay.dialects.tunnel.connector import Connector
    from rmb_relay.dialects.tunnel.targets import parse_target

    args = parser(prog).parse_args(argv)
    setup_logging(args.debug)
    if not args.server.startswith(("http://", "https://")):
        raise SystemExit(f"{prog}: --server must be an http(s) URL")
    if not args.target_timeout > 0:
        raise SystemExit(f"{prog}: --target-timeout must be positive")
    targets: dict[str, Target] = {}
    try:
        for text in args.target:
            name, target = parse_target(text, args.target_timeout)
            targets[name] = target
    except ConfigError as err:
        raise SystemExit(f"{prog}: {err}") from None
    connector = Connector(
        args.server,
        args.tenant,
        args.secret,
        targets,
        binary=args.msgpack,
        target_timeout=args.target_timeout,
    )
    run(_serve(connector))
    return 0
