"""The hostile-load scenarios of issue 9, run against a relay process, with its RSS and CPU
read from /proc: the figures of docs/hardening.md.

    .venv/bin/python -m bench.hardening                       # every scenario, this tree
    .venv/bin/python -m bench.hardening --relay-path OTHER/python mailbox-bytes

`--relay-path` runs the relay from another checkout's `python/` directory (with its compiled
`_core` beside it), so the same scenarios measure the code before a change; the clients are
always this tree's. Scenarios (each with a fresh relay and twin directory):

- mailbox-bytes: 400 requests of 1 MB to one offline twin (in-memory mailbox)
- mailbox-sids: 20,000 requests of 10 KB to one offline twin, each to a different sid
- mailbox-ttl: `--mailbox-ttl 5`, no `--limit`: 100 requests, then how long until they expire
- sbd-flood: 2,000 websocket upgrades from one IP that never handshake
- redis-stall: Redis stopped (SIGSTOP) for 8 s while 200 requests of 1 MB go to an offline twin
- methods: 3,030 requests with random methods, then the size of /metrics
- sg-queue-flood: 100,000 singyeong QUEUE frames of ~1.1 KB to one queue nobody consumes
- tunnel-queue-flood: 20,000 queue-mode tunnel requests of 10 KB to a tenant with no connector
- token-flood (issue 33): eight clients posting wrong tunnel secrets as fast as answered
- pipeline-flood (issue 33): one client pipelining GET /metrics that never reads
- forged-federation (issue 33): four clients posting unsigned envelopes for a local twin
- upload-flood (issue 33): four clients uploading endless chunked bodies to an open tunnel
  tenant's queue (no connector), the relay at `--tunnel-max-body 8388608`; upload-flood-1g
  the same at 1 Gbit/s in all (what one well-connected host can send)

The issue-33 scenarios measure an honest client (from 127.0.0.2) meanwhile: `/health` on a
keep-alive connection and an SBD message between two clients, p50/p99 quiet and under the
attack (`PHASE_S` each), with the relay's RSS, CPU and bytes written to disk around the attack.

`--relay-flag=--FLAG=VALUE` (repeatable) passes a flag to every relay, e.g. huge byte budgets
(`--relay-flag=--sg-queue-bytes=1099511627776`) to measure the stores unbounded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.helpers import RawWebSocket
from tests.redis_process import start_redis
from tests.rmb_fixtures import key_for

from rmb_relay.sdk import RmbClient
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory

from .procstat import cpu_seconds, free_port, rss_bytes, wait_seconds
from .scenarios import raise_fd_limit

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
#: flags every relay of this run gets (`--relay-flag`)
EXTRA_FLAGS: list[str] = []


class RelayProcess:
    def __init__(self, directory: Path, relay_path: str | None, *flags: str) -> None:
        self.port = free_port()
        env = dict(os.environ)
        if relay_path:
            env["PYTHONPATH"] = relay_path
        env["XDG_STATE_HOME"] = str(directory)  # the tunnel's body store: this run's alone
        cmd = [sys.executable, "-m", "rmb_relay", "serve", "-l", f"127.0.0.1:{self.port}"]
        cmd += ["--twins", f"sqlite:{directory / 'twins.sqlite3'}", *flags, *EXTRA_FLAGS]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert self.process.stdout is not None
        banner = self.process.stdout.readline()
        if "listening" not in banner:
            raise RuntimeError(f"relay did not start: {banner!r}")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def rss(self) -> int:
        return rss_bytes(self.process.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def provision(directory: Path) -> None:
    with SqliteTwinDirectory(directory / "twins.sqlite3") as twins:
        for twin_id in (1, 2, 3):
            twins.add(Twin(twin_id, key_for(twin_id).public_key, frozenset({"relay.test"}), None))


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, bytes, float]:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n".encode())
    try:
        data = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data.partition(b"\r\n\r\n")[2], time.perf_counter() - started


async def metric(port: int, name: str) -> float:
    _, body, _ = await http_get(port, "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def send_to_offline(
    relay: RelayProcess, count: int, size: int, sid: Callable[[int], str | None]
) -> dict[str, Any]:
    """Send `count` requests of `size` bytes to offline twin 3; count the error replies."""
    client = await RmbClient.connect(relay.url, 1, key_for(1))
    payload = os.urandom(size)
    futures = []
    errors: dict[str, int] = {}
    try:
        for i in range(count):
            futures.append(client.send_request(3, "m", payload, dest_sid=sid(i)))
            await client.writable()
        # every envelope has been routed once the mailbox holds or refused the rest
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            answered = sum(f.done() for f in futures)
            stored = await metric(relay.port, "rmb_relay_mailbox_depth")
            if answered + stored >= count:
                break
            await asyncio.sleep(0.2)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is None:
                error = future.result().error
                if error is not None:
                    errors[error[1]] = errors.get(error[1], 0) + 1
            future.cancel()
    finally:
        await client.close()
    return {"errors": errors, "stored": await metric(relay.port, "rmb_relay_mailbox_depth")}


async def scenario_mailbox(
    directory: Path, relay_path: str | None, count: int, size: int, distinct_sids: bool
) -> dict[str, Any]:
    relay = RelayProcess(directory, relay_path)
    try:
        before = relay.rss()
        result = await send_to_offline(
            relay, count, size, (lambda i: f"s{i}") if distinct_sids else (lambda i: None)
        )
        result.update(rss_before_mib=before / MIB, rss_after_mib=relay.rss() / MIB)
        return result
    finally:
        relay.stop()


async def scenario_ttl(directory: Path, relay_path: str | None) -> dict[str, Any]:
    relay = RelayProcess(directory, relay_path, "--mailbox-ttl", "5")
    try:
        await send_to_offline(relay, 100, 1000, lambda i: None)
        sent = time.monotonic()
        depth = await metric(relay.port, "rmb_relay_mailbox_depth")
        while depth and time.monotonic() - sent < 30:
            await asyncio.sleep(0.5)
            depth = await metric(relay.port, "rmb_relay_mailbox_depth")
        return {
            "stored": 100,
            "left_after_s": round(time.monotonic() - sent, 1),
            "left": depth,
        }
    finally:
        relay.stop()


async def scenario_sbd(directory: Path, relay_path: str | None) -> dict[str, Any]:
    relay = RelayProcess(directory, relay_path)
    opened: list[RawWebSocket] = []
    refused: dict[str, int] = {}
    try:
        cpu, rss = relay.cpu(), relay.rss()
        started = time.monotonic()
        for _ in range(2000):
            path = "/" + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
            try:
                opened.append(await RawWebSocket.connect("127.0.0.1", relay.port, path))
            except ConnectionError as err:
                status = str(err).split(" ", 3)[-1][:24] if "HTTP/1.1" in str(err) else "closed"
                refused[status] = refused.get(status, 0) + 1
        elapsed = time.monotonic() - started
        _, _, health = await http_get(relay.port, "/health")
        received = 0
        for ws in opened:  # what the relay pushed at the never-handshaking clients
            try:
                while True:
                    chunk = await asyncio.wait_for(ws.reader.read(1 << 20), 0.001)
                    if not chunk:
                        break
                    received += len(chunk)
            except TimeoutError:
                pass
        return {
            "opened": len(opened),
            "refused": refused,
            "relay_cpu_s": round(relay.cpu() - cpu, 2),
            "open_s": round(elapsed, 1),
            "health_s": round(health, 3),
            "bytes_to_clients": received,
            "rss_growth_mib": round((relay.rss() - rss) / MIB, 1),
        }
    finally:
        for ws in opened:
            ws.writer.close()
        relay.stop()


async def scenario_redis(directory: Path, relay_path: str | None) -> dict[str, Any]:
    redis_dir = directory / "redis"
    redis_dir.mkdir()
    redis = start_redis(str(redis_dir), durable=False)
    try:
        relay = RelayProcess(directory, relay_path, "--redis", redis.url)
        try:
            before = relay.rss()
            redis.process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            client = await RmbClient.connect(relay.url, 1, key_for(1))
            payload = os.urandom(1_000_000)
            futures = []
            for _ in range(200):
                futures.append(client.send_request(3, "m", payload))
                await client.writable()
            peak = relay.rss()
            answered_in_stall = 0
            while time.monotonic() - stopped < 8:
                await asyncio.sleep(0.25)
                peak = max(peak, relay.rss())
                answered_in_stall = sum(f.done() for f in futures)
            # a twin that logs in during the stall: does it get a live message?
            carol = RmbClient(3, key_for(3))
            carol.handle("live", lambda r: b"ok")
            await carol.open(relay.url)
            live = await client.request(3, "live", timeout=30, raise_on_error=False)
            live_ok = live.error is None
            redis.process.send_signal(signal.SIGCONT)
            await asyncio.sleep(2)
            for future in futures:
                future.cancel()
            await carol.close()
            await client.close()
            return {
                "rss_before_mib": round(before / MIB, 1),
                "rss_peak_mib": round(peak / MIB, 1),
                "rss_after_mib": round(relay.rss() / MIB, 1),
                "answered_during_stall": answered_in_stall,
                "live_during_stall": live_ok,
            }
        finally:
            relay.stop()
    finally:
        redis.process.send_signal(signal.SIGCONT)
        redis.stop()


async def scenario_methods(directory: Path, relay_path: str | None) -> dict[str, Any]:
    relay = RelayProcess(directory, relay_path)
    try:
        _, before, _ = await http_get(relay.port, "/metrics")
        rng = random.Random(9)
        for _ in range(3030):
            method = "".join(rng.choices(string.ascii_uppercase, k=8))
            await http_get(relay.port, "/x", method)
        _, after, _ = await http_get(relay.port, "/metrics")
        series = sum(
            1
            for line in after.decode().splitlines()
            if line.startswith("rmb_relay_http_requests_total{")
        )
        return {
            "metrics_kb_before": len(before) // 1024,
            "metrics_kb_after": len(after) // 1024,
            "method_series": series,
        }
    finally:
        relay.stop()


async def scenario_sg_queue_flood(directory: Path, relay_path: str | None) -> dict[str, Any]:
    """QUEUE frames to a queue nobody consumes: confirmed (kept) or refused (queue_full)."""
    import websockets

    relay = RelayProcess(directory, relay_path)
    total, batch = 100_000, 1_000
    outcomes: dict[str, int] = {}
    try:
        before, cpu_before = relay.rss(), relay.cpu()
        uri = f"ws://127.0.0.1:{relay.port}/gateway/websocket?encoding=json"
        async with websockets.connect(uri, max_size=None) as ws:
            await ws.recv()  # hello
            await ws.send(json.dumps({"op": 1, "d": {"client_id": "p", "application_id": "a"}}))
            await ws.recv()  # ready
            frame = {
                "op": 4,
                "t": "QUEUE",
                "d": {"queue": "jobs", "target": {"application": "w"}, "nonce": None},
            }
            for start in range(0, total, batch):
                for n in range(start, start + batch):
                    frame["d"]["payload"] = f"{n:08d}" + "x" * 992
                    await ws.send(json.dumps(frame))
                for _ in range(batch):
                    reply = json.loads(await ws.recv())
                    key = reply["t"] if reply["op"] == 4 else reply["d"]["error"]
                    outcomes[key] = outcomes.get(key, 0) + 1
        cpu = relay.cpu() - cpu_before
        return {
            "outcomes": outcomes,
            "held_mib": await metric(relay.port, 'rmb_relay_sg_queue_bytes{state="all"}') / MIB,
            "rss_before_mib": before / MIB,
            "rss_after_mib": relay.rss() / MIB,
            "cpu_us_per_frame": cpu / total * 1e6,
        }
    finally:
        relay.stop()


async def scenario_tunnel_queue_flood(directory: Path, relay_path: str | None) -> dict[str, Any]:
    """Queue-mode requests for a tenant whose connector is away: 202 (held) or 503 (refused)."""
    import httpx

    from rmb_relay.dialects.tunnel.tenants import Tenant, TenantStore

    with TenantStore(directory / "twins.sqlite3") as store:
        store.add(Tenant("acme"))
    relay = RelayProcess(directory, relay_path)
    total = 20_000
    statuses: dict[int, int] = {}
    body = os.urandom(10_000)
    gate = asyncio.Semaphore(32)
    try:
        before, cpu_before = relay.rss(), relay.cpu()
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{relay.port}", limits=limits, timeout=60
        ) as client:

            async def one(n: int) -> None:
                async with gate:
                    reply = await client.post(f"/queue/acme/app/x?n={n}", content=body)
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1

            await asyncio.gather(*(one(n) for n in range(total)))
        cpu = relay.cpu() - cpu_before
        return {
            "statuses": statuses,
            "held_mib": await metric(relay.port, "rmb_relay_tunnel_held_bytes") / MIB,
            "rss_before_mib": before / MIB,
            "rss_after_mib": relay.rss() / MIB,
            "cpu_us_per_request": cpu / total * 1e6,
        }
    finally:
        relay.stop()


# ---- issue 33: attacks on the loop and on memory, with honest clients measured meanwhile ----

#: how long each phase (quiet, under attack) measures the honest clients
PHASE_S = 4.0
#: the honest probe's pause between two rounds (a /health and an SBD message each)
PROBE_PAUSE_S = 0.01
#: an honest client's address: loopback answers for all of 127/8, so per-IP limits on the
#: attackers (127.0.0.1) do not touch it
HONEST_HOST = "127.0.0.2"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _written_bytes(pid: int) -> int:
    """Bytes the process caused to be written to storage (/proc/PID/io)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


