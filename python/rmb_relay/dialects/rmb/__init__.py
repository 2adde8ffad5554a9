"""The RMB relay dialect: twins log in with a JWT at `GET /?<jwt>` and exchange envelopes.

Theory of operation (spec/rmb.md §1.6, §3.1 and the decisions at its top)
-----------------------------------------------------------------------
Login: the whole query string is the JWT; structure and expiry are checked first, then the twin
is looked up (cached directory) and the signature checked against its account key. A session
is (twin, sid); a newer login with the same key replaces the older connection (1008).

Per message (the fast path, no awaits): the Rust core scans the routing fields straight from
the protobuf bytes; the per-twin limiter runs; source must equal the session; an envelope ping
is answered with a pong; a destination connected to this process gets the received bytes as
they are (never re-encoded). Anything else takes the slow path, one FIFO task per sender: twin
lookup, then the mailbox (a destination of this relay that is offline) or federation (a
destination on another relay). Failures reach the sender as rmb-rs-compatible error envelopes,
and only when the failed envelope was a request.

With no `--domain` the relay is standalone: every twin it knows is its own, so messages for
offline twins wait in the mailbox instead of being federated (rmb-rs would federate them).

| module | what |
|---|---|
| `settings.py` | `RmbSettings`, the flags, the session limits |
| `dialect.py` | `RmbDialect`: login, routing the slow path, federation's `POST /` |
| `session.py` | `RmbSession`: one connection, its slow-path queue and mailbox drain |
| `forward.py` | what becomes of an envelope handed to another instance |
| `metrics.py` | counters |
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rmb_relay.dialects.base import DialectEntry
from rmb_relay.dialects.rmb.dialect import RmbDialect
from rmb_relay.dialects.rmb.session import RmbSession
from rmb_relay.dialects.rmb.settings import RmbSettings, add_arguments
from rmb_relay.errors import ConfigError
from rmb_relay.federation import setup as federation_setup

if TYPE_CHECKING:
    from rmb_relay.services import Services

__all__ = ["ENTRY", "RmbDialect", "RmbSession", "RmbSettings", "add_arguments"]


async def build(args: argparse.Namespace, services: Services) -> RmbDialect:
    """The RMB dialect of `rmb-relay serve`, on the process's switch and twin directory."""
    if args.limit is not None and min(args.limit) <= 0:
        raise ConfigError("--limit COUNT SIZE must both be positive")
    if args.limit_window <= 0:
        raise ConfigError("--limit-window must be positive")
    if args.max_token_lifetime <= 0:
        raise ConfigError("--max-token-lifetime must be positive")
    if args.metrics_max_twins < 0:
        raise ConfigError("--metrics-max-twins must be 0 (off) or positive")
    if args.retry_hold_bytes < 0:
        raise ConfigError("--retry-hold-bytes must not be negative")
    settings = RmbSettings(
        domains=frozenset(args.domain),
        limit_count=args.limit[0] if args.limit else None,
        limit_size=args.limit[1] if args.limit else None,
        limit_window=args.limit_window,
        max_token_lifetime=args.max_token_lifetime,
        metrics_max_twins=args.metrics_max_twins,
        retry_hold_bytes=args.retry_hold_bytes,
    )
    directory = services.twin_directory()
    dialect = RmbDialect(
        settings,
        directory,
        services.metrics,
        switch=services.switch,
        max_message=args.max_message,
        throttles=services.throttles,
    )
    outbound, inbound = federation_setup.build(
        args,
        redis=services.redis,
        switch=services.switch,
        registry=services.metrics,
        directory=directory,
        is_ours=dialect.serves_federated,
    )
    dialect.federation = services.switch.federation = outbound
    dialect.inbound = inbound
    if services.redis is not None:
        outbound.start()  # take over what a crashed instance left queued
    # without Redis the queue starts empty and the first forward starts the workers: 256
    # parked tasks (~0.4 MB) a relay that never federates does not hold
    return dialect


ENTRY = DialectEntry(
    name="rmb",
    summary="RMB (ThreeFold Reliable Message Bus) twins at GET /?<jwt>",
    add_arguments=add_arguments,
    build=build,
)
