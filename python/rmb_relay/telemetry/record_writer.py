"""The route-record writer process: batches from the relay in, Parquet files out.

The relay process stays single-threaded: any second thread in it (a writer thread, or the
threads pyarrow and numpy start when imported) makes glibc's malloc lock its arena on every
allocation above the thread cache's 1032 bytes, which is every message of 1 KiB or more: a
relay with one idle extra thread spent ~40 ns (3.5%) more per 1000-byte SBD forward (measured),
more than the writer itself. So the Arrow and Parquet work runs here, in a child process the
relay starts (`record_process.WriterProcess`), reading frames from its stdin:

    u32 header length, u32 payload length (little-endian)
    header   pickle of (dialect, weight, sample, rows, full records, names offset, new names,
             arena offset); `sample` < 1: the rate this writer samples the rows at (the relay
             samples small rates itself and sends 1; records.RELAY_SAMPLE_MAX)
    payload  the hot path's four int64 columns, `rows` values each: time (µs), src, dst, size;
             empty when they are in the arena (shared memory) at the header's offset

and reporting after each batch, on its stdout, one line of cumulative counters:
`written failed files cpu_ns released` (cpu_ns: the CPU it spent on batches, not on starting
or waiting; released: the arena batches it is done with, whose memory the relay reuses;
record_process.py). It exits when its stdin closes (the relay closed it, or died), after
closing (renaming) its files.

Files (record schema version 2, record_schema.py): what the writer costs is what recording
costs, so they are laid out for the writer. The hot path of each dialect has its own stream,
whose files hold only the four columns that vary per row (time, src, dst, size), as they
arrived (viewed, not copied, by numpy and Arrow); the eight that do not (instance, dialect, route
`local`, outcome `delivered`, ...) are written once into the file's metadata. Per row that
leaves a delta-encoded time, dictionary indexes for the addresses and the size. The other
records share one stream per hour with every column but the instance and the weight. One file
per hour partition and stream (`DIR/date=YYYY-MM-DD/hour=HH/`, hive style, so Spark prunes by
time), written under a hidden name (`.` prefix, which Spark and pyarrow skip) and renamed when
closed, at the latest `roll_seconds` after it was opened, so a reader never sees a
half-written file.

A writer that is killed (SIGKILL, OOM, power loss) leaves its open files hidden and without a
Parquet footer, so nothing can read them. Each file is therefore created under an exclusive
`flock` held until it is renamed: the kernel drops the lock when its process dies, however it
dies. At start a writer looks for hidden files under DIR that nobody holds locked (`recover`):
one whose footer is complete (killed between closing and renaming) is renamed into view, any
other is removed, each with a log line naming the file and what was lost. A lock held means a
live writer (of this relay or another instance sharing DIR), whose file is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import mmap
import os
import pickle
import select
import struct
import sys
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

from rmb_relay.telemetry.record_schema import SCHEMA, file_metadata

log = logging.getLogger("rmb_relay.records")

#: Parquet page compression: lz4 writes ~2x faster than snappy here at the same size
COMPRESSION = "lz4"
HOUR_US = 3_600_000_000
#: a frame's lengths (header, payload)
FRAME = struct.Struct("<II")

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


@dataclass(slots=True)
class Batch:
    """One flush of one dialect's records, as the writer takes it."""

    dialect: str
    weight: float
    #: the hot path's columns (time_us, src, dst, size), int64 each, or None
    local: tuple[np.ndarray, ...] | None
    #: any record but the hot path's: (time_ns, src, dst, size, route, outcome, reason,
    #: relay_ns, remote)
    full: list[tuple[Any, ...]]
    #: SBD key names by id when the hot path's addresses are key ids, else None
    names: pa.StringArray | None

    def __len__(self) -> int:
        return (0 if self.local is None else len(self.local[0])) + len(self.full)


def make_batch(
    dialect: str,
    weight: float,
    sample: float,
    columns: list[Any] | None,
    full: list[tuple[Any, ...]],
    names: pa.StringArray | None,
) -> Batch:
    """A batch from the hot path's four column buffers (viewed, not copied), sampled at
    `sample` (1: as they are)."""
    local: tuple[np.ndarray, ...] | None = None
    if columns is not None:
        local = tuple(np.frombuffer(column, dtype=np.int64) for column in columns)
        if sample < 1.0:
            keep = np.random.default_rng().random(len(local[0])) < sample
            local = tuple(column[keep] for column in local)
        if not len(local[0]):
            local = None
    keys = names if local is not None and names is not None and len(names) else None
    return Batch(dialect, weight, local, full, keys)


