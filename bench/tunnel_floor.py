"""The kernel's floor under the tunnel's request pattern (issue 13's "5x the baseline" goal):
what any relay + connector, in any language, must at least spend per tunnelled request on this
machine, and the rate that leaves on two cores.

    .venv/bin/python -m bench.tunnel_floor [--clients 1,64] [--seconds 3] [--runs 3]
    .venv/bin/python -m bench.tunnel_floor --half-rate 7347 [--runs 5]  # paced: p50/p99

Compiles `tunnel_floor.c` with the system C compiler into a temporary directory and runs it:
four threads, each with its own epoll loop (client, relay, connector, target), doing only
the system calls of the tunnel's pattern: `--clients` keep-alive client connections to the
relay, each with one request at a time; one connection from the relay to the connector
carrying every request and answer as a frame (the frames of one loop turn in one write, as
the relay and the connector do); one idle target connection per request in flight. Each hop
writes and reads the byte counts the tunnel itself moves there for a 1 KiB echo (the defaults,
from /proc/PID/io's rchar/wchar over a `bench.tunnel` run at 1 KiB x 64, msgpack, lean
target). No parsing, no copying beyond read/write.

Reported per party: user and system CPU microseconds per request (RUSAGE_THREAD over the
measured window), their sum, the rate reached, and the rate two fully busy cores would allow
at that CPU per request (2e6 / total us) beside 5x the baseline's rate (`--baseline-rps`).

`--half-rate R` paces the clients instead (Poisson arrivals of R requests/s in all from a
timerfd, as `bench.tunnel --half-load` does) and runs the pattern with and without the relay
and connector hops (`direct`: the client connected straight to the target), reporting p50 and
p99 of each: the latency the two extra hops add when nothing but the kernel works on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from .floor_build import compiled

SOURCE = Path(__file__).with_name("tunnel_floor.c")
PARTIES = ("client", "relay", "connector", "target")


def run_once(
    exe: Path,
    args: argparse.Namespace,
    clients: int,
    batch: bool,
    rate: float = 0.0,
    direct: bool = False,
) -> dict[str, float]:
    out = subprocess.run(
        [
            str(exe),
            str(clients),
            str(max(clients, args.targets)),
            str(args.seconds),
            *(str(n) for n in args.bytes),
            "1" if batch else "0",
            str(rate),
            "1" if direct else "0",
            str(args.work_us),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    row: dict[str, float] = json.loads(out)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="1,64", help="comma-separated client counts")
    parser.add_argument("--targets", type=int, default=64, help="target connections (>= clients)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3, help="runs per row (median reported)")
    parser.add_argument(
        "--bytes",
        type=int,
        nargs=6,
        metavar=("REQ", "RESP", "FRAME_REQ", "FRAME_RESP", "TARGET_REQ", "TARGET_RESP"),
        default=[1130, 1103, 1486, 1348, 1132, 1105],
        help="bytes per request on each hop: client request, client response, relay->connector "
        "frame, connector->relay frame, connector->target request, target response",
    )
    parser.add_argument("--no-batch", action="store_true", help="also run one write per frame")
    parser.add_argument(
        "--baseline-rps", type=float, default=9589.0, help="the baseline tunnel's 1 KiB x 64 rate"
    )
    parser.add_argument(
        "--half-rate",
        type=float,
        help="pace 64 clients at this many requests/s (Poisson) and report p50/p99, direct and "
        "through the two hops",
    )
    parser.add_argument(
        "--work-us",
        type=float,
        default=0.0,
        metavar="US",
        help="CPU microseconds the relay and the connector each also spend per request (half "
        "on the way in, half on the way out), spinning: how the latency and the rate respond "
        "to the user-space work a real relay and connector add to the system calls",
    )
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; bytes per hop {args.bytes}")
    with compiled(SOURCE, "-lm") as exe:
        if args.half_rate:
            paced(exe, args)
            return
        print(
            "clients batch  req/s (median, min-max)   "
            + "  ".join(f"{p:>16}" for p in PARTIES)
            + "  total us  2 cores allow  vs 5x baseline"
        )
        for clients in (int(text) for text in args.clients.split(",")):
            for batch in (True, False) if args.no_batch else (True,):
                rows = [run_once(exe, args, clients, batch) for _ in range(args.runs)]
                rps = [row["rps"] for row in rows]
                cells = []
                total = 0.0
                for party in PARTIES:
                    user = statistics.median(row[f"{party}_user_us"] for row in rows)
                    system = statistics.median(row[f"{party}_sys_us"] for row in rows)
                    total += user + system
                    cells.append(f"{user:5.1f}u+{system:5.1f}s")
                allow = 2e6 / total
                print(
                    f"{clients:>7} {'yes' if batch else 'no':>5}  "
                    f"{statistics.median(rps):>7,.0f} ({min(rps):,.0f}-{max(rps):,.0f})"
                    f"{'':>6}" + "  ".join(f"{c:>16}" for c in cells) + f"  {total:8.1f}"
                    f"  {allow:>13,.0f}  {allow / (5 * args.baseline_rps):>13.2f}x",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.2f}")


def paced(exe: Path, args: argparse.Namespace) -> None:
    """Direct and tunnel rows at `--half-rate`, interleaved, `--runs` of each."""
    print("run  route    req/s   p50 ms   p99 ms  us/req (user+sys) per party")
    for run in range(args.runs):
        for direct in (True, False):
            row = run_once(exe, args, 64, True, args.half_rate, direct)
            parties = ("client", "target") if direct else PARTIES
            cpu = "  ".join(f"{p} {row[f'{p}_user_us'] + row[f'{p}_sys_us']:.1f}" for p in parties)
            print(
                f"{run:>3}  {'direct' if direct else 'tunnel':7} {row['rps']:>6,.0f}"
                f"  {row['p50_ms']:7.3f}  {row['p99_ms']:7.3f}  {cpu}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
