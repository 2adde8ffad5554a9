"""RMB's counters: the hot ones as plain ints, the rest in the shared `rmb_relay_*` families."""

from __future__ import annotations

from collections.abc import Iterable, Sized
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

    def live_received(self) -> Iterable[tuple[int, int]]:
        """(twin, data messages received) of every live session."""
        ...

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


#: the `twin` label of the twins beyond `TwinTraffic.cap`
OTHER_TWINS = "(other)"


class TwinTraffic:
    """Messages received per authenticated twin (rmb-rs's `relay_message_rx_twin{twin}`), for
    at most `cap` twins; the rest are summed under `OTHER_TWINS`.

    Nothing is counted per message here: a session's count is its websocket decoder's (Rust,
    `WsDecoder.messages_in`), added once when the session ends (`ended`) and read for live
    sessions at scrape. A twin gets its series the first time a count of it is seen (a scrape
    or an ended session) while fewer than `cap` twins have one; the table never shrinks, so a
    twin left out stays out and every series only grows. `folded` counts the sessions with
    messages whose twin has no series of its own."""

    __slots__ = ("cap", "folded", "other", "twins")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        #: twin -> messages of its ended sessions (a twin is here once it has a series)
        self.twins: dict[int, int] = {}
        self.other = 0
        self.folded = 0

    def _admits(self, twin: int) -> bool:
        twins = self.twins
        if twin in twins:
            return True
        if len(twins) < self.cap:
            twins[twin] = 0
            return True
        return False

    def ended(self, twin: int, received: int) -> None:
        """A session of `twin` ended after sending `received` data messages."""
        if received <= 0 or self.cap <= 0:
            return
        if self._admits(twin):
            self.twins[twin] += received
        else:
            self.other += received
            self.folded += 1

    def samples(self, live: Iterable[tuple[int, int]]) -> tuple[dict[str, int], int]:
        """The series (twin label -> messages) and `folded`, with the `live` sessions' counts."""
        if self.cap <= 0:
            return {}, 0
        counts = dict(self.twins)
        other, folded = self.other, self.folded
        for twin, received in live:
            if received <= 0:
                continue
            if self._admits(twin):
                counts[twin] = counts.get(twin, 0) + received
            else:
                other += received
                folded += 1
        series = {str(twin): n for twin, n in counts.items()}
        if other or folded:
            series[OTHER_TWINS] = other
        return series, folded


class RmbMetrics:
    """RMB's part of the shared `rmb_relay_*` families (docs/metrics.md), `dialect="rmb"`."""

    def __init__(self, registry: Registry, dialect: MetricsSource, max_twins: int = 0) -> None:
        hot = self.hot = HotCounters()
        twins = self.twins = TwinTraffic(max_twins)
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
        registry.counter_of(
            "rmb_relay_twin_messages_in_total",
            "RMB messages received per authenticated twin (the first --metrics-max-twins "
            "twins; the rest as (other))",
            lambda: [((t,), n) for t, n in twins.samples(dialect.live_received())[0].items()],
            ("twin",),
        )
        registry.counter_of(
            "rmb_relay_twin_series_folded_total",
            "RMB sessions with messages whose twin has no series of its own in "
            "rmb_relay_twin_messages_in_total (over --metrics-max-twins): counted as (other)",
            lambda: [((), twins.samples(dialect.live_received())[1])],
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
