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
- Everything else (mailbox, federation outcomes, drops, expiry, the tunnel) is rarer and calls
  `Channel.add` with every field, once the message's outcome is known: a forward queued for
  another instance's Redis stream is recorded when Redis answered (`switch.QueuedForward`).
  The tunnel's hub keeps its requests' records with every field in Rust and
  the channel takes them at each flush (`Channel.add_source`): no Python call per request.
- Every `FLUSH_INTERVAL` the event loop takes the buffers (the Rust columns move out without a
  copy) and hands them to the writer process (record_process.py): the columns are copied into
  shared memory the writer maps, a small frame saying where goes down its stdin pipe
  (non-blocking). A batch that finds `max_pending` frames still waiting (the writer fell
  behind), or no writer running (it died and is not restarted yet), is shed and counted
  (`rmb_relay_records_shed_total`): forwarding never blocks on recording. The taken columns'
  memory goes back to the Rust buffer for the scanners to append into.
- The writer is a child process (`record_writer.py`: Arrow, Parquet, the file layout), not a
  thread, so that the relay stays single-threaded and never imports pyarrow or numpy: a second
  thread of any kind made every allocation of a 1 KiB message take glibc's arena lock, ~40 ns a
  message (measured), more than the writer's own work. It reports what it wrote (and its CPU
  time) on its stdout; it is restarted if it dies, at most every `RESTART_SECONDS`.

`--records-sample R` keeps a random fraction R of the records. `add` draws per record. The hot
path's columns are sampled where it costs least (measured, bench/README.md): at R up to
`RELAY_SAMPLE_MAX` by `take`, before anything is handed over (record_sample.py: the gaps between
kept rows are drawn from a table, so the Python work is per kept row), and neither the
shared-memory copy nor the writer sees a dropped row; above it by the writer (numpy), since
keeping most rows costs Python more per row than handing them over and dropping the rest
there. Each row counts for `weight` = 1/R so the analytics jobs estimate totals from a
sample.

Route values `cluster` and `federation` are in the record schema since version 1, so instances
that federate or cluster write the same files.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rmb_relay._core import Column, RecordBuffer
from rmb_relay.clock import Clock, wall_clock
from rmb_relay.telemetry.record_process import (
    ARENA_BYTES,
    RESTART_SECONDS,
    Batch,
    FullRecord,
    RecordStats,
    WriterProcess,
)
from rmb_relay.telemetry.record_sample import RowSampler

#: where a message went; `cluster` and `federation` are reserved for instances that have them
ROUTES = ("local", "mailbox", "cluster", "federation", "none")
#: what became of it
OUTCOMES = ("delivered", "queued", "expired", "rate-limited", "rejected")

#: how often the event loop hands the buffers to the writer (seconds): bounds buffer memory
FLUSH_INTERVAL = 0.5
#: batches waiting to go into the writer's pipe; beyond this they are shed (~32 s of backlog)
MAX_PENDING_BATCHES = 64
#: a Parquet file is closed (made visible) at the latest this long after it was opened
ROLL_SECONDS = 60.0
#: --records-sample at or below this: the relay samples the hot path's rows before handing
#: them over; above it the writer does. Per row taken, sampling in the relay cost the event loop
#: ~2-4 ns at R = 0.01, ~12-15 at 0.1 and ~80 at 0.5, and saved the writer ~15 ns (measured)
RELAY_SAMPLE_MAX = 0.05


