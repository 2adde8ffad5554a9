"""Cross-instance routing beside local routing, same generator, one run:

    .venv/bin/python -m bench.cluster [--pairs 10] [--size 1024] [--duration 5]

Starts a redis-server and two `rmb-relay` instances joined through it. `local`: sender and
receiver on instance A. `cross`: sender on A, receiver on B (every message goes A -> Redis
stream -> B). Prints throughput and latency percentiles of both and their ratio, and the CPU
each process (relays A and B, Redis) spent per delivered message: the figure that holds on a
machine shared with other work.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.processes import stop_processes
from tests.redis_process import start_redis

from bench.procstat import cpu_seconds
from bench.scenarios import PY, ROOT, free_port, raise_fd_limit
from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load


def start_relay(port: int, twins: Path, redis: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [PY, "-m", "rmb_relay", "-l", f"127.0.0.1:{port}", "--twins", f"sqlite:{twins}",
         "--redis", redis],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    if not process.stdout.readline().startswith("rmb-relay listening"):
        raise RuntimeError("relay did not start")
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--duration", type=float, default=5)
    args = parser.parse_args()
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="rmb-bench-cluster-") as tmp:
        twins = Path(tmp) / "twins.sqlite3"
        redis = start_redis(tmp, durable=False)
        url = redis.url
        ports = free_port(), free_port()
        relays = [start_relay(port, twins, url) for port in ports]
        results: dict[str, Any] = {}
        cpu: dict[str, dict[str, float]] = {}
        pids = {"relay A": relays[0].pid, "relay B": relays[1].pid, "redis": redis.process.pid}
        try:
            for name, receiver in (("local", ports[0]), ("cross", ports[1])):
                argv = ["rmb", "--url", f"ws://127.0.0.1:{ports[0]}/", "--quiet",
                        "--receiver-url", f"ws://127.0.0.1:{receiver}/",
                        "--twins", f"sqlite:{twins}", "--pairs", str(args.pairs),
                        "--size", str(args.size), "--duration", str(args.duration),
                        "--warmup", "1"]  # fmt: skip
                before = {who: cpu_seconds(pid) for who, pid in pids.items()}
                results[name] = run_load(load_parser().parse_args(argv))
                # whole run (warm-up included) over every message delivered in it
                delivered = max(1, results[name]["delivered"])
                cpu[name] = {
                    who: (cpu_seconds(pid) - before[who]) / delivered * 1e6
                    for who, pid in pids.items()
                }
        finally:
            stop_processes(relays)
            redis.stop()
    for name, result in results.items():
        latency = result["latency_ms"]
        print(
            f"{name:>6}: {result['throughput_msgs_per_s']:>9,.0f} msg/s  p50 {latency['p50']:.2f} "
            f"ms  p99 {latency['p99']:.2f} ms  lost {result['lost']}  CPU us/msg: "
            + ", ".join(f"{who} {us:.1f}" for who, us in cpu[name].items())
            + f"; generator {result['generator_cpu_share']:.0%} of a core"
        )
    ratio = results["cross"]["throughput_msgs_per_s"] / results["local"]["throughput_msgs_per_s"]
    print(f"cross-instance / local throughput: {ratio:.0%}")


if __name__ == "__main__":
    main()
