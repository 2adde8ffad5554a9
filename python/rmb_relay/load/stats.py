"""What a load run measures, in a form that merges across generator processes.

Latencies are kept as raw nanosecond samples in an `array` (8 bytes each: a million messages
is 8 MB), so percentiles are exact and merging processes is concatenation. A process's
recorder (`_core.LoadRecorder`) fills them; the percentiles are computed in Rust too.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from rmb_relay._core import latency_percentiles


@dataclass
class RunStats:
    """Counters and samples of one generator process (or, merged, of a whole run)."""

    sent: int = 0
    #: deliveries the messages sent should make (a BROADCAST to N clients: N each)
    expected: int = 0
    delivered: int = 0
    #: deliveries the relay answered with an error instead (counted in `errors` by reason)
    refused: int = 0
    #: what stopped the run early (a refusal, a lost connection): one line, exit code 2
    fatal: str | None = None
    #: delivered inside the measuring window (after warm-up): the throughput numerator
    measured: int = 0
    duplicated: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ns: array[int] = field(default_factory=lambda: array("q"))
    connect_ns: array[int] = field(default_factory=lambda: array("q"))
    #: (second since start, messages delivered in that second)
    timeline: dict[int, int] = field(default_factory=dict)
    bytes_delivered: int = 0
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    measure_seconds: float = 0.0

    def error(self, kind: str, n: int = 1) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + n

    def merge(self, other: RunStats) -> None:
        self.sent += other.sent
        self.expected += other.expected
        self.delivered += other.delivered
        self.refused += other.refused
        if self.fatal is None:
            self.fatal = other.fatal
        self.measured += other.measured
        self.duplicated += other.duplicated
        for kind, n in other.errors.items():
            self.error(kind, n)
        self.latencies_ns.extend(other.latencies_ns)
        self.connect_ns.extend(other.connect_ns)
        for second, n in other.timeline.items():
            self.timeline[second] = self.timeline.get(second, 0) + n
        self.bytes_delivered += other.bytes_delivered
        self.cpu_seconds += other.cpu_seconds
        self.wall_seconds = max(self.wall_seconds, other.wall_seconds)
        self.measure_seconds = max(self.measure_seconds, other.measure_seconds)

    def to_wire(self) -> dict[str, Any]:
        """Picklable form for multiprocessing."""
        data = dict(self.__dict__)
        data["latencies_ns"] = self.latencies_ns.tobytes()
        data["connect_ns"] = self.connect_ns.tobytes()
        return data

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RunStats:
        data = dict(data)
        latencies, connects = array("q"), array("q")
        latencies.frombytes(data.pop("latencies_ns"))
        connects.frombytes(data.pop("connect_ns"))
        return cls(latencies_ns=latencies, connect_ns=connects, **data)


def percentiles(samples: array[int], points: tuple[float, ...]) -> dict[str, float]:
    """Exact percentiles (nearest rank, rust/load.rs) in milliseconds, and the maximum."""
    values = latency_percentiles(samples.tobytes(), list(points))
    out = {f"p{p:g}": ns / 1e6 for p, ns in zip(points, values, strict=False)}
    out["max"] = values[-1] / 1e6
    return out


LATENCY_POINTS = (50.0, 90.0, 99.0, 99.9)


def summary(
    stats: RunStats, config: dict[str, Any], watched: dict[str, float] | None = None
) -> dict[str, Any]:
    """The run's figures, the same for every dialect (printed by `print_summary`, --json).

    `lost` counts deliveries that neither arrived nor were refused; `watched` is the CPU
    seconds of processes given with --watch-pid (the relay...), reported per delivery beside
    the generator's own so that a run shows it measured the relay, not itself."""
    seconds = stats.measure_seconds or 1e-9
    lost = max(0, stats.expected - stats.delivered - stats.refused)
    per_delivery = 1e6 / max(stats.delivered, 1)
    return {
        "config": config,
        "sent": stats.sent,
        "expected": stats.expected,
        "delivered": stats.delivered,
        "lost": lost,
        "duplicated": stats.duplicated,
        "errors": stats.errors,
        "failed": stats.fatal,
        "throughput_msgs_per_s": stats.measured / seconds,
        "throughput_mb_per_s": stats.bytes_delivered / seconds / 1e6,
        "latency_ms": percentiles(stats.latencies_ns, LATENCY_POINTS),
        "connect_ms": percentiles(stats.connect_ns, (50.0, 99.0)),
        "timeline_msgs_per_s": [stats.timeline[s] for s in sorted(stats.timeline)],
        "generator_cpu_share": stats.cpu_seconds / stats.wall_seconds if stats.wall_seconds else 0,
        "generator_cpu_us_per_msg": stats.cpu_seconds * per_delivery,
        "watched_cpu_us_per_msg": {
            name: cpu * per_delivery for name, cpu in (watched or {}).items()
        },
        "measure_seconds": stats.measure_seconds,
    }
