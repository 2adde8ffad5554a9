"""End-to-end benchmark of the HTTP tunnel (issue 13): requests/s, p50 and p99 for POST bodies
of 1 KiB and 1 MiB (echoed back) at 1 and 64 concurrent clients, three ways to reach the same
echo server:

- `direct`: the client talks to the server itself;
- `tunnel`: client → rmb-relay (`/relay/acme/app/...`) → `rmb-relay connector` → server;
- `baseline`: the same through `bench/baseline_tunnel.py` (aiohttp + websockets, ~100 lines).

The server is aiohttp (`--target aiohttp`, the default) or the lean uvloop echo server of
`bench/echo_target.py` (`--target lean`); every route of a run reaches the same one. Every
party is its own process; the generator is this process (uvloop, one Protocol per keep-alive
HTTP/1.1 connection, each response checked for status and length). Besides the rates, each
row gives the CPU microseconds every process (relay, connector, target, generator) spent per
request over the measured window, and the host's load average. `--half-load` then paces 64
clients at half the tunnel's measured 1 KiB throughput, through the tunnel and directly, and
reports the p99 difference. Results print as a table and go to bench/results/tunnel-*.json.

    .venv/bin/python -m bench.tunnel [--seconds 3] [--half-load] [--msgpack] [--target lean]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import ctypes
import functools
import heapq
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import uvloop
from aiohttp import web

from .floor_build import compiled
from .outdir import RESULTS
from .procstat import cpu_seconds, free_port, io_syscalls, wait_seconds

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


# ---- the generator ----------------------------------------------------------------------------

#: how paced clients (`--rate`, `--half-load`) space their requests (`--arrivals`)
ARRIVALS = ("poisson", "even", "tick")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Pacer:
    """Sends each paced request at its own time, to the microsecond: one `timerfd` (Linux,
    CLOCK_MONOTONIC, nanosecond resolution) armed for the earliest pending send and watched
    by the loop like a socket. The loop's own timers (`call_at`) run on libuv's millisecond
    clock: every send due within a millisecond leaves in the same loop turn, so 64 paced
    clients at 7,000 req/s arrive as bursts of ~7 each millisecond instead of one every
    ~140 us, and the latency measured is the queueing of that burst. Independent clients do
    not share a tick; this pacer lets them arrive when they would."""

    TFD_TIMER_ABSTIME = 1
    TFD_NONBLOCK_CLOEXEC = os.O_NONBLOCK | os.O_CLOEXEC
    CLOCK_MONOTONIC = 1

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.timerfd_create(self.CLOCK_MONOTONIC, self.TFD_NONBLOCK_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.fd = fd
        self.loop = loop
        self._heap: list[tuple[float, int, _Client]] = []
        self._seq = itertools.count()
        self._armed = 0.0
        loop.add_reader(fd, self._fire)

    def add(self, at: float, client: _Client) -> None:
        """Send `client`'s next request at `at` (time.monotonic seconds)."""
        heapq.heappush(self._heap, (at, next(self._seq), client))
        if self._heap[0][0] == at and at != self._armed:
            self._arm(at)

    def _arm(self, at: float) -> None:
        self._armed = at
        spec = _Itimerspec()
        seconds = int(at)
        spec.it_value.tv_sec = seconds
        spec.it_value.tv_nsec = max(1, int((at - seconds) * 1e9))
        self._libc.timerfd_settime(self.fd, self.TFD_TIMER_ABSTIME, ctypes.byref(spec), None)

    def _fire(self) -> None:
        with contextlib.suppress(BlockingIOError):  # read already, or not yet due
            os.read(self.fd, 8)
        heap = self._heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, client = heapq.heappop(heap)
            client._send()
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        os.close(self.fd)


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


