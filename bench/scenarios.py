"""End-to-end load scenarios, each run against rmb-relay and the `websockets` baseline relay in
the same run, printed as a table and appended to bench/results/ as JSON with the commit id.

    .venv/bin/python -m bench.scenarios                 # everything (~5 minutes on 2 cores)
    .venv/bin/python -m bench.scenarios rmb --quick     # one scenario, shorter runs

Scenarios: `rmb` (local routing, 1/10/100 pairs x 64 B/1 KiB/16 KiB), `sbd` (forwards of 1000 B),
`idle` (RSS per idle connection), `mailbox` (drain rate of a mailbox on connect), `records` (the
cost of `--records`: the same load with route records off and on, alternating).
The generator runs in one process (one core) and the relay in another (the other core); the
relay's CPU share is read from /proc so a reader can tell which side was the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load

from .outdir import RESULTS
from .procstat import free_port, rss_bytes, system_seconds, tree_cpu_seconds
from .relay_build import relay_process

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def raise_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Relay:
    """A relay process (ours or the baseline) on a free port."""

    def __init__(self, kind: str, twins: Path, extra: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.port = free_port()
        if kind == "rmb-relay":
            cmd = [
                PY,
                "-m",
                "rmb_relay",
                "-l",
                f"127.0.0.1:{self.port}",
                "--twins",
                f"sqlite:{twins}",
                "--sbd-disable-rate-limit",
                "--sbd-idle-ms",
                "600000",
                "--sbd-limit-clients",
                "100000",
                # every generator connection comes from 127.0.0.1
                "--max-connections-per-ip",
                "1000000",
                *extra,
            ]
        else:
            cmd = [PY, "-m", "bench.baseline_relay", "--port", str(self.port)]
        self.process = relay_process(cmd)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the banner: listening
        if not line:
            raise RuntimeError(f"{kind} did not start")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def cpu_seconds(self) -> float:
        # with its children: the relay's route-record writer is a child process
        return tree_cpu_seconds(self.process.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextmanager
def relays(twins: Path) -> Iterator[dict[str, Relay]]:
    started = {kind: Relay(kind, twins) for kind in ("rmb-relay", "websockets-baseline")}
    try:
        yield started
    finally:
        for relay in started.values():
            relay.stop()


def load(relay: Relay, dialect: str, twins: Path, *options: str) -> dict[str, Any]:
    argv = [dialect, "--url", relay.url, "--quiet", *options]
    if dialect == "rmb":
        argv += ["--twins", f"sqlite:{twins}"]
    cpu0, wall0 = relay.cpu_seconds(), time.monotonic()
    sys0 = system_seconds(relay.process.pid)
    result = run_load(load_parser().parse_args(argv))
    cpu = relay.cpu_seconds() - cpu0
    kernel = system_seconds(relay.process.pid) - sys0
    result["relay_cpu_share"] = cpu / (time.monotonic() - wall0)
    # relay CPU per message it delivered in the run (warm-up included, as the CPU is): what a
    # message costs the relay, whether or not the generator was the bottleneck; and the
    # kernel's part of it (reads, writes, the loopback network stack)
    result["relay_us_per_msg"] = cpu / max(result["delivered"], 1) * 1e6
    result["relay_sys_us_per_msg"] = kernel / max(result["delivered"], 1) * 1e6
    return result


def row(name: str, ours: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    ratio = ours["throughput_msgs_per_s"] / max(base["throughput_msgs_per_s"], 1e-9)
    return {
        "scenario": name,
        "rmb_relay_msgs_per_s": round(ours["throughput_msgs_per_s"]),
        "baseline_msgs_per_s": round(base["throughput_msgs_per_s"]),
        "ratio": round(ratio, 1),
        "rmb_relay_p50_ms": round(ours["latency_ms"]["p50"], 2),
        "rmb_relay_p99_ms": round(ours["latency_ms"]["p99"], 2),
        "baseline_p99_ms": round(base["latency_ms"]["p99"], 2),
        "lost": ours["lost"],
        "relay_cpu": round(ours["relay_cpu_share"], 2),
        "relay_us_per_msg": round(ours["relay_us_per_msg"], 2),
        "relay_sys_us_per_msg": round(ours["relay_sys_us_per_msg"], 2),
        "baseline_us_per_msg": round(base["relay_us_per_msg"], 2),
        "generator_cpu": round(ours["generator_cpu_share"], 2),
    }


def throughput_scenario(
    dialect: str, matrix: list[tuple[int, int]], twins: Path, seconds: float
) -> list[dict[str, Any]]:
    rows = []
    cases = THROUGHPUT_RUN["cases"]
    if cases:
        matrix = [case for case in matrix if f"{case[0]}x{case[1]}" in cases]
    with relays(twins) as running:
        for pairs, size in matrix:
            opts = [
                "--pairs",
                str(pairs),
                "--size",
                str(size),
                "--duration",
                str(seconds),
                "--warmup",
                "1",
                "--procs",
                str(THROUGHPUT_RUN["procs"]),
            ]
            results = {kind: load(relay, dialect, twins, *opts) for kind, relay in running.items()}
            rows.append(
                row(
                    f"{dialect} {pairs} pairs x {size} B",
                    results["rmb-relay"],
                    results["websockets-baseline"],
                )
            )
            print_rows(rows[-1:], header=len(rows) == 1)
    return rows


async def _open_idle(url: str, count: int, twins: Path, dialect: str) -> list[Any]:
    from rmb_relay.identity import make_jwt
    from rmb_relay.load.rmb import load_key
    from rmb_relay.sdk.websocket import WebSocketClient

    twin = 1_900_000
    if dialect == "rmb":
        from rmb_relay.twins import Twin
        from rmb_relay.twins.local import SqliteTwinDirectory

        SqliteTwinDirectory(twins).add(Twin(twin, load_key(twin).public_key, frozenset({"x"})))
    now = int(time.time())
    clients = []
    for start in range(0, count, 500):
        batch = [
            WebSocketClient.connect(
                f"{url}?{make_jwt(load_key(twin), twin, f'idle-{i}', now, ttl=3600)}"
            )
            for i in range(start, min(count, start + 500))
        ]
        clients.extend(await asyncio.gather(*batch))
    return clients


def idle_scenario(twins: Path, count: int) -> list[dict[str, Any]]:
    import uvloop

    rows = []
    with relays(twins) as running:
        for kind, relay in running.items():
            before = relay.rss_bytes()

            async def run(relay: Relay = relay) -> int:
                clients = await _open_idle(relay.url, count, twins, "rmb")
                rss = relay.rss_bytes()
                for client in clients:
                    client.transport.abort()
                return rss

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                after = runner.run(run())
            rows.append(
                {
                    "scenario": f"{count:,} idle RMB connections",
                    "relay": kind,
                    "rss_before_mb": round(before / 1e6, 1),
                    "rss_after_mb": round(after / 1e6, 1),
                    "bytes_per_connection": round((after - before) / count),
                }
            )
            print_rows(rows[-1:], header=len(rows) == 1)
    return rows


def mailbox_scenario(twins: Path, count: int) -> list[dict[str, Any]]:
    import uvloop

    from rmb_relay.identity import make_jwt
    from rmb_relay.load.rmb import load_key
    from rmb_relay.sdk import RmbClient
    from rmb_relay.sdk.websocket import WebSocketClient
    from rmb_relay.twins import Twin
    from rmb_relay.twins.local import SqliteTwinDirectory

    directory = SqliteTwinDirectory(twins)
    for twin in (1_800_001, 1_800_002):
        directory.add(Twin(twin, load_key(twin).public_key, frozenset({"x"})))
    relay = Relay("rmb-relay", twins)
    try:

        async def run() -> float:
            sender = await RmbClient.connect(relay.url, 1_800_001, load_key(1_800_001), sign=False)
            payload = bytes(1024)
            wires = [sender.request_envelope(1_800_002, "m", payload)[1] for _ in range(count)]
            assert sender.ws is not None
            for start in range(0, count, 256):
                sender.ws.send_binaries(wires[start : start + 256])
                await sender.ws.drain()
            # wait until everything is stored (the relay's own metric says so)
            await wait_for_metric(relay.port, "rmb_relay_mailbox_depth", count)
            got = 0
            done = asyncio.Event()

            def on_message(message: Any) -> None:
                nonlocal got
                got += 1
                if got == count:
                    done.set()

            # a raw client: the drain is measured, not an SDK handler answering each request
            token = make_jwt(load_key(1_800_002), 1_800_002, None, int(time.time()))
            started = time.perf_counter()
            receiver = await WebSocketClient.connect(f"{relay.url}?{token}", on_message=on_message)
            await asyncio.wait_for(done.wait(), 120)
            elapsed = time.perf_counter() - started
            await receiver.close()
            await sender.close()
            return elapsed

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            elapsed = runner.run(run())
    finally:
        relay.stop()
    rows = [
        {
            "scenario": f"mailbox drain, {count:,} x 1 KiB (in memory)",
            "seconds": round(elapsed, 3),
            "msgs_per_s": round(count / elapsed),
        }
    ]
    print_rows(rows)
    return rows


async def wait_for_metric(port: int, name: str, value: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        page = (await reader.read()).decode()
        writer.close()
        for line in page.splitlines():
            if line.startswith(name + " ") and float(line.split()[1]) >= value:
                return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{name} never reached {value}")


def print_rows(rows: list[dict[str, Any]], header: bool = True) -> None:
    if not rows:
        return
    keys = list(rows[0])
    if header:
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |", flush=True)


def save(name: str, rows: list[dict[str, Any]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (RESULTS / f"{name}-{stamp}.json").write_text(
        json.dumps({"commit": commit(), "time": stamp, "rows": rows}, indent=2) + "\n"
    )


def records_scenario(
    twins: Path, seconds: float, rounds: int, sample: float = 1.0
) -> list[dict[str, Any]]:
    """The cost of `--records`: rmb-relay without and with route records, interleaved in the
    same run (`rounds` of each, in A-B-B-A order) so drift on a shared machine hits both alike.
    Figures are medians over the rounds. Throughput is what the generator got;
    `relay_us_per_msg` (relay CPU per delivered message, all its threads) is the cost even
    when the generator is the bottleneck. The recording relay's written and shed counters are
    read at the end: a shed record would make recording look cheaper than it is."""
    import statistics

    rows = []
    with tempfile.TemporaryDirectory(prefix="rmb-records-") as records:
        plain = Relay("rmb-relay", twins)
        recording = Relay(
            "rmb-relay", twins, ("--records", records, "--records-sample", repr(sample))
        )
        try:
            for dialect, pairs, size in (("rmb", 1, 64), ("rmb", 10, 1024), ("sbd", 1, 1000)):
                opts = ["--pairs", str(pairs), "--size", str(size)]
                opts += ["--duration", str(seconds), "--warmup", "1"]
                runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
                for round_ in range(rounds):
                    order = (("off", plain), ("on", recording))
                    for side, relay in order if round_ % 2 == 0 else order[::-1]:
                        runs[side].append(load(relay, dialect, twins, *opts))

                def median(
                    key: str, side: str, runs: dict[str, list[dict[str, Any]]] = runs
                ) -> float:
                    return statistics.median(r[key] for r in runs[side])

                off_rate = median("throughput_msgs_per_s", "off")
                on_rate = median("throughput_msgs_per_s", "on")
                off_us, on_us = median("relay_us_per_msg", "off"), median("relay_us_per_msg", "on")
                per_round = [
                    round((on["relay_us_per_msg"] / off["relay_us_per_msg"] - 1) * 100, 1)
                    for off, on in zip(runs["off"], runs["on"], strict=True)
                ]
                rows.append(
                    {
                        "scenario": f"{dialect} {pairs} pairs x {size} B",
                        "records_sample": sample,
                        "off_msgs_per_s": round(off_rate),
                        "on_msgs_per_s": round(on_rate),
                        "throughput_change_pct": round((on_rate / off_rate - 1) * 100, 1),
                        "off_relay_us_per_msg": round(off_us, 3),
                        "on_relay_us_per_msg": round(on_us, 3),
                        "cpu_cost_pct": round((on_us / off_us - 1) * 100, 1),
                        "cpu_cost_pct_per_round": per_round,
                        "off_relay_cpu": round(median("relay_cpu_share", "off"), 2),
                        "on_relay_cpu": round(median("relay_cpu_share", "on"), 2),
                        "generator_cpu": round(median("generator_cpu_share", "on"), 2),
                    }
                )
                print_rows(rows[-1:], header=len(rows) == 1)
            counters = read_metrics(recording.port)
        finally:
            plain.stop()
            recording.stop()
        written = sum(1 for _ in Path(records).rglob("part-*.parquet"))
        shed = counters.get("rmb_relay_records_shed_total", 0.0)
        records_written = counters.get("rmb_relay_records_written_total", 0.0)
        # the writer's own CPU per record (absent before it was exported): the part of the cost
        # that is measured directly rather than as a difference of two noisy runs
        writer_cpu = counters.get("rmb_relay_records_writer_cpu_seconds_total")
        writer_ns = None if writer_cpu is None else writer_cpu / max(records_written, 1) * 1e9
        print(
            f"(recording relay: {records_written:.0f} records written, {shed:.0f} shed, "
            f"{written} Parquet files"
            + ("" if writer_ns is None else f", writer {writer_ns:.1f} ns CPU per record")
            + ")"
        )
        for r in rows:
            r["records_shed"] = shed
            r["writer_ns_per_record"] = None if writer_ns is None else round(writer_ns, 1)
    return rows


def read_metrics(port: int) -> dict[str, float]:
    """The relay's unlabelled /metrics samples."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        page = response.read().decode()
    found = {}
    for line in page.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            found[name] = float(value)
    return found


