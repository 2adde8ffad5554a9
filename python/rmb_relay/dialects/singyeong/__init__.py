"""The 신경 (singyeong) gateway dialect (spec/singyeong.md), one concern per module. Queries
are parsed, matched and routed by the Rust core (rust/dialects/singyeong/), which also
answers a JSON client's SEND/BROADCAST inside the read when it can write the answer itself.

| module | what |
|---|---|
| `settings.py` | `SgSettings`, the flags |
| `etf.py` / `codec.py` | the restricted ETF codec; json/msgpack/etf frames both ways |
| `frames.py` | opcodes and the frames the gateway sends |
| `metadata.py` | metadata types, validation, semver |
| `query.py` | `parse`: a query object -> the core's `SgQuery`, within `QueryLimits` |
| `clients.py` | `Client`, and `ClientIndex` over the core's index (`SgIndex`) |
| `queues.py` | queues: confirm, request, ack, redelivery, dead letters |
| `redis_queues.py` | the same queues in Redis (shared by instances, kept over restarts) |
| `session.py` | `SgSession`: one connection |
| `dialect.py` | `SingyeongDialect`: routing, the fast path's scanner, timers |
| `cluster.py` | several instances as one gateway: replicas, forwarded dispatches |
| `proxy.py` | `/api/v1/proxy`: an HTTP request to a client's own service |
| `api.py` | the HTTP API |
| `metrics.py` | counters and gauges |
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rmb_relay.dialects.base import DialectEntry
from rmb_relay.dialects.singyeong.dialect import SingyeongDialect
from rmb_relay.dialects.singyeong.settings import SgSettings, add_arguments

if TYPE_CHECKING:
    from rmb_relay.services import Services

__all__ = ["ENTRY", "SgSettings", "SingyeongDialect", "add_arguments"]


async def build(args: argparse.Namespace, services: Services) -> SingyeongDialect | None:
    """The gateway the flags ask for, or None with `--no-singyeong`. Raises ConfigError."""
    if args.no_singyeong:
        return None
    return SingyeongDialect(
        SgSettings.from_args(args),
        services.metrics,
        redis=services.redis,
        cluster=services.cluster,
        outboxes=services.switch.outboxes,
    )


ENTRY = DialectEntry(
    name="singyeong",
    summary="singyeong gateway at GET /gateway/websocket?encoding=json|msgpack|etf",
    add_arguments=add_arguments,
    build=build,
)
