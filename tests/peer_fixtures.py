"""Real processes for rmb-peer tests: relays (`python -m rmb_relay serve`), twins added with
`rmb-relay twins add`, peers (`python -m rmb_relay.peer.cli`), each peer on its own
`redis-server`. Everything waits on a line the process prints, never on a sleep."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mnemonic import Mnemonic
from redis.asyncio import Redis

from tests.conftest import WAIT, RedisServer, start_redis
from tests.processes import relay_env

#: the log line scripts wait for (spec/rmb.md §5.3)
CONNECTED = 'now connected to relay Some("localhost")'
#: msgbus requests in flight at once (`run_client`)
WINDOW = 500
#: msgbus items taken per pop and pushed per pipeline
BATCH = 200


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


async def echo_service(url: str, stop: asyncio.Event) -> int:
    """Pops msgbus.test.echo, answers each request with its payload reversed."""
    served = 0
    async with Redis.from_url(url) as redis:
        while not stop.is_set():
            popped = await redis.brpop(["msgbus.test.echo"], timeout=0.2)
            if popped is None:
                continue
            batch = [popped[1], *(await redis.rpop("msgbus.test.echo", BATCH) or [])]
            pipe = redis.pipeline(transaction=False)
            for raw in batch:
                request = json.loads(raw)
                data = base64.b64decode(request["dat"])[::-1]
                reply = {
                    "ver": 1,
                    "ref": request["ref"],
                    "dat": base64.b64encode(data).decode(),
                    "dst": request["src"],
                    "shm": None,
                    "now": int(time.time()),
                }
                pipe.lpush("msgbus.system.reply", json.dumps(reply))
            await pipe.execute()
            served += len(batch)
    return served


async def run_client(
    url: str, requests: int, on_progress: Callable[[int], None] | None = None
) -> dict[str, int]:
    """Sends `requests` requests to twin 2's `test.echo` through the peer whose Redis is at
    `url`, at most WINDOW unanswered; checks each reply; returns replies per ref."""
    answered: dict[str, int] = {}
    errors: list[object] = []
    window = asyncio.Semaphore(WINDOW)
    done = asyncio.Event()
    async with Redis.from_url(url) as redis, Redis.from_url(url) as reader_redis:

        async def reader() -> None:
            while len(answered) < requests:
                popped = await reader_redis.brpop(["acceptance.ret"], timeout=0.2)
                if popped is None:
                    continue
                more = await reader_redis.rpop("acceptance.ret", BATCH) or []
                for raw in [popped[1], *more]:
                    reply = json.loads(raw)
                    ref = reply["ref"]
                    expected = f"payload {ref}".encode()[::-1]
                    if reply["err"] is not None or base64.b64decode(reply["dat"]) != expected:
                        errors.append(reply)
                    if ref not in answered:
                        window.release()
                    answered[ref] = answered.get(ref, 0) + 1
                if on_progress is not None:
                    on_progress(len(answered))
            done.set()

        task = asyncio.create_task(reader())
        sent = 0
        while sent < requests:
            pipe = redis.pipeline(transaction=False)
            for _ in range(min(BATCH, requests - sent)):
                await window.acquire()
                ref = str(sent)
                request = {
                    "ver": 1,
                    "ref": ref,
                    "cmd": "test.echo",
                    "exp": 300,
                    "dat": base64.b64encode(f"payload {ref}".encode()).decode(),
                    "tag": None,
                    "dst": [2],
                    "ret": "acceptance.ret",
                    "shm": None,
                    "now": int(time.time()),
                }
                pipe.lpush("msgbus.system.local", json.dumps(request))
                sent += 1
            await pipe.execute()
        await asyncio.wait_for(done.wait(), 120)
        await task
    assert errors == []
    return answered