class HonestProbe:
    """What an honest user sees: `/health` on a keep-alive connection (from HONEST_HOST) and an
    SBD message from one client to another and back, each timed, round after round."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.health: list[float] = []
        self.message: list[float] = []
        self.failures = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HonestProbe:
        from tests.sbd_client import SbdClient

        self.reader, self.writer = await asyncio.open_connection(
            "127.0.0.1", self.port, local_addr=(HONEST_HOST, 0)
        )
        self.a = await SbdClient.connect("127.0.0.1", self.port)
        self.b = await SbdClient.connect("127.0.0.1", self.port)
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task
        self.writer.close()
        self.a.ws.close()
        self.b.ws.close()

    def take(self) -> dict[str, float]:
        """The figures since the last take (ms), and start again."""
        health, message, self.health, self.message = self.health, self.message, [], []
        return {
            "health_p50_ms": round(_percentile(health, 0.5) * 1e3, 2),
            "health_p99_ms": round(_percentile(health, 0.99) * 1e3, 2),
            "message_p50_ms": round(_percentile(message, 0.5) * 1e3, 2),
            "message_p99_ms": round(_percentile(message, 0.99) * 1e3, 2),
            "rounds": len(health),
        }

    async def _run(self) -> None:
        request = b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
        n = 0
        while not self._stop.is_set():
            started = time.perf_counter()
            self.writer.write(request)
            head = await asyncio.wait_for(self.reader.readuntil(b"ok\n"), 60)
            if not head.startswith(b"HTTP/1.1 200"):
                self.failures += 1
            self.health.append(time.perf_counter() - started)
            n += 1
            body = b"probe %d" % n
            started = time.perf_counter()
            self.a.forward(self.b.pubkey, body)
            got = await asyncio.wait_for(self.b.receive_forward(), 60)
            self.b.forward(self.a.pubkey, body)  # (both stay active: SBD drops idlers)
            back = await asyncio.wait_for(self.a.receive_forward(), 60)
            if got != (self.a.pubkey, body) or back != (self.b.pubkey, body):
                self.failures += 1
            self.message.append(time.perf_counter() - started)
            await asyncio.sleep(PROBE_PAUSE_S)


def _run_attack(name: str, port: int, seconds: float, results: Any) -> None:
    """The attack `name` in a process of its own (spawned), so its client CPU is not the
    honest probe's; puts its outcome on `results`."""

    async def timed() -> dict[str, Any]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        return await ATTACKS[name](port, stop)

    results.put(asyncio.run(timed()))