class _Client(asyncio.Protocol):
    """One keep-alive connection of the generator: writes a request, reads its answer (status
    and length checked), writes the next, with no task or future per request, so the
    generator's own CPU per request stays small beside the parties it measures. Paced
    (`interval`): each request goes out at its own time instead of at once: from the `_Pacer`
    (`poisson`: exponential gaps of mean `interval`, so 64 clients together are a Poisson
    stream; `even`: every `interval`, the clients' phases spread evenly), or from the loop's
    millisecond timers (`tick`, what this benchmark did before: sends bunch on each tick). A
    client whose answer comes after its next time sends at once (one request at a time per
    connection); the latency is counted from the actual send."""

    def __init__(self, run: _Run, offset: float) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.remaining = -1
        self.started = 0.0
        self.next_at = 0.0
        self.offset = offset
        self.over = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        run = self.run
        if run.pacer is None:
            self.next_at = run.loop.time() + self.offset
        else:
            self.next_at = time.monotonic() + self.offset
        self._schedule()

    def _schedule(self) -> None:
        run = self.run
        interval = run.interval
        if interval is None:
            self._send()
            return
        pacer = run.pacer
        if pacer is None:  # tick: the loop's millisecond timers
            now = run.loop.time()
            at, self.next_at = self.next_at, self.next_at + interval
            if at > now:
                run.loop.call_at(at, self._send)
            else:
                self._send()
            return
        gap = run.rng.expovariate(1 / interval) if run.arrivals == "poisson" else interval
        at, self.next_at = self.next_at, self.next_at + gap
        if at > time.monotonic():
            pacer.add(at, self)
        else:
            self._send()

    def _send(self) -> None:
        run = self.run
        if run.loop.time() >= run.until or self.transport is None:
            self._finish(None)
            return
        self.started = time.perf_counter()
        self.transport.write(run.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        buffer = self.buffer
        run = self.run
        while True:
            if self.remaining < 0:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buffer[:end])
                del buffer[: end + 4]
                length = -1
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if head[9:12] != b"200" or length != run.size:
                    self._finish(RuntimeError(f"bad response {head[:200]!r}"))
                    return
                self.remaining = length
            if len(buffer) < self.remaining:
                return
            del buffer[: self.remaining]
            self.remaining = -1
            run.done += 1
            if run.loop.time() >= run.warm_until:
                run.latencies.append(time.perf_counter() - self.started)
            self._schedule()
            if not buffer:
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the server closed the connection"))

    def _finish(self, error: BaseException | None) -> None:
        if self.over:
            return
        self.over = True
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        run = self.run
        run.open -= 1
        if run.finished.done():
            return
        if error is not None:
            run.finished.set_exception(error)
        elif not run.open:
            run.finished.set_result(None)


@dataclass(eq=False)
class _Run:
    loop: asyncio.AbstractEventLoop
    request: bytes
    size: int
    until: float
    warm_until: float
    interval: float | None
    open: int
    finished: asyncio.Future[None]
    latencies: list[float] = field(default_factory=list)
    #: requests answered so far (warm-up included)
    done: int = 0
    arrivals: str = "poisson"
    pacer: _Pacer | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(13))


_Snapshot = tuple[dict[str, float], dict[str, tuple[int, int]], dict[str, float]]


