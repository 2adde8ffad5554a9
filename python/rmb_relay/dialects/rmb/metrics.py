"""RMB's counters: the hot ones as plain ints, the rest in the shared `rmb_relay_*` families."""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Protocol

from rmb_relay.contract import REPLY_PAUSES
from rmb_relay.mailbox import Mailbox
from rmb_relay.switch import Switch

if TYPE_CHECKING:
    from rmb_relay.dialects.rmb.later import Later
    from rmb_relay.telemetry.metrics import Registry


class MetricsSource(Protocol):
    """What the gauges read of the dialect, at scrape time."""

    @property
    def switch(self) -> Switch: ...

    @property
    def sessions(self) -> Sized: ...

    @property
    def mailbox(self) -> Mailbox: ...

    @property
    def later(self) -> Later[Any]: ...


class HotCounters:
    """Counters bumped once or twice per relayed message: plain ints, because a metrics
    `Counter.inc` per message cost 19% of the relay's CPU under load (py-spy)."""

    __slots__ = ("bytes_in", "bytes_out", "local", "messages_in", "messages_out")

    def __init__(self) -> None:
        self.messages_in = 0
        self.bytes_in = 0
        self.messages_out = 0
        self.bytes_out = 0
        self.local = 0


class RmbMetrics:
    """RMB's part of the shared `rmb_relay_*` families (docs/metrics.md), `dialect="rmb"`."""

    def __init__(self, registry: Registry, dialect: MetricsSource) -> None:
        hot = self.hot = HotCounters()
        # each envelope the Rust fast path forwards is one message in, one out and one routed
        # locally; the outboxes count them under the receiver's kind, "rmb" (switch.py), and
        # the envelopes they crossed to other instances or placed from them
        fast = dialect.switch.outboxes
        rmb = {"dialect": "rmb"}
        #: the slow path waited for a sender to read the errors it caused (session.py)
        self.reply_pauses = registry.counter(*REPLY_PAUSES, const=rmb)
        registry.counter_of(
            "rmb_relay_messages_in_total",
            "Messages received from clients, by dialect",
            lambda: [((), hot.messages_in + fast.forwarded("rmb")[0] + fast.crossed[0])],
            const=rmb,
        )
        registry.counter_of(
            "rmb_relay_bytes_in_total",
            "Message bytes received from clients, by dialect",
            lambda: [((), hot.bytes_in + fast.forwarded("rmb")[1] + fast.crossed[1])],
            const=rmb,
        )
        registry.counter_of(
            "rmb_relay_messages_out_total",
            "Messages written to clients (RMB: incl. error envelopes and mailbox), by dialect",
            lambda: [((), hot.messages_out + fast.forwarded("rmb")[0] + fast.placed[0])],
            const=rmb,
        )
        registry.counter_of(
            "rmb_relay_bytes_out_total",
            "Message bytes written to clients, by dialect",
            lambda: [((), hot.bytes_out + fast.forwarded("rmb")[1] + fast.placed[1])],
            const=rmb,
        )
        self.routed_slow: dict[str, int] = {"mailbox": 0, "federation": 0, "cluster": 0}
        registry.counter_of(
            "rmb_relay_messages_routed_total",
            "Messages routed, by dialect and path (local, mailbox, federation)",
            lambda: (
                [(("local",), hot.local + fast.forwarded("rmb")[0])]
                # the fast path's envelopes for other instances (rust/forward/crossing.rs) too
                + [
                    ((path,), n + (fast.crossed[0] if path == "cluster" else 0))
                    for path, n in self.routed_slow.items()
                ]
            ),
            ("path",),
            const=rmb,
        )
        self.errors_sent = registry.counter(
            "rmb_relay_error_replies_total",
            "Error replies sent to senders instead of delivering, by dialect and reason",
            ("reason",),
            const=rmb,
        )
        self.drops = registry.counter(
            "rmb_relay_messages_dropped_total",
            "Messages dropped without delivery, by dialect and reason",
            ("reason",),
            const=rmb,
        )
        self.limited = registry.counter(
            "rmb_relay_messages_rate_limited_total",
            "Messages refused by a rate limiter, by dialect",
            const=rmb,
        )
        self.login_failures = registry.counter(
            "rmb_relay_auth_failures_total",
            "Refused logins, handshakes or tokens, by dialect and reason",
            ("reason",),
            const=rmb,
        )
        self.logins = registry.counter(
            "rmb_relay_logins_total", "Accepted logins, by dialect", const=rmb
        )
        self.replaced = registry.counter(
            "rmb_relay_sessions_replaced_total",
            "Sessions closed because the same identity logged in again, by dialect",
            const=rmb,
        )
        registry.gauge(
            "rmb_relay_sessions",
            "Sessions a dialect holds (RMB: logged in; SBD: handshaking and ready)",
            read=lambda: [((), len(dialect.sessions))],
            const=rmb,
        )
        later = dialect.later
        registry.gauge(
            "rmb_relay_retry_held_bytes",
            "Answer bytes held to be routed again while Redis or another instance cannot be "
            "reached (bounded by --retry-hold-bytes)",
            read=lambda: [((), later.held_bytes)],
        )
        registry.counter_of(
            "rmb_relay_retry_refused_total",
            "Answers not held for another try because --retry-hold-bytes were held (dropped)",
            lambda: [((), later.refused)],
        )
        registry.gauge(
            "rmb_relay_mailbox_depth",
            "Messages waiting in mailboxes for offline sessions",
            read=lambda: [((), dialect.mailbox.depth())],
        )
        registry.counter_of(
            "rmb_relay_mailbox_dropped_total",
            "Messages a mailbox dropped, by reason (full: oldest first; expired)",
            lambda: [
                (("full",), dialect.mailbox.stats.dropped_full),
                (("expired",), dialect.mailbox.stats.expired),
            ],
            ("reason",),
        )
        registry.gauge(
            "rmb_relay_mailbox_bytes",
            "Envelope bytes the relay holds for mailboxes (in memory, or on their way to Redis)",
            read=lambda: [((), dialect.mailbox.held_bytes())],
        )
        registry.counter_of(
            "rmb_relay_mailbox_refused_total",
            "Messages a mailbox refused because a memory budget was reached (the sender of a "
            "request gets an error)",
            lambda: [((), dialect.mailbox.stats.refused)],
        )