class WriterStats:
    """What the writer did, reported to the relay after each batch."""

    __slots__ = ("failed", "files", "written")

    def __init__(self) -> None:
        self.written = 0
        self.failed = 0
        self.files = 0


# ---- batches to Arrow ----------------------------------------------------------------------


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


def local_table(batch: Batch) -> pa.Table:
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


def full_table(batch: Batch) -> pa.Table:
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
        stats: WriterStats,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.monotonic = monotonic
        self.directory = directory
        self.instance = instance
        self.roll_seconds = roll_seconds
        self.stats = stats
        self._tag = _safe(instance)
        #: (hour in unix hours, stream name) -> (writer, hidden path, final path, opened at,
        #: the fd holding the file's lock)
        self._open: dict[tuple[int, str], tuple[pq.ParquetWriter, Path, Path, float, int]] = {}

    def write(self, batch: Batch) -> None:
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
            lock = _create_locked(hidden)
            writer = pq.ParquetWriter(
                hidden,
                stream.schema,
                compression=COMPRESSION,
                store_schema=False,  # readers see the Parquet types, not Arrow dictionaries
                **stream.options,
            )
            writer.add_key_value_metadata(file_metadata(stream.constants))
            entry = (writer, hidden, final, self.monotonic(), lock)
            self._open[(hour, stream.name)] = entry
        entry[0].write_table(table)

    def roll_if_due(self) -> None:
        now = self.monotonic()
        for key, (_, _, _, opened, _) in list(self._open.items()):
            if now - opened >= self.roll_seconds:
                self._finish(key)

    def _finish(self, key: tuple[int, str]) -> None:
        writer, hidden, final, _, lock = self._open.pop(key)
        try:
            writer.close()
            os.replace(hidden, final)
        finally:
            os.close(lock)  # unlocked only once renamed: `recover` never sees it half done
        self.stats.files += 1

    def close(self) -> None:
        for key in list(self._open):
            self._finish(key)


def _create_locked(path: Path) -> int:
    """Create `path` and lock it (`flock`, exclusive) for as long as the returned fd is open.
    A `recover` running in another writer may have removed the file between our create and
    our lock (it was not locked yet): then the lock is on a file that is gone, so start again."""
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a `recover` looks at it
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _hidden_parts(directory: Path) -> list[Path]:
    """Hidden route-record files under `directory` (open, or left by a writer that died)."""
    return sorted(p for p in directory.glob("date=*/hour=*/.part-*.parquet") if p.is_file())


def recover(directory: Path, roll_seconds: float) -> tuple[int, int]:
    """Deal with the hidden files under `directory` that no live writer holds (see the module
    docstring): rename the complete ones into view, remove the rest (a file holds at most
    `roll_seconds` of its stream, which the log line says). Returns (renamed, removed); logs
    one line per file."""
    renamed = removed = 0
    for path in _hidden_parts(directory):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # renamed or removed meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer's open file
            if not os.path.exists(path) or os.stat(path).st_ino != os.fstat(fd).st_ino:
                continue  # renamed (closed) between our listing and our lock
            final = path.with_name(path.name[1:])
            status = os.fstat(fd)
            size = status.st_size
            if not size and time.time() - status.st_mtime < roll_seconds:
                continue  # maybe a live writer's, between creating it and locking it
            try:
                rows = pq.read_metadata(path).num_rows
            except (OSError, pa.ArrowException):
                os.unlink(path)
                removed += 1
                log.warning(
                    "route records: removed %s (%d bytes), left unfinished by a record writer "
                    "that was killed: it has no Parquet footer, so its records (up to %.0f s "
                    "of this stream) are lost",
                    path,
                    size,
                    roll_seconds,
                )
                continue
            os.replace(path, final)
            renamed += 1
            log.warning(
                "route records: %s was complete (%d records) but never renamed by the writer "
                "that was killed; renamed to %s",
                path,
                rows,
                final.name,
            )
        finally:
            os.close(fd)
    return renamed, removed


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:48] or "relay"


