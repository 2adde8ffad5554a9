"""A real `redis-server` on a free loopback port, for tests and benchmarks alike. Standard
library only, so a benchmark that must not import rmb-relay (the 신경 acceptance run) can use
it too."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import ExitStack
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


#: masters of the local Redis Cluster tests and benchmarks start
CLUSTER_MASTERS = 3


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _wait_until_ok(ports: list[int]) -> None:
    """Until every node reports `cluster_state:ok` (after `create` the nodes still gossip for a
    moment; until then commands answer CLUSTERDOWN). Polls `redis-cli`: there is no event to
    wait on from outside the nodes."""
    deadline = time.monotonic() + WAIT * 3
    pending = list(ports)
    while pending:
        info = subprocess.run(
            ["redis-cli", "-p", str(pending[0]), "cluster", "info"],
            capture_output=True,
            timeout=WAIT,
        ).stdout
        if b"cluster_state:ok" in info:
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis cluster node {pending[0]} not ok in time:\n{info.decode()}")
        time.sleep(0.05)


@dataclass
class RedisCluster:
    """A Redis Cluster of `redis-server --cluster-enabled yes` nodes on loopback, no replicas."""

    nodes: list[RedisServer]
    stack: ExitStack

    @property
    def url(self) -> str:
        """One node's URL: the client discovers the others."""
        return self.nodes[0].url

    def stop(self) -> None:
        self.stack.close()


def start_redis_cluster(directory: str, masters: int = CLUSTER_MASTERS) -> RedisCluster:
    """Start `masters` nodes and join them with `redis-cli --cluster create`; returns once every
    node reports the cluster ok. Raises RuntimeError when redis-cli/redis-server are missing."""
    if shutil.which("redis-cli") is None:
        raise RuntimeError("redis-cli is not installed: run `make test`, which installs it")
    stack = ExitStack()
    nodes: list[RedisServer] = []
    try:
        for _ in range(masters):
            port = _cluster_port()
            node = start_redis(
                directory,
                port,
                durable=False,
                extra=("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"),
            )
            stack.callback(node.stop)
            nodes.append(node)
        subprocess.run(
            ["redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{node.port}" for node in nodes]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=WAIT * 3,
        )
        _wait_until_ok([node.port for node in nodes])
    except BaseException:
        stack.close()
        raise
    return RedisCluster(nodes, stack)