class Channel:
    """One dialect's buffers. `native` is what the dialect's scanners append the hot path's
    records to (see the module docstring); `add` records everything else."""

    __slots__ = (
        "_full",
        "_sampler",
        "_scan_clock",
        "_sources",
        "clock",
        "dialect",
        "names",
        "names_sent",
        "native",
        "sample",
        "writer_sample",
    )

    def __init__(self, dialect: str, sample: float, clock: Clock) -> None:
        self.dialect = dialect
        self.sample = sample
        self.clock = clock
        self._full: list[FullRecord] = []
        #: what `add_source` added: called at each `take`
        self._sources: list[Callable[[], list[FullRecord]]] = []
        #: the scanners' buffer
        self.native = RecordBuffer()
        #: the names (base64url) of the SBD keys `native` interned, by key id
        self.names: list[str] = []
        #: names the writer has (a batch carries the ones after these)
        self.names_sent = 0
        self._scan_clock: Clock = clock
        #: samples the hot path's rows at `take` (R <= RELAY_SAMPLE_MAX), else None
        self._sampler = RowSampler(sample) if sample <= RELAY_SAMPLE_MAX else None
        #: the rate the writer samples the hot path's rows at (1: not at all)
        self.writer_sample = 1.0 if self._sampler is not None else sample

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

    def add_source(self, source: Callable[[], list[FullRecord]]) -> None:
        """Records kept elsewhere (the tunnel's hub keeps them in Rust), as `add`
        would have made them, in this channel's clock: `source` gives the ones since its last
        call at each `take`, and they are sampled here as `add` samples."""
        self._sources.append(source)

    def take(self, weight: float) -> Batch | None:
        """The records so far as one batch (None if there are none); the buffers start over.
        The batch carries the key names the writer does not have yet (`names_sent`)."""
        time_us, src, dst, size, keys = self.native.take()
        self._sync_offset()
        self.names += [base64.urlsafe_b64encode(key).rstrip(b"=").decode() for key in keys]
        full, self._full = self._full, []
        for source in self._sources:
            more = source()
            if self.sample < 1.0:
                sample = self.sample
                more = [r for r in more if random.random() < sample]
            full += more
        rows = len(time_us)
        columns: Sequence[Column | memoryview] | None = None
        if rows and self._sampler is not None:
            columns = self._sampler.sample((time_us, src, dst, size), rows)
            rows = 0 if columns is None else len(columns[0]) // 8
        elif rows:
            columns = (time_us, src, dst, size)
        if not rows and not full:
            return None
        new = self.names[self.names_sent :]
        return Batch(
            self.dialect, weight, self.writer_sample, rows, columns, full, self.names_sent, new
        )


class Recorder:
    """Channels, the flush timer and the writer process; see the module docstring.

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
        restart_seconds: float = RESTART_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        arena_bytes: int = ARENA_BYTES,
    ) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"records sample must be in (0, 1], got {sample}")
        self.directory = directory
        self.instance = instance
        self.sample = sample
        self.clock = clock
        self.flush_interval = flush_interval
        self.roll_seconds = roll_seconds
        self.stats = RecordStats()
        self.channels: dict[str, Channel] = {}
        self._writer = WriterProcess(
            self.directory,
            self.instance,
            roll_seconds,
            self.stats,
            self._writer_started,
            max_pending=max_pending,
            restart_seconds=restart_seconds,
            monotonic=monotonic,
            arena_bytes=arena_bytes,
        )
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def channel(self, dialect: str) -> Channel:
        """The buffers of one dialect (made on first use)."""
        channel = self.channels.get(dialect)
        if channel is None:
            channel = self.channels[dialect] = Channel(dialect, self.sample, self.clock)
        return channel

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id (None before `start` and after `close`)."""
        return self._writer.pid

    def _writer_started(self) -> None:
        for channel in self.channels.values():
            channel.names_sent = 0  # a new writer knows no key names

    def start(self) -> None:
        """Start the writer process and the flush timer; OSError if DIR cannot be made."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.get_running_loop()
        self._writer.start(self._loop)
        self._timer = self._loop.call_later(self.flush_interval, self._tick)

    def _tick(self) -> None:
        self._writer.check()
        self.flush()
        assert self._loop is not None
        self._timer = self._loop.call_later(self.flush_interval, self._tick)

    def flush(self) -> None:
        """Queue what the channels hold for the writer; shed it (counted) if too much waits."""
        weight = 1.0 / self.sample
        for channel in self.channels.values():
            batch = channel.take(weight)
            if batch is None:
                continue
            if self._writer.send(batch):
                channel.names_sent = batch.names_offset + len(batch.names)
            else:
                self.stats.shed += len(batch)

    async def close(self) -> None:
        """Write everything buffered and stop the writer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        await self._writer.close()
