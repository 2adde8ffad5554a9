"""The HTTP tunnel dialect in the style of Thinktecture RelayServer (spec/tunnel.md), one
concern per module:

| module | what |
|---|---|
| `settings.py` | `TunnelSettings`, the flags |
| `tenants.py` | tenants and the token key in the twin directory's SQLite file |
| `tokens.py` | embedded JWTs (`POST /tunnel/token`) and OIDC tokens (JWKS) |
| `wire.py` | connector messages, JSON and msgpack (the Rust codec) |
| `hub.py` | around the hub (rust/dialects/tunnel/hub.rs: every decision): effects, timer, metrics |
| `client.py` | requests the hub's fast path left to Python: the I/O its steps ask for |
| `scaleout.py` | several relays on one Redis: the hub's requests and answers over the cluster |
| `endpoints.py` | discovery, token, body side channels, manual acknowledgements |
| `management.py` | `/management/tenants` |
| `bodystore.py` | body files and their sweeper |
| `host.py` | `TunnelHost`: what the request paths use of the dialect (so they do not import it) |
| `tenants_cli.py` | `rmb-relay tenants ...` |
| `connector.py`, `targets.py` | the connector (`rmb-relay connector`) and its targets |
| `httpclient.py` | the connector's HTTP/1.1 client for web targets |
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rmb_relay.dialects.base import DialectEntry
from rmb_relay.dialects.tunnel.dialect import TunnelDialect
from rmb_relay.dialects.tunnel.settings import TunnelSettings, add_arguments
from rmb_relay.dialects.tunnel.tenants import TenantStore

if TYPE_CHECKING:
    from rmb_relay.services import Services

__all__ = ["ENTRY", "TunnelDialect", "TunnelSettings"]


async def build(args: argparse.Namespace, services: Services) -> TunnelDialect | None:
    """The tunnel the flags ask for, or None with `--no-tunnel`. Raises ConfigError."""
    if args.no_tunnel:
        return None
    settings = TunnelSettings.from_args(args)
    store = TenantStore(services.twins_path())
    dialect = TunnelDialect(
        settings,
        store,
        services.metrics,
        services.switch.outboxes,
        cluster=services.cluster,
        throttles=services.throttles,
    )
    channel = services.switch.record_channel("tunnel")  # --records
    if channel is not None:
        dialect.record_into(channel)
    return dialect


ENTRY = DialectEntry(
    name="tunnel",
    summary="HTTP tunnel (RelayServer style) at /relay|queue|trace/{tenant}/{target}/...",
    add_arguments=add_arguments,
    build=build,
)
