"""`rmb-analytics`: the analytics plane's command line.

    rmb-analytics [run] --input RECORDS --output OUT [--samples LOAD.parquet] [--master URL]
                  [--since T] [--until T] [--window SECONDS]
    rmb-analytics report --input OUT --output report.html

Bad input (missing, corrupt or foreign Parquet, a newer record schema, an empty window) is one
line on stderr and exit code 2; a Spark failure is one line and exit code 1. Never a Java trace.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rmb_relay.analytics.inputs import InputError, parse_time
from rmb_relay.analytics.spark import DEFAULT_MASTER

PROG = "rmb-analytics"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _run_parser(prog: str) -> argparse.ArgumentParser:
    from rmb_relay.cli_support import HelpFormatter

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the PySpark jobs over route records (rmb-relay --records DIR) and/or "
        "rmb-load samples; write one Parquet table per job, priors.json and summary.json "
        "(docs/analytics.md).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--input", type=Path, help="route records: a directory (or one file)")
    parser.add_argument("--samples", type=Path, help="rmb-load --samples Parquet file or folder")
    parser.add_argument("--output", type=Path, required=True, help="directory for the tables")
    parser.add_argument(
        "--master", default=DEFAULT_MASTER, help="Spark master: local[N] or spark://HOST:PORT"
    )
    parser.add_argument("--since", help="first instant (ISO 8601; UTC unless a zone is given)")
    parser.add_argument("--until", help="end instant, exclusive (ISO 8601)")
    parser.add_argument(
        "--window", type=_positive, default=60, metavar="SECONDS", help="time window of tables"
    )
    parser.add_argument(
        "--driver-memory", default="2g", help="JVM heap of the Spark driver (local mode: all)"
    )
    parser.add_argument(
        "--jobs",
        metavar="TABLE,...",
        help="make only these tables (default: all; docs/analytics.md lists them)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _report_parser(prog: str) -> argparse.ArgumentParser:
    from rmb_relay.cli_support import HelpFormatter

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write one self-contained HTML page (embedded PNG plots and tables) from "
        "the tables of `rmb-analytics run`.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--input", type=Path, required=True, help="the --output of a run")
    parser.add_argument("--output", type=Path, required=True, help="the HTML file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "report":
            return _report(_report_parser(f"{PROG} report").parse_args(args[1:]))
        if args and args[0] == "run":
            args.pop(0)
        return _run(_run_parser(f"{PROG} run").parse_args(args))
    except InputError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace) -> int:
    from rmb_relay.analytics.report import write_report

    write_report(args.input, args.output)
    print(f"{PROG}: wrote {args.output}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    import io

    from rmb_relay.analytics.pipeline import Plan, Progress, check, run
    from rmb_relay.analytics.spark import java_message, session

    plan = Plan(
        records=args.input,
        samples=args.samples,
        output=args.output,
        since=parse_time(args.since, "--since") if args.since else None,
        until=parse_time(args.until, "--until") if args.until else None,
        window=args.window,
        jobs=frozenset(name.strip() for name in args.jobs.split(",")) if args.jobs else None,
    )
    checked = check(plan)  # before Spark starts: bad input costs no JVM
    progress = Progress(out=io.StringIO() if args.quiet else sys.stderr)
    from pyspark.sql import SparkSession

    # a session already running in this process (an embedding program, the tests) is used
    # as it is and left running
    owned = SparkSession.getActiveSession() is None
    try:
        spark = session(
            args.master,
            progress=not args.quiet,
            extra={"spark.driver.memory": args.driver_memory},
        )
    except Exception as err:  # no Java, or an unreachable master
        print(f"{PROG}: cannot start Spark on {args.master}: {java_message(err)}", file=sys.stderr)
        return 1
    try:
        summary = run(spark, plan, checked, progress)
    except InputError:
        raise
    except Exception as err:
        print(f"{PROG}: the Spark job failed: {java_message(err)}", file=sys.stderr)
        return 1
    finally:
        if owned:
            spark.stop()
    total = sum(summary["seconds"].values())
    print(f"{PROG}: {len(summary['tables'])} tables in {plan.output} ({total:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
