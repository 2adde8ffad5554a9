"""Process metrics: our own plain numbers, exposed through `prometheus_client`.

Why the values are not `prometheus_client` metrics: its `Counter.inc` takes a lock and costs
~200 ns; the relay bumps several counters per message from one event-loop thread, and that
alone was 15-19% of its CPU under load. So the hot counters are plain int attributes the
dialects own (`HotCounters`), read by `counter_of` callbacks, and the rest are small dicts
here. `prometheus_client` does what it is good at: a `Collector` turns the numbers into metric
families at scrape time and its encoders write the exposition (text or OpenMetrics, by the
scraper's `Accept` header).

Names and families (docs/metrics.md has the table)
--------------------------------------------------
Every metric is `rmb_relay_<what>`; counters end in `_total`. A per-dialect metric has a
`dialect` label, and one family is usually fed by several registrations: the listener counts
`rmb_relay_messages_dropped_total{dialect, reason="connection closing"}`, RMB and SBD add their
own reasons to the same family. A registration fixes some labels with `const` (typically
`{"dialect": "rmb"}`) and gets a handle that fills them in, so a call site passes only the labels
it varies. Registering a name again needs the same type, labels and help; samples with the same
label values from two sources are summed.

Bounded label values: every label value must come from a fixed set, or a client could create
series without bound (and memory with them). Reasons are the code's own strings; a label fed
from the wire (the HTTP method) is declared with `allowed=` and anything outside the set is
counted as `other`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric as MetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

LabelValues = tuple[str, ...]
Read = Callable[[], Iterable[tuple[LabelValues, float]]]

#: every metric of the relay starts with this (one product, one prefix)
PREFIX = "rmb_relay_"
#: the value a label declared with `allowed=` takes for anything outside its set
OTHER = "other"

_NAME = re.compile(r"[a-z_][a-z0-9_]*")


class _Family:
    """One metric name: its shape, the values counted here, and the callbacks read at scrape."""

    __slots__ = ("allowed", "help", "kind", "labels", "name", "reads", "values")

    def __init__(self, kind: str, name: str, help_text: str, labels: LabelValues) -> None:
        self.kind = kind
        self.name = name
        self.help = help_text
        self.labels = labels
        self.values: dict[LabelValues, float] = {}
        self.reads: list[tuple[LabelValues, Read]] = []
        #: label position -> the values it may take (the rest become OTHER)
        self.allowed: dict[int, frozenset[str]] = {}

    def bound(self, key: LabelValues) -> LabelValues:
        """`key` with every value of a bounded label outside its set replaced by OTHER."""
        if not self.allowed:
            return key
        values = list(key)
        for index, allowed in self.allowed.items():
            if values[index] not in allowed:
                values[index] = OTHER
        return tuple(values)

    def samples(self) -> dict[LabelValues, float]:
        """Label values -> number, over every source (equal label values summed)."""
        out = dict(self.values)
        for prefix, read in self.reads:
            for values, number in read():
                key = self.bound(prefix + tuple(values))
                out[key] = out.get(key, 0) + number
        if not out and not self.labels:
            out[()] = 0
        return out

    def family(self) -> MetricFamily:
        family: MetricFamily
        if self.kind == "counter":
            # CounterMetricFamily takes the name without `_total` and adds it to the sample
            family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        else:
            family = GaugeMetricFamily(self.name, self.help, labels=self.labels)
        for values, number in sorted(self.samples().items()):
            family.add_metric(values, number)
        return family


class Metric:
    """A handle on one family with some labels fixed (`const`); the base of Counter and Gauge.

    `value(*label_values)` is the current number for the remaining labels, over every source of
    the family (plain counts and `read` callbacks alike), so tests read what /metrics shows."""

    __slots__ = ("_family", "_prefix", "_width")

    def __init__(self, family: _Family, prefix: LabelValues) -> None:
        self._family = family
        self._prefix = prefix
        self._width = len(family.labels)

    @property
    def name(self) -> str:
        return self._family.name

    @property
    def kind(self) -> str:
        """`counter` or `gauge`."""
        return self._family.kind

    @property
    def help(self) -> str:
        return self._family.help

    @property
    def labels(self) -> LabelValues:
        """All label names of the family, the fixed ones first."""
        return self._family.labels

    def _key(self, label_values: LabelValues) -> LabelValues:
        key = self._prefix + label_values if self._prefix else label_values
        if len(key) != self._width:
            raise ValueError(
                f"{self._family.name} takes {self._width - len(self._prefix)} label values "
                f"after {self._prefix!r}, got {label_values!r}"
            )
        return self._family.bound(key)

    def value(self, *label_values: str) -> float:
        return self._family.samples().get(self._key(label_values), 0)

    def _add(self, amount: float, label_values: LabelValues) -> None:
        key = self._key(label_values)
        values = self._family.values
        values[key] = values.get(key, 0) + amount


class Counter(Metric):
    """Monotonic count. `inc()` is a dict update (~100 ns): fine per connection or per error,
    too much per relayed message, where a plain int read through `counter_of` belongs."""

    __slots__ = ()

    def inc(self, amount: float = 1, *label_values: str) -> None:
        if amount < 0:
            raise ValueError(f"{self._family.name}: a counter only goes up (got {amount})")
        # `_add`, `_key` and `bound` inlined for the common case (the HTTP server counts
        # every request, with a bounded label): no calls, no list when the values are known;
        # 0.36 -> 0.23 us a count (timeit)
        prefix = self._prefix
        key = prefix + label_values if prefix else label_values
        family = self._family
        if len(key) != self._width:
            key = self._key(label_values)  # words the error
        else:
            for index, allowed in family.allowed.items():
                if key[index] not in allowed:
                    key = family.bound(key)
                    break
        values = family.values
        values[key] = values.get(key, 0) + amount


class Gauge(Metric):
    """A value that goes up and down, or is read from a callback at scrape time."""

    __slots__ = ()

    def set(self, value: float, *label_values: str) -> None:
        self._family.values[self._key(label_values)] = value

    def inc(self, amount: float = 1, *label_values: str) -> None:
        self._add(amount, label_values)

    def dec(self, amount: float = 1, *label_values: str) -> None:
        self._add(-amount, label_values)


class _FamilyCollector(Collector):
    """The bridge to prometheus_client: yields our families, in registration order."""

    def __init__(self, families: Mapping[str, _Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[MetricFamily]:
        for family in self._families.values():
            yield family.family()


class _UpstreamCollector(Collector):
    """The OpenMetrics side of `Registry.add_upstream` families."""

    def __init__(
        self, upstream: Mapping[str, tuple[Callable[[], str], Callable[[], MetricFamily]]]
    ) -> None:
        self._upstream = upstream

    def collect(self) -> Iterator[MetricFamily]:
        for _, openmetrics in self._upstream.values():
            yield openmetrics()


class Registry:
    """Every metric of one process. Dialects and the listener register into the same one."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        #: `add_read` sources of families not registered yet, by name
        self._waiting_reads: dict[str, list[Read]] = {}
        self._prometheus = CollectorRegistry(auto_describe=False)
        self._prometheus.register(_FamilyCollector(self._families))
        #: families under another product's names (telemetry/upstream_names.py): their text
        #: and OpenMetrics forms, appended to the exposition
        self._upstream: dict[str, tuple[Callable[[], str], Callable[[], MetricFamily]]] = {}
        self._upstream_prometheus = CollectorRegistry(auto_describe=False)
        self._upstream_prometheus.register(_UpstreamCollector(self._upstream))

    def counter(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...] = (),
        *,
        const: Mapping[str, str] | None = None,
        allowed: Mapping[str, Collection[str]] | None = None,
    ) -> Counter:
        """A counter counted here. `const` fixes labels for this handle (they come first in the
        family's label order); `allowed` bounds a label fed from outside to a fixed set."""
        family, prefix = self._family("counter", name, help_text, labels, const, allowed)
        if not labels:
            family.values.setdefault(prefix, 0)  # shown as 0 before the first event
        return Counter(family, prefix)

    def counter_of(
        self,
        name: str,
        help_text: str,
        read: Read,
        labels: tuple[str, ...] = (),
        *,
        const: Mapping[str, str] | None = None,
    ) -> Counter:
        """A counter whose value lives elsewhere (a plain int on the hot path), read at scrape;
        `read` yields (label values after the `const` ones, number)."""
        family, prefix = self._family("counter", name, help_text, labels, const, None)
        family.reads.append((prefix, read))
        return Counter(family, prefix)

    def gauge(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...] = (),
        read: Read | None = None,
        *,
        const: Mapping[str, str] | None = None,
    ) -> Gauge:
        family, prefix = self._family("gauge", name, help_text, labels, const, None)
        if read is not None:
            family.reads.append((prefix, read))
        elif not labels:
            family.values.setdefault(prefix, 0)
        return Gauge(family, prefix)

    def _family(
        self,
        kind: str,
        name: str,
        help_text: str,
        labels: tuple[str, ...],
        const: Mapping[str, str] | None,
        allowed: Mapping[str, Collection[str]] | None,
    ) -> tuple[_Family, LabelValues]:
        const = const or {}
        full = (*const, *labels)
        _check_shape(kind, name, full)
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = _Family(kind, name, help_text, full)
            family.reads.extend(((), read) for read in self._waiting_reads.pop(name, ()))
        elif (family.kind, family.labels, family.help) != (kind, full, help_text):
            raise ValueError(
                f"metric {name} registered twice with different shapes: "
                f"{family.kind}{family.labels} {family.help!r} vs {kind}{full} {help_text!r}"
            )
        for label, values in (allowed or {}).items():
            if label not in labels:
                raise ValueError(f"{name}: allowed= names {label!r}, not one of its labels")
            index = full.index(label)
            bounded = frozenset(values) | {OTHER}
            if family.allowed.setdefault(index, bounded) != bounded:
                raise ValueError(f"{name}: label {label!r} bounded twice differently")
        return family, tuple(const.values())

    def add_read(self, name: str, read: Read) -> None:
        """Another source of an existing family's values (label values without its `const`
        ones, number), read at scrape beside what is counted here: a Rust table that counts
        what Python no longer sees (the tunnel's hub)."""
        family = self._families.get(name)
        if family is None:  # registered later (the listener's families come after dialects')
            self._waiting_reads.setdefault(name, []).append(read)
        else:
            family.reads.append(((), read))

    def add_upstream(
        self, name: str, text: Callable[[], str], openmetrics: Callable[[], MetricFamily]
    ) -> None:
        """Export a family under a name outside our scheme (rmb-rs's, for dashboards built on
        it): `text` writes it in the Prometheus text format, `openmetrics` as a family for the
        OpenMetrics encoder; both read at scrape."""
        if name in self._families or name in self._upstream:
            raise ValueError(f"metric {name} registered twice")
        self._upstream[name] = (text, openmetrics)

    def upstream_names(self) -> list[str]:
        """The names `add_upstream` exported (rmb-rs's)."""
        return list(self._upstream)

    def samples(self, name: str) -> list[tuple[LabelValues, float]]:
        """Every sample of family `name`: (all label values, number), sorted."""
        return sorted(self._families[name].samples().items())

    def get(self, name: str) -> Metric:
        """The whole family (no label fixed): `get(name).value(*all_label_values)`."""
        family = self._families[name]
        return Counter(family, ()) if family.kind == "counter" else Gauge(family, ())

    def names(self) -> list[str]:
        return list(self._families)

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return self.exposition(None)[0].decode()

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """(body, content type) for a scrape, in the format its `Accept` header asks for:
        OpenMetrics when asked, the Prometheus text format otherwise."""
        encoder, content_type = choose_encoder(accept or "")
        body = encoder(self._prometheus)
        if not self._upstream:
            return body, content_type
        if encoder is generate_latest:
            extra = "".join(text() for text, _ in self._upstream.values()).encode()
            return body + extra, content_type
        # OpenMetrics: one document, one `# EOF` at its end
        eof = b"# EOF\n"
        upstream = encoder(self._upstream_prometheus)
        return body.removesuffix(eof) + upstream, content_type


def _check_shape(kind: str, name: str, labels: LabelValues) -> None:
    """The naming rules, checked where a metric is declared so a bad one fails at startup."""
    if not name.startswith(PREFIX) or not _NAME.fullmatch(name):
        raise ValueError(f"metric name {name!r} must be {PREFIX}<what> in [a-z0-9_]")
    if (kind == "counter") != name.endswith("_total"):
        raise ValueError(f"metric {name!r}: counters, and only counters, end in _total")
    for label in labels:
        if not _NAME.fullmatch(label) or label.startswith("__"):
            raise ValueError(f"metric {name!r}: bad label name {label!r}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"metric {name!r}: label named twice in {labels!r}")