# ---- the process ---------------------------------------------------------------------------


#: logged when the relay's end of the pipe closes in the middle of a batch
CUT_SHORT = "route records: the relay closed the pipe inside a batch"


class _Reader:
    """Exact reads from the relay's pipe into one buffer kept across batches: a fresh buffer
    per batch cost ~10 ns a record in zero-filling and page faults (measured)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()

    def read(self, size: int) -> memoryview | None:
        """The next `size` bytes, valid until the next read; None at end of file (before or
        inside them)."""
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view = memoryview(self._buffer)[:size]
        done = 0
        while done < size:
            got = os.readv(self.fd, [view[done:]])
            if not got:
                return None
            done += got
        return view


def serve(
    directory: Path,
    instance: str,
    roll_seconds: float,
    fd_in: int,
    out: Any,
    arena: mmap.mmap | None = None,
) -> None:
    """Write the frames read from `fd_in` until it closes; counters to `out` (see above)."""
    recover(directory, roll_seconds)
    shared = memoryview(arena) if arena is not None else None
    released = 0
    stats = WriterStats()
    writer = _PartitionWriter(directory, instance, roll_seconds, stats)
    columns_in = _Reader(fd_in)
    names: dict[str, pa.StringArray] = {}

    #: CPU spent on batches (reading, Arrow, Parquet), not on starting up or waiting
    busy_ns = 0

    def report() -> None:
        out.write(f"{stats.written} {stats.failed} {stats.files} {busy_ns} {released}\n")
        out.flush()

    try:
        while True:
            ready, _, _ = select.select([fd_in], [], [], roll_seconds / 4)
            if not ready:
                writer.roll_if_due()
                continue
            started = time.process_time_ns()
            # one buffer for the three reads: each is decoded before the next overwrites it
            lengths = columns_in.read(FRAME.size)
            if lengths is None:
                break
            header_size, payload_size = FRAME.unpack(lengths)
            header = columns_in.read(header_size)
            if header is None:
                log.error(CUT_SHORT)
                break
            dialect, weight, sample, rows, full, offset, new, at = pickle.loads(header)
            if at is None:
                payload = columns_in.read(payload_size)
                if payload is None:
                    log.error(CUT_SHORT)
                    break
            else:
                assert shared is not None, "a batch in the arena, but no arena"
                payload = shared[at : at + rows * 32]
            table = names.get(dialect, pa.array([], pa.string()))
            if new:
                known = table[:offset]
                if len(known) < offset:  # never expected: the relay resends names it lost
                    log.error("route records: %d SBD key names missing", offset - len(known))
                    known = pa.concat_arrays([known, pa.nulls(offset - len(known), pa.string())])
                table = pa.concat_arrays([known, pa.array(new, pa.string())])
                names[dialect] = table
            columns = None
            if rows:
                columns = [payload[i * rows * 8 : (i + 1) * rows * 8] for i in range(4)]
            batch = make_batch(dialect, weight, sample, columns, full, table)
            try:
                writer.write(batch)
            except Exception:  # a full disk must not end recording for good
                log.exception("could not write %d route records", len(batch))
                stats.failed += len(batch)
            # views of the reader's buffer or of the arena, which are reused once reported
            del batch, columns, payload
            if at is not None:
                released += 1
            busy_ns += time.process_time_ns() - started
            report()
    finally:
        writer.close()
        report()
        if shared is not None:
            with contextlib.suppress(BufferError):  # a batch's view, if it ended in one
                shared.release()


def main(argv: list[str] | None = None) -> None:
    """`python -m rmb_relay.telemetry.record_writer DIR INSTANCE ROLL_SECONDS [ARENA_FD
    ARENA_BYTES]` (the relay starts it; see the module docstring)."""
    directory, instance, roll, *shared = argv if argv is not None else sys.argv[1:]
    arena = None
    if shared:
        arena = mmap.mmap(int(shared[0]), int(shared[1]), access=mmap.ACCESS_READ)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # what the imports left (pyarrow, numpy: ~100k objects) is never garbage; without this
    # the cyclic collector kept walking it, a third of the writer's CPU (measured)
    gc.freeze()
    serve(Path(directory), instance, float(roll), sys.stdin.fileno(), sys.stdout, arena)


if __name__ == "__main__":
    main()
