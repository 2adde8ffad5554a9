"""End-to-end benchmark of the HTTP tunnel (issue 13): requests/s, p50 and p99 for POST bodies
of 1 KiB and 1 MiB (echoed back) at 1 and 64 concurrent clients, three ways to reach the same
echo server:

- `direct`: the client talks to the server itself;
- `tunnel`: client → rmb-relay (`/relay/acme/app/...`) → `rmb-relay connector` → server;
- `baseline`: the same through `bench/baseline_tunnel.py` (aiohttp + websockets, ~100 lines).

The server is aiohttp (`--target aiohttp`, the default) or the harness's lean uvloop echo
server (`rmb_relay/load/echo_target.py`, `--target lean`); every route of a run reaches the
same one. Every party is its own process; the generator is the harness, `rmb-load tunnel`
(`--request-path` for each route, every answer checked for status and length), or the C
generator (`--generator c`, `bench/http_load.c`). Besides the rates, each row gives the CPU
microseconds every process (relay, connector, target, generator) spent per request over the
run, and the host's load average. `--half-load` then paces 64
clients at half the tunnel's measured 1 KiB throughput, through the tunnel and directly, and
reports the p99 difference. Results print as a table and go to bench/results/tunnel-*.json.

    .venv/bin/python -m bench.tunnel [--seconds 3] [--half-load] [--msgpack] [--target lean]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load
from rmb_relay.load.engine import ARRIVALS as LOAD_ARRIVALS

from .floor_build import compiled
from .outdir import RESULTS
from .procstat import cpu_seconds, free_port, io_syscalls, wait_seconds
from .relay_build import relay_env

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret-0123456789"


# ---- the target servers ----------------------------------------------------------------------


async def target(port: int) -> None:
    """The aiohttp echo server (`--target aiohttp`); `bench/echo_target.py` is the lean one."""

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read(), content_type="application/octet-stream")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


# ---- the generator: the harness's, `rmb-load tunnel` -------------------------------------------

#: how paced clients (`--rate`, `--half-load`) space their requests (`--arrivals`)
ARRIVALS = LOAD_ARRIVALS


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
    #: cores each process used (CPU seconds per second) over the measured window
    cpu: dict[str, float]
    #: CPU microseconds each process spent per request over the measured window
    us_per_request: dict[str, float] = field(default_factory=dict)
    #: read-like and write-like system calls each process made per request (/proc/PID/io)
    syscalls_per_request: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: the host's 1-minute load average at the start and the end of the row
    load: tuple[float, float] = (0.0, 0.0)
    paced_rps: float | None = None
    #: microseconds per request each process's main thread spent runnable but waiting for a
    #: core (/proc/PID/schedstat): on a shared host, the latency that is not our work
    waited_us_per_request: dict[str, float] = field(default_factory=dict)


_Snapshot = tuple[dict[str, float], dict[str, tuple[int, int]], dict[str, float]]


def _snapshot(pids: dict[str, int]) -> _Snapshot:
    """CPU, system calls and waits of `pids` (the C generator is one of them when used; the
    harness reports its own CPU)."""
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    io = {name: io_syscalls(pid) for name, pid in pids.items()}
    waited = {name: wait_seconds(pid) for name, pid in pids.items()}
    return cpu, io, waited


def _request(path: str, body: bytes, token: str | None) -> bytes:
    """The one request every connection of a row sends, head and body."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
        + (f"Authorization: Bearer {token}\r\n" if token else "")
        + f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _result(
    size: int,
    clients: int,
    seconds: float,
    rate: float | None,
    window: tuple[_Snapshot, _Snapshot],
    answered: int,
    elapsed: float,
    latencies: list[float],
    load_start: float,
) -> Result:
    """A row from what the window measured: the parties' snapshots at its two ends, the
    requests answered in it and its length, and the latencies (seconds) recorded."""
    (cpu0, io0, wait0), (cpu1, io1, wait1) = window
    elapsed = max(elapsed, 1e-6)
    per = max(1, answered)
    cpu = {name: round((cpu1[name] - cpu0[name]) / elapsed, 2) for name in cpu1}
    per_request = {name: round((cpu1[name] - cpu0[name]) * 1e6 / per, 1) for name in cpu1}
    syscalls = {
        name: (
            round((io1[name][0] - io0[name][0]) / per, 2),
            round((io1[name][1] - io0[name][1]) / per, 2),
        )
        for name in io1
    }
    waited = {name: round((wait1[name] - wait0[name]) * 1e6 / per, 1) for name in wait1}
    latencies = sorted(latencies)
    n = len(latencies)
    p50 = latencies[n // 2] * 1000 if n else 0.0
    p99 = latencies[min(n - 1, int(n * 0.99))] * 1000 if n else 0.0
    return Result(
        "", size, clients, n, seconds, answered / elapsed, p50, p99, cpu, per_request,
        syscalls, (round(load_start, 2), round(os.getloadavg()[0], 2)), rate, waited,
    )  # fmt: skip


async def measure(
    port: int,
    path: str,
    size: int,
    clients: int,
    seconds: float,
    pids: dict[str, int],
    rate: float | None = None,
    arrivals: str = "poisson",
    token: str | None = None,
    generator: Path | None = None,
) -> Result:
    """`clients` connections for `seconds` after a warm-up, from `rmb-load tunnel` (the
    harness, its own process); CPU per request is counted from /proc over the whole run for
    the parties and by the harness for itself. With a `rate`, requests are paced as `arrivals`
    says. `generator`: the C generator's executable, to run the row with it instead
    (`_measure_c`)."""
    warm = min(0.5, seconds / 4)
    if generator is not None:
        request = _request(path, os.urandom(size), token)
        return await _measure_c(
            generator, port, request, size, clients, (warm, seconds), pids, rate, arrivals
        )
    argv = ["tunnel", "--url", f"http://127.0.0.1:{port}/", "--request-path", path,
            "--concurrency", str(clients), "--size", str(size), "--duration", str(seconds),
            "--warmup", str(warm), "--echo-check", "--quiet",
            *(["--token", token] if token else []),
            *(["--rate", str(rate), "--arrivals", arrivals] if rate else [])]  # fmt: skip
    load_start = os.getloadavg()[0]
    before = _snapshot(pids)
    started = time.monotonic()
    summary = run_load(load_parser().parse_args(argv))
    elapsed = time.monotonic() - started
    after = _snapshot(pids)
    if summary["failed"] or summary["errors"] or summary["lost"]:
        raise RuntimeError(f"tunnel row {path} x {clients}: {summary}")
    result = _result(
        size, clients, seconds, rate, (before, after), summary["delivered"], elapsed, [],
        load_start,
    )  # fmt: skip
    result.rps = summary["throughput_msgs_per_s"]
    result.requests = summary["delivered"]
    result.p50_ms = summary["latency_ms"]["p50"]
    result.p99_ms = summary["latency_ms"]["p99"]
    result.us_per_request["generator"] = round(summary["generator_cpu_us_per_msg"], 1)
    result.cpu["generator"] = round(summary["generator_cpu_share"], 2)
    return result


async def _measure_c(
    exe: Path,
    port: int,
    request: bytes,
    size: int,
    clients: int,
    window: tuple[float, float],
    pids: dict[str, int],
    rate: float | None,
    arrivals: str,
) -> Result:
    """`measure` with the C generator (`bench/http_load.c`, `--generator c`): the same request,
    warm-up and window (`window`: their lengths), pacing, from a process of its own whose CPU
    is counted from /proc as the parties' is. The parties are sampled when it says `warm` and
    `end`; its own counts (requests in the window, the window's length) and latencies make
    the row."""
    warm, seconds = window
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rmb-bench-load-") as tmp:
        request_file, latency_file = Path(tmp) / "request", Path(tmp) / "latencies"
        request_file.write_bytes(request)
        process = await asyncio.create_subprocess_exec(
            str(exe), str(port), str(clients), str(warm), str(seconds), str(rate or 0),
            arrivals, str(request_file), str(size), str(latency_file),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert process.stdin is not None
        assert process.stdout is not None
        assert process.stderr is not None
        parties = {**pids, "generator": process.pid}
        snapshots: list[_Snapshot] = []
        summary: dict[str, Any] = {}
        while line := await process.stdout.readline():
            if line.strip() in (b"warm", b"end"):
                snapshots.append(_snapshot(parties))
            elif line.startswith(b"{"):
                summary = json.loads(line)
                process.stdin.close()  # its /proc entry was read at both marks: it may go
        error = (await process.stderr.read()).decode().strip()
        if await process.wait() != 0 or len(snapshots) != 2 or not summary:
            raise RuntimeError(error or f"{exe.name} ended with {process.returncode}")
        latencies = array.array("d")
        latencies.frombytes(latency_file.read_bytes())
    return _result(
        size, clients, seconds, rate, (snapshots[0], snapshots[1]), int(summary["answered"]),
        float(summary["window"]), latencies.tolist(), load_start,
    )  # fmt: skip


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


def wait_ready(port: int, path: str, token: str | None = None) -> None:
    """Until one request through `path` is echoed (the connector prints nothing when up)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", b"x", headers)
    for _ in range(200):
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                if reply.status == 200 and reply.read() == b"x":
                    return
        except OSError:
            pass
        time.sleep(0.05)  # polling processes we started, not a test's synchronisation
    raise SystemExit(f"nothing answers {path} on {port}")


def tenant_home(prefix: str) -> tuple[Path, dict[str, str], str]:
    """A fresh directory (the processes' XDG_DATA_HOME) with tenant `acme` (secret `SECRET`)
    in its twin/tenant database: the directory, the environment and the `--twins` value."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    env = relay_env({**os.environ, "XDG_DATA_HOME": str(tmp)})
    db = f"sqlite:{tmp / 'relay.sqlite3'}"
    _run_sync(
        [sys.executable, "-m", "rmb_relay", "tenants", "--twins", db,
         "add", "acme", "--secret", SECRET],
        check=True,
        env=env,
        capture_output=True,
    )  # fmt: skip
    return tmp, env, db


async def bearer_token(port: int) -> str:
    """A client token for `acme` from the relay's `POST /tunnel/token` (client credentials)."""
    form = {
        "grant_type": "client_credentials",
        "client_id": "acme",
        "client_secret": SECRET,
        "scope": "client",
    }
    for _ in range(200):  # until the relay is up
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://127.0.0.1:{port}/tunnel/token", data=form) as reply,
            ):
                reply.raise_for_status()
                return str((await reply.json())["access_token"])
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    raise SystemExit(f"no token from the relay on {port}")


async def run(args: argparse.Namespace) -> list[Result]:
    with contextlib.ExitStack() as built:
        programs = {
            name: built.enter_context(compiled(ROOT / "bench" / f"{name}.c", *libs))
            for name, libs, wanted in (
                ("echo_target", (), args.target == "c"),
                ("http_load", ("-lm",), args.generator == "c"),
            )
            if wanted
        }
        return await _run(args, programs)


async def _run(args: argparse.Namespace, programs: dict[str, Path]) -> list[Result]:
    """Every row of the run, with the C programs `programs` (built for `--target c` and
    `--generator c`)."""
    tmp, env, db = tenant_home("tunnel-bench-")
    if args.auth:  # clients of `acme` must send a bearer token (the generator's: `--auth`)
        _run_sync(
            [sys.executable, "-m", "rmb_relay", "tenants", "--twins", db,
             "set", "acme", "--require-auth", "yes"],
            check=True, env=env, capture_output=True,
        )  # fmt: skip
    py = sys.executable
    target_port, relay_port, base_port = free_port(), free_port(), free_port()
    target_url = f"http://127.0.0.1:{target_port}"
    profile = os.environ.get("BENCH_PROFILE")  # a directory: cProfile relay and connector

    def prof(name: str) -> list[str]:
        # CPU-time profile (bench/cpuprofile.py): wall time would charge preemption to syscalls
        return ["-m", "bench.cpuprofile", f"{profile}/{name}.prof"] if profile else []

    connector_flags = ["--msgpack"] if args.msgpack else []
    target_command = {
        "aiohttp": [py, "-m", "bench.tunnel", "target"],
        "lean": [py, "-m", "bench.echo_target"],
        "c": [str(programs.get("echo_target"))],
    }[args.target]
    processes = {
        "target": spawn([*target_command, "--port", str(target_port)], env),
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
                # a token that outlives the run (the generator fetches one at the start)
                *(["--tunnel-token-ttl", "86400"] if args.auth else []),
                # every client is one address of one tenant: the upload rates (64 and
                # 128 MiB/s) would measure that policy at 1 MiB bodies, not the relay
                *("--tunnel-upload-rate-per-ip", "0", "--tunnel-upload-rate-per-tenant", "0"),
                *args.relay_flag,
            ],
            env,
        ),
        "baseline": spawn(
            [py, "-m", "bench.baseline_tunnel", "server", "--port", str(base_port)], env
        ),
    }
    # the connector prints nothing when it is up: `wait_ready` below finds out
    # `--connectors N`: the tenant's requests shared by N connector processes (hub.py)
    connectors = ["connector"] + [f"connector{n}" for n in range(2, args.connectors + 1)]
    for name in connectors:
        processes[name] = _popen(
            [py, *prof(name), "-m", "rmb_relay", "connector", *connector_flags,
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
        "tunnel": (relay_port, "/relay/acme/app/echo", ("relay", *connectors, "target")),
        "baseline": (base_port, "/relay/echo", ("baseline", "baseline-connector", "target")),
    }
    if "python-floor" in args.routes:  # the thinnest Python tunnel (bench/tunnel_python_floor.py)
        floor_port, link_port = free_port(), free_port()
        floor = [py, "-m", "bench.tunnel_python_floor"]
        processes["python-floor-relay"] = spawn(
            [*floor, "relay", "--port", str(floor_port), "--link-port", str(link_port)], env
        )
        processes["python-floor-connector"] = spawn(
            [*floor, "connector", "--link-port", str(link_port),
             "--target-port", str(target_port)],
            env,
        )  # fmt: skip
        floor_parts = ("python-floor-relay", "python-floor-connector", "target")
        routes["python-floor"] = (floor_port, "/relay/acme/app/echo", floor_parts)
    print("pids " + " ".join(f"{name}={p.pid}" for name, p in processes.items()), flush=True)
    results: list[Result] = []
    token: str | None = None
    meter = functools.partial(measure, generator=programs.get("http_load"))

    def show(result: Result, label: str) -> None:
        print(
            f"{label:19} {result.body:>8} B x {result.clients:>2}: {result.rps:7.0f} req/s  "
            f"p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  "
            f"us/req {result.us_per_request}  load {result.load[0]:.1f}-{result.load[1]:.1f}\n"
            f"{'':19} syscalls/req (read, write) {result.syscalls_per_request}\n"
            f"{'':19} waited for a core us/req {result.waited_us_per_request}",
            flush=True,
        )

    try:
        if args.auth:
            token = await bearer_token(relay_port)
        for route, (port, path, _) in routes.items():
            wait_ready(port, path, token if route == "tunnel" else None)
        if args.connectors > 1:
            await asyncio.sleep(1.0)  # one connector answered; give the others time to join
        for size in args.sizes:
            for clients in args.clients:
                for route, (port, path, parties) in routes.items():
                    if route not in args.routes:
                        continue
                    pids = {name: processes[name].pid for name in parties}
                    result = await meter(
                        port, path, size, clients, args.seconds, pids, args.rate, args.arrivals,
                        token if route == "tunnel" else None,
                    )  # fmt: skip
                    result.route = route
                    results.append(result)
                    show(result, route)
        if args.half_load:
            full = next(
                (r for r in results if (r.route, r.body, r.clients) == ("tunnel", 1024, 64)), None
            )
            rate = args.half_rate or (full.rps / 2 if full is not None else None)
            if rate is not None:
                # the same generator and pacing for every route: the difference is the tunnel's
                for _ in range(args.half_repeat):
                    for route in ("direct", "tunnel", "python-floor"):
                        if route not in routes:
                            continue
                        port, path, parties = routes[route]
                        pids = {name: processes[name].pid for name in parties}
                        result = await meter(
                            port, path, 1024, 64, args.seconds, pids, rate, args.arrivals,
                            token if route == "tunnel" else None,
                        )  # fmt: skip
                        result.route = route
                        results.append(result)
                        show(result, f"half {rate:.0f}/s {route}")
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
    parser.add_argument(
        "--connectors", type=int, default=1, help="connector processes sharing the tenant"
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="pace every row at this many requests/s in all (CPU per request at a fixed rate "
        "compares two versions of the code on a busy host better than their peak rates)",
    )
    parser.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="poisson",
        help="how paced clients space their requests (the harness's pacer, exact times from a "
        "timerfd): poisson (independent clients) or even (one every rate/clients)",
    )
    parser.add_argument(
        "--half-rate",
        type=float,
        help="the --half-load rate (req/s) instead of half the measured tunnel rate: the same "
        "load for runs to compare",
    )
    parser.add_argument(
        "--half-repeat", type=int, default=1, help="--half-load rows per route (interleaved)"
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="the tunnel's tenant requires a bearer token; the generator sends one from "
        "POST /tunnel/token",
    )
    parser.add_argument(
        "--routes",
        nargs="*",
        default=["direct", "tunnel", "baseline"],
        help="routes to measure: direct, tunnel, baseline, and python-floor (the thinnest tunnel "
        "a Python relay and connector can be, bench/tunnel_python_floor.py; also at half load)",
    )
    parser.add_argument(
        "--relay-flag",
        action="append",
        default=[],
        help="one more rmb-relay flag (repeatable), e.g. --relay-flag=--tunnel-token-ttl=60",
    )
    parser.add_argument(
        "--target",
        choices=("aiohttp", "lean", "c"),
        default="aiohttp",
        help="the echo server every route reaches: aiohttp, bench/echo_target.py (lean), or "
        "bench/echo_target.c (c, built with the system's C compiler)",
    )
    parser.add_argument(
        "--generator",
        choices=("python", "c"),
        default="python",
        help="the load generator: the harness (python: `rmb-load tunnel`, its own process), or "
        "bench/http_load.c (c, built with the system's C compiler: a few microseconds per "
        "request, so the host's two cores go to the routes measured)",
    )
    args = parser.parse_args()
    if args.role == "target":
        uvloop.run(target(args.port))
        return
    results = uvloop.run(run(args))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"tunnel-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {
                "commit": commit,
                "target": args.target,
                "generator": args.generator,
                "connector": "msgpack" if args.msgpack else "json",
                "results": [asdict(r) for r in results],
            },
            indent=1,
        )
    )
    # RMB_BENCH_RESULTS may point outside the tree (make's PGO training does)
    print(f"written {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
