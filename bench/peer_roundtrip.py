"""Request/response round trips through two rmb-peers and one relay, as a msgbus client sees
them: LPUSH to peer A's `msgbus.system.local`, an echo service on peer B's `msgbus.<cmd>`, the
reply popped from the client's return queue.

    .venv/bin/python -m bench.peer_roundtrip            # 4 scenarios x 5 s (~40 s)
    .venv/bin/python -m bench.peer_roundtrip --quick    # 2 s each

Processes (all on this machine's 2 cores): the relay, peer A, peer B, one redis-server per
peer (no persistence), the load generator (closed loop: N clients, each sends its next request
when its reply is in) and the echo service (its own process). Scenarios: plaintext (peers
started with --no-update: no published keys) and end-to-end encrypted, with 1 and 50 clients.
For each, round trips/s, latency p50/p99, and the CPU each process spent per round trip (read
from /proc), which says where the time goes. Results are appended to
bench/results/peer-<time>.json with the commit id.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from tests.conftest import free_port
from tests.peer_fixtures import (
    CONNECTED,
    Process,
    add_twin,
    mnemonic_for,
    rmb_peer,
    spawn,
    start_relay,
)

from bench.outdir import RESULTS
from bench.scenarios import commit
from rmb_relay.sdk.resp import RespClient

from .procstat import cpu_seconds

COMMAND = "bench.echo"
PAYLOAD = b"x" * 100


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
            *("--dir", str(directory), "--save", "", "--appendonly", "no"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdout is not None
    for line in iter(process.stdout.readline, b""):
        if b"Ready to accept connections" in line:
            break
    return process, f"redis://127.0.0.1:{port}"


async def service(url: str) -> None:
    """The echo service: pops requests in batches, answers each batch in one pipeline."""
    redis, blocking = RespClient(url), RespClient(url)
    queue = f"msgbus.{COMMAND}".encode()
    while True:
        popped, more = await blocking.pipeline([(b"BRPOP", queue, 5), (b"RPOP", queue, 256)])
        if popped is None:
            continue
        batch = [popped[1], *(more or ())]
        replies = []
        for raw in batch:
            request = json.loads(raw)
            reply = {
                "ver": 1,
                "ref": request["ref"],
                "dat": request["dat"],
                "dst": request["src"],
                "shm": None,
                "now": int(time.time()),
            }
            replies.append((b"LPUSH", b"msgbus.system.reply", json.dumps(reply).encode()))
        await redis.pipeline(replies)


async def load(url: str, clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """`clients` closed loops for warmup + seconds; round trips and latencies of the last
    `seconds` only."""
    redis, blocking = RespClient(url), RespClient(url)
    ret = f"bench-ret-{os.getpid()}"
    waiting: dict[str, asyncio.Future[None]] = {}
    latencies: list[int] = []
    measuring = False
    stop = False

    async def reader() -> None:
        while True:
            popped, more = await blocking.pipeline([(b"BRPOP", ret, 5), (b"RPOP", ret, 256)])
            if popped is None:
                continue
            for raw in [popped[1], *(more or ())]:
                reply = json.loads(raw)
                if reply["err"] is not None:
                    raise RuntimeError(f"error reply: {reply}")
                future = waiting.pop(reply["ref"], None)
                if future is not None and not future.done():
                    future.set_result(None)

    async def client(index: int) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        dat = base64.b64encode(PAYLOAD).decode()
        while not stop:
            ref = f"{index}-{n}"
            n += 1
            message = {
                "ver": 1,
                "ref": ref,
                "cmd": COMMAND,
                "exp": 300,
                "dat": dat,
                "tag": None,
                "dst": [2],
                "ret": ret,
                "shm": None,
                "now": int(time.time()),
            }
            future = waiting[ref] = loop.create_future()
            started = time.perf_counter_ns()
            # the push's acknowledgement is not waited for before the reply: a client that
            # did would add a Redis round trip of its own to every measurement
            push = loop.create_task(
                redis.pipeline([(b"LPUSH", b"msgbus.system.local", json.dumps(message))])
            )
            await asyncio.wait_for(future, 30)
            await push
            if measuring:
                latencies.append(time.perf_counter_ns() - started)

    read = asyncio.create_task(reader())
    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    await asyncio.sleep(warmup)
    measuring = True
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    measuring = False
    elapsed = time.perf_counter() - started
    stop = True
    await asyncio.gather(*tasks)
    read.cancel()
    latencies.sort()
    count = len(latencies)
    return {
        "round_trips": count,
        "per_second": round(count / elapsed),
        "p50_ms": round(latencies[count // 2] / 1e6, 3),
        "p99_ms": round(latencies[int(count * 0.99)] / 1e6, 3),
    }


def scenario(encrypted: bool, clients: int, seconds: float, tmp: Path) -> dict[str, Any]:
    twins = f"sqlite:{tmp / f'twins-{encrypted}-{clients}.sqlite3'}"
    add_twin(twins, 1)
    add_twin(twins, 2, "ed25519")
    relay = start_relay(twins)
    redis_a, url_a = start_redis(tmp)
    redis_b, url_b = start_redis(tmp)
    flags = [] if encrypted else ["--no-update"]
    peers: list[Process] = []
    for twin, url, key_type in ((1, url_a, "sr25519"), (2, url_b, "ed25519")):
        args = ["-m", mnemonic_for(twin), "-k", key_type, "-r", url, "--twins", twins]
        peers.append(spawn(rmb_peer(*args, "--relay", relay.url, *flags)))
    for peer in peers:
        peer.output.wait_for(CONNECTED)
    echo = subprocess.Popen([sys.executable, "-m", "bench.peer_roundtrip", "--service", url_b])
    named = {
        "relay": relay.process.popen.pid,
        "peer_a": peers[0].popen.pid,
        "peer_b": peers[1].popen.pid,
        "redis_a": redis_a.pid,
        "redis_b": redis_b.pid,
        "service": echo.pid,
        "generator": os.getpid(),
    }
    before = {name: cpu_seconds(pid) for name, pid in named.items()}
    try:
        result = uvloop.run(load(url_a, clients, seconds, warmup=1.0))
        after = {name: cpu_seconds(pid) for name, pid in named.items()}
    finally:
        echo.terminate()
        echo.wait()
        for peer in peers:
            peer.stop()
        relay.process.stop()
        for process in (redis_a, redis_b):
            process.terminate()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
    total = max(result["round_trips"], 1) * (seconds + 1.0) / seconds  # warm-up included
    result["cpu_us_per_round_trip"] = {
        name: round((after[name] - before[name]) / total * 1e6, 1) for name in named
    }
    result.update(encrypted=encrypted, clients=clients, seconds=seconds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s per scenario instead of 5")
    parser.add_argument(
        "--mode", choices=("plain", "e2e"), action="append", help="only these (default: both)"
    )
    parser.add_argument(
        "--clients", type=int, action="append", help="only these counts (default: 1 and 50)"
    )
    parser.add_argument("--service", metavar="REDIS_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.service:
        uvloop.run(service(args.service))
        return
    seconds = 2.0 if args.quick else 5.0
    rows = []
    with tempfile.TemporaryDirectory(prefix="rmb-peer-bench-") as directory:
        for encrypted in [mode == "e2e" for mode in args.mode or ("plain", "e2e")]:
            for clients in args.clients or (1, 50):
                row = scenario(encrypted, clients, seconds, Path(directory))
                rows.append(row)
                cpu = row["cpu_us_per_round_trip"]
                print(
                    f"{'e2e' if encrypted else 'plain':5} clients={clients:3} "
                    f"{row['per_second']:6}/s p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms"
                    f" | cpu us/rt: " + " ".join(f"{k}={v}" for k, v in cpu.items()),
                    flush=True,
                )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = RESULTS / f"peer-{stamp}.json"
    out.write_text(json.dumps({"commit": commit(), "rows": rows}, indent=2))
    print(f"results: {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
