"""신경 gateway scenarios, run against rmb-relay and `bench/singyeong_baseline.py` (a
`websockets`-only gateway) in the same run, printed as a table and appended to bench/results/.

    .venv/bin/python -m bench.singyeong                  # 10,000 clients, every scenario
    .venv/bin/python -m bench.singyeong --clients 2000 --duration 3 --only send_eq

Scenarios (all JSON): `send_eq` SEND to `application` + `$eq` on a per-client id;
`send_range` SEND to a range of 10 (`$gte`/`$lt`, one picked); `broadcast` BROADCAST to one
group of 1,000 clients, the group changing from one BROADCAST to the next (10 groups at 10,000
clients: no two BROADCASTs in flight share a receiver, so nothing can coalesce);
`broadcast_1000` the issue's "fan-out to 1,000 clients" read literally: 1,000 clients
connected, every BROADCAST to all of them (those in flight share their receivers, and a gateway
that writes once per receiver per read coalesces them); `queue` QUEUE -> 20 consumers
(REQUEST/ACK) -> acked messages/s.
The generator is this process (one core, uvloop, frames masked and decoded by the Rust core,
payloads carry the send time in microseconds); the gateway is another process (the other
core). `gw_cpu` / `gen_cpu` are each side's share of one core during the measured window.
`SG_GATEWAY_ARGS` adds flags to the rmb-relay command line. `SG_WINDOW` (default 4096) bounds
the deliveries in flight in the SEND and BROADCAST scenarios (recorded in each row as
`window`; docs/singyeong.md has a table over it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rmb_relay._core import ClientFrameEncoder, WsDecoder, WsMessage

from .outdir import RESULTS
from .procstat import cpu_seconds, cpu_split, free_port

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("send_eq", "send_range", "broadcast", "broadcast_1000", "queue")
GROUP = 1000  # clients per broadcast group
CONSUMERS = 20
QUEUE_NAME = "bench"
ACK = '{"op":4,"t":"QUEUE_ACK","d":{"queue":"' + QUEUE_NAME + '","id":"%s"}}'
REQUEST = '{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"' + QUEUE_NAME + '"}}'


def now_us() -> int:
    return time.monotonic_ns() // 1000


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Stats:
    def __init__(self) -> None:
        self.received = 0
        self.latencies: list[int] = []
        self.wake = asyncio.Event()
        self.acked = 0


class Conn(asyncio.Protocol):
    """One client: upgrade, then frames in (Rust decoder) and out (Rust masking)."""

    def __init__(self, stats: Stats, host: str, port: int) -> None:
        self.stats = stats
        self.host = host
        self.port = port
        self.decoder = WsDecoder(client_mode=True, max_message=64 << 20)
        self.encoder = ClientFrameEncoder(os.urandom(32))
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.upgraded = False
        self.waiter: asyncio.Future[bytes] | None = None
        self.inbox: list[bytes] = []
        self.mode = "control"
        self.consumer_queue = ""
        self.index = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        transport.write(
            b"GET /gateway/websocket?encoding=json HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )

    def data_received(self, data: bytes) -> None:
        if not self.upgraded:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            if not self.head.startswith(b"HTTP/1.1 101"):
                raise ConnectionError(self.head[:200])
            self.upgraded = True
            data, self.head = self.head[end + 4 :], b""
            if not data:
                return
        stats = self.stats
        out: list[bytes] = []
        for event in self.decoder.feed(data):
            if type(event) is not WsMessage:
                continue
            body = event.data
            if self.mode == "count":
                stats.received += 1
                if stats.received & 15 == 0:
                    start = body.find(b'"payload":') + 10
                    stats.latencies.append(now_us() - int(body[start : body.find(b"}", start)]))
                stats.wake.set()
            elif self.mode == "consume" and b'"QUEUE"' in body:
                # the id is the only part that varies: a slice, not a json.loads, so that the
                # generator is not what limits the rate (ours writes `"id":"..."`, the
                # baseline `"id": "..."`; the payload is an integer, so the key is unique)
                start = body.index(b'"', body.index(b'"id":') + 5) + 1
                message_id = body[start : body.index(b'"', start)].decode()
                stats.acked += 1
                stats.wake.set()
                encoder = self.encoder
                out.append(encoder.text(ACK % message_id))
                out.append(encoder.text(REQUEST))
            elif self.mode == "producer":
                if b'"QUEUE_CONFIRM"' in body:
                    stats.received += 1
                    stats.wake.set()
            elif self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(body)
            else:
                self.inbox.append(body)
        if out:  # a consumer answers everything one read brought with one write
            assert self.transport is not None
            self.transport.write(b"".join(out))

    def send_text(self, text: str) -> None:
        assert self.transport is not None
        self.transport.write(self.encoder.text(text))

    async def next(self) -> dict[str, Any]:
        if self.inbox:
            return dict(json.loads(self.inbox.pop(0)))
        self.waiter = asyncio.get_running_loop().create_future()
        return dict(json.loads(await asyncio.wait_for(self.waiter, 30)))


async def connect(
    stats: Stats, host: str, port: int, app: str, cid: str, metadata: dict[str, Any]
) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: Conn(stats, host, port), host, port)
    assert (await conn.next())["op"] == 0
    conn.send_text(
        json.dumps(
            {
                "op": 1,
                "d": {
                    "client_id": cid,
                    "application_id": app,
                    "metadata": {k: {"type": "integer", "value": v} for k, v in metadata.items()},
                },
            }
        )
    )
    ready = await conn.next()
    assert ready["op"] == 2, ready
    return conn


class Gateway:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.port = free_port()
        if kind == "rmb-relay":
            cmd = [
                sys.executable,
                "-m",
                "rmb_relay",
                "serve",
                "--no-sbd",
                "-l",
                f"127.0.0.1:{self.port}",
                "--sg-heartbeat-interval",
                "3600000",
                "--max-message",
                str(16 << 20),
                "--max-connections-per-ip",
                "100000",  # every generator connection comes from 127.0.0.1
                # e.g. SG_GATEWAY_ARGS="--sg-query-max-list 64"
                *os.environ.get("SG_GATEWAY_ARGS", "").split(),
            ]
        else:
            cmd = [sys.executable, "-m", "bench.singyeong_baseline", "--port", str(self.port)]
        self.process = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert self.process.stdout is not None
        self.process.stdout.readline()  # banner: listening

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def run_scenario(kind: str, scenario: str, clients: int, duration: float) -> dict[str, Any]:
    if scenario == "broadcast_1000":
        clients = min(clients, GROUP)
    gateway = Gateway(kind)
    host, port = "127.0.0.1", gateway.port
    stats = Stats()
    try:
        receivers: list[Conn] = []
        semaphore = asyncio.Semaphore(int(os.environ.get("SG_CONNECT_CONCURRENCY", "50")))

        async def one(i: int) -> None:
            async with semaphore:
                conn = await connect(
                    stats, host, port, "bench", f"c{i}", {"id": i, "n": i, "group": i // GROUP}
                )
                conn.index = i
                receivers.append(conn)

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(clients)))
        connect_s = time.monotonic() - started
        sender = await connect(stats, host, port, "caller", "sender", {})
        for conn in receivers:
            conn.mode = "count"
        receivers.sort(key=lambda conn: conn.index)  # consumers are ids 0..CONSUMERS-1
        result = await (QUEUE if scenario == "queue" else LOAD)(
            scenario, gateway, stats, sender, receivers, clients, duration
        )
        extra = os.environ.get("SG_GATEWAY_ARGS", "") if kind == "rmb-relay" else ""
        result.update(
            gateway=kind + (f" {extra}" if extra else ""),
            scenario=scenario,
            clients=clients,
            connect_s=round(connect_s, 1),
        )
        for conn in (*receivers, sender):
            if conn.transport is not None:
                conn.transport.close()
        return result
    finally:
        gateway.stop()


def template(scenario: str, k: int, clients: int) -> str:
    if scenario == "send_eq":
        ops = f'[{{"id":{{"$eq":{k % clients}}}}}]'
    elif scenario == "send_range":
        low = k % (clients - 10)
        ops = f'[{{"n":{{"$gte":{low}}}}},{{"n":{{"$lt":{low + 10}}}}}]'
    else:
        ops = f'[{{"group":{{"$eq":{k % max(1, clients // GROUP)}}}}}]'
    t = "BROADCAST" if scenario.startswith("broadcast") else "SEND"
    return (
        f'{{"op":4,"t":"{t}","d":{{"target":{{"application":"bench","ops":{ops}}},"payload":%d}}}}'
    )


def us_per_message(gateway: Gateway, split: tuple[float, float], count: int) -> dict[str, float]:
    """The gateway's user and kernel CPU per message (delivery, acked message) over the
    measured window, in microseconds: the figure that stays put when the host is busy."""
    user, system = cpu_split(gateway.process.pid)
    user, system = user - split[0], system - split[1]
    count = max(count, 1)
    return {
        "gw_us": round((user + system) / count * 1e6, 2),
        "gw_user_us": round(user / count * 1e6, 2),
        "gw_sys_us": round(system / count * 1e6, 2),
    }


async def LOAD(
    scenario: str,
    gateway: Gateway,
    stats: Stats,
    sender: Conn,
    receivers: list[Conn],
    clients: int,
    duration: float,
) -> dict[str, Any]:
    fanout = min(GROUP, clients) if scenario.startswith("broadcast") else 1
    window = int(os.environ.get("SG_WINDOW", "4096"))
    templates = [template(scenario, k * 7919, clients) for k in range(4096)]
    sent = 0
    batch = max(1, int(os.environ.get("SG_BATCH", "256")) // fanout)
    warm_until = time.monotonic() + 1.0
    end = warm_until + duration
    mark: tuple[float, int, float, float] | None = None
    while True:
        now = time.monotonic()
        if mark is None and now >= warm_until:
            stats.latencies.clear()
            mark = (now, stats.received, cpu_seconds(gateway.process.pid), own_cpu())
            split = cpu_split(gateway.process.pid)
        if now >= end:
            break
        if sent * fanout - stats.received < window:
            stamp = now_us()
            assert sender.transport is not None
            sender.transport.write(
                b"".join(
                    sender.encoder.text(templates[(sent + i) & 4095] % stamp) for i in range(batch)
                )
            )
            sent += batch
            await asyncio.sleep(0)
        else:
            stats.wake.clear()
            await stats.wake.wait()
    assert mark is not None
    elapsed = time.monotonic() - mark[0]
    delivered = stats.received - mark[1]
    lat = sorted(stats.latencies) or [0]
    return {
        **us_per_message(gateway, split, delivered),
        "rate": round(delivered / elapsed),
        "window": window,
        "p50_ms": round(lat[len(lat) // 2] / 1000, 2),
        "p99_ms": round(lat[int(len(lat) * 0.99)] / 1000, 2),
        "gw_cpu": round((cpu_seconds(gateway.process.pid) - mark[2]) / elapsed, 2),
        "gen_cpu": round((own_cpu() - mark[3]) / elapsed, 2),
    }


async def QUEUE(
    scenario: str,
    gateway: Gateway,
    stats: Stats,
    sender: Conn,
    receivers: list[Conn],
    clients: int,
    duration: float,
) -> dict[str, Any]:
    consumers = receivers[:CONSUMERS]
    for conn in consumers:
        conn.mode = "consume"
        for _ in range(32):
            conn.send_text(REQUEST)
    sender.mode = "producer"
    frame = (
        '{"op":4,"t":"QUEUE","d":{"queue":"' + QUEUE_NAME + '","nonce":null,'
        f'"target":{{"application":"bench","ops":[{{"id":{{"$lt":{CONSUMERS}}}}}]}},'
        '"payload":%d}}'
    )
    produced = 0
    warm_until = time.monotonic() + 1.0
    end = warm_until + duration
    mark: tuple[float, int, float, float] | None = None
    while True:
        now = time.monotonic()
        if mark is None and now >= warm_until:
            mark = (now, stats.acked, cpu_seconds(gateway.process.pid), own_cpu())
            split = cpu_split(gateway.process.pid)
        if now >= end:
            break
        if produced - stats.acked < 2000:
            assert sender.transport is not None
            sender.transport.write(
                b"".join(sender.encoder.text(frame % (produced + i)) for i in range(64))
            )
            produced += 64
            await asyncio.sleep(0)
        else:
            stats.wake.clear()
            await stats.wake.wait()
    assert mark is not None
    elapsed = time.monotonic() - mark[0]
    return {
        **us_per_message(gateway, split, stats.acked - mark[1]),
        "rate": round((stats.acked - mark[1]) / elapsed),
        "p50_ms": None,
        "p99_ms": None,
        "gw_cpu": round((cpu_seconds(gateway.process.pid) - mark[2]) / elapsed, 2),
        "gen_cpu": round((own_cpu() - mark[3]) / elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--gateways", default="rmb-relay,baseline")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    rows = []
    for scenario in args.only.split(","):
        for kind in args.gateways.split(","):
            row = uvloop.run(run_scenario(kind, scenario, args.clients, args.duration))
            print(json.dumps(row), flush=True)
            rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"singyeong-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    print(
        "| scenario | gateway | rate/s | p50 ms | p99 ms | gw_cpu | gen_cpu "
        "| gw us/msg (user + kernel) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scenario']} | {r['gateway']} | {r['rate']:,} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['gw_cpu']} | {r['gen_cpu']} | "
            f"{r['gw_us']} ({r['gw_user_us']} + {r['gw_sys_us']}) |"
        )


if __name__ == "__main__":
    main()
