"""Route records: one row per routed message or drop, written as time-partitioned Parquet.

Theory of operation
-------------------
The relay forwards hundreds of thousands of messages a second on one core, so recording must
cost the forwarding path next to nothing and must never make it wait:

- The hot path (a message delivered to a local connection inside the read that decoded it)
  costs Python nothing: the connection's scanner, which reads source, destination and size of
  every message inside the one `feed` call per read, appends them with the clock reading passed
  into `feed` to the channel's Rust `RecordBuffer` (`Channel.native`, one per dialect), four
  int64 columns. The dialect retracts a record on the rare paths where it does not deliver
  after all (`Channel.retract`: the rate limiter, a connection gone since the scan, a message
  discarded after a close). The route and outcome are implied by the buffer. Addresses are
  integers there: RMB twin ids as they are, SBD keys as the buffer's key ids, whose names
  (base64url) the channel keeps in id order (`Channel.names`).
- Everything else (mailbox, federation, drops, expiry, the tunnel) is rarer and calls
  `Channel.add` with every field.
- Every `FLUSH_INTERVAL` the event loop takes the buffers (the Rust columns move out without a
  copy) and puts the batch on a bounded queue. A full queue (the writer fell behind) sheds the
  batch and counts it (`rmb_relay_records_shed_total`): forwarding never blocks on recording.
- One writer thread turns a batch into Arrow arrays and appends them to Parquet files, one per
  hour partition and *stream* (`DIR/date=YYYY-MM-DD/hour=HH/`, hive style, so Spark prunes by
  time). A file is written under a hidden name (`.` prefix, which Spark and pyarrow skip) and
  renamed when it is closed, at the latest every `ROLL_SECONDS`, so a reader never sees a
  half-written file.

What the writer costs is what recording costs (the hot path's append is a few ns), so the files
are laid out for the writer (record schema version 2, record_schema.py). The hot path of each
dialect has its own stream, whose files hold only the four columns that vary per row (time,
src, dst, size) straight from the Rust columns (viewed, not copied, by numpy and Arrow); the
eight that do not (instance, dialect, route `local`, outcome `delivered`, ...) are written once
into the file's metadata. Per row that leaves a delta-encoded time, dictionary indexes for the
addresses and the size. The other records share one stream per hour with every column but the
instance and the weight. `writer_cpu_ns` (`rmb_relay_records_writer_cpu_seconds_total`) counts
the writer thread's CPU, so the cost per record can be read off a running relay.

`--records-sample R` keeps a random fraction R of the records (the hot path's when its columns
are taken, with numpy); each row counts for `weight` = 1/R so the analytics jobs estimate
totals from a sample.

Route values `cluster` and `federation` are in the schema since version 1, so instances that
federate or cluster write the same files.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rmb_relay._core import RecordBuffer
from rmb_relay.clock import Clock, wall_clock
from rmb_relay.telemetry.record_schema import (
    SCHEMA,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    file_metadata,
)

__all__ = ["SCHEMA", "SCHEMA_KEY", "SCHEMA_VERSION", "Channel", "RecordStats", "Recorder"]

log = logging.getLogger("rmb_relay.records")

#: where a message went; `cluster` and `federation` are reserved for instances that have them
ROUTES = ("local", "mailbox", "cluster", "federation", "none")
#: what became of it
OUTCOMES = ("delivered", "queued", "expired", "rate-limited", "rejected")

#: how often the event loop hands the buffers to the writer (seconds): bounds buffer memory
FLUSH_INTERVAL = 0.5
#: batches waiting for the writer; beyond this they are shed (about 32 s of backlog)
MAX_PENDING_BATCHES = 64
#: a Parquet file is closed (made visible) at the latest this long after it was opened
ROLL_SECONDS = 60.0
#: Parquet page compression: lz4 writes ~2x faster than snappy here at the same size
COMPRESSION = "lz4"
HOUR_US = 3_600_000_000

TIME = pa.timestamp("us", tz="UTC")
#: the hot path's files: the columns that vary per row (the rest are file constants)
LOCAL_COLUMNS = ("time", "src", "dst", "size")
#: the other records' files: all but the process's constants (instance, weight)
FULL_COLUMNS = tuple(name for name in SCHEMA.names if name not in ("instance", "weight"))
#: what a hot-path record says besides its four columns
LOCAL_CONSTANTS = {
    "route": "local",
    "outcome": "delivered",
    "reason": None,
    "relay_us": 0,
    "remote": None,
}

#: any record but the hot path's: (time_ns, src, dst, size, route, outcome, reason, relay_ns,
#: remote)
FullRecord = tuple[int, Any, Any, int, str, str, str | None, int | None, str | None]


class Channel:
    """One dialect's buffers. `native` is what the dialect's scanners append the hot path's
    records to (see the module docstring); `add` records everything else."""

    __slots__ = ("_full", "_scan_clock", "clock", "dialect", "names", "native", "sample")

    def __init__(self, dialect: str, sample: float, clock: Clock) -> None:
        self.dialect = dialect
        self.sample = sample
        self.clock = clock
        self._full: list[FullRecord] = []
        #: the scanners' buffer
        self.native = RecordBuffer()
        #: the names (base64url) of the SBD keys `native` interned, by key id; an immutable
        #: Arrow array, so a batch may share it with the writer thread
        self.names: pa.StringArray = pa.array([], pa.string())
        self._scan_clock: Clock = clock

    def scanner_buffer(self, scan_clock: Clock) -> RecordBuffer:
        """The buffer a scanner appends to, stamping records with `scan_clock` (the reading
        the connection passes into `feed`); records are kept in this channel's clock, the
        difference is re-read at every take."""
        self._scan_clock = scan_clock
        self._sync_offset()
        return self.native

    def _sync_offset(self) -> None:
        scan = self._scan_clock
        self.native.offset = 0 if scan is self.clock else self.clock() - scan()

    def retract(self, index: int) -> None:
        """The message whose scan appended record `index` was not delivered after all."""
        if index >= 0:
            self.native.retract(index)

    def add(
        self,
        src: Any,
        dst: Any,
        size: int,
        route: str,
        outcome: str,
        reason: str | None = None,
        *,
        received: int | None = None,
        remote: str | None = None,
    ) -> None:
        """Record a message that did not take the hot path. `received` is the clock reading
        when the relay got it (for the time spent inside the relay)."""
        if self.sample < 1.0 and random.random() >= self.sample:
            return
        now = self.clock()
        relay_ns = None if received is None else max(0, now - received)
        self._full.append((now, src, dst, size, route, outcome, reason, relay_ns, remote))

    def take(self, weight: float) -> _Batch | None:
        """The records so far as one batch (None if there are none); the buffers start over."""
        time_us, src, dst, size, keys = self.native.take()
        self._sync_offset()
        if keys:
            new = [base64.urlsafe_b64encode(key).rstrip(b"=").decode() for key in keys]
            self.names = pa.concat_arrays([self.names, pa.array(new, pa.string())])
        full, self._full = self._full, []
        local: tuple[np.ndarray, ...] | None = None
        if len(time_us):
            # views of the Rust columns (no copy), or the sample's rows
            local = tuple(
                np.frombuffer(memoryview(c), dtype=np.int64) for c in (time_us, src, dst, size)
            )
            if self.sample < 1.0:
                keep = np.random.default_rng().random(len(local[0])) < self.sample
                local = tuple(column[keep] for column in local)
            if not len(local[0]):
                local = None
        if local is None and not full:
            return None
        names = self.names if local is not None and len(self.names) else None
        return _Batch(self.dialect, weight, local, full, names)


@dataclass(slots=True)
class _Batch:
    dialect: str
    weight: float
    #: the hot path's columns (time_us, src, dst, size), int64 each, or None
    local: tuple[np.ndarray, ...] | None
    full: list[FullRecord]
    #: SBD key names by id when the hot path's addresses are key ids, else None
    names: pa.StringArray | None

    def __len__(self) -> int:
        return (0 if self.local is None else len(self.local[0])) + len(self.full)


class RecordStats:
    """Counters read by /metrics (plain ints: bumped by the loop and the writer thread)."""

    __slots__ = ("files", "shed", "writer_cpu_ns", "written")

    def __init__(self) -> None:
        self.written = 0
        self.shed = 0
        self.files = 0
        #: CPU time of the writer thread (what recording costs besides the hot path's append)
        self.writer_cpu_ns = 0


class Recorder:
    """Channels, the flush timer and the writer thread; see the module docstring.

    `start()` on the running loop, `await close()` at shutdown (writes what is buffered)."""

    def __init__(
        self,
        directory: Path,
        instance: str,
        *,
        sample: float = 1.0,
        clock: Clock = wall_clock,
        flush_interval: float = FLUSH_INTERVAL,
        max_pending: int = MAX_PENDING_BATCHES,
        roll_seconds: float = ROLL_SECONDS,
    ) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"records sample must be in (0, 1], got {sample}")
        self.directory = directory
        self.instance = instance
        self.sample = sample
        self.clock = clock
        self.flush_interval = flush_interval
        self.stats = RecordStats()
        self.channels: dict[str, Channel] = {}
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max_pending)
        self._writer = _PartitionWriter(directory, instance, roll_seconds, self.stats)
        self._thread: threading.Thread | None = None
        self._timer: Any = None
        self._loop: Any = None

    def channel(self, dialect: str) -> Channel:
        """The buffers of one dialect (made on first use)."""
        channel = self.channels.get(dialect)
        if channel is None:
            channel = self.channels[dialect] = Channel(dialect, self.sample, self.clock)
        return channel

    def start(self) -> None:
        import asyncio

        self.directory.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="rmb-records", daemon=True)
        self._thread.start()
        self._timer = self._loop.call_later(self.flush_interval, self._tick)

    def _tick(self) -> None:
        self.flush()
        self._timer = self._loop.call_later(self.flush_interval, self._tick)

    def flush(self) -> None:
        """Hand what the channels hold to the writer; shed it (counted) if the queue is full."""
        weight = 1.0 / self.sample
        for channel in self.channels.values():
            batch = channel.take(weight)
            if batch is None:
                continue
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.stats.shed += len(batch)

    async def close(self) -> None:
        """Write everything buffered and stop the writer."""
        import asyncio

        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        if self._thread is not None:
            await asyncio.to_thread(self._stop_writer)
            self._thread = None

    def _stop_writer(self) -> None:
        self._queue.put(None)  # blocking here is fine: this is shutdown, off the loop
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        # not niced: a low-priority thread holding the GIL would stall forwarding behind it
        writer, stats = self._writer, self.stats
        while True:
            try:
                batch = self._queue.get(timeout=writer.roll_seconds / 4)
            except queue.Empty:
                writer.roll_if_due()
                continue
            if batch is None:
                break
            started = time.thread_time_ns()
            try:
                writer.write(batch)
            except Exception:  # a full disk must not end recording for good, nor the relay
                log.exception("could not write %d route records", len(batch))
                stats.shed += len(batch)
            stats.writer_cpu_ns += time.thread_time_ns() - started
        writer.close()


# ---- batches to Arrow ------------------------------------------------------------------------


def _int64s(values: np.ndarray, kind: pa.DataType | None = None) -> pa.Array:
    """An int64-wide Arrow array (int64 or `kind`) over `values`' memory (no copy)."""
    return pa.Array.from_buffers(kind or pa.int64(), len(values), [None, pa.py_buffer(values)])