def _ms3(seconds: float) -> float:
    return round(seconds, 3)


async def _attack_phase(relay: RelayProcess, name: str) -> dict[str, Any]:
    """Honest figures quiet, then under attack `name` (another process, `PHASE_S`), with the
    relay's RSS, CPU and disk writes around the attack."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()

    # runnable but not running (waiting for a core), the relay's main thread and ours (the
    # honest clients'): what a loaded host adds to their latency, apart from the relay's work
    def waits() -> tuple[float, float, float]:
        return wait_seconds(relay.process.pid), wait_seconds(os.getpid()), time.perf_counter()

    async with HonestProbe(relay.port) as probe:
        started = waits()
        await asyncio.sleep(PHASE_S)
        quiet = probe.take()
        quiet_waits = [b - a for a, b in zip(started, waits(), strict=True)]
        rss, written, cpu = relay.rss(), _written_bytes(relay.process.pid), relay.cpu()
        attacker = spawn.Process(target=_run_attack, args=(name, relay.port, PHASE_S, results))
        attacker.start()
        await asyncio.sleep(1.0)  # the attacker's interpreter starting is not the attack
        probe.take()
        started = waits()
        outcome = await asyncio.to_thread(results.get, True, 120)
        under = probe.take()
        attack_waits = [b - a for a, b in zip(started, waits(), strict=True)]
        await asyncio.to_thread(attacker.join, 30)
        failures = probe.failures
    return {
        "quiet": quiet,
        "attack": under,
        "honest_failures": failures,
        "outcome": outcome,
        "rss_before_mib": round(rss / MIB, 1),
        "rss_after_mib": round(relay.rss() / MIB, 1),
        "disk_written_kib": (_written_bytes(relay.process.pid) - written) // 1024,
        "relay_cpu_s": round(relay.cpu() - cpu, 2),
        # seconds the relay's loop thread and the honest clients' waited for a core in
        # the quiet and the attack phase, and how long each phase was measured
        "waiting_for_a_core_s": {
            "relay": [_ms3(quiet_waits[0]), _ms3(attack_waits[0])],
            "honest": [_ms3(quiet_waits[1]), _ms3(attack_waits[1])],
            "phase": [_ms3(quiet_waits[2]), _ms3(attack_waits[2])],
        },
    }


async def attack_token_flood(port: int, stop: asyncio.Event) -> dict[str, Any]:
    """Eight clients post wrong tunnel secrets as fast as they are answered (each a scrypt),
    then an honest client logs in from another address."""
    import httpx

    form = {"grant_type": "client_credentials", "client_id": "acme", "scope": "connector"}
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

        async def one() -> None:
            while not stop.is_set():
                reply = await client.post("/tunnel/token", data={**form, "client_secret": "no"})
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1

        await asyncio.gather(*(one() for _ in range(8)))
    honest = httpx.AsyncHTTPTransport(local_address=HONEST_HOST)
    async with httpx.AsyncClient(transport=honest, timeout=60) as client:
        login = await client.post(
            f"http://127.0.0.1:{port}/tunnel/token",
            data={**form, "client_secret": "the-right-secret"},
        )
    return {"statuses": statuses, "honest_login": login.status_code}


async def attack_pipeline_flood(port: int, stop: asyncio.Event) -> dict[str, Any]:
    """One client pipelines GET /metrics and never reads an answer."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    sent = 0
    request = b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n"
    while not stop.is_set() and sent < 200_000:
        writer.write(request * 1000)
        sent += 1000
        try:
            await asyncio.wait_for(writer.drain(), 0.5)
        except TimeoutError:
            await stop.wait()  # the relay stopped reading us
    answered = await metric(port, "rmb_relay_http_requests_total")
    writer.transport.abort()
    return {"pipelined": sent, "answered_requests": answered}


