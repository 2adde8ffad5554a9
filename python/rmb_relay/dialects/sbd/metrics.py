"""SBD metrics: plain-int counters on the hot path, the rest through the registry. Forwards the
Rust fast path makes are counted in the switch's `Outboxes` and added in when read."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay._core import Outboxes
    from rmb_relay.telemetry.metrics import Registry


class HotCounters:
    """Counters bumped for every message: plain ints rendered by the metrics page, because a
    metrics `Counter.inc` costs ~190 ns against ~70 ns for an int (three per forward)."""

    __slots__ = ("bytes_in", "bytes_out", "forward_drops", "forwards", "messages_in")

    def __init__(self) -> None:
        self.messages_in = 0
        self.bytes_in = 0
        self.forwards = 0
        self.bytes_out = 0
        self.forward_drops = 0


class SbdMetrics:
    """SBD's part of the shared `rmb_relay_*` families (docs/metrics.md), `dialect="sbd"`.

    SBD drops a connection without a close frame for every violation (`SbdSession.drop`);
    those drops are one family, `rmb_relay_connections_closed_total`, by the reason passed to
    `drop`: `rate` and `idle` from the handles here, the protocol violations from `violations`."""

    def __init__(self, registry: Registry, fast: Outboxes) -> None:
        hot = self.hot = HotCounters()
        sbd = {"dialect": "sbd"}
        registry.counter_of(
            "rmb_relay_messages_in_total",
            "Messages received from clients, by dialect",
            lambda: [((), hot.messages_in + fast.forwarded("sbd")[0])],
            const=sbd,
        )
        registry.counter_of(
            "rmb_relay_bytes_in_total",
            "Message bytes received from clients, by dialect",
            lambda: [((), hot.bytes_in + fast.forwarded("sbd")[1])],
            const=sbd,
        )
        # every relayed forward is one message written to its (local) destination
        registry.counter_of(
            "rmb_relay_messages_out_total",
            "Messages written to clients (RMB: incl. error envelopes and mailbox), by dialect",
            lambda: [((), hot.forwards + fast.forwarded("sbd")[0])],
            const=sbd,
        )
        registry.counter_of(
            "rmb_relay_bytes_out_total",
            "Message bytes written to clients, by dialect",
            lambda: [((), hot.bytes_out + fast.forwarded("sbd")[1])],
            const=sbd,
        )
        registry.counter_of(
            "rmb_relay_messages_routed_total",
            "Messages routed, by dialect and path (local, mailbox, federation)",
            lambda: [(("local",), hot.forwards + fast.forwarded("sbd")[0])],
            ("path",),
            const=sbd,
        )
        registry.counter_of(
            "rmb_relay_messages_dropped_total",
            "Messages dropped without delivery, by dialect and reason",
            lambda: [(("unknown key",), hot.forward_drops)],
            ("reason",),
            const=sbd,
        )
        dropped = "rmb_relay_connections_closed_total"
        dropped_help = "Connections the relay closed on its own initiative, by dialect and reason"
        self.rate_limited = registry.counter(dropped, dropped_help, const={**sbd, "reason": "rate"})
        self.idle_closed = registry.counter(dropped, dropped_help, const={**sbd, "reason": "idle"})
        self.violations = registry.counter(dropped, dropped_help, ("reason",), const=sbd)
        self.auth_failures = registry.counter(
            "rmb_relay_auth_failures_total",
            "Refused logins, handshakes or tokens, by dialect and reason",
            ("reason",),
            const=sbd,
        )
        self.refused = registry.counter(
            "rmb_relay_upgrades_refused_total",
            "WebSocket upgrades a dialect refused before 101, by dialect and status",
            ("status",),
            const=sbd,
        )
