"""`rmb-relay` subcommands, one module each: `serve` (the default), `twins`, `tenants`,
`connector` (the HTTP tunnel's), `devchain`, `top` (monitoring/top.py), and the launch lines
of other servers run as ours: `sbd-serverd` (holochain's sbd-server flags) and `singyeong` (the
신경 server's environment); `sbd_obahn.py` is the relay the SBD conformance suite starts, not a
command.

A command module exposes `NAME`, `HELP` (one line) and `main(argv, prog) -> int`; adding a
command is one module plus one line in `commands()` below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    main: Callable[[Sequence[str], str], int]


def commands() -> dict[str, Command]:
    from rmb_relay.commands import (
        connector,
        devchain,
        sbd_serverd,
        serve,
        singyeong,
        tenants,
        top,
        twins,
    )

    modules = (serve, twins, tenants, connector, devchain, top, sbd_serverd, singyeong)
    return {module.NAME: Command(module.NAME, module.HELP, module.main) for module in modules}