async def attack_forged_federation(port: int, stop: asyncio.Event) -> dict[str, Any]:
    """Four clients post unsigned envelopes claiming twin 999999 for local twin 3."""
    import httpx

    from rmb_relay._core import MSG_REQUEST, Envelope

    def forged(n: int) -> bytes:
        env = Envelope(f"forged-{n}")
        env.source_twin, env.dest_twin = 999_999, 3
        env.kind, env.command = MSG_REQUEST, "x"
        env.timestamp, env.expiration = int(time.time()), 3600
        env.plain = os.urandom(1000)
        return env.encode()

    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

        async def one(k: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                reply = await client.post("/", content=forged(k * 10_000_000 + n))
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1

        await asyncio.gather(*(one(k) for k in range(4)))
    return {"statuses": statuses, "stored": await metric(port, "rmb_relay_mailbox_depth")}


async def attack_upload_flood(
    port: int, stop: asyncio.Event, rate: float | None = None
) -> dict[str, Any]:
    """Four clients upload endless chunked bodies to an open tenant's queue, a new upload as
    soon as the last one is refused; all four together at most `rate` bytes/s if given (a
    link's speed: on loopback they are limited only by the relay)."""
    chunk = os.urandom(256 * 1024)
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    statuses: dict[str, int] = {}
    sent = 0
    started = time.perf_counter()

    async def one() -> None:
        nonlocal sent
        while not stop.is_set():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /queue/acme/app/upload HTTP/1.1\r\nHost: r\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            answer = asyncio.ensure_future(reader.readline())
            while not answer.done() and not stop.is_set():
                writer.write(frame)
                try:
                    await writer.drain()
                except ConnectionError:
                    break
                sent += len(chunk)
                if rate is not None:  # pace to the link's speed
                    await asyncio.sleep(max(0.0, sent / rate - (time.perf_counter() - started)))
            if stop.is_set() and not answer.done():
                writer.transport.abort()  # the attack is over: this one was cut short
                answer.cancel()
                break
            try:
                line = await asyncio.wait_for(answer, 10)
                status = line.split(b" ", 2)[1].decode() if line else "closed"
            except (TimeoutError, ConnectionError, IndexError):
                status = "none"
            answer.cancel()
            writer.close()
            statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(one() for _ in range(4)))
    return {"statuses": statuses, "sent_mib": round(sent / MIB, 1)}


