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

`--relay-flag=--FLAG=VALUE` (repeatable) passes a flag to every relay, e.g. huge byte budgets
(`--relay-flag=--sg-queue-bytes=1099511627776`) to measure the stores unbounded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
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

from .procstat import cpu_seconds, free_port, rss_bytes
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


SCENARIOS: dict[str, Callable[[Path, str | None], Awaitable[dict[str, Any]]]] = {
    "mailbox-bytes": lambda d, p: scenario_mailbox(d, p, 400, 1_000_000, False),
    "mailbox-sids": lambda d, p: scenario_mailbox(d, p, 20_000, 10_000, True),
    "mailbox-ttl": scenario_ttl,
    "sbd-flood": scenario_sbd,
    "redis-stall": scenario_redis,
    "methods": scenario_methods,
    "sg-queue-flood": scenario_sg_queue_flood,
    "tunnel-queue-flood": scenario_tunnel_queue_flood,
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
