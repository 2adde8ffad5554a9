"""Federated throughput between two relay processes, beside local routing on one of them.

    .venv/bin/python -m bench.federation                # 10 pairs x 1 KiB, 10 s each
    .venv/bin/python -m bench.federation --pairs 1 --size 64 --duration 5

Relay A (127.0.0.2) and relay B (127.0.0.3) run as `python -m rmb_relay` processes with their
own domains; senders log in at A, receivers at B, so every message is posted from A to B over
HTTP (`--federation-url-template http://{domain}:PORT/`); the generator is the harness's
(`rmb-load rmb --relays A,B`). The same generator then runs with both ends on A (local
routing) for the comparison. Both relays' CPU is read from /proc so a reader can tell which
side saturated. Results are printed and appended to bench/results/federation-*.json with the
commit id.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load

from .outdir import RESULTS
from .procstat import cpu_seconds, free_port, system_seconds, wait_seconds
from .relay_build import relay_process

ROOT = Path(__file__).resolve().parent.parent
A, B = "127.0.0.2", "127.0.0.3"
#: the harness provisions twins from here (sender 2i, receiver 2i + 1)
TWIN_BASE = 10_000


class RelayProcess:
    def __init__(self, domain: str, port: int, twins: Path, *extra: str) -> None:
        self.domain, self.port = domain, port
        self.process = relay_process(
            [
                sys.executable,
                "-m",
                "rmb_relay",
                "-l",
                f"{domain}:{port}",
                "--twins",
                f"sqlite:{twins}",
                "-m",
                domain,
                "--federation-url-template",
                f"http://{{domain}}:{port}/",
                "--no-sbd",
                *extra,
            ]
        )
        assert self.process.stdout is not None
        if not self.process.stdout.readline():
            raise RuntimeError(f"relay {domain} did not start")

    @property
    def url(self) -> str:
        return f"ws://{self.domain}:{self.port}/"

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def system_seconds(self) -> float:
        return system_seconds(self.process.pid)

    def wait_seconds(self) -> float:
        return wait_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()


def measure(
    relays: list[RelayProcess], twins: Path, domains: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One `rmb-load rmb` run: senders on the first relay, receivers on the last, the twins
    provisioned in `twins` naming `domains` (sender's, receiver's)."""
    first, last = relays[0], relays[-1]
    argv = ["rmb", "--relays", f"{first.url},{last.url}", "--twins", f"sqlite:{twins}",
            "--domains", domains, "--twin-base", str(TWIN_BASE), "--pairs", str(args.pairs),
            "--size", str(args.size), "--window", str(args.window),
            "--duration", str(args.duration), "--warmup", "1", "--quiet"]  # fmt: skip
    cpu0 = [r.cpu_seconds() for r in relays]
    sys0 = [r.system_seconds() for r in relays]
    wait0 = [r.wait_seconds() for r in relays]
    wall0 = time.perf_counter()
    summary = run_load(load_parser().parse_args(argv))
    wall = time.perf_counter() - wall0
    used = [r.cpu_seconds() - c for r, c in zip(relays, cpu0, strict=True)]
    kernel = [r.system_seconds() - c for r, c in zip(relays, sys0, strict=True)]
    waited = [r.wait_seconds() - w for r, w in zip(relays, wait0, strict=True)]
    delivered = max(1, summary["delivered"])
    return {
        "msgs_per_s": round(summary["throughput_msgs_per_s"]),
        "p50_ms": summary["latency_ms"]["p50"],
        "p99_ms": summary["latency_ms"]["p99"],
        "lost": summary["lost"],
        "duplicated": summary["duplicated"],
        "errors": summary["errors"],
        # per relay: share of one core over the run, and CPU microseconds per message (the
        # figure that survives a host shared with other work)
        "relay_cpu": [round(u / wall, 2) for u in used],
        "relay_us_per_msg": [round(u / delivered * 1e6, 1) for u in used],
        # the kernel's part of it (syscalls, the loopback TCP stack)
        "relay_sys_us_per_msg": [round(k / delivered * 1e6, 1) for k in kernel],
        "generator_cpu": round(summary["generator_cpu_share"], 2),
        "generator_us_per_msg": round(summary["generator_cpu_us_per_msg"], 1),
        # share of the run each event loop spent runnable but waiting for a core: high means
        # the host's other work, not the relay, set the pace
        "relay_wait": [round(w / wall, 2) for w in waited],
    }


def federation_metrics(relay: RelayProcess) -> dict[str, float]:
    """The relay's rmb_relay_federation_* samples (posts, failures, retries) after a run."""
    import urllib.request

    with urllib.request.urlopen(f"http://{relay.domain}:{relay.port}/metrics") as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("rmb_relay_federation_") and "ranker" not in line:
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over runs (lists element-wise); losses, errors and the relay's
    counters summed, so a loss in any run shows."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        values = [row[key] for row in rows]
        if key in ("lost", "duplicated"):
            out[key] = sum(values)
        elif isinstance(value, (int, float)):
            out[key] = round(statistics.median(values), 2)
        elif isinstance(value, list):
            out[key] = [round(statistics.median(column), 2) for column in zip(*values, strict=True)]
        elif isinstance(value, dict):
            total: dict[str, Any] = {}
            for counts in values:
                for name, count in counts.items():
                    total[name] = total.get(name, 0) + count
            out[key] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument(
        "--relay-arg", action="append", default=[], help="extra flag for relay A (repeatable)"
    )
    parser.add_argument("--no-local", action="store_true", help="skip the local comparison")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the scenarios this many times, alternating, and add a median row for each "
        "(the host is shared: one run says little)",
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="directory the JSON results go to"
    )
    args = parser.parse_args()
    port = free_port()
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rmb-fed-bench-") as tmp:
        twins = Path(tmp) / "twins.sqlite3"
        local_twins = Path(tmp) / "local.sqlite3"
        for _ in range(args.rounds):
            relay_a = RelayProcess(A, port, twins, *args.relay_arg)
            relay_b = RelayProcess(B, port, twins)
            try:
                row = measure([relay_a, relay_b], twins, f"{A},{B}", args)
                row["federation_metrics_a"] = federation_metrics(relay_a)
                runs.setdefault("federated A -> B", []).append(row)
            finally:
                relay_a.stop()
                relay_b.stop()
            if not args.no_local:
                local = RelayProcess(A, port, local_twins)
                try:
                    row = measure([local], local_twins, f"{A},{A}", args)
                    runs.setdefault("local on A", []).append(row)
                finally:
                    local.stop()
    rows = []
    for scenario, results in runs.items():
        rows.extend({"scenario": scenario, **row} for row in results)
        if len(results) > 1:
            rows.append({"scenario": f"{scenario} (median of {len(results)})", **median(results)})
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    for row in rows:
        print(json.dumps(row))
    args.results.mkdir(exist_ok=True)
    out = args.results / f"federation-{time.strftime('%Y%m%dT%H%M%S')}.json"
    params = {**vars(args), "results": str(args.results)}
    out.write_text(json.dumps({"commit": commit, "params": params, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
