"""A real `redis-server` on a free loopback port, for tests and benchmarks alike. Standard
library only, so a benchmark that must not import rmb-relay (the 신경 acceptance run) can use
it too."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tests.processes import stop_processes

#: bounded waits: a redis-server that does not stop is a failure, not a stuck run
WAIT = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]
    directory: str
    drain: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """SIGTERM; SIGKILL after `processes.GRACE` (a stuck server must not hang the run)."""
        stop_processes([self.process], close_pipes=False)
        if self.drain is not None:
            self.drain.join(WAIT)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_redis(
    directory: str, port: int | None = None, *, durable: bool = True, extra: Sequence[str] = ()
) -> RedisServer:
    """A real redis-server on loopback; returns once it logs that it accepts connections.
    `durable`: an append-only file synced on every write, so a restart on the same directory and
    port keeps what it acknowledged (benchmarks that measure throughput turn it off). `extra`:
    more options (a Redis Cluster node's). Raises RuntimeError when it is not installed or
    exits early."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: run `make test`, which installs it")
    port = port or free_port()
    process = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            directory,
            "--save",
            "",
            *(("--appendonly", "yes", "--appendfsync", "always") if durable else ()),
            "--loglevel",
            "notice",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdout is not None
    seen = []
    for line in iter(process.stdout.readline, b""):
        seen.append(line)
        if b"Ready to accept connections" in line:
            break
    else:
        raise RuntimeError("redis-server exited early:\n" + b"".join(seen).decode(errors="replace"))
    # keep reading its log so a full pipe never blocks redis
    log = process.stdout
    assert log is not None
    drain = threading.Thread(target=lambda: deque(log, maxlen=0), daemon=True)
    drain.start()
    return RedisServer(port, process, directory, drain)
