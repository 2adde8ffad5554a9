"""The SBD dialect (holochain's simple websocket relay), one concern per module:

| module | what |
|---|---|
| `settings.py` | `SbdSettings` (decision 6 limits), the flags, the spec's constants |
| `dialect.py` | `SbdDialect`: upgrade checks, per-IP bookkeeping, sweep, `PUT /authenticate` |
| `session.py` | `SbdSession`: one connection, handshake and forwards |
| `auth_hook.py` | the spec-auth hook client |
| `metrics.py` | counters |
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rmb_relay.dialects.base import DialectEntry
from rmb_relay.dialects.sbd.auth_hook import call_auth_hook
from rmb_relay.dialects.sbd.dialect import SbdDialect, ip_key
from rmb_relay.dialects.sbd.session import SbdSession
from rmb_relay.dialects.sbd.settings import SbdSettings, add_arguments

if TYPE_CHECKING:
    from rmb_relay.services import Services

__all__ = [
    "ENTRY",
    "SbdDialect",
    "SbdSession",
    "SbdSettings",
    "add_arguments",
    "call_auth_hook",
    "ip_key",
]


async def build(args: argparse.Namespace, services: Services) -> SbdDialect | None:
    """The SBD dialect the flags ask for, or None with `--no-sbd`. Raises ConfigError."""
    if args.no_sbd:
        return None
    return SbdDialect(
        SbdSettings.from_args(args),
        services.metrics,
        switch=services.switch,
        throttles=services.throttles,
    )


ENTRY = DialectEntry(
    name="sbd",
    summary="SBD (holochain simple websocket relay) at GET /<base64url ed25519 key>",
    add_arguments=add_arguments,
    build=build,
)
