"""`rmb-relay top --url URL`: a live terminal view of a relay (monitoring/top.py)."""

from __future__ import annotations

from collections.abc import Sequence

NAME = "top"
HELP = "watch a relay live: totals, rates, top connections, congested ones, failing peers"


def main(argv: Sequence[str], prog: str) -> int:
    from rmb_relay.monitoring import top

    return top.main(argv, prog)
