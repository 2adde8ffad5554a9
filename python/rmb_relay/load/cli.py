"""`rmb-load`: saturate a relay and report throughput and latency percentiles.

    rmb-load rmb --url ws://127.0.0.1:8080/ --pairs 10 --size 1024 --duration 10

Generator processes (`--procs`) each run a share of the pairs on uvloop and send their counters
back; the parent merges them, shows a live progress line and writes `--json` / `--samples`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import sys
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rmb_relay._core import SBD_MAX_MESSAGE
from rmb_relay.errors import ConfigError
from rmb_relay.load.rmb import MIN_SIZE, LoadPlan, PairSpec, load_key, run_pairs
from rmb_relay.load.sbd import SBD_MIN_SIZE
from rmb_relay.load.stats import RunStats, summary

#: twin ids the harness provisions start here (far from real twins in a shared directory)
DEFAULT_TWIN_BASE = 1_000_000


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rmb-load",
        description="Load-test a relay: throughput, loss and one-way latency percentiles.",
    )
    commands = parser.add_subparsers(dest="dialect", metavar="DIALECT", required=True)
    rmb = commands.add_parser(
        "rmb",
        help="RMB twins exchanging envelopes through the relay",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _common(rmb, default_size=1024)
    rmb.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        help="provision the pairs' twins in this directory (default: the relay's default file)",
    )
    rmb.add_argument(
        "--receiver-url",
        help="receivers connect here instead of --url (another instance of a cluster)",
    )
    rmb.add_argument(
        "--twin-base", type=int, default=DEFAULT_TWIN_BASE, help="first twin id to provision"
    )
    rmb.add_argument(
        "--no-provision",
        action="store_true",
        help="the twins already exist (e.g. a relay on another host)",
    )
    rmb.add_argument(
        "--identities",
        type=Path,
        metavar="FILE",
        help='JSON list of {"twin": ID, "key_type": "sr25519|ed25519", "secret": "mnemonic or '
        "0x seed\"} of twins that exist in the relay's directory; consecutive entries are "
        "(sender, receiver) pairs; implies --no-provision and sets --pairs",
    )
    sbd = commands.add_parser(
        "sbd",
        help="SBD clients forwarding to each other (run the relay with --sbd-disable-rate-limit)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _common(sbd, default_size=1000)
    return parser


def _common(rmb: argparse.ArgumentParser, default_size: int) -> None:
    rmb.add_argument("--url", default="ws://127.0.0.1:8080/", help="relay websocket URL")
    rmb.add_argument("--pairs", type=int, default=1, help="sender/receiver pairs")
    rmb.add_argument(
        "--size", type=int, default=default_size, help="message bytes (RMB: the payload)"
    )
    rmb.add_argument(
        "--rate", type=float, default=0, help="messages/s over all pairs; 0 = as fast as possible"
    )
    rmb.add_argument("--window", type=int, default=256, help="in-flight messages per pair")
    stop = rmb.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, help="seconds to measure (10)")
    stop.add_argument("--count", type=int, default=None, help="messages per pair instead")
    rmb.add_argument("--procs", type=int, default=1, help="generator processes")
    rmb.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    rmb.add_argument("--json", type=Path, help="write the summary here")
    rmb.add_argument("--samples", type=Path, help="per-message records (.jsonl or .parquet)")
    rmb.add_argument("--quiet", action="store_true", help="no live progress line")


def _pairs(args: argparse.Namespace) -> list[PairSpec]:
    base = getattr(args, "twin_base", DEFAULT_TWIN_BASE)
    return [PairSpec(i, base + 2 * i, base + 2 * i + 1) for i in range(args.pairs)]


def _read_identities(path: Path) -> tuple[tuple[int, str, bytes], ...]:
    from rmb_relay.identity import secret_from_phrase

    try:
        entries = json.loads(path.read_text())
        identities = tuple(
            (int(e["twin"]), str(e.get("key_type", "sr25519")), secret_from_phrase(e["secret"]))
            for e in entries
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--identities {path}: {err}") from None
    if len(identities) < 2 or len(identities) % 2:
        raise ConfigError(f"--identities {path}: need an even number (>= 2) of identities")
    for _, key_type, _ in identities:
        if key_type not in ("sr25519", "ed25519"):
            raise ConfigError(f"--identities {path}: unknown key_type {key_type!r}")
    return identities


def _provision(args: argparse.Namespace, pairs: list[PairSpec]) -> None:
    from rmb_relay.twins import Twin
    from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path, parse_twins_url

    path = parse_twins_url(args.twins) if args.twins else default_twins_path()
    directory = SqliteTwinDirectory(path)
    for pair in pairs:
        for twin in (pair.sender, pair.receiver):
            directory.add(Twin(twin, load_key(twin).public_key, frozenset({"load.local"})))


_shared: Any = None


def _init_child(shared: Any) -> None:
    global _shared
    _shared = shared


def _child(
    plan: LoadPlan, specs: list[PairSpec], slot: int, dialect: str
) -> tuple[dict[str, Any], bytes | None]:
    """One generator process: its pairs on uvloop; progress through shared counters."""
    import uvloop

    from rmb_relay.load.sbd import SbdPair

    shared = _shared
    pair_class = SbdPair if dialect == "sbd" else None

    def progress(sent: int, delivered: int) -> None:
        shared[2 * slot] = sent
        shared[2 * slot + 1] = delivered

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        stats, samples = runner.run(run_pairs(plan, specs, progress, pair_class))
    return stats.to_wire(), None if samples is None else samples.tobytes()


def _progress_line(shared: Any, procs: int, started: float) -> str:
    sent = sum(shared[2 * i] for i in range(procs))
    delivered = sum(shared[2 * i + 1] for i in range(procs))
    elapsed = time.monotonic() - started
    rate = delivered / elapsed if elapsed > 0 else 0
    return f"{elapsed:6.1f}s  sent {sent:>10,}  delivered {delivered:>10,}  ~{rate:>10,.0f} msg/s"


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    minimum = MIN_SIZE if args.dialect == "rmb" else SBD_MIN_SIZE
    maximum = 1 << 20 if args.dialect == "rmb" else SBD_MAX_MESSAGE
    if not minimum <= args.size <= maximum:
        raise ConfigError(f"--size must be {minimum}..{maximum} for {args.dialect}")
    if args.pairs < 1 or args.procs < 1 or args.window < 1:
        raise ConfigError("--pairs, --procs and --window must be positive")
    duration = args.duration if args.duration is not None or args.count else 10.0
    plan = LoadPlan(
        url=args.url,
        size=args.size,
        rate=args.rate / args.procs,
        window=args.window,
        duration=duration,
        count=args.count,
        warmup=args.warmup,
        record_samples=args.samples is not None,
        receiver_url=getattr(args, "receiver_url", None),
    )
    identities: tuple[tuple[int, str, bytes], ...] = ()
    if args.dialect == "rmb" and args.identities is not None:
        identities = _read_identities(args.identities)
        pairs = [
            PairSpec(i, identities[2 * i][0], identities[2 * i + 1][0])
            for i in range(len(identities) // 2)
        ]
        plan = dataclasses.replace(plan, identities=identities)
        args.pairs = len(pairs)
    else:
        pairs = _pairs(args)
        if args.dialect == "rmb" and not args.no_provision:
            _provision(args, pairs)
    procs = min(args.procs, len(pairs))
    shares = [pairs[i::procs] for i in range(procs)]
    context = multiprocessing.get_context("spawn")
    shared = context.Array("q", 2 * procs, lock=False)
    started = time.monotonic()
    with context.Pool(procs, initializer=_init_child, initargs=(shared,)) as pool:
        pending = [
            pool.apply_async(_child, (plan, share, slot, args.dialect))
            for slot, share in enumerate(shares)
        ]
        live = None
        if not args.quiet and sys.stderr.isatty():
            from rich.live import Live

            live = Live("", refresh_per_second=4, transient=True)
            live.start()
        try:
            while not all(p.ready() for p in pending):
                if live is not None:
                    live.update(_progress_line(shared, procs, started))
                time.sleep(0.25)
        finally:
            if live is not None:
                live.stop()
        results = [p.get() for p in pending]
    merged = RunStats()
    samples = array("q")
    for wire, sample_bytes in results:
        merged.merge(RunStats.from_wire(wire))
        if sample_bytes:
            samples.frombytes(sample_bytes)
    config = {
        "dialect": args.dialect,
        "url": args.url,
        "pairs": args.pairs,
        "size": args.size,
        "rate": args.rate,
        "window": args.window,
        "duration": duration,
        "count": args.count,
        "procs": procs,
        "warmup": args.warmup,
    }
    result = summary(merged, config)
    if args.samples is not None:
        _write_samples(args.samples, samples, args.size)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _write_samples(path: Path, samples: array[int], size: int) -> None:
    """Per-message records: send time, pair, size, latency, outcome."""
    rows = [
        {
            "timestamp_ns": samples[i],
            "pair": samples[i + 1],
            "size": size,
            "latency_ns": samples[i + 2],
            "outcome": "delivered",
        }
        for i in range(0, len(samples), 3)
    ]
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError("--samples FILE.parquet needs pyarrow; use .jsonl") from None
        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    with path.open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rmb-load {result['config']['dialect']}: {result['config']['url']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    latency = result["latency_ms"]
    rows = [
        ("pairs x size", f"{result['config']['pairs']} x {result['config']['size']} B"),
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
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        result = run_load(args)
    except ConfigError as err:
        raise SystemExit(f"rmb-load: {err}") from None
    print_summary(result)
    if result["delivered"] == 0:
        raise SystemExit("rmb-load: nothing was delivered (is the relay running at --url?)")


if __name__ == "__main__":
    main()
