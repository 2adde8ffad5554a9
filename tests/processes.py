"""Stopping the processes a test started, in bounded time. Standard library only (benchmarks use
it too).

A process that ignores SIGTERM must cost a test its grace period, never the whole run: after
the grace it is killed, and the caller is told which ones needed that (a relay that does not
exit on SIGTERM is a bug the test should report, after cleaning up)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterable

#: how long processes get, all together, to exit after SIGTERM; also what a relay promises
#: (its shutdown is bounded by its own timeouts, well under this)
GRACE = 10.0


def stop_processes(
    processes: Iterable[subprocess.Popen[str] | subprocess.Popen[bytes]],
    grace: float = GRACE,
    *,
    close_pipes: bool = True,
) -> list[subprocess.Popen[str] | subprocess.Popen[bytes]]:
    """SIGTERM every process still running, wait up to `grace` seconds for all of them, SIGKILL
    the ones left and reap them, close every pipe (unless a thread still reads one: the caller
    closes it after joining that thread). Returns the processes that had to be killed."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    killed = []
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            killed.append(process)
    for process in killed:
        # a SIGKILLed process is gone at once unless stuck in the kernel (then it is not ours
        # to wait for: report it and go on)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    if not close_pipes:
        return killed
    for process in processes:
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()
    return killed
