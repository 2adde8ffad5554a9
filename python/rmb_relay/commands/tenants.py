"""`rmb-relay tenants add|list|set|rm`: the HTTP tunnel's tenants in the embedded SQLite file
(dialects/tunnel/tenants_cli.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rmb_relay.dialects.tunnel import tenants_cli

NAME = "tenants"
HELP = "manage the HTTP tunnel's tenants (in the twin directory's SQLite file)"


def main(argv: Sequence[str], prog: str) -> int:
    return tenants_cli.main(argv, prog)
