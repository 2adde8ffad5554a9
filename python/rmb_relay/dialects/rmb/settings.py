"""The RMB dialect's settings and flags (rmb-rs's names where it has them), and the limits
of what a session may hold, with why."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rmb_relay.dialects.rmb.later import LATER_BYTES
from rmb_relay.federation import setup as federation_setup
from rmb_relay.identity import DEFAULT_MAX_TOKEN_LIFETIME

#: relay error envelopes live this long (rmb-rs build_error_envelope)
ERROR_ENVELOPE_TTL = 300
#: a drained mailbox is written this many envelopes at a time, waiting for the socket between
DRAIN_BATCH = 256
#: envelopes of one session waiting for the slow path (lookup, mailbox, federation), in bytes:
#: beyond it the relay stops reading the sender's socket until half of it has been routed, so
#: a slow or stalled dependency (a Redis that stopped answering) pushes back on the sender
#: instead of piling its traffic up in the heap
SLOW_SESSION_BYTES = 8 << 20
#: the same for all sessions together; beyond it a message is refused at once ("relay busy"),
#: so many senders together cannot do what one cannot
SLOW_TOTAL_BYTES = 64 << 20
#: a mailbox that could not be read is tried again after this long, doubling up to the max
DRAIN_RETRY = 1.0
DRAIN_RETRY_MAX = 30.0
#: twins with a series of their own in `relay_message_rx_twin` (rmb-rs's per-twin counter):
#: each authenticated twin that sends is a series, so a stranger with many twins could make any
#: number; the rest are summed under `twin="(other)"`
DEFAULT_METRICS_MAX_TWINS = 1000


@dataclass(slots=True)
class RmbSettings:
    """The RMB-specific part of the relay configuration."""

    domains: frozenset[str] = frozenset()
    limit_count: int | None = None
    limit_size: int | None = None
    limit_window: int = 60
    max_token_lifetime: int = DEFAULT_MAX_TOKEN_LIFETIME
    slow_session_bytes: int = SLOW_SESSION_BYTES
    slow_total_bytes: int = SLOW_TOTAL_BYTES
    metrics_max_twins: int = DEFAULT_METRICS_MAX_TWINS
    #: answers that could not reach another instance, held for another try (later.py)
    retry_hold_bytes: int = LATER_BYTES

    @property
    def standalone(self) -> bool:
        return not self.domains


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The RMB flags of `rmb-relay serve` (rmb-rs's names where it has them)."""
    rmb = parser.add_argument_group("RMB relay (GET /?<jwt>)")
    rmb.add_argument(
        "-m",
        "--domain",
        action="extend",
        nargs="+",
        default=[],
        metavar="DOMAIN",
        help=(
            "domains this relay serves, one or more per flag, the flag repeatable (rmb-rs: "
            "`--domain a b` and `-m a -m b` alike); twins whose on-chain relay list shares one "
            "are kept here when offline. None given: standalone, every known twin is local"
        ),
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
        "--max-token-lifetime",
        type=int,
        default=DEFAULT_MAX_TOKEN_LIFETIME,
        metavar="SECONDS",
        help="refuse a login JWT still valid for longer than this (exp - now); rmb-peer's "
        "tokens live 300 s",
    )
    rmb.add_argument(
        "--metrics-max-twins",
        type=int,
        default=DEFAULT_METRICS_MAX_TWINS,
        metavar="N",
        help="twins counted one by one in relay_message_rx_twin{twin} (messages received per "
        'authenticated twin); later ones are summed as twin="(other)"; 0: not counted',
    )
    rmb.add_argument(
        "--retry-hold-bytes",
        type=int,
        default=LATER_BYTES,
        metavar="BYTES",
        help="bytes of answers (responses, errors) held to be routed again while Redis or "
        "another instance cannot be reached; past it an answer is dropped and counted "
        "(default 4 MiB)",
    )
    federation_setup.add_arguments(parser)