def _key_names(src: np.ndarray, dst: np.ndarray, names: pa.StringArray) -> list[pa.Array]:
    """SBD key ids as dictionary arrays over the names the batch uses (not every key the
    channel ever saw: the dictionary is written into every row group)."""
    used = np.zeros(len(names), dtype=bool)
    used[src] = True
    used[dst] = True
    keep = np.flatnonzero(used)
    index = np.zeros(len(names), dtype=np.int32)
    index[keep] = np.arange(len(keep), dtype=np.int32)
    dictionary = names.take(pa.array(keep))
    return [pa.DictionaryArray.from_arrays(pa.array(index[ids]), dictionary) for ids in (src, dst)]


def local_table(batch: _Batch) -> pa.Table:
    """The hot path's columns as a table of its files' schema (`local_schema`)."""
    assert batch.local is not None
    time_us, src, dst, size = batch.local
    if batch.names is not None:
        addresses = _key_names(src, dst, batch.names)
    else:
        addresses = [_int64s(src), _int64s(dst)]
    columns = [_int64s(time_us, TIME), *addresses, _int64s(size)]
    return pa.Table.from_arrays(columns, schema=local_schema(batch.names is not None))


def local_schema(keys: bool) -> pa.Schema:
    """The hot path's file schema: addresses as key names (SBD) or twin ids (RMB)."""
    address = pa.dictionary(pa.int32(), pa.string()) if keys else pa.int64()
    return pa.schema(
        [
            pa.field("time", TIME, nullable=False),
            pa.field("src", address, nullable=False),
            pa.field("dst", address, nullable=False),
            pa.field("size", pa.int64(), nullable=False),
        ]
    )


