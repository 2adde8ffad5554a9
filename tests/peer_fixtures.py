"""Real processes for rmb-peer tests: relays (`python -m rmb_relay serve`), twins added with
`rmb-relay twins add`, peers (`python -m rmb_relay.peer.cli`), each peer on its own
`redis-server`. Everything waits on a line the process prints, never on a sleep."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mnemonic import Mnemonic

from tests.conftest import WAIT, RedisServer, start_redis
from tests.processes import relay_env

#: the log line scripts wait for (spec/rmb.md §5.3)
CONNECTED = 'now connected to relay Some("localhost")'


def mnemonic_for(twin: int) -> str:
    """A deterministic BIP39 phrase per test twin."""
    entropy = hashlib.sha256(f"rmb-peer test twin {twin}".encode()).digest()[:16]
    return str(Mnemonic("english").to_mnemonic(entropy))


class Output:
    """A process's output lines, read by a thread; `wait_for` blocks until a line contains
    the text (or the process exits, or WAIT passes)."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def count(self, text: str) -> int:
        with self._changed:
            return sum(text in line for line in self.lines)

    def wait_for(self, text: str, times: int = 1, timeout: float = WAIT) -> None:
        with self._changed:
            ok = self._changed.wait_for(
                lambda: self._done or sum(text in line for line in self.lines) >= times, timeout
            )
            if not ok or sum(text in line for line in self.lines) < times:
                raise AssertionError(
                    f"{text!r} x{times} not seen; output:\n" + "\n".join(self.lines[-40:])
                )

    def join(self) -> None:
        self._thread.join(WAIT)


@dataclass
class Process:
    popen: subprocess.Popen[str]
    output: Output

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        code = self.popen.wait(WAIT)
        self.output.join()
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()
        return code


def spawn(args: list[str], *, stream: str = "stderr") -> Process:
    env = relay_env({**os.environ, "PYTHONUNBUFFERED": "1"})
    popen = subprocess.Popen(
        args,
        stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
        stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL,
        text=True,
        env=env,
    )
    pipe = popen.stdout if stream == "stdout" else popen.stderr
    return Process(popen, Output(pipe))


def rmb_relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "rmb_relay", *args]


def rmb_peer(*args: str) -> list[str]:
    return [sys.executable, "-m", "rmb_relay.peer.cli", *args]


def add_twin(twins: str, twin: int, key_type: str = "sr25519") -> None:
    subprocess.run(
        rmb_relay(
            "twins",
            "add",
            "--twins",
            twins,
            "--id",
            str(twin),
            "--mnemonic",
            mnemonic_for(twin),
            "--key-type",
            key_type,
            "--relay",
            "localhost",
        ),
        check=True,
        env=relay_env(),
        capture_output=True,
        timeout=WAIT,
    )


@dataclass
class Relay:
    process: Process
    port: int

    @property
    def url(self) -> str:
        return f"ws://localhost:{self.port}/"


def start_relay(twins: str, *extra: str) -> Relay:
    process = spawn(
        rmb_relay("serve", "-l", "127.0.0.1:0", "--twins", twins, "--twin-cache-ttl", "0", *extra),
        stream="stdout",
    )
    process.output.wait_for("rmb-relay listening on ")
    banner = next(line for line in process.output.lines if "listening on" in line)
    port = int(banner.split()[3].rstrip(";").rpartition(":")[2])
    return Relay(process, port)


@dataclass
class Peer:
    twin: int
    process: Process
    redis: RedisServer
    relays: list[Relay] = field(default_factory=list)

    @property
    def output(self) -> Output:
        return self.process.output


def start_peer(
    twin: int,
    twins: str,
    redis: RedisServer,
    relays: list[Relay],
    *extra: str,
    key_type: str = "sr25519",
    connected: bool = True,
) -> Peer:
    args = ["-m", mnemonic_for(twin), "-k", key_type, "-r", redis.url, "--twins", twins]
    for relay in relays:
        args += ["--relay", relay.url]
    peer = Peer(twin, spawn(rmb_peer(*args, *extra)), redis, relays)
    if connected:
        peer.output.wait_for(CONNECTED, times=len(relays))
    return peer


@contextmanager
def redis_servers(tmp_path: Path, count: int) -> Iterator[list[RedisServer]]:
    servers: list[RedisServer] = []
    try:
        for i in range(count):
            directory = tmp_path / f"redis-{i}"
            directory.mkdir()
            servers.append(start_redis(str(directory)))
        yield servers
    finally:
        for server in servers:
            server.stop()
