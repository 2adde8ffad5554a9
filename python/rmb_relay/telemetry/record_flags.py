"""`rmb-relay serve --records DIR [--records-sample R] [--records-instance NAME]`: the flags of
route recording and the `rmb_relay_records_*` metrics, kept apart from the recorder itself so
the process wiring (services.py) stays one call."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from rmb_relay.errors import ConfigError

if TYPE_CHECKING:
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.telemetry.records import Recorder


def _sample(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("route records (input of rmb-analytics; docs/analytics.md)")
    group.add_argument(
        "--records",
        metavar="DIR",
        default=None,
        help="write one record per routed or dropped message as hourly-partitioned Parquet "
        "under DIR (default: off)",
    )
    group.add_argument(
        "--records-sample",
        type=_sample,
        default=1.0,
        metavar="R",
        help="keep a random fraction R of the records; rows carry weight 1/R",
    )
    group.add_argument(
        "--records-instance",
        default=None,
        metavar="NAME",
        help="this relay's name in its records (default: HOSTNAME:PORT)",
    )


def recorder_from_args(args: argparse.Namespace, metrics: Registry) -> Recorder | None:
    """The started recorder the flags ask for, or None; must run on the relay's loop."""
    if args.records is None:
        return None
    # pyarrow and numpy cost a relay ~60 MiB of RSS and a fifth of a second to start: only a
    # relay that records loads them
    from rmb_relay.telemetry.records import Recorder

    instance = args.records_instance or _default_instance(args.listen)
    directory = Path(args.records)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--records {directory}: not a directory")
    recorder = Recorder(directory, instance, sample=args.records_sample)
    stats = recorder.stats
    metrics.counter_of(
        "rmb_relay_records_written_total",
        "Route records written to Parquet",
        lambda: [((), stats.written)],
    )
    metrics.counter_of(
        "rmb_relay_records_shed_total",
        "Route records dropped because the writer fell behind (never blocks forwarding)",
        lambda: [((), stats.shed)],
    )
    metrics.counter_of(
        "rmb_relay_records_writer_cpu_seconds_total",
        "CPU time of the route-record writer process (Arrow and Parquet work)",
        lambda: [((), stats.writer_cpu_ns / 1e9)],
    )
    try:
        recorder.start()
    except OSError as err:
        raise ConfigError(f"--records {directory}: {err}") from None
    return recorder


def _default_instance(listen: str) -> str:
    port = listen.rsplit(":", 1)[-1]
    return f"{socket.gethostname()}:{port}"
