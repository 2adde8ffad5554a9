"""`rmb-load`: drive a relay in any of its dialects and report throughput, loss and latency.

    rmb-load rmb --url ws://127.0.0.1:8080/ --pairs 10 --size 1024 --duration 10
    rmb-load singyeong --url ws://127.0.0.1:8080/ --clients 100 --mode send_eq
    rmb-load tunnel --url http://127.0.0.1:8080/ --start-target --concurrency 32
    rmb-load peer --redis redis://127.0.0.1:6379 --serve-redis redis://127.0.0.1:6380 --dst 2

Every subcommand runs on the one engine (engine.py): the same pacing, stop conditions,
generator processes, progress line, summary table, `--json` and `--samples`. Exit codes: 0 a
run that delivered, 1 a run that delivered nothing, 2 bad input or a refusal (the relay
unreachable, a wrong tenant secret, a peer's Redis down, a 신경 password refused), printed as
one line after the table of what was measured until then.
"""

from __future__ import annotations

import argparse
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rmb_relay.errors import ConfigError
from rmb_relay.load.engine import ARRIVALS, Refused, generator, run_load, write_samples

#: subcommand -> its one-line help
DIALECTS = {
    "rmb": "RMB twins exchanging envelopes through the relay (or two relays: --relays A,B)",
    "sbd": "SBD clients forwarding to each other (run the relay with --sbd-disable-rate-limit)",
    "singyeong": "신경 clients: SEND by $eq or range, BROADCAST fan-out, QUEUE with acks",
    "tunnel": "HTTP requests through the relay's tunnel to a target behind a connector",
    "peer": "msgbus round trips through two rmb-peers, as a plain Redis client",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rmb-load",
        description="Load-test a relay: throughput, loss and latency percentiles, any dialect.",
    )
    commands = parser.add_subparsers(dest="dialect", metavar="DIALECT", required=True)
    for dialect, text in DIALECTS.items():
        sub = commands.add_parser(
            dialect, help=text, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        generator(dialect).add_arguments(sub)
        _common(sub)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size", type=int, default=None, help="message (or request body) bytes; per dialect"
    )
    parser.add_argument(
        "--rate", type=float, default=0, help="messages/s over all streams; 0 = saturate"
    )
    parser.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="even",
        help="with --rate: even gaps, or Poisson arrivals (exponential gaps)",
    )
    parser.add_argument("--window", type=int, default=256, help="in-flight messages per stream")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, help="seconds to measure (10)")
    stop.add_argument("--count", type=int, default=None, help="messages per stream instead")
    parser.add_argument("--procs", type=int, default=1, help="generator processes")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument(
        "--samples",
        type=Path,
        help="per-message records (.parquet for rmb-analytics --samples, or .jsonl)",
    )
    parser.add_argument(
        "--watch-pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="also report this process's CPU per message (the relay, a connector; repeatable)",
    )
    parser.add_argument("--quiet", action="store_true", help="no live progress line")


def _write_samples(path: Path, samples: array[int], size: int, dialect: str = "rmb") -> None:
    """`engine.write_samples` under its old name (tests/test_dependencies.py)."""
    write_samples(path, samples, dialect, size)


def print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    where = config.get("url", "")
    if config.get("receiver_url"):
        where += f" -> {config['receiver_url']}"
    table = Table(title=f"rmb-load {config['dialect']}: {where}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    latency = result["latency_ms"]
    rows = [
        (
            "streams x size",
            f"{config.get('streams', config.get('pairs', '?'))} x {config['size']} B",
        ),
        ("sent", f"{result['sent']:,}"),
        ("delivered", f"{result['delivered']:,}"),
        ("lost", f"{result['lost']:,}"),
        ("duplicated", f"{result['duplicated']:,}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in result["errors"].items()) or "none"),
        ("throughput", f"{result['throughput_msgs_per_s']:,.0f} msg/s"),
        ("throughput", f"{result['throughput_mb_per_s']:,.2f} MB/s"),
        *((f"latency {k}", f"{v:.3f} ms") for k, v in latency.items()),
        ("connect p50", f"{result['connect_ms']['p50']:.2f} ms"),
        ("generator CPU", f"{result['generator_cpu_share']:.0%} of one core per process"),
        ("generator CPU", f"{result['generator_cpu_us_per_msg']:.1f} us/msg"),
        *(
            (f"{name} CPU", f"{us:.1f} us/msg")
            for name, us in result["watched_cpu_us_per_msg"].items()
        ),
    ]
    if result["expected"] != result["sent"]:
        rows.insert(2, ("expected deliveries", f"{result['expected']:,}"))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        result = run_load(args)
    except (ConfigError, Refused) as err:
        print(f"rmb-load: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print_summary(result)
    if result["failed"]:
        print(f"rmb-load: {result['failed']}", file=sys.stderr)
        raise SystemExit(2)
    if result["delivered"] == 0:
        raise SystemExit("rmb-load: nothing was delivered (is the relay running at --url?)")


if __name__ == "__main__":
    main()
