"""Cross-instance routing beside local routing, same generator, one run:

    .venv/bin/python -m bench.cluster [--pairs 10] [--size 1024] [--duration 5]
                                      [--scenarios local,cross,cluster,workers]

Each scenario starts what it needs and stops it before the next:

- `local`, `cross`: a redis-server and two `rmb-relay` instances joined through it. `local`:
  sender and receiver on instance A. `cross`: sender on A, receiver on B (every message goes
  A -> Redis stream -> B).
- `cluster`: the same `cross` on a 3-master Redis Cluster started here (`--redis-cluster`).
- `workers`: one `rmb-relay --redis` process beside `rmb-relay --processes 2` on one port
  (SO_REUSEPORT spreads the connections over the two workers, so about half of the messages
  cross between them through Redis).

Prints throughput and latency percentiles of each and the ratios, and the CPU each process
(relays, their workers, Redis) spent per delivered message: the figure that holds on a machine
shared with other work.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.processes import stop_processes
from tests.redis_process import start_redis, start_redis_cluster

from bench.procstat import free_port, tree_cpu_seconds
from bench.relay_build import relay_process
from bench.scenarios import PY, raise_fd_limit
from rmb_relay.load.cli import _parser as load_parser
from rmb_relay.load.cli import run_load


def start_relay(
    port: int, twins: Path, redis: str, *extra: str, workers: int = 1
) -> subprocess.Popen[str]:
    """An `rmb-relay` on `port` joined to `redis`; returns once it listens (with `workers` > 1,
    once every worker does)."""
    argv = [PY, "-m", "rmb_relay", "-l", f"127.0.0.1:{port}", "--twins", f"sqlite:{twins}",
            "--redis", redis, *extra]  # fmt: skip
    if workers > 1:
        argv += ["--processes", str(workers)]
    process = relay_process(argv)
    assert process.stdout is not None
    for _ in range(workers):
        if not process.stdout.readline().startswith("rmb-relay listening"):
            raise RuntimeError("relay did not start")
    return process


def measure(
    args: argparse.Namespace,
    twins: Path,
    sender: int,
    receiver: int,
    pids: dict[str, int],
) -> tuple[dict[str, Any], dict[str, float]]:
    """One load run (senders on port `sender`, receivers on `receiver`) and the CPU each of
    `pids` (with its children: a `--processes` parent's workers) spent per delivered message."""
    argv = ["rmb", "--quiet",
            "--relays", f"ws://127.0.0.1:{sender}/,ws://127.0.0.1:{receiver}/",
            "--twins", f"sqlite:{twins}", "--pairs", str(args.pairs),
            "--size", str(args.size), "--duration", str(args.duration),
            "--window", str(args.window), "--warmup", "1"]  # fmt: skip
    before = {who: tree_cpu_seconds(pid) for who, pid in pids.items()}
    result: dict[str, Any] = run_load(load_parser().parse_args(argv))
    # whole run (warm-up included) over every message delivered in it
    delivered = max(1, result["delivered"])
    cpu = {
        who: (tree_cpu_seconds(pid) - before[who]) / delivered * 1e6 for who, pid in pids.items()
    }
    return result, cpu


def two_instances(
    args: argparse.Namespace, tmp: str, twins: Path, results: dict[str, Any], cpu: dict[str, Any]
) -> None:
    """`local` and `cross` on one redis-server."""
    socket_path = f"{tmp}/redis.sock"
    extra = ("--unixsocket", socket_path, "--unixsocketperm", "700") if args.unix else ()
    redis = start_redis(tmp, durable=False, extra=extra)
    url = f"unix://{socket_path}?db=0" if args.unix else redis.url
    ports = free_port(), free_port()
    relays = [start_relay(port, twins, url) for port in ports]
    pids = {"relay A": relays[0].pid, "relay B": relays[1].pid, "redis": redis.process.pid}
    try:
        for name, receiver in (("local", ports[0]), ("cross", ports[1])):
            if name in args.scenarios:
                results[name], cpu[name] = measure(args, twins, ports[0], receiver, pids)
    finally:
        stop_processes(relays)
        redis.stop()


def on_redis_cluster(
    args: argparse.Namespace, tmp: str, twins: Path, results: dict[str, Any], cpu: dict[str, Any]
) -> None:
    """`cross` with the two instances on a 3-master Redis Cluster."""
    directory = Path(tmp) / "redis-cluster"
    directory.mkdir()
    cluster = start_redis_cluster(str(directory))
    ports = free_port(), free_port()
    relays = [start_relay(port, twins, cluster.url, "--redis-cluster") for port in ports]
    pids = {"relay A": relays[0].pid, "relay B": relays[1].pid}
    pids |= {f"redis {i}": node.process.pid for i, node in enumerate(cluster.nodes)}
    try:
        results["cluster"], cpu["cluster"] = measure(args, twins, ports[0], ports[1], pids)
    finally:
        stop_processes(relays)
        cluster.stop()


def workers(
    args: argparse.Namespace, tmp: str, twins: Path, results: dict[str, Any], cpu: dict[str, Any]
) -> None:
    """One process, then `--processes 2`, on one port and one redis-server."""
    redis = start_redis(tmp, durable=False)
    try:
        for name, count in (("1 process", 1), ("workers 2", 2)):
            port = free_port()
            relay = start_relay(port, twins, redis.url, workers=count)
            pids = {"relay": relay.pid, "redis": redis.process.pid}
            try:
                results[name], cpu[name] = measure(args, twins, port, port, pids)
            finally:
                stop_processes([relay])
    finally:
        redis.stop()


SCENARIOS = {"local": two_instances, "cross": two_instances, "cluster": on_redis_cluster,
             "workers": workers}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument(
        "--unix",
        action="store_true",
        help="local and cross: the relays reach redis-server over a Unix socket, not TCP "
        "(instances on one host)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=256,
        help="in-flight messages per pair (rmb-load --window), the same for every scenario",
    )
    parser.add_argument("--duration", type=float, default=5)
    parser.add_argument(
        "--scenarios",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=list(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    raise_fd_limit()
    results: dict[str, Any] = {}
    cpu: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rmb-bench-cluster-") as tmp:
        twins = Path(tmp) / "twins.sqlite3"
        done = set()
        for name in args.scenarios:
            run = SCENARIOS[name]
            if run not in done:
                run(args, tmp, twins, results, cpu)
                done.add(run)
    for name, result in results.items():
        latency = result["latency_ms"]
        print(
            f"{name:>9}: {result['throughput_msgs_per_s']:>9,.0f} msg/s  p50 {latency['p50']:.2f} "
            f"ms  p99 {latency['p99']:.2f} ms  lost {result['lost']}  CPU us/msg: "
            + ", ".join(f"{who} {us:.1f}" for who, us in cpu[name].items())
            + f"; generator {result['generator_cpu_share']:.0%} of a core"
        )

    def ratio(a: str, b: str) -> None:
        if a in results and b in results:
            share = results[a]["throughput_msgs_per_s"] / results[b]["throughput_msgs_per_s"]
            print(f"{a} / {b} throughput: {share:.0%}")

    ratio("cross", "local")
    ratio("cluster", "local")
    ratio("workers 2", "1 process")


if __name__ == "__main__":
    main()
