"""신경 SEND across two gateway instances sharing one Redis: the receivers on instance B, the
senders on instance A, so every message crosses the cluster. Prints delivered messages per
second and the CPU each process (A, B, redis-server) spent per delivered message, the figure
that holds on a shared host.

    .venv/bin/python -m bench.singyeong_cluster --duration 5 [--broadcast]
    # another checkout's Python code against the same build (e.g. before a change):
    .venv/bin/python -m bench.singyeong_cluster --pythonpath /path/to/other/python

The generator is this process (plain `websockets`), so the rate is bounded by it; the CPU per
message of the relays is the comparison that matters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websockets
from tests.redis_process import start_redis

from .procstat import cpu_seconds, free_port

ROOT = Path(__file__).resolve().parent.parent
#: messages sent and not yet received, at most (a SEND has no acknowledgement)
WINDOW = 2000


async def identify(url: str, client_id: str, n: int | None = None) -> Any:
    ws = await websockets.connect(f"{url}/gateway/websocket?encoding=json", max_size=None)
    await ws.recv()  # hello
    await ws.send(json.dumps({"op": 1, "d": {"client_id": client_id, "application_id": "api"}}))
    await ws.recv()  # ready
    if n is not None:
        update = {"n": {"type": "integer", "value": n}}
        await ws.send(json.dumps({"op": 4, "t": "UPDATE_METADATA", "d": update}))
    return ws


def start_relay(redis_url: str, instance: str, pythonpath: str | None) -> tuple[Any, str]:
    port = free_port()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    process = subprocess.Popen(
        [
            str(ROOT / ".venv/bin/python"),
            "-m",
            "rmb_relay",
            "serve",
            "--no-sbd",
            "--no-tunnel",
            "-l",
            f"127.0.0.1:{port}",
            "--redis",
            redis_url,
            "--instance-id",
            instance,
            "--sg-node",
            instance,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert process.stdout is not None
    process.stdout.readline()
    return process, f"ws://127.0.0.1:{port}"


def replicated(http: str, count: int) -> bool:
    request = urllib.request.Request(
        f"{http}/api/v1/query",
        data=json.dumps({"application": "api", "ops": [{"n": {"$gte": 0}}]}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        return len(json.loads(reply.read())) >= count


async def run(args: argparse.Namespace, a: str, b: str) -> tuple[int, float]:
    receivers = [await identify(b, f"r{i}", i) for i in range(args.receivers)]
    http_a = a.replace("ws://", "http://")
    deadline = time.monotonic() + 30
    while not await asyncio.to_thread(replicated, http_a, args.receivers):
        if time.monotonic() > deadline:
            raise SystemExit("the receivers never reached instance A's replica")
        await asyncio.sleep(0.1)
    senders = [await identify(a, f"s{i}") for i in range(args.senders)]
    received = 0
    sent = 0
    room = asyncio.Event()
    room.set()
    stop = False

    async def receive(ws: Any) -> None:
        nonlocal received
        async for _ in ws:
            received += 1
            if sent - received < WINDOW // 2:
                room.set()

    async def send(ws: Any, index: int) -> None:
        nonlocal sent
        count = 0
        payload = "x" * args.size
        while not stop:
            if sent - received >= WINDOW:
                room.clear()
                await room.wait()
                continue
            if args.broadcast:  # every receiver gets each one
                target: dict[str, Any] = {"application": "api"}
                frame = {"op": 4, "t": "BROADCAST", "d": {"target": target, "payload": payload}}
            else:
                target = {"application": "api", "ops": [{"n": {"$eq": count % args.receivers}}]}
                frame = {"op": 4, "t": "SEND", "d": {"target": target, "payload": payload}}
            await ws.send(json.dumps(frame))
            sent += args.receivers if args.broadcast else 1
            count += 1

    readers = [asyncio.create_task(receive(ws)) for ws in receivers]
    writers = [asyncio.create_task(send(ws, i)) for i, ws in enumerate(senders)]
    await asyncio.sleep(1.0)  # warm up
    start_received = received
    start = time.monotonic()
    cpu = {pid: cpu_seconds(pid) for pid in args.pids}
    await asyncio.sleep(args.duration)
    delivered = received - start_received
    elapsed = time.monotonic() - start
    args.cpu = {pid: cpu_seconds(pid) - before for pid, before in cpu.items()}
    stop = True
    room.set()
    for task in readers + writers:
        task.cancel()
    for ws in receivers + senders:
        await ws.close()
    return delivered, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--senders", type=int, default=10)
    parser.add_argument("--receivers", type=int, default=10)
    parser.add_argument("--size", type=int, default=100, help="payload characters")
    parser.add_argument(
        "--broadcast", action="store_true", help="BROADCAST to every receiver instead of SEND"
    )
    parser.add_argument("--pythonpath", help="run the relays from this python/ directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        redis = start_redis(directory, durable=False)
        relays = []
        try:
            relay_a, a = start_relay(redis.url, "a", args.pythonpath)
            relays.append(relay_a)
            relay_b, b = start_relay(redis.url, "b", args.pythonpath)
            relays.append(relay_b)
            args.pids = [relay_a.pid, relay_b.pid, redis.process.pid]
            delivered, elapsed = asyncio.run(run(args, a, b))
        finally:
            for process in relays:
                process.terminate()
                process.wait(20)
            redis.stop()
    per = [args.cpu[pid] / max(delivered, 1) * 1e6 for pid in args.pids]
    print(
        f"{delivered / elapsed:,.0f} msg/s delivered across instances "
        f"({'BROADCAST' if args.broadcast else 'SEND'}); CPU us/msg: relay A "
        f"{per[0]:.1f} / relay B {per[1]:.1f} / redis {per[2]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