def _snapshot(pids: dict[str, int]) -> _Snapshot:
    """CPU, system calls and waits of `pids`, and of this process as `generator` unless the
    generator is a process of its own (then it is one of `pids`)."""
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    io = {name: io_syscalls(pid) for name, pid in pids.items()}
    waited = {name: wait_seconds(pid) for name, pid in pids.items()}
    if "generator" not in pids:
        cpu["generator"] = time.process_time()
        io["generator"] = io_syscalls(os.getpid())
        waited["generator"] = wait_seconds(os.getpid())
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
    """`clients` connections for `seconds` after a warm-up; CPU per request is counted over
    the same window as the rate (warm-up excluded), from /proc for the parties and from this
    process's own clock for the generator. With a `rate`, requests are paced as `arrivals`
    says (`_Client`). `generator`: the C generator's executable, to run the row with it
    instead (`_measure_c`)."""
    request = _request(path, os.urandom(size), token)
    warm = min(0.5, seconds / 4)
    if generator is not None:
        return await _measure_c(
            generator, port, request, size, clients, (warm, seconds), pids, rate, arrivals
        )
    loop = asyncio.get_running_loop()
    start = loop.time()
    load_start = os.getloadavg()[0]
    interval = clients / rate if rate else None
    run = _Run(
        loop, request, size, start + warm + seconds, start + warm, interval, clients,
        loop.create_future(), arrivals=arrivals,
    )  # fmt: skip
    if interval is not None and arrivals != "tick":
        run.pacer = _Pacer(loop)
    marks: dict[str, tuple[_Snapshot, int, float]] = {}

    def mark(name: str) -> None:
        marks[name] = (_snapshot(pids), run.done, loop.time())

    loop.call_at(start + warm, mark, "warm")
    protocols: list[_Client] = []
    for i in range(clients):
        if interval is not None and arrivals == "poisson":
            offset = run.rng.expovariate(1 / interval)  # memoryless: stationary from the start
        else:
            offset = (interval or 0) * i / clients
        _, protocol = await loop.create_connection(
            functools.partial(_Client, run, offset), "127.0.0.1", port
        )
        protocols.append(protocol)
    try:
        await run.finished
    finally:
        for protocol in protocols:
            if protocol.transport is not None:
                protocol.transport.close()
        if run.pacer is not None:
            run.pacer.close()
    mark("end")
    (snap0, done0, t0), (snap1, done1, t1) = marks["warm"], marks["end"]
    # uvloop's clock is per loop turn: a tiny run can read 0. The window ends at `until`, not
    # when the last paced client noticed it (up to a few of its gaps later with Poisson
    # arrivals): what is answered after it was sent before it
    elapsed = min(t1, run.until) - t0
    return _result(
        size, clients, seconds, rate, (snap0, snap1), done1 - done0, elapsed, run.latencies,
        load_start,
    )  # fmt: skip


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
    if arrivals == "tick":
        raise SystemExit("--generator c paces poisson or even arrivals, not tick")
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


async def wait_ready(port: int, path: str, token: str | None = None) -> None:
    for _ in range(200):
        try:
            await measure(port, path, 1, 1, 0.01, {}, token=token)
            return
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.05)
    raise SystemExit(f"nothing answers {path} on {port}")


def tenant_home(prefix: str) -> tuple[Path, dict[str, str], str]:
    """A fresh directory (the processes' XDG_DATA_HOME) with tenant `acme` (secret `SECRET`)
    in its twin/tenant database: the directory, the environment and the `--twins` value."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    env = {**os.environ, "XDG_DATA_HOME": str(tmp)}
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
    """A connector token for `acme` from the relay's `POST /tunnel/token` (client credentials)."""
    form = {"grant_type": "client_credentials", "client_id": "acme", "client_secret": SECRET}
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
    if "pyfloor" in args.routes:  # the thinnest Python tunnel (bench/tunnel_pyfloor.py)
        floor_port, link_port = free_port(), free_port()
        floor = [py, "-m", "bench.tunnel_pyfloor"]
        processes["pyfloor-relay"] = spawn(
            [*floor, "relay", "--port", str(floor_port), "--link-port", str(link_port)], env
        )
        processes["pyfloor-connector"] = spawn(
            [*floor, "connector", "--link-port", str(link_port),
             "--target-port", str(target_port)],
            env,
        )  # fmt: skip
        routes["pyfloor"] = (
            floor_port, "/relay/acme/app/echo", ("pyfloor-relay", "pyfloor-connector", "target")
        )  # fmt: skip
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
            await wait_ready(port, path, token if route == "tunnel" else None)
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
                    for route in ("direct", "tunnel", "pyfloor"):
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
        help="how paced clients space their requests: poisson (independent clients, exact "
        "times from a timerfd), even (one every rate/clients, exact times), tick (the loop's "
        "millisecond timers: sends bunch on each millisecond, the old behaviour)",
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
        help="routes to measure: direct, tunnel, baseline, and pyfloor (the thinnest tunnel a "
        "Python relay and connector can be, bench/tunnel_pyfloor.py; measured at half load too)",
    )
    parser.add_argument(
        "--relay-flag",
        action="append",
        default=[],
        help="one more rmb-relay flag (repeatable), e.g. --relay-flag=--no-tunnel-express to "
        "compare the tunnel's task path with its express path",
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
        help="the load generator: this process (python, uvloop), or bench/http_load.c (c, "
        "built with the system's C compiler: a few microseconds per request, so the host's "
        "two cores go to the routes measured)",
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
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
