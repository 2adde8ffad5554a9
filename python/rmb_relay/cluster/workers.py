"""`rmb-relay --processes N`: N relay processes on one host sharing one port.

Python serves one core per process, so a host with more cores runs more processes. Each
worker is a full `rmb-relay serve` with `--reuse-port` (the kernel spreads new connections over
the sockets bound with SO_REUSEPORT) and its own `--instance-id`; they find each other's
sessions through the cluster (`--redis`), exactly as instances on different hosts do. The
parent only starts them, passes SIGINT/SIGTERM on, and exits when they have all exited (with
the first non-zero status). A worker that dies is not restarted: its clients reconnect to the
others, which take over what waited for it (docs/cluster.md); a supervisor (systemd, k8s)
restarts the whole service.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

from rmb_relay.errors import ConfigError


def check(workers: int, redis: str | None, port: int) -> None:
    """Raise ConfigError when the flags cannot make a working group of workers."""
    if workers < 1:
        raise ConfigError("--processes must be at least 1")
    if workers > 1 and not redis:
        raise ConfigError(
            "--processes N needs --redis: the processes find each other's sessions there"
        )
    if workers > 1 and port == 0:
        raise ConfigError("--processes N needs a fixed port (with port 0 each would get its own)")


def worker_argv(argv: Sequence[str], index: int, instance_base: str) -> list[str]:
    """The serve command line of worker `index`: ours without --processes, plus --reuse-port and
    an instance id of its own."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--processes":
            skip = True
            continue
        if arg.startswith("--processes="):
            continue
        out.append(arg)
    return [*out, "--reuse-port", "--instance-id", f"{instance_base}-w{index}"]


def run_workers(argv: Sequence[str], workers: int, instance_base: str) -> int:
    """Start the workers and wait for them; returns the exit status."""
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "rmb_relay", "serve", *worker_argv(argv, i, instance_base)]
        )
        for i in range(workers)
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    for child in children:
        code = child.wait()
        if code and not status:
            status = code
    return status


def default_base() -> str:
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"