ATTACKS: dict[str, Callable[[int, asyncio.Event], Awaitable[dict[str, Any]]]] = {
    "upload-flood": attack_upload_flood,
    "upload-flood-1g": functools.partial(attack_upload_flood, rate=125e6),
    "token-flood": attack_token_flood,
    "pipeline-flood": attack_pipeline_flood,
    "forged-federation": attack_forged_federation,
}


async def scenario_attack(name: str, directory: Path, relay_path: str | None) -> dict[str, Any]:
    flags: list[str] = []
    if name in ("token-flood", "upload-flood", "upload-flood-1g"):
        from rmb_relay.dialects.tunnel.tenants import Tenant, TenantStore, hash_secret

        with TenantStore(directory / "twins.sqlite3") as store:
            store.add(Tenant("acme", secret_hash=hash_secret("the-right-secret")))
    if name.startswith("upload-flood"):
        flags += ["--tunnel-max-body", str(8 * MIB)]
    relay = RelayProcess(directory, relay_path, *flags)
    try:
        return await _attack_phase(relay, name)
    finally:
        relay.stop()


SCENARIOS: dict[str, Callable[[Path, str | None], Awaitable[dict[str, Any]]]] = {
    "mailbox-bytes": lambda d, p: scenario_mailbox(d, p, 400, 1_000_000, False),
    "mailbox-sids": lambda d, p: scenario_mailbox(d, p, 20_000, 10_000, True),
    "mailbox-ttl": scenario_ttl,
    "sbd-flood": scenario_sbd,
    "redis-stall": scenario_redis,
    "methods": scenario_methods,
    "sg-queue-flood": scenario_sg_queue_flood,
    "tunnel-queue-flood": scenario_tunnel_queue_flood,
    **{name: functools.partial(scenario_attack, name) for name in ATTACKS},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", choices=[*SCENARIOS, []], default=[])
    parser.add_argument("--relay-path", help="run the relay from this python/ directory")
    parser.add_argument(
        "--relay-flag", action="append", default=[], help="a flag for every relay (repeatable)"
    )
    args = parser.parse_args()
    EXTRA_FLAGS.extend(args.relay_flag)
    raise_fd_limit()
    results = {}
    for name in args.scenarios or SCENARIOS:
        with tempfile.TemporaryDirectory(prefix="rmb-hardening-") as tmp:
            directory = Path(tmp)
            provision(directory)
            results[name] = asyncio.run(SCENARIOS[name](directory, args.relay_path))
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()
