"""SBD metrics: plain-int counters on the hot path, the rest through the registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    def __init__(self, registry: Registry) -> None:
        hot = self.hot = HotCounters()
        registry.counter_of(
            "sbd_messages_in_total",
            "SBD messages received (commands and forwards)",
            lambda: [((), hot.messages_in)],
        )
        registry.counter_of(
            "sbd_bytes_in_total", "SBD message bytes received", lambda: [((), hot.bytes_in)]
        )
        registry.counter_of(
            "sbd_bytes_out_total", "SBD forward bytes sent", lambda: [((), hot.bytes_out)]
        )
        registry.counter_of(
            "sbd_forwards_total", "SBD forwards relayed", lambda: [((), hot.forwards)]
        )
        registry.counter_of(
            "sbd_forward_drops_total",
            "Forwards to an unknown or not-ready key (dropped)",
            lambda: [((), hot.forward_drops)],
        )
        self.rate_limited = registry.counter(
            "sbd_rate_limited_total", "Connections dropped for exceeding the IP byte budget"
        )
        self.idle_closed = registry.counter(
            "sbd_idle_closed_total", "Connections dropped for idleness (or a slow handshake)"
        )
        self.violations = registry.counter(
            "sbd_violations_total", "Connections dropped for protocol violations", ("reason",)
        )
        self.auth_failures = registry.counter(
            "sbd_auth_failures_total", "Refused handshakes or tokens", ("reason",)
        )
        self.refused = registry.counter(
            "sbd_upgrades_refused_total", "Upgrades refused before 101", ("status",)
        )
