"""What the relay process costs the machine: CPU seconds and resident memory, read from the
kernel when asked (getrusage, /proc/self/statm)."""

from __future__ import annotations

import os
import resource

_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    """User plus system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_bytes() -> int:
    """Resident memory now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0
