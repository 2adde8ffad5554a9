"""rmb-rs's metric names, exported beside ours so dashboards and alerts built on the public relay
keep working after the binary is swapped (docs/metrics.md, "rmb-rs names").

Each name is a view of our own families, read at scrape time: nothing on the message path
counts twice, and an rmb-rs name can never disagree with the `rmb_relay_*` family it is made of.
The names, types and labels are rmb-rs's (src/relay/switch/mod.rs, federation/mod.rs):

| rmb-rs | type | labels | made of |
|---|---|---|---|
| `relay_message_rx` | counter | | `rmb_relay_messages_in_total{dialect="rmb"}` |
| `relay_message_rx_bytes` | counter | | `rmb_relay_bytes_in_total{dialect="rmb"}` |
| `relay_message_tx` | counter | | `rmb_relay_messages_out_total{dialect="rmb"}` |
| `relay_message_tx_bytes` | counter | | `rmb_relay_bytes_out_total{dialect="rmb"}` |
| `relay_worker_connections` | gauge | worker | `rmb_relay_sessions{dialect="rmb"}`, as worker `0` |
| `relay_session_evictions_total` | counter | reason | sessions ended (below) |
| `federation_message_success` | counter | relay | `rmb_relay_federation_delivered_total{relay}` |
| `federation_message_error` | counter | relay | `rmb_relay_federation_failed_total{relay}` |
| `relay_message_rx_twin` | counter | twin | `rmb_relay_twin_messages_in_total{twin}` |

`relay_session_evictions_total{reason}`: `cancelled` counts sessions replaced by a newer login
of the same twin and session (`rmb_relay_sessions_replaced_total`), `closed` the other ended
sessions (logins - replaced - live), `back_pressure_timeout` stays 0: we pause a sender while its
receiver is slow (docs/backpressure.md) instead of evicting the receiver after a timeout.

Why the exposition is written here and not by prometheus_client: rmb-rs's counters are named
without `_total` (`relay_message_rx`), which the Prometheus text format allows and
prometheus_client's encoder would rename (`relay_message_rx_total`), breaking every query. So
the text format gets rmb-rs's exact lines (`# TYPE relay_message_rx counter`,
`relay_message_rx 12`). OpenMetrics cannot express a counter without `_total`: there those
counters are `unknown` (the series keep their names, which is what queries use); a counter
already ending in `_total` stays a counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric as MetricFamily

from rmb_relay.telemetry.metrics import LabelValues, Registry

Samples = Callable[[], Iterable[tuple[LabelValues, float]]]


@dataclass(frozen=True, slots=True)
class UpstreamFamily:
    """One rmb-rs name: its type and labels as rmb-rs declares them, and where its values come
    from."""

    name: str
    kind: str
    help: str
    labels: LabelValues
    read: Samples

    def samples(self) -> list[tuple[LabelValues, float]]:
        out: dict[LabelValues, float] = {}
        for values, number in self.read():
            out[values] = out.get(values, 0) + number
        if not out and not self.labels:
            out[()] = 0
        return sorted(out.items())

    def text(self) -> str:
        """This family in the Prometheus text format (0.0.4), as rmb-rs's encoder writes it."""
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        for values, number in self.samples():
            lines.append(f"{self.name}{_label_text(self.labels, values)} {_number(number)}")
        return "\n".join(lines) + "\n"

    def openmetrics(self) -> MetricFamily:
        family: MetricFamily
        if self.kind == "gauge":
            family = GaugeMetricFamily(self.name, self.help, labels=self.labels)
            for values, number in self.samples():
                family.add_metric(values, number)
        elif self.name.endswith("_total"):
            family = CounterMetricFamily(self.name[: -len("_total")], self.help, labels=self.labels)
            for values, number in self.samples():
                family.add_metric(values, number)
        else:
            family = MetricFamily(self.name, self.help, "unknown")
            for values, number in self.samples():
                family.add_sample(self.name, dict(zip(self.labels, values, strict=True)), number)
        return family


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(labels: LabelValues, values: LabelValues) -> str:
    if not labels:
        return ""
    pairs = (
        f'{label}="{_escape_value(value)}"' for label, value in zip(labels, values, strict=True)
    )
    return "{" + ",".join(pairs) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _ours(registry: Registry, name: str, *labels: str) -> float:
    """One sample of our family `name` (0 while it is not registered: that dialect is off)."""
    if name not in registry.names():
        return 0
    return registry.get(name).value(*labels)


def _by_label(registry: Registry, name: str) -> Iterator[tuple[LabelValues, float]]:
    """Every sample of our single-label family `name`."""
    if name in registry.names():
        yield from registry.samples(name)


def families(registry: Registry) -> list[UpstreamFamily]:
    """The rmb-rs names over `registry`'s families (see the module docstring)."""

    def one(name: str, *labels: str) -> Samples:
        return lambda: [((), _ours(registry, name, *labels))]

    def evictions() -> list[tuple[LabelValues, float]]:
        logins = _ours(registry, "rmb_relay_logins_total", "rmb")
        replaced = _ours(registry, "rmb_relay_sessions_replaced_total", "rmb")
        live = _ours(registry, "rmb_relay_sessions", "rmb")
        return [
            (("back_pressure_timeout",), 0),
            (("cancelled",), replaced),
            (("closed",), max(0.0, logins - replaced - live)),
        ]

    return [
        UpstreamFamily(
            "relay_message_rx",
            "counter",
            "number of messages received by relay",
            (),
            one("rmb_relay_messages_in_total", "rmb"),
        ),
        UpstreamFamily(
            "relay_message_tx",
            "counter",
            "number of messages forwarded by relay",
            (),
            one("rmb_relay_messages_out_total", "rmb"),
        ),
        UpstreamFamily(
            "relay_message_rx_bytes",
            "counter",
            "size of messages received by relay in bytes",
            (),
            one("rmb_relay_bytes_in_total", "rmb"),
        ),
        UpstreamFamily(
            "relay_message_tx_bytes",
            "counter",
            "size of messages forwarded by relay in bytes",
            (),
            one("rmb_relay_bytes_out_total", "rmb"),
        ),
        UpstreamFamily(
            "relay_worker_connections",
            "gauge",
            "number of connections handled by this worker",
            ("worker",),
            lambda: [(("0",), _ours(registry, "rmb_relay_sessions", "rmb"))],
        ),
        UpstreamFamily(
            "relay_session_evictions_total",
            "counter",
            "Total number of session evictions from the relay, labeled by reason",
            ("reason",),
            evictions,
        ),
        UpstreamFamily(
            "relay_message_rx_twin",
            "counter",
            "number of messages received by relay per twin",
            ("twin",),
            lambda: _by_label(registry, "rmb_relay_twin_messages_in_total"),
        ),
        UpstreamFamily(
            "federation_message_success",
            "counter",
            "number of messages send successfully via federation",
            ("relay",),
            lambda: _by_label(registry, "rmb_relay_federation_delivered_total"),
        ),
        UpstreamFamily(
            "federation_message_error",
            "counter",
            "number of messages that failed to send via federation",
            ("relay",),
            lambda: _by_label(registry, "rmb_relay_federation_failed_total"),
        ),
    ]


def register(registry: Registry) -> None:
    """Export the rmb-rs names from `registry`'s /metrics."""
    for family in families(registry):
        registry.add_upstream(family.name, family.text, family.openmetrics)
