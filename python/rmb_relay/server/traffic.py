"""Traffic totals since the relay started, and rates over the last seconds.

Totals are the open connections' counters plus those of every connection that closed
(`Retired`, told by the listener as each one goes), so they never step back when a busy
connection leaves. A rate is the change of the totals between now and a sample at least
`WINDOW` seconds old (samples are taken when someone asks, at most one per `WINDOW / 2`, so
a monitor polled every second shows the last second or two, and nothing runs when nobody
asks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rmb_relay.clock import NS

if TYPE_CHECKING:
    from rmb_relay.server.connection_base import ConnectionBase

#: seconds a rate is measured over, at least
WINDOW = 1.0
#: samples kept (enough for a few minutes of polling every half window)
KEEP = 16

#: messages in, bytes in, messages out, bytes out
Traffic = tuple[int, int, int, int]
FIELDS = ("msgs_in", "bytes_in", "msgs_out", "bytes_out")


class Retired:
    """The traffic of connections that closed, summed."""

    __slots__ = ("bytes_in", "bytes_out", "msgs_in", "msgs_out")

    def __init__(self) -> None:
        self.msgs_in = self.bytes_in = self.msgs_out = self.bytes_out = 0

    def add(self, conn: ConnectionBase) -> None:
        msgs_in, bytes_in, msgs_out, bytes_out = conn.traffic()
        self.msgs_in += msgs_in
        self.bytes_in += bytes_in
        self.msgs_out += msgs_out
        self.bytes_out += bytes_out


def totals(open_conns: Iterable[ConnectionBase], retired: Retired) -> Traffic:
    msgs_in, bytes_in = retired.msgs_in, retired.bytes_in
    msgs_out, bytes_out = retired.msgs_out, retired.bytes_out
    for conn in open_conns:
        a, b, c, d = conn.traffic()
        msgs_in += a
        bytes_in += b
        msgs_out += c
        bytes_out += d
    return msgs_in, bytes_in, msgs_out, bytes_out


class Rates:
    """Samples of (time ns, CPU seconds, traffic) and the rates between them."""

    def __init__(self, started_at: int, cpu: float) -> None:
        self._samples: deque[tuple[int, float, Traffic]] = deque(maxlen=KEEP)
        self._samples.append((started_at, cpu, (0, 0, 0, 0)))

    def sample(self, now: int, cpu: float, traffic: Traffic) -> dict[str, float]:
        """Record this reading (if the last one is old enough) and return the rates per
        second against the newest sample at least `WINDOW` old (else the oldest), with the
        CPU share (1.0 = one core) as `cpu`."""
        samples = self._samples
        base = samples[0]
        for earlier in reversed(samples):
            if now - earlier[0] >= WINDOW * NS:
                base = earlier
                break
        if now - samples[-1][0] >= WINDOW * NS / 2:
            samples.append((now, cpu, traffic))
        elapsed = (now - base[0]) / NS
        if elapsed <= 0:
            return {"cpu": 0.0, **{f"{name}_per_s": 0.0 for name in FIELDS}}
        rates = {
            f"{name}_per_s": round((value - then) / elapsed, 1)
            for name, value, then in zip(FIELDS, traffic, base[2], strict=True)
        }
        return {"cpu": round((cpu - base[1]) / elapsed, 3), "window_s": round(elapsed, 3), **rates}
