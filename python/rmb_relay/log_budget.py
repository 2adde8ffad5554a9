"""A bound on log lines a stranger can cause: the same message (one logger, level and format
string) is written at most `rate` times a second, in bursts of `BURST_SECONDS` worth; the
lines over it are counted, and the next line of that message that is written says how many
were left out.

Why: the relay logs a refusal at INFO (a malformed request, a refused upgrade, a failed
login), which is what an operator wants to see once, but a flood of them is a line per
request the attacker sends: disk and journal throughput it chooses. Errors and above always
pass (an error a stranger can cause on purpose is a bug to see, not to sample).

A `logging.Filter` on the process's handler, so every call site is covered without changing
it. Time is each record's own `created` stamp: the filter reads no clock.
"""

from __future__ import annotations

import logging

__all__ = ["DEFAULT_LOG_RATE", "LogBudget", "suppressed"]

#: lines per second one message may write
DEFAULT_LOG_RATE = 5.0
#: a quiet message may write this many seconds' worth at once
BURST_SECONDS = 10.0
#: messages remembered (format strings are the code's own; an f-string message is not, so the
#: table is cleared when it grows past this)
MAX_MESSAGES = 1024

#: lines left out so far by every `LogBudget` of the process
#: (`rmb_relay_log_lines_suppressed_total`)
_suppressed = [0]


def suppressed() -> int:
    return _suppressed[0]


class LogBudget(logging.Filter):
    """See the module docstring."""

    def __init__(self, rate: float = DEFAULT_LOG_RATE) -> None:
        super().__init__()
        if not rate > 0:
            raise ValueError("--log-rate must be positive")
        self.rate = rate
        self.burst = rate * BURST_SECONDS
        #: (logger, level, format string) -> [tokens, last seen, lines left out since written]
        self._messages: dict[tuple[str, int, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        key = (record.name, record.levelno, str(record.msg))
        entry = self._messages.get(key)
        if entry is None:
            if len(self._messages) >= MAX_MESSAGES:
                self._messages.clear()
            entry = self._messages[key] = [self.burst, record.created, 0.0]
        tokens = min(self.burst, entry[0] + (record.created - entry[1]) * self.rate)
        entry[1] = record.created
        if tokens < 1.0:
            entry[0] = tokens
            entry[2] += 1
            _suppressed[0] += 1
            return False
        entry[0] = tokens - 1.0
        if entry[2]:
            record.msg = f"{record.msg} ({int(entry[2])} more like this left out before)"
            entry[2] = 0.0
        return True
