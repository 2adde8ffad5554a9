"""`rmb-relay twins add|list|show|rm`: manage the embedded twin directory (twins/cli.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rmb_relay.twins import cli

NAME = "twins"
HELP = "manage the embedded twin directory (a SQLite file)"


def main(argv: Sequence[str], prog: str) -> int:
    return cli.main(argv, prog)
