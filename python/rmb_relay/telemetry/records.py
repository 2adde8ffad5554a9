"""Route records: one row per routed message or drop, written as time-partitioned Parquet.

Theory of operation
-------------------
The relay forwards hundreds of thousands of messages a second on one core, so recording must
cost the forwarding path next to nothing and must never make it wait:

- The hot path (a message delivered to a local connection inside the read that decoded it)
  costs Python nothing: the connection's scanner, which reads source, destination and size of
  every message inside the one `feed` call per read, appends four integers
  `(time_ns, src, dst, size)` to the channel's Rust `RecordBuffer` (`Channel.native`, one per
  dialect) at the clock reading passed into `feed`. The dialect retracts a record on the rare
  paths where it does not deliver after all (`Channel.retract`: the rate limiter, a
  connection gone since the scan, a message discarded after a close). Appending from Python
  instead (`Channel.local`, kept for callers without a scanner) cost ~230 ns a message, half
  of what forwarding it costs. The route and outcome are implied by the buffer. Addresses are
  integers there: RMB twin ids as they are, SBD keys as an index into the channel's name table
  (`Channel.name_id`; the Rust buffer's own key ids are mapped onto it when taken). The
  writer takes the rows as one numpy view, so turning a million hot-path records into Arrow
  columns costs milliseconds of C, not a second of the relay's GIL. Everything else (mailbox,
  federation, drops, expiry) is rarer and calls `Channel.add` with every field.
- Every `FLUSH_INTERVAL` the event loop swaps the lists out and puts the batch on a bounded
  queue. A full queue (the writer fell behind) sheds the batch and counts it
  (`rmb_relay_records_shed_total`): forwarding never blocks on recording.
- One writer thread turns batches into Arrow columns (the per-column conversion runs in
  pyarrow's C++; text columns dictionary-encoded in memory, so a batch's constant columns
  cost nothing per row and Parquet does not hash them again), and appends them to one Parquet
  file per hour partition
  (`DIR/date=YYYY-MM-DD/hour=HH/`, hive style, so Spark prunes by time). A file is written under a
  hidden name (`.` prefix, which Spark and pyarrow skip) and renamed when it is closed, at the
  latest every `ROLL_SECONDS`, so a reader never sees a half-written file.

`--records-sample R` keeps a random fraction R of the records; each row carries its `weight`
(1/R) so the analytics jobs estimate totals from a sample.

The schema is versioned (`SCHEMA_VERSION`, in every file's metadata); docs/analytics.md is its
reference. Route values `cluster` and `federation` are part of version 1 already, so instances
that federate or cluster write the same files.
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
from array import array
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

log = logging.getLogger("rmb_relay.records")

#: the record schema's version, in every file's key-value metadata under `SCHEMA_KEY`
SCHEMA_VERSION = 1
SCHEMA_KEY = b"rmb.records.schema_version"

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

SCHEMA = pa.schema(
    [
        pa.field("time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("instance", pa.string(), nullable=False),
        pa.field("dialect", pa.string(), nullable=False),
        pa.field("src", pa.string()),
        pa.field("dst", pa.string()),
        pa.field("size", pa.int64(), nullable=False),
        pa.field("route", pa.string(), nullable=False),
        pa.field("outcome", pa.string(), nullable=False),
        pa.field("reason", pa.string()),
        pa.field("relay_us", pa.int64()),
        pa.field("remote", pa.string()),
        pa.field("weight", pa.float64(), nullable=False),
    ],
    metadata={SCHEMA_KEY: str(SCHEMA_VERSION).encode()},
)

#: columns the writer holds dictionary-encoded already: the text ones and the hot path's
#: constant numbers (a batch's constant columns are one value and a run of zero indexes,
#: addresses one string per distinct id), so Parquet writes the dictionaries as given instead
#: of hashing (or compressing) every row of them; this halved the Parquet write
DICT_COLUMNS = [f.name for f in SCHEMA if f.type == pa.string()] + ["relay_us", "weight"]
#: `SCHEMA` as the writer's tables carry it; the files hold no Arrow schema (`store_schema`
#: off), so every reader, pyarrow and Spark alike, sees the Parquet types: `SCHEMA`
WRITE_SCHEMA = pa.schema(
    [
        pa.field(f.name, pa.dictionary(pa.int32(), f.type), f.nullable)
        if f.name in DICT_COLUMNS
        else f
        for f in SCHEMA
    ],
    metadata=SCHEMA.metadata,
)

#: a hot-path record: (time_ns, src, dst, size), delivered to a local connection; src and dst
#: are twin ids or `Channel.name_id`s
LocalRecord = tuple[int, int, int, int]
#: any other record: (time_ns, src, dst, size, route, outcome, reason, relay_ns, remote)
FullRecord = tuple[int, Any, Any, int, str, str, str | None, int | None, str | None]


class Channel:
    """One dialect's buffers. `native` is what the dialect's scanners append the hot path's
    records to (see the module docstring); `local` the same record appended from Python."""

    __slots__ = (
        "_full",
        "_ids",
        "_key_ids",
        "_local",
        "_scan_clock",
        "clock",
        "dialect",
        "local",
        "names",
        "native",
        "sample",
    )

    def __init__(self, dialect: str, sample: float, clock: Clock) -> None:
        self.dialect = dialect
        self.sample = sample
        self.clock = clock
        self._local = array("q")
        self._full: list[FullRecord] = []
        #: text addresses of the hot path by id (`name_id`); empty: addresses are integers
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        #: the scanners' buffer; its SBD key ids map onto `names` through `_key_ids`
        self.native = RecordBuffer()
        self._key_ids: list[int] = []
        self._scan_clock: Clock = clock
        self.local: Callable[[LocalRecord], None]
        if sample >= 1.0:
            self.local = self._local.extend
        else:
            self.local = _sampler(self._local.extend, sample)

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

    def name_id(self, name: str) -> int:
        """The integer a text address (an SBD key) is recorded as on the hot path."""
        found = self._ids.get(name)
        if found is None:
            found = self._ids[name] = len(self.names)
            self.names.append(name)
        return found

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

    def take(self) -> tuple[array[int], list[FullRecord]]:
        """The records so far; the buffers stay the same objects (the hot path holds a bound
        `extend` of `_local`, the scanners hold `native`)."""
        local, full = array("q", self._local), self._full[:]
        del self._local[:]
        self._full.clear()
        rows, keys = self.native.take()
        self._sync_offset()
        for key in keys:
            self._key_ids.append(self.name_id(base64.urlsafe_b64encode(key).rstrip(b"=").decode()))
        if rows:
            local.frombytes(self._native_rows(rows))
        return local, full

    def _native_rows(self, rows: bytes) -> bytes:
        """The scanners' rows sampled, SBD key ids as `name_id`s (numpy, no loop over records
        on the event loop; RMB rows unsampled pass as they are)."""
        if self.sample >= 1.0 and not self._key_ids:
            return rows
        grid = np.frombuffer(rows, dtype=np.int64).reshape(-1, 4)
        if self.sample < 1.0:
            grid = grid[np.random.default_rng().random(len(grid)) < self.sample]
        else:
            grid = grid.copy()
        if self._key_ids:
            ids = np.asarray(self._key_ids, dtype=np.int64)
            grid[:, 1] = ids[grid[:, 1]]
            grid[:, 2] = ids[grid[:, 2]]
        return grid.tobytes()


def _sampler(extend: Callable[[LocalRecord], None], rate: float) -> Callable[[LocalRecord], None]:
    rand = random.random

    def sampled(record: LocalRecord) -> None:
        if rand() < rate:
            extend(record)

    return sampled


@dataclass(slots=True)
class _Batch:
    dialect: str
    weight: float
    #: hot-path records, four integers each
    local: array[int]
    full: list[FullRecord]
    #: the channel's name table when its hot-path addresses are ids (a snapshot: append-only)
    names: list[str]

    def __len__(self) -> int:
        return len(self.local) // 4 + len(self.full)


class RecordStats:
    """Counters read by /metrics (plain ints: bumped by the loop and the writer thread)."""

    __slots__ = ("files", "shed", "written")

    def __init__(self) -> None:
        self.written = 0
        self.shed = 0
        self.files = 0


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
            local, full = channel.take()
            if not local and not full:
                continue
            names = channel.names[:] if channel.names else []
            batch = _Batch(channel.dialect, weight, local, full, names)
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
        writer = self._writer
        while True:
            try:
                batch = self._queue.get(timeout=writer.roll_seconds / 4)
            except queue.Empty:
                writer.roll_if_due()
                continue
            if batch is None:
                break
            try:
                writer.write(batch)
            except Exception:  # a full disk must not end recording for good, nor the relay
                log.exception("could not write %d route records", len(batch))
                self.stats.shed += len(batch)
        writer.close()


def _column(values: list[Any]) -> pa.Array:
    """Addresses as text: RMB twin ids arrive as ints, SBD keys as text; None stays null."""
    array = pa.array(values)
    if pa.types.is_string(array.type):
        return array
    if pa.types.is_null(array.type):
        return pa.nulls(len(values), pa.string())
    return pc.cast(array, pa.string())


def _times(nanos: pa.Array) -> pa.Array:
    return pc.divide(nanos, 1000).cast(pa.timestamp("us", tz="UTC"))


def _local_table(batch: _Batch, instance: str) -> pa.Table:
    """The hot-path records: columns cut from one numpy view of the buffer (no Python loop),
    text as dictionaries (`WRITE_SCHEMA`)."""
    grid = np.frombuffer(batch.local, dtype=np.int64).reshape(-1, 4)
    n = len(grid)
    zeros = pa.array(np.zeros(n, dtype=np.int32))

    def const(value: Any, kind: pa.DataType | None = None) -> pa.Array:
        return pa.DictionaryArray.from_arrays(zeros, pa.array([value], kind or pa.string()))

    def address(column: int) -> pa.Array:
        ids = pa.array(grid[:, column])
        if batch.names:
            names = pa.array(batch.names, pa.string())
            return pa.DictionaryArray.from_arrays(ids.cast(pa.int32()), names)
        found = pc.dictionary_encode(ids)  # few distinct twins: one string each
        return pa.DictionaryArray.from_arrays(found.indices, pc.cast(found.dictionary, pa.string()))

    nulls = pa.DictionaryArray.from_arrays(pa.nulls(n, pa.int32()), pa.array([], pa.string()))
    columns = [
        _times(pa.array(grid[:, 0])),
        const(instance),
        const(batch.dialect),
        address(1),
        address(2),
        pa.array(grid[:, 3]),
        const("local"),
        const("delivered"),
        nulls,
        const(0, pa.int64()),
        nulls,
        const(batch.weight, pa.float64()),
    ]
    return pa.Table.from_arrays(columns, schema=WRITE_SCHEMA)


def _full_table(batch: _Batch, instance: str) -> pa.Table:
    """The other records (few): converted field by field."""
    n = len(batch.full)
    t, s, d, z, r, o, why, dur, far = (list(c) for c in zip(*batch.full, strict=True))
    columns = [
        _times(pa.array(t, pa.int64())),
        pa.repeat(pa.scalar(instance), n),
        pa.repeat(pa.scalar(batch.dialect), n),
        _column(s),
        _column(d),
        pa.array(z, pa.int64()),
        pa.array(r, pa.string()),
        pa.array(o, pa.string()),
        pa.array(why, pa.string()),
        pc.divide(pa.array(dur, pa.int64()), 1000),
        pa.array(far, pa.string()),
        pa.repeat(pa.scalar(batch.weight), n),
    ]
    table = pa.Table.from_arrays(columns, schema=SCHEMA)
    for name in DICT_COLUMNS:
        index = table.schema.get_field_index(name)
        encoded = pc.dictionary_encode(table.column(index))
        table = table.set_column(index, WRITE_SCHEMA.field(name), encoded)
    return table


def to_table(batch: _Batch, instance: str) -> pa.Table:
    """One batch as a table of `WRITE_SCHEMA` (both kinds of record)."""
    parts = []
    if batch.local:
        parts.append(_local_table(batch, instance))
    if batch.full:
        parts.append(_full_table(batch, instance))
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


class _PartitionWriter:
    """Open Parquet files by hour partition; hidden while open, renamed when closed."""

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
        #: hour (unix hours) -> (writer, hidden path, final path, opened at monotonic s)
        self._open: dict[int, tuple[pq.ParquetWriter, Path, Path, float]] = {}

    def write(self, batch: _Batch) -> None:
        table = to_table(batch, self.instance)
        hours = pc.divide(table.column("time").cast(pa.int64()), 3_600_000_000)
        low, high = pc.min(hours).as_py(), pc.max(hours).as_py()
        if low == high:
            self._append(low, table)
        else:
            for hour in range(low, high + 1):
                part = table.filter(pc.equal(hours, hour))
                if part.num_rows:
                    self._append(hour, part)
        self.stats.written += table.num_rows
        self.roll_if_due()

    def _append(self, hour: int, table: pa.Table) -> None:
        entry = self._open.get(hour)
        if entry is None:
            stamp = time.gmtime(hour * 3600)
            folder = (
                self.directory / f"date={time.strftime('%Y-%m-%d', stamp)}/hour={stamp.tm_hour:02d}"
            )
            folder.mkdir(parents=True, exist_ok=True)
            name = f"part-{self._tag}-{uuid.uuid4().hex[:12]}.parquet"
            hidden, final = folder / f".{name}", folder / name
            writer = pq.ParquetWriter(
                hidden,
                WRITE_SCHEMA,
                compression=COMPRESSION,
                # a dictionary of unique timestamps, of the numbers, and min/max of every text
                # column cost more than the rest of the write; `time` keeps its statistics
                # (readers prune on it); the others arrive as dictionaries
                use_dictionary=DICT_COLUMNS,
                write_statistics=["time"],
                store_schema=False,  # readers see the Parquet types: `SCHEMA`, not dictionaries
            )
            writer.add_key_value_metadata({SCHEMA_KEY: str(SCHEMA_VERSION).encode()})
            entry = (writer, hidden, final, self.monotonic())
            self._open[hour] = entry
        entry[0].write_table(table)

    def roll_if_due(self) -> None:
        now = self.monotonic()
        for hour, (_, _, _, opened) in list(self._open.items()):
            if now - opened >= self.roll_seconds:
                self._finish(hour)

    def _finish(self, hour: int) -> None:
        writer, hidden, final, _ = self._open.pop(hour)
        writer.close()
        os.replace(hidden, final)
        self.stats.files += 1

    def close(self) -> None:
        for hour in list(self._open):
            self._finish(hour)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:48] or "relay"
