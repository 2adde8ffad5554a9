"""Request/response round trips through two rmb-peers and one relay, as a msgbus client sees
them: LPUSH to peer A's `msgbus.system.local`, an echo service on peer B's `msgbus.<cmd>`, the
reply popped from the client's return queue.

    .venv/bin/python -m bench.peer_roundtrip            # 4 scenarios x 5 s (~40 s)
    .venv/bin/python -m bench.peer_roundtrip --quick    # 2 s each

Processes (all on this machine's 2 cores): the relay, peer A, peer B, one redis-server per
peer (no persistence) and the harness, `rmb-load peer` (closed loop: N clients, each sends its
next request when its reply is in, and the echo service on peer B's Redis). Scenarios:
plaintext (peers started with --no-update: no published keys) and end-to-end encrypted, with 1
and 50 clients. For each, round trips/s, latency p50/p99, and the CPU each process spent per
round trip (read from /proc), which says where the time goes. Results are appended to
bench/results/peer-<time>.json with the commit id.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

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
from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load

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
    named = {
        "relay": relay.process.popen.pid,
        "peer_a": peers[0].popen.pid,
        "peer_b": peers[1].popen.pid,
        "redis_a": redis_a.pid,
        "redis_b": redis_b.pid,
    }
    # the harness is the client and the echo service (one process: `generator` below)
    argv = ["peer", "--redis", url_a, "--serve-redis", url_b, "--dst", "2",
            "--command", COMMAND, "--size", str(len(PAYLOAD)), "--clients", str(clients),
            "--window", "1", "--duration", str(seconds), "--warmup", "1", "--quiet",
            *(arg for pid in named.values() for arg in ("--watch-pid", str(pid)))]  # fmt: skip
    try:
        summary = run_load(load_parser().parse_args(argv))
    finally:
        for peer in peers:
            peer.stop()
        relay.process.stop()
        for process in (redis_a, redis_b):
            process.terminate()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
    watched = summary["watched_cpu_us_per_msg"]
    result: dict[str, Any] = {
        "round_trips": summary["delivered"],
        "per_second": round(summary["throughput_msgs_per_s"]),
        "p50_ms": round(summary["latency_ms"]["p50"], 3),
        "p99_ms": round(summary["latency_ms"]["p99"], 3),
        "lost": summary["lost"],
        "errors": summary["errors"],
        "cpu_us_per_round_trip": {
            **{name: round(watched[f"pid {pid}"], 1) for name, pid in named.items()},
            "generator": round(summary["generator_cpu_us_per_msg"], 1),
        },
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
    args = parser.parse_args()
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
