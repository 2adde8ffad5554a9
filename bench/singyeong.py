"""신경 gateway scenarios, run against rmb-relay and `bench/singyeong_baseline.py` (a
`websockets`-only gateway) in the same run, printed as a table and appended to bench/results/.

    .venv/bin/python -m bench.singyeong                  # 10,000 clients, every scenario
    .venv/bin/python -m bench.singyeong --clients 2000 --duration 3 --only send_eq

The generator is the harness, `rmb-load singyeong` (one process, uvloop, frames built by the
gateway's own codec and masked by the Rust core, payloads stamped with the send time); the
gateway is another process. Scenarios (all JSON): `send_eq` SEND to `application` + `$eq` on
a per-client id; `send_range` SEND to a range of 10 (`$gte`/`$lt`, one picked); `broadcast`
BROADCAST to one group of 1,000 clients, the group changing from one BROADCAST to the next (10
groups at 10,000 clients: no two BROADCASTs in flight share a receiver, so nothing can
coalesce); `broadcast_1000` the issue's "fan-out to 1,000 clients" read literally: 1,000 clients
connected, every BROADCAST to all of them; `queue` QUEUE -> 20 consumers (REQUEST/ACK) ->
acked messages/s. `gw_cpu` / `gen_cpu` are each side's share of one core over the run,
`gw_us` / `gen_us` their CPU per delivery. `SG_GATEWAY_ARGS` adds flags to the rmb-relay
command line. `SG_WINDOW` (default 4096) bounds the deliveries in flight (recorded in each row
as `window`; docs/singyeong.md has a table over it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load

from .outdir import RESULTS
from .procstat import cpu_seconds, free_port
from .relay_build import relay_env

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("send_eq", "send_range", "broadcast", "broadcast_1000", "queue")
GROUP = 1000  # clients per broadcast group
CONSUMERS = 20


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
            cmd, cwd=ROOT, env=relay_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert self.process.stdout is not None
        self.process.stdout.readline()  # banner: listening

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def scenario_args(scenario: str, clients: int) -> tuple[list[str], int]:
    """The `rmb-load singyeong` flags of a scenario, and its fan-out."""
    if scenario == "broadcast_1000":
        clients = min(clients, GROUP)
    if scenario.startswith("broadcast"):
        group = clients if scenario == "broadcast_1000" else min(GROUP, clients)
        while clients % group:  # the harness wants groups of one size
            group -= 1
        return ["--mode", "broadcast", "--clients", str(clients), "--group", str(group)], group
    if scenario == "queue":
        return ["--mode", "queue", "--clients", str(clients), "--consumers", str(CONSUMERS)], 1
    return ["--mode", scenario, "--clients", str(clients)], 1


def run_scenario(kind: str, scenario: str, clients: int, duration: float) -> dict[str, Any]:
    gateway = Gateway(kind)
    try:
        flags, fanout = scenario_args(scenario, clients)
        window = max(1, int(os.environ.get("SG_WINDOW", "4096")) // fanout)
        argv = ["singyeong", "--url", f"ws://127.0.0.1:{gateway.port}/", *flags,
                "--window", str(window), "--duration", str(duration), "--warmup", "1",
                "--quiet", "--watch-pid", str(gateway.process.pid)]  # fmt: skip
        cpu0, wall0 = cpu_seconds(gateway.process.pid), time.monotonic()
        summary = run_load(load_parser().parse_args(argv))
        wall = time.monotonic() - wall0
        gw_cpu = (cpu_seconds(gateway.process.pid) - cpu0) / wall
    finally:
        gateway.stop()
    extra = os.environ.get("SG_GATEWAY_ARGS", "") if kind == "rmb-relay" else ""
    gw_us = summary["watched_cpu_us_per_msg"][f"pid {gateway.process.pid}"]
    return {
        "gateway": kind + (f" {extra}" if extra else ""),
        "scenario": scenario,
        "clients": summary["config"]["clients"],
        "rate": round(summary["throughput_msgs_per_s"]),
        "window": window,
        "p50_ms": round(summary["latency_ms"]["p50"], 2),
        "p99_ms": round(summary["latency_ms"]["p99"], 2),
        "lost": summary["lost"],
        "gw_cpu": round(gw_cpu, 2),
        "gen_cpu": round(summary["generator_cpu_share"], 2),
        "gw_us": round(gw_us, 2),
        "gen_us": round(summary["generator_cpu_us_per_msg"], 2),
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
    rows = []
    for scenario in args.only.split(","):
        for kind in args.gateways.split(","):
            row = run_scenario(kind, scenario, args.clients, args.duration)
            print(json.dumps(row), flush=True)
            rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"singyeong-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    print(
        "| scenario | gateway | rate/s | p50 ms | p99 ms | lost | gw_cpu | gen_cpu | gw us "
        "| gen us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scenario']} | {r['gateway']} | {r['rate']:,} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['lost']} | {r['gw_cpu']} | {r['gen_cpu']} | {r['gw_us']} | "
            f"{r['gen_us']} |"
        )


if __name__ == "__main__":
    main()
