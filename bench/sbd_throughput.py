"""SBD forward throughput: rmb-relay beside the public Rust `sbd-server` 0.4.0, measured the same
way on the same machine (issue 4's acceptance note).

    .venv/bin/python -m bench.sbd_throughput                  # 1 and 10 pairs, 1000 B, 5 s each
    .venv/bin/python -m bench.sbd_throughput --pairs 1 --seconds 10 --procs 1

Both relays run with rate limiting off (`--sbd-disable-rate-limit` / `--disable-rate-limiting`,
lbrt = 1) on 127.0.0.1; the generator is `rmb-load sbd` (1000-byte forwards, window 256 per
pair) in its own process(es). Besides messages/s the table gives the relay's CPU per message,
read from /proc: on a 2-core machine the generator usually saturates first, and then relay CPU
per message is the number that compares the relays. The reference server is built once with
`cargo install sbd-server --version 0.4.0 --locked --root .tools/sbd-server` (cached in
~/.cache/rmb-relay/sbd-tester-target, shared with the conformance tester); pass `--no-reference`
to measure rmb-relay alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.scenarios import PY, ROOT, commit
from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load

from .outdir import RESULTS
from .procstat import cpu_seconds, free_port
from .relay_build import relay_process

SBD_SERVERD = ROOT / ".tools" / "sbd-server" / "bin" / "sbd-serverd"
TARGET = Path.home() / ".cache" / "rmb-relay" / "sbd-tester-target"


def build_reference() -> Path:
    if not SBD_SERVERD.exists():
        subprocess.run(
            [
                "cargo",
                "install",
                "-q",
                "sbd-server",
                "--version",
                "0.4.0",
                "--locked",
                "--root",
                str(SBD_SERVERD.parent.parent),
            ],
            env={**os.environ, "CARGO_TARGET_DIR": str(TARGET)},
            check=True,
        )
    return SBD_SERVERD


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, ready: str) -> None:
        self.name = name
        self.port = port
        self.process = relay_process(cmd)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if ready in line:
                break
        else:
            raise RuntimeError(f"{name} did not start")

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def rmb_relay() -> Server:
    port = free_port()
    twins = Path(tempfile.mkdtemp(prefix="rmb-bench-")) / "twins.sqlite"
    cmd = [
        PY,
        "-m",
        "rmb_relay",
        "-l",
        f"127.0.0.1:{port}",
        "--twins",
        f"sqlite:{twins}",
        "--sbd-disable-rate-limit",
        "--sbd-idle-ms",
        "600000",
    ]
    return Server("rmb-relay", cmd, port, "listening")


def reference() -> Server:
    port = free_port()
    cmd = [
        str(build_reference()),
        "--bind",
        f"127.0.0.1:{port}",
        "--disable-rate-limiting",
        "--limit-idle-millis",
        "600000",
    ]
    return Server("sbd-server 0.4.0", cmd, port, "#sbd-serverd#ready#")


def measure(server: Server, pairs: int, size: int, seconds: float, procs: int) -> dict[str, Any]:
    argv = [
        "sbd",
        "--url",
        f"ws://127.0.0.1:{server.port}/",
        "--quiet",
        "--pairs",
        str(pairs),
        "--size",
        str(size),
        "--duration",
        str(seconds),
        "--warmup",
        "1",
        "--procs",
        str(procs),
    ]
    cpu0, wall0 = server.cpu_seconds(), time.monotonic()
    result = run_load(load_parser().parse_args(argv))
    cpu, wall = server.cpu_seconds() - cpu0, time.monotonic() - wall0
    # every message the relay forwarded in the run (warm-up included): CPU per message
    total = result["delivered"]
    rate = result["throughput_msgs_per_s"]
    return {
        "relay": server.name,
        "pairs": pairs,
        "size": size,
        "msgs_per_s": round(rate),
        "p50_ms": round(result["latency_ms"]["p50"], 2),
        "p99_ms": round(result["latency_ms"]["p99"], 2),
        "lost": result["lost"],
        "relay_cpu": round(cpu / wall, 2),
        "relay_us_per_msg": round(cpu / max(total, 1) * 1e6, 2),
        "generator_cpu": round(result["generator_cpu_share"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, action="append", help="pairs (repeatable; 1, 10)")
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--procs", type=int, default=1, help="generator processes")
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()
    makers = [rmb_relay] + ([] if args.no_reference else [reference])
    rows = []
    for make in makers:
        server = make()
        try:
            for pairs in args.pairs or [1, 10]:
                rows.append(measure(server, pairs, args.size, args.seconds, args.procs))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            server.stop()
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"sbd-vs-reference-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps({"commit": commit(), "rows": rows}, indent=1) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