FULL_SCHEMA = pa.schema([SCHEMA.field(name) for name in FULL_COLUMNS])


def _address(values: list[Any]) -> pa.Array:
    """Addresses as text: RMB twin ids arrive as ints, SBD keys as text; None stays null."""
    array = pa.array(values)
    if pa.types.is_string(array.type):
        return array
    if pa.types.is_null(array.type):
        return pa.nulls(len(values), pa.string())
    return pc.cast(array, pa.string())


def full_table(batch: _Batch) -> pa.Table:
    """The other records (few): converted field by field."""
    n = len(batch.full)
    t, s, d, z, r, o, why, dur, far = (list(c) for c in zip(*batch.full, strict=True))
    columns = [
        pc.divide(pa.array(t, pa.int64()), 1000).cast(TIME),
        pa.repeat(pa.scalar(batch.dialect), n),
        _address(s),
        _address(d),
        pa.array(z, pa.int64()),
        pa.array(r, pa.string()),
        pa.array(o, pa.string()),
        pa.array(why, pa.string()),
        pc.divide(pa.array(dur, pa.int64()), 1000),
        pa.array(far, pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=FULL_SCHEMA)


# ---- Parquet files ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stream:
    """Rows that share their files: a file's schema, constants and encodings. `name` is
    unique per process (instance and weight are the process's) and part of the file name."""

    name: str
    schema: pa.Schema
    constants: dict[str, Any]
    options: dict[str, Any]


def local_stream(dialect: str, instance: str, weight: float, keys: bool) -> _Stream:
    constants = {"instance": instance, "dialect": dialect, **LOCAL_CONSTANTS, "weight": weight}
    options = {
        # measured per record on 200k-row batches: time delta-encoded ~5 ns (plain would be
        # 8 bytes a row to compress); the addresses and the size as dictionaries ~6 ns each
        # (few distinct values; pyarrow falls back to plain for a column that has many);
        # statistics on `time` only (readers prune on it, nothing filters on the others)
        "use_dictionary": ["src", "dst", "size"],
        "column_encoding": {"time": "DELTA_BINARY_PACKED"},
        "write_statistics": ["time"],
    }
    return _Stream(f"{dialect}-local", local_schema(keys), constants, options)


def full_stream(instance: str, weight: float) -> _Stream:
    constants = {"instance": instance, "weight": weight}
    options = {"use_dictionary": True, "write_statistics": ["time"]}
    return _Stream("full", FULL_SCHEMA, constants, options)


class _PartitionWriter:
    """Open Parquet files by hour partition and stream; hidden while open, renamed when
    closed."""

    def __init__(
        self,
        directory: Path,
        instance: str,
        roll_seconds: float,
        stats: RecordStats,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.monotonic = monotonic
        self.directory = directory
        self.instance = instance
        self.roll_seconds = roll_seconds
        self.stats = stats
        self._tag = _safe(instance)
        #: (hour in unix hours, stream name) -> (writer, hidden path, final path, opened at)
        self._open: dict[tuple[int, str], tuple[pq.ParquetWriter, Path, Path, float]] = {}

    def write(self, batch: _Batch) -> None:
        if batch.local is not None:
            keys = batch.names is not None
            stream = local_stream(batch.dialect, self.instance, batch.weight, keys)
            self._split(stream, batch.local[0], local_table(batch))
        if batch.full:
            table = full_table(batch)
            micros = table.column("time").cast(pa.int64()).to_numpy()
            self._split(full_stream(self.instance, batch.weight), micros, table)
        self.stats.written += len(batch)
        self.roll_if_due()

    def _split(self, stream: _Stream, micros: np.ndarray, table: pa.Table) -> None:
        """Append `table` to the files of the hours its rows (`micros`) fall in."""
        low, high = int(micros.min()) // HOUR_US, int(micros.max()) // HOUR_US
        if low == high:
            self._append(low, stream, table)
            return
        hours = micros // HOUR_US
        for hour in range(low, high + 1):
            part = table.filter(pa.array(hours == hour))
            if part.num_rows:
                self._append(hour, stream, part)

    def _append(self, hour: int, stream: _Stream, table: pa.Table) -> None:
        entry = self._open.get((hour, stream.name))
        if entry is None:
            stamp = time.gmtime(hour * 3600)
            folder = (
                self.directory / f"date={time.strftime('%Y-%m-%d', stamp)}/hour={stamp.tm_hour:02d}"
            )
            folder.mkdir(parents=True, exist_ok=True)
            name = f"part-{self._tag}-{stream.name}-{uuid.uuid4().hex[:12]}.parquet"
            hidden, final = folder / f".{name}", folder / name
            writer = pq.ParquetWriter(
                hidden,
                stream.schema,
                compression=COMPRESSION,
                store_schema=False,  # readers see the Parquet types, not Arrow dictionaries
                **stream.options,
            )
            writer.add_key_value_metadata(file_metadata(stream.constants))
            entry = (writer, hidden, final, self.monotonic())
            self._open[(hour, stream.name)] = entry
        entry[0].write_table(table)

    def roll_if_due(self) -> None:
        now = self.monotonic()
        for key, (_, _, _, opened) in list(self._open.items()):
            if now - opened >= self.roll_seconds:
                self._finish(key)

    def _finish(self, key: tuple[int, str]) -> None:
        writer, hidden, final, _ = self._open.pop(key)
        writer.close()
        os.replace(hidden, final)
        self.stats.files += 1

    def close(self) -> None:
        for key in list(self._open):
            self._finish(key)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:48] or "relay"
