"""The HTTP tunnel across two relays sharing one Redis: the client on relay A, the connector on
relay B, so every request goes through the tenant's work queue and every answer back to A.
Prints requests per second and the CPU each relay and redis-server spent per request (the
figure that holds on a shared host).

    .venv/bin/python -m bench.tunnel_cluster --seconds 5
    # another checkout's Python code against the same build (e.g. before a change):
    .venv/bin/python -m bench.tunnel_cluster --pythonpath /path/to/other/python

CPU per request counts the 0.5 s warm-up too (the requests counted do not): the same for
every run, so runs compare.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

from tests.processes import stop_processes
from tests.redis_process import start_redis

from .procstat import free_port
from .tunnel import SECRET, _popen, measure, spawn, tenant_home, wait_ready


async def run(args: argparse.Namespace) -> None:
    tmp, env, db = tenant_home("tunnel-cluster-bench-")
    relay_env = dict(env)
    if args.pythonpath:
        relay_env["PYTHONPATH"] = args.pythonpath
    py = sys.executable
    redis = start_redis(str(tmp), durable=False)
    target_port, a_port, b_port = free_port(), free_port(), free_port()
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        processes["target"] = spawn(
            [py, "-m", "bench.tunnel", "target", "--port", str(target_port)], env
        )
        for name, port in (("a", a_port), ("b", b_port)):
            processes[name] = spawn(
                [py, "-m", "rmb_relay", "-l", f"127.0.0.1:{port}", "--twins", db, "--no-sbd",
                 "--tunnel-body-store", str(tmp / "bodies"), "--redis", redis.url,
                 "--instance-id", name],
                relay_env,
            )  # fmt: skip
        processes["connector"] = _popen(
            [py, "-m", "rmb_relay", "connector", "--server", f"http://127.0.0.1:{b_port}",
             "--tenant", "acme", "--secret", SECRET,
             "--target", f"app=http://127.0.0.1:{target_port}"],
            env=relay_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        wait_ready(b_port, "/relay/acme/app/echo")
        wait_ready(a_port, "/relay/acme/app/echo")
        pids = {"a": processes["a"].pid, "b": processes["b"].pid, "redis": redis.process.pid}
        # `measure` reads each process's CPU over the measured window
        result = await measure(
            a_port, "/relay/acme/app/echo", args.size, args.clients, args.seconds, pids
        )
        per = result.us_per_request
        print(
            f"{result.rps:,.0f} req/s ({args.size} B x {args.clients} clients, A -> B's "
            f"connector) p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms; CPU us/req: "
            f"relay A {per['a']:.0f} / relay B {per['b']:.0f} / redis {per['redis']:.0f}"
        )
    finally:
        stop_processes(processes.values())
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pythonpath", help="run the relays from this python/ directory")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
