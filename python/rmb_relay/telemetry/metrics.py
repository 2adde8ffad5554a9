"""A small Prometheus text-format registry.

Why not `prometheus_client`: its counters take a lock and a dict lookup per increment; our hot
path increments several counters per relayed message from a single event-loop thread, so plain
integer attributes are enough and much cheaper. Rendering happens only on `GET /metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = "untyped"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...] = (),
        read: Callable[[], Iterable[tuple[LabelValues, float]]] | None = None,
    ) -> None:
        self.name = name
        self.help = help_text
        self.labels = labels
        self._values: dict[LabelValues, float] = {}
        self._read = read

    def samples(self) -> Iterable[tuple[LabelValues, float]]:
        if self._read is not None:
            return sorted(self._read())
        return sorted(self._values.items())

    def value(self, *label_values: str) -> float:
        return self._values.get(label_values, 0)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        samples = list(self.samples())
        if not samples and not self.labels:
            samples = [((), 0)]
        for values, number in samples:
            if self.labels:
                pairs = ",".join(
                    f'{k}="{_escape(v)}"' for k, v in zip(self.labels, values, strict=True)
                )
                lines.append(f"{self.name}{{{pairs}}} {_number(number)}")
            else:
                lines.append(f"{self.name} {_number(number)}")
        return "\n".join(lines)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Counter(_Metric):
    """Monotonic count. `inc()` on the unlabelled counter is one dict update; a counter
    incremented per relayed message should instead be a plain int read through `read=`."""

    kind = "counter"

    def inc(self, amount: float = 1, *label_values: str) -> None:
        self._values[label_values] = self._values.get(label_values, 0) + amount


class Gauge(_Metric):
    """A value that goes up and down, or is read from a callback at render time."""

    kind = "gauge"

    def set(self, value: float, *label_values: str) -> None:
        self._values[label_values] = value

    def inc(self, amount: float = 1, *label_values: str) -> None:
        self._values[label_values] = self._values.get(label_values, 0) + amount

    def dec(self, amount: float = 1, *label_values: str) -> None:
        self._values[label_values] = self._values.get(label_values, 0) - amount

    def samples(self) -> Iterable[tuple[LabelValues, float]]:
        if self._read is not None:
            return sorted(self._read())
        return super().samples()


M = TypeVar("M", bound=_Metric)


class Registry:
    """Every metric of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._add(Counter(name, help_text, labels))

    def counter_of(
        self,
        name: str,
        help_text: str,
        read: Callable[[], Iterable[tuple[LabelValues, float]]],
        labels: tuple[str, ...] = (),
    ) -> Counter:
        """A counter whose value lives elsewhere (a plain int on the hot path)."""
        return self._add(Counter(name, help_text, labels, read))

    def gauge(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...] = (),
        read: Callable[[], Iterable[tuple[LabelValues, float]]] | None = None,
    ) -> Gauge:
        return self._add(Gauge(name, help_text, labels, read))

    def _add(self, metric: M) -> M:
        existing = self._metrics.get(metric.name)
        if existing is not None:
            if type(existing) is not type(metric) or existing.labels != metric.labels:
                raise ValueError(f"metric {metric.name} registered twice with different shapes")
            return existing  # type: ignore[return-value,unused-ignore]
        self._metrics[metric.name] = metric
        return metric

    def get(self, name: str) -> _Metric:
        return self._metrics[name]

    def render(self) -> str:
        return "\n".join(m.render() for m in self._metrics.values()) + "\n"
