"""What route records (`--records`) cost, each measured against the same work without them (or
as it was before schema version 2) in the same run: `make bench` prints the ratio table.

- the RMB read path (decode + scan 100 x 64 B envelopes, what the relay does per read) with the
  scanner appending a record per message, against the same path without a record buffer;
- the writer's work on one flush of 100,000 hot-path records (take the columns, build Arrow
  arrays, write Parquet; the pipe to the writer process is left out), against the version-1
  writer on the same records.

Every benchmark checks its result, so one that silently does nothing fails instead.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.baselines import write_records_v1
from rmb_relay._core import (
    MSG_REQUEST,
    ClientFrameEncoder,
    Envelope,
    EnvelopeRouting,
    RecordBuffer,
    RmbScanner,
    RouteTable,
    WsDecoder,
)
from rmb_relay.clock import wall_clock
from rmb_relay.telemetry.record_writer import WriterStats, _PartitionWriter, make_batch
from rmb_relay.telemetry.records import Channel

Bench = Callable[..., Any]

#: reads per round: 100 x 1000 = 100,000 records, about one flush at full speed
READS = 1000
#: records in one writer batch
BATCH = 100_000
T0 = 1_700_000_000 * 1_000_000_000


def _envelope() -> bytes:
    env = Envelope("c1b8a8c2-1234-4bd4-9a4e-0c2f53d1d5a1")
    env.source_twin, env.source_connection = 7, "app"
    env.dest_twin, env.dest_connection = 9, "svc"
    env.kind = MSG_REQUEST
    env.command = "echo"
    env.plain = os.urandom(64)
    return env.encode()


READ = ClientFrameEncoder(os.urandom(32)).binary_batch([_envelope()] * 100)


def _read_path(buffer: RecordBuffer | None) -> Callable[[], int]:
    routes = RouteTable()
    routes.register_session(9, "svc", 42)
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, "app", buffer))

    def reads() -> int:
        routed = 0
        for _ in range(READS):
            for message in decoder.feed(READ, T0):
                routing: EnvelopeRouting = message.routing  # type: ignore[assignment]
                routed += routing.dest_conn_id == 42
        if buffer is not None:  # one flush: the columns go, the writer drops them
            time_us, *_ = buffer.take()
            if len(time_us) != READS * 100:
                return -1
        return routed

    return reads


@pytest.mark.benchmark(group="route records: RMB read path, 1000 reads x 100 x 64 B")
def test_read_path_with_records_measured(benchmark: Bench) -> None:
    reads = _read_path(RecordBuffer())
    assert benchmark.pedantic(reads, rounds=15, warmup_rounds=2) == READS * 100


@pytest.mark.benchmark(group="route records: RMB read path, 1000 reads x 100 x 64 B")
def test_read_path_without_records_baseline(benchmark: Bench) -> None:
    reads = _read_path(None)
    assert benchmark.pedantic(reads, rounds=15, warmup_rounds=2) == READS * 100


def _columns() -> tuple[np.ndarray, ...]:
    """100,000 records as a relay makes them: 10 per read, 20 twins."""
    rng = np.random.default_rng(1)
    time_ns = T0 + (np.arange(BATCH) // 10) * 20_000
    return time_ns, rng.integers(1000, 1020, BATCH), rng.integers(1000, 1020, BATCH)


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rmb-bench-records-") as name:
        yield Path(name)


@pytest.mark.benchmark(group="route records: writer, one flush of 100,000 hot-path records")
def test_writer_measured(benchmark: Bench, folder: Path) -> None:
    time_ns, src, dst = (c.tolist() for c in _columns())
    stats = WriterStats()

    def setup() -> tuple[tuple[Channel], dict[str, Any]]:
        channel = Channel("rmb", 1.0, wall_clock)
        push = channel.native.push
        for i in range(BATCH):
            push(time_ns[i], src[i], dst[i], 64)
        return (channel,), {}

    def write(channel: Channel) -> int:
        taken = channel.take(1.0)
        assert taken is not None
        assert taken.columns is not None
        batch = make_batch("rmb", 1.0, 1.0, list(taken.columns), [], None)
        writer = _PartitionWriter(folder, "relay:8080", 60.0, stats)
        writer.write(batch)
        writer.close()
        return len(batch)

    benchmark.pedantic(write, setup=setup, rounds=15, warmup_rounds=1)
    files = list(folder.rglob("part-*.parquet"))
    assert sum(pq.read_metadata(f).num_rows for f in files) == stats.written > 0


@pytest.mark.benchmark(group="route records: writer, one flush of 100,000 hot-path records")
def test_writer_v1_baseline(benchmark: Bench, folder: Path) -> None:
    time_ns, src, dst = _columns()
    # what the version-1 RecordBuffer.take handed over: one row-major bytes
    rows = np.stack([time_ns, src, dst, np.full(BATCH, 64)], axis=1).astype(np.int64).tobytes()
    written = []

    def write() -> None:
        path = folder / f"v1-{len(written)}.parquet"
        written.append(write_records_v1(rows, "relay:8080", "rmb", str(path)))

    benchmark.pedantic(write, rounds=15, warmup_rounds=1)
    files = list(folder.glob("v1-*.parquet"))
    assert sum(pq.read_metadata(f).num_rows for f in files) == sum(written) > 0
