"""The one clock convention of rmb-relay.

A clock is a zero-argument callable returning **integer nanoseconds**. There are two kinds,
and each component takes the kind it needs as a constructor argument (tests pass a fake):

- `wall_clock` (unix epoch, `time.time_ns`): for anything compared with times on the wire or
  in storage: JWT `iat`/`exp`, envelope timestamps and expiry, mailbox deadlines (which are
  unix *seconds*, as rmb-rs stores them: divide with `seconds`).
- `monotonic_clock` (`time.monotonic_ns`): for durations only: rate limits, idle timeouts,
  cache TTLs. It never jumps when the system time is set.

The Rust core takes the same integers as arguments (it never reads a clock itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], int]

#: nanoseconds per second
NS = 1_000_000_000

wall_clock: Clock = time.time_ns
monotonic_clock: Clock = time.monotonic_ns


def seconds(nanos: int) -> int:
    """Whole seconds of a nanosecond reading (floor), e.g. a unix timestamp from `wall_clock()`."""
    return nanos // NS


def nanos(secs: float) -> int:
    """A duration in seconds (flags, TTLs) as nanoseconds."""
    return int(secs * NS)
