"""End-to-end benchmark of the HTTP tunnel (issue 13): requests/s, p50 and p99 for POST bodies
of 1 KiB and 1 MiB (echoed back) at 1 and 64 concurrent clients, three ways to reach the same
aiohttp server:

- `direct`: the client talks to the server itself;
- `tunnel`: client → rmb-relay (`/relay/acme/app/...`) → `rmb-relay connector` → server;
- `baseline`: the same through `bench/baseline_tunnel.py` (aiohttp + websockets, ~100 lines).

Every party is its own process; the generator is this process (uvloop, raw keep-alive HTTP/1.1
connections, each response checked for status and length). `--half-load` then paces 64
clients at half the tunnel's measured 1 KiB throughput, through the tunnel and directly, and
reports the p99 difference. Results print as a table and go to bench/results/tunnel-*.json.

    .venv/bin/python -m bench.tunnel [--seconds 3] [--half-load]
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from .procstat import cpu_seconds, free_port

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret-0123456789"


# ---- the target server ------------------------------------------------------------------------


async def target(port: int) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read(), content_type="application/octet-stream")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


# ---- the generator ----------------------------------------------------------------------------


@dataclass
class Result:
    route: str
    body: int
    clients: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    cpu: dict[str, float]
    paced_rps: float | None = None


async def _client(
    port: int,
    path: str,
    body: bytes,
    until: float,
    warm_until: float,
    latencies: list[float],
    interval: float | None,
    offset: float,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    next_at = loop.time() + offset
    try:
        while True:
            if interval is not None:
                now = loop.time()
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                next_at += interval
            start = time.perf_counter()
            if loop.time() >= until:
                return
            writer.write(head)
            writer.write(body)
            response = await reader.readuntil(b"\r\n\r\n")
            status = response[9:12]
            length = -1
            for line in response.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if status != b"200" or length != len(body):
                raise RuntimeError(f"bad response {response[:200]!r}")
            await reader.readexactly(length)
            if loop.time() >= warm_until:
                latencies.append(time.perf_counter() - start)
    finally:
        writer.close()


async def measure(
    port: int,
    path: str,
    size: int,
    clients: int,
    seconds: float,
    pids: dict[str, int],
    rate: float | None = None,
) -> tuple[int, float, float, float, dict[str, float]]:
    body = os.urandom(size)
    loop = asyncio.get_running_loop()
    warm = min(0.5, seconds / 4)
    start = loop.time()
    latencies: list[float] = []
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    before["generator"] = time.process_time()
    interval = clients / rate if rate else None
    await asyncio.gather(
        *(
            _client(
                port,
                path,
                body,
                start + warm + seconds,
                start + warm,
                latencies,
                interval,
                (interval or 0) * i / clients,
            )
            for i in range(clients)
        )
    )
    cpu = {name: (cpu_seconds(pid) - before[name]) / (seconds + warm) for name, pid in pids.items()}
    cpu["generator"] = (time.process_time() - before["generator"]) / (seconds + warm)
    latencies.sort()
    n = len(latencies)
    p50 = latencies[n // 2] * 1000 if n else 0.0
    p99 = latencies[min(n - 1, int(n * 0.99))] * 1000 if n else 0.0
    return n, n / seconds, p50, p99, {k: round(v, 2) for k, v in cpu.items()}


# ---- orchestration ----------------------------------------------------------------------------


def _run_sync(args: list[str], **options: Any) -> None:
    subprocess.run(args, **options)


def _popen(args: list[str], **options: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(args, **options)


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"{args} did not start")
    return process


async def wait_ready(port: int, path: str) -> None:
    for _ in range(200):
        try:
            await measure(port, path, 1, 1, 0.01, {})
            return
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.05)
    raise SystemExit(f"nothing answers {path} on {port}")


async def run(args: argparse.Namespace) -> list[Result]:
    tmp = Path(tempfile.mkdtemp(prefix="tunnel-bench-"))
    env = {**os.environ, "XDG_DATA_HOME": str(tmp)}
    py = sys.executable
    db = f"sqlite:{tmp / 'relay.sqlite3'}"
    _run_sync(
        [py, "-m", "rmb_relay", "tenants", "--twins", db, "add", "acme", "--secret", SECRET],
        check=True,
        env=env,
        capture_output=True,
    )
    target_port, relay_port, base_port = free_port(), free_port(), free_port()
    target_url = f"http://127.0.0.1:{target_port}"
    profile = os.environ.get("BENCH_PROFILE")  # a directory: cProfile relay and connector

    def prof(name: str) -> list[str]:
        # CPU-time profile (bench/cpuprofile.py): wall time would charge preemption to syscalls
        return ["-m", "bench.cpuprofile", f"{profile}/{name}.prof"] if profile else []

    connector_flags = ["--msgpack"] if args.msgpack else []
    processes = {
        "target": spawn([py, "-m", "bench.tunnel", "target", "--port", str(target_port)], env),
        "relay": spawn(
            [
                py,
                *prof("relay"),
                "-m",
                "rmb_relay",
                "-l",
                f"127.0.0.1:{relay_port}",
                "--twins",
                db,
                "--no-sbd",
                "--tunnel-body-store",
                str(tmp / "bodies"),
            ],
            env,
        ),
        "baseline": spawn(
            [py, "-m", "bench.baseline_tunnel", "server", "--port", str(base_port)], env
        ),
    }
    # the connector prints nothing when it is up: `wait_ready` below finds out
    processes["connector"] = _popen(
        [py, *prof("connector"), "-m", "rmb_relay", "connector", *connector_flags,
         "--server", f"http://127.0.0.1:{relay_port}", "--tenant", "acme", "--secret", SECRET,
         "--target", f"app={target_url}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    processes["baseline-connector"] = spawn(
        [py, "-m", "bench.baseline_tunnel", "connector", "--server",
         f"ws://127.0.0.1:{base_port}/connect", "--target", target_url],
        env,
    )  # fmt: skip
    routes = {
        "direct": (target_port, "/echo", ("target",)),
        "tunnel": (relay_port, "/relay/acme/app/echo", ("relay", "connector", "target")),
        "baseline": (base_port, "/relay/echo", ("baseline", "baseline-connector", "target")),
    }
    results: list[Result] = []
    try:
        for port, path, _ in routes.values():
            await wait_ready(port, path)
        for size in args.sizes:
            for clients in args.clients:
                for route, (port, path, parties) in routes.items():
                    if route not in args.routes:
                        continue
                    pids = {name: processes[name].pid for name in parties}
                    n, rps, p50, p99, cpu = await measure(
                        port, path, size, clients, args.seconds, pids
                    )
                    result = Result(route, size, clients, n, args.seconds, rps, p50, p99, cpu)
                    results.append(result)
                    print(
                        f"{route:9} {size:>8} B x {clients:>2}: {rps:9.0f} req/s  "
                        f"p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  cpu {cpu}",
                        flush=True,
                    )
        if args.half_load:
            full = next(
                (r for r in results if (r.route, r.body, r.clients) == ("tunnel", 1024, 64)), None
            )
            if full is not None:
                rate = full.rps / 2
                for route in ("direct", "tunnel"):
                    port, path, parties = routes[route]
                    pids = {name: processes[name].pid for name in parties}
                    n, rps, p50, p99, cpu = await measure(
                        port, path, 1024, 64, args.seconds, pids, rate=rate
                    )
                    result = Result(route, 1024, 64, n, args.seconds, rps, p50, p99, cpu, rate)
                    results.append(result)
                    print(
                        f"half load {route:9} {rate:7.0f}/s paced: {rps:7.0f} req/s  "
                        f"p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  cpu {cpu}",
                        flush=True,
                    )
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(10)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    t = sub.add_parser("target")
    t.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 1 << 20])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--half-load", action="store_true")
    parser.add_argument("--msgpack", action="store_true", help="the connector speaks msgpack")
    parser.add_argument("--routes", nargs="+", default=["direct", "tunnel", "baseline"])
    args = parser.parse_args()
    if args.role == "target":
        uvloop.run(target(args.port))
        return
    results = uvloop.run(run(args))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    out = ROOT / "bench" / "results" / f"tunnel-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(
        json.dumps({"commit": commit, "results": [asdict(r) for r in results]}, indent=1)
    )
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