SCENARIOS: dict[str, Callable[[Path, bool], list[dict[str, Any]]]] = {
    "rmb": lambda twins, quick: throughput_scenario(
        "rmb",
        [(p, s) for p in (1, 10, 100) for s in (64, 1024, 16384)],
        twins,
        2 if quick else 4,
    ),
    "sbd": lambda twins, quick: throughput_scenario(
        "sbd", [(1, 1000), (10, 1000)], twins, 2 if quick else 4
    ),
    "idle": lambda twins, quick: idle_scenario(twins, 1000 if quick else 10_000),
    "mailbox": lambda twins, quick: mailbox_scenario(twins, 2000 if quick else 10_000),
    "records": lambda twins, quick: records_scenario(
        twins,
        2 if quick else RECORDS_RUN["seconds"],
        1 if quick else int(RECORDS_RUN["rounds"]),
        RECORDS_RUN["sample"],
    ),
}
#: `records`: seconds per load run and interleaved rounds (medians); --seconds, --rounds
RECORDS_RUN = {"seconds": 4.0, "rounds": 3, "sample": 1.0}
#: `rmb` / `sbd`: generator processes (a pair stays in one process, so at most one per pair)
#: and the "PAIRSxSIZE" cases to run (empty: all); --procs, --cases
THROUGHPUT_RUN: dict[str, Any] = {"procs": 1, "cases": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help=f"scenarios to run: {', '.join(SCENARIOS)}")
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer connections")
    parser.add_argument(
        "--rounds",
        type=int,
        default=int(RECORDS_RUN["rounds"]),
        help="records: interleaved off/on rounds per case (medians are reported)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=RECORDS_RUN["seconds"],
        help="records: seconds of load per run (after 1 s of warm-up)",
    )
    parser.add_argument(
        "--sample",
        type=float,
        default=RECORDS_RUN["sample"],
        help="records: the recording relay's --records-sample R",
    )
    parser.add_argument(
        "--procs",
        type=int,
        default=1,
        help="rmb, sbd: generator processes (so that the relay, not the generator, is the limit)",
    )
    parser.add_argument(
        "--cases",
        default="",
        help="rmb, sbd: only these PAIRSxSIZE cases, comma-separated (e.g. 1x1024,10x16384)",
    )
    args = parser.parse_args()
    RECORDS_RUN.update(rounds=args.rounds, seconds=args.seconds, sample=args.sample)
    THROUGHPUT_RUN.update(procs=args.procs, cases=[c for c in args.cases.split(",") if c])
    unknown = set(args.names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="rmb-bench-") as tmp:
        twins = Path(tmp) / "twins.sqlite3"
        for name in args.names or list(SCENARIOS):
            print(f"\n## {name}\n", flush=True)
            save(name, SCENARIOS[name](twins, args.quick))


if __name__ == "__main__":
    main()
