"""What every benchmark reads about the processes it runs: a free port to start them on, and
their CPU time and resident memory from /proc (so a figure is the process's own, not the
machine's)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tests.redis_process import free_port as free_port

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds the process has used so far: what it spent itself and what
    the kernel spent for it (its writes, mostly)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used so far."""
    return sum(cpu_split(pid))


def children(pid: int) -> list[int]:
    """The live child processes of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU of the process and of its live children (a relay's route-record writer is one):
    what the process costs, whatever it handed to a helper process."""
    total = cpu_seconds(pid)
    for child in children(pid):
        with contextlib.suppress(OSError):  # ended meanwhile
            total += cpu_seconds(child)
    return total


def system_seconds(pid: int) -> float:
    """The kernel's part of `cpu_seconds` (syscalls, and the loopback network stack)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / TICKS


def wait_seconds(pid: int) -> float:
    """Time the process's main thread spent runnable but not running (waiting for a core,
    /proc/PID/schedstat): on a host shared with other work it tells a process that was
    starved of CPU from one that was idle; 0 when the kernel does not say."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def io_syscalls(pid: int) -> tuple[int, int]:
    """Read-like and write-like system calls the process has made so far (`syscr`, `syscw` of
    /proc/PID/io; a socket's read/write/recv/send count there, epoll_wait does not): per
    request, they tell how well a process batches its socket I/O. (0, 0) when unreadable."""
    try:
        fields = dict(
            line.split(": ", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines()
        )
        return int(fields["syscr"]), int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def rss_bytes(pid: int) -> int:
    """Resident memory now (VmRSS); 0 when the kernel does not say."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
