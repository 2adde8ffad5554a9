"""Tunnel metrics (`dialect="tunnel"`, docs/tunnel.md lists them).

Label values come from tenants that exist and from targets their connector answered for; a
request refused by the relay (unknown tenant, 401, 408, 503) or answered 404 by the connector
counts under target `-`, so a client cannot create series by inventing names."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay.telemetry.metrics import Registry

Samples = Callable[[], Iterable[tuple[tuple[str, ...], float]]]


class TunnelMetrics:
    def __init__(
        self,
        registry: Registry,
        *,
        inflight: Samples,
        queued: Samples,
        connectors: Samples,
        body_bytes: Samples,
        held_bytes: Samples,
        refused: Samples,
    ) -> None:
        const = {"dialect": "tunnel"}
        self.requests = registry.counter(
            "rmb_relay_tunnel_requests_total",
            "Tunnel requests answered, by tenant, target and status",
            ("tenant", "target", "status"),
            const=const,
        )
        self.expired = registry.counter(
            "rmb_relay_tunnel_expired_total",
            "Tunnel requests dropped because no connector took them within the request TTL",
            const=const,
        )
        self.redelivered = registry.counter(
            "rmb_relay_tunnel_redelivered_total",
            "Unacknowledged tunnel requests queued again after their connector went away",
            const=const,
        )
        self.bad_messages = registry.counter(
            "rmb_relay_tunnel_bad_messages_total",
            "Connector messages refused as malformed or naming unknown requests",
            const=const,
        )
        #: requests the express path took: a plain int (one per request; `Counter.inc` is a
        #: dict update with label checks), read at scrape as outcome="taken"
        self.express_taken = 0
        self.express = registry.counter_of(
            "rmb_relay_tunnel_express_total",
            "Relay-mode requests offered to the express path (express.py): taken, or declined "
            "to the task path and why (path, tenant, auth, no connector, queued, "
            "limit, budget)",
            lambda: [(("taken",), self.express_taken)],
            ("outcome",),
            const=const,
        )
        #: express answers the Rust core built (express.deliver_native), a plain int as above
        self.native_answers = 0
        registry.counter_of(
            "rmb_relay_tunnel_native_answers_total",
            "Express-path answers built from the connector's Deliver in the Rust core "
            "(the rest of the express path's answers are built in Python)",
            lambda: [((), self.native_answers)],
            (),
            const=const,
        )
        self.swept = registry.counter(
            "rmb_relay_tunnel_body_files_swept_total",
            "Orphaned body files the sweeper removed",
            const=const,
        )
        self.auth_failures = registry.counter(
            "rmb_relay_auth_failures_total",
            "Refused logins, handshakes or tokens, by dialect and reason",
            ("reason",),
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_inflight",
            "Tunnel requests a connector holds, by tenant",
            ("tenant",),
            read=inflight,
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_queued",
            "Tunnel requests waiting for a connector, by tenant",
            ("tenant",),
            read=queued,
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_connectors",
            "Connected tunnel connectors, by tenant",
            ("tenant",),
            read=connectors,
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_held_bytes",
            "In-memory bytes (inline body, URL, headers) of tunnel requests this relay holds "
            "until answered, by tenant; bounded by --tunnel-tenant-bytes and --tunnel-total-bytes",
            ("tenant",),
            read=held_bytes,
            const=const,
        )
        registry.counter_of(
            "rmb_relay_tunnel_refused_total",
            "Tunnel requests refused with 503 at the memory budget, by the limit hit "
            "(tenant: --tunnel-tenant-bytes, total: --tunnel-total-bytes)",
            refused,
            ("limit",),
            const=const,
        )
        registry.gauge(
            "rmb_relay_tunnel_body_store_bytes",
            "Bytes held in the tunnel's body store",
            read=body_bytes,
            const=const,
        )
