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
  `Channel.add` with every field.
- Every `FLUSH_INTERVAL` the event loop takes the buffers (the Rust columns move out without a
  copy) and queues them, as one frame, for the writer process. The loop writes frames into the
  writer's stdin pipe only as fast as the pipe takes them (non-blocking); a batch that finds
  `max_pending` batches still waiting (the writer fell behind), or no writer running (it died
  and is not restarted yet), is shed
  and counted (`rmb_relay_records_shed_total`): forwarding never blocks on recording. Once a
  batch's columns are in the pipe, their memory goes back to the Rust buffer for the scanners
  to append into.
- The writer is a child process (`record_writer.py`: Arrow, Parquet, the file layout), not a
  thread, so that the relay stays single-threaded and never imports pyarrow or numpy: a second
  thread of any kind made every allocation of a 1 KiB message take glibc's arena lock, ~40 ns a
  message (measured), more than the writer's own work. It reports what it wrote (and its CPU
  time) on its stdout; it is restarted if it dies, at most every `RESTART_SECONDS`.

`--records-sample R` keeps a random fraction R of the records (the writer samples the hot
path's columns, `add` samples the rest); each row counts for `weight` = 1/R so the analytics
jobs estimate totals from a sample.

Route values `cluster` and `federation` are in the record schema since version 1, so instances
that federate or cluster write the same files.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import pickle
import random
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rmb_relay._core import Column, RecordBuffer
from rmb_relay.clock import Clock, wall_clock

log = logging.getLogger("rmb_relay.records")

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
#: the writer's pipe is asked to hold this much (Linux caps it at fs.pipe-max-size, 1 MiB by
#: default): a batch of a few MB goes in a few writes instead of one per 64 KiB
PIPE_SIZE = 1 << 20
#: a writer that died is started again at most this often (its batches meanwhile are shed)
RESTART_SECONDS = 5.0
#: how long `close` waits for the writer to take what is queued and finish its files
CLOSE_TIMEOUT = 60.0
#: a frame's lengths (header, payload): see record_writer.py
FRAME = struct.Struct("<II")

#: any record but the hot path's: (time_ns, src, dst, size, route, outcome, reason, relay_ns,
#: remote)
FullRecord = tuple[int, Any, Any, int, str, str, str | None, int | None, str | None]


class Channel:
    """One dialect's buffers. `native` is what the dialect's scanners append the hot path's
    records to (see the module docstring); `add` records everything else."""

    __slots__ = (
        "_full",
        "_scan_clock",
        "clock",
        "dialect",
        "names",
        "names_sent",
        "native",
        "sample",
    )

    def __init__(self, dialect: str, sample: float, clock: Clock) -> None:
        self.dialect = dialect
        self.sample = sample
        self.clock = clock
        self._full: list[FullRecord] = []
        #: the scanners' buffer
        self.native = RecordBuffer()
        #: the names (base64url) of the SBD keys `native` interned, by key id
        self.names: list[str] = []
        #: names the writer has (a batch carries the ones after these)
        self.names_sent = 0
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

    def take(self, weight: float) -> Batch | None:
        """The records so far as one batch (None if there are none); the buffers start over.
        The batch carries the key names the writer does not have yet (`names_sent`)."""
        time_us, src, dst, size, keys = self.native.take()
        self._sync_offset()
        self.names += [base64.urlsafe_b64encode(key).rstrip(b"=").decode() for key in keys]
        full, self._full = self._full, []
        rows = len(time_us)
        if not rows and not full:
            return None
        columns = (time_us, src, dst, size) if rows else None
        new = self.names[self.names_sent :]
        return Batch(self.dialect, weight, self.sample, rows, columns, full, self.names_sent, new)


@dataclass(slots=True)
class Batch:
    """One flush of one channel, as the writer process is sent it."""

    dialect: str
    weight: float
    sample: float
    #: hot-path records in `columns`
    rows: int
    #: the hot path's columns (time_us, src, dst, size), or None
    columns: tuple[Column, Column, Column, Column] | None
    full: list[FullRecord]
    #: SBD key names from id `names_offset` on, which the writer does not have yet
    names_offset: int
    names: list[str]

    def __len__(self) -> int:
        return self.rows + len(self.full)

    def frame(self) -> list[memoryview]:
        """The batch as the writer reads it (record_writer.py): lengths, header, columns."""
        header = pickle.dumps(
            (
                self.dialect,
                self.weight,
                self.sample,
                self.rows,
                self.full,
                self.names_offset,
                self.names,
            ),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        columns = [memoryview(column) for column in self.columns or ()]
        lengths = FRAME.pack(len(header), sum(len(c) for c in columns))
        return [memoryview(lengths), memoryview(header), *columns]


class RecordStats:
    """Counters read by /metrics (plain ints, bumped on the event loop)."""

    __slots__ = ("files", "shed", "writer_cpu_ns", "written")

    def __init__(self) -> None:
        self.written = 0
        self.shed = 0
        self.files = 0
        #: CPU time of the writer process (what recording costs besides the scanners' append)
        self.writer_cpu_ns = 0


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
        self._writer = _WriterProcess(self, max_pending, restart_seconds, monotonic)
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


class _WriterProcess:
    """The child process that writes Parquet (record_writer.py), the non-blocking pipe to it
    and the counters it reports back."""

    def __init__(
        self,
        recorder: Recorder,
        max_pending: int,
        restart_seconds: float,
        monotonic: Callable[[], float],
    ) -> None:
        self.recorder = recorder
        self.stats = recorder.stats
        self.max_pending = max_pending
        self.restart_seconds = restart_seconds
        self.monotonic = monotonic
        #: frames not yet wholly in the pipe (the first one maybe in part): (records, chunks)
        self._pending: deque[tuple[int, deque[memoryview]]] = deque()
        self._process: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pipe = -1
        self._report = -1
        self._report_tail = b""
        #: (written, failed, files, cpu_ns) of the writers that ended, and of the running one
        self._ended = (0, 0, 0, 0)
        self._running = (0, 0, 0, 0)
        #: records the writers failed to write, already counted as shed
        self._failed_counted = 0
        self._started_at: float | None = None
        self._drained: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._spawn()

    def _spawn(self) -> None:
        assert self._loop is not None
        self._started_at = self.monotonic()
        recorder = self.recorder
        command = [
            sys.executable,
            "-m",
            "rmb_relay.telemetry.record_writer",
            str(recorder.directory),
            recorder.instance,
            repr(recorder.roll_seconds),
        ]
        # its own session: a Ctrl-C to the relay's terminal must not kill it before the relay
        # has handed it the last records (it ends when its stdin closes)
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        self._pipe = self._process.stdin.fileno()
        self._report = self._process.stdout.fileno()
        os.set_blocking(self._pipe, False)
        os.set_blocking(self._report, False)
        with contextlib.suppress(OSError, AttributeError):
            import fcntl

            fcntl.fcntl(self._pipe, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self._report_tail = b""
        self._running = (0, 0, 0, 0)
        self._loop.add_reader(self._report, self._on_report)
        for channel in recorder.channels.values():
            channel.names_sent = 0  # a new writer knows no key names

    def send(self, batch: Batch) -> bool:
        """Queue a batch for the pipe; False (shed) when `max_pending` batches wait already,
        or the writer died and is not running again yet."""
        if len(self._pending) >= self.max_pending:
            return False
        if self._loop is not None and self._pipe < 0:
            return False
        was_idle = not self._pending
        self._pending.append((len(batch), deque(batch.frame())))
        if was_idle and self._pipe >= 0:
            self._drain()
            if self._pending and self._loop is not None:
                self._loop.add_writer(self._pipe, self._drain)
        return True

    def _drain(self) -> None:
        """Write into the pipe what it takes now (called again when it has room)."""
        pending = self._pending
        try:
            while pending:
                _, chunks = pending[0]
                while chunks:
                    chunk = chunks[0]
                    written = os.write(self._pipe, chunk)
                    if written < len(chunk):
                        chunks[0] = chunk[written:]
                        return
                    chunks.popleft()
                pending.popleft()  # its columns go back to the scanners' buffer
        except BlockingIOError:
            return
        except OSError as err:  # BrokenPipeError: the writer died; `check` restarts it
            log.warning("route-record writer pipe: %s", err)
            self._stop_writing()
            return
        self._stop_writing()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _stop_writing(self) -> None:
        if self._loop is not None and self._pipe >= 0:
            self._loop.remove_writer(self._pipe)

    def _on_report(self) -> None:
        """The writer's counter lines (cumulative for its life): the last whole one counts."""
        try:
            data = os.read(self._report, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the writer closed its stdout: it is ending
            assert self._loop is not None
            self._loop.remove_reader(self._report)
            if self._finished is not None and not self._finished.done():
                self._finished.set_result(None)
            return
        lines = (self._report_tail + data).split(b"\n")
        self._report_tail = lines.pop()
        if lines:
            written, failed, files, cpu_ns = (int(v) for v in lines[-1].split())
            self._running = (written, failed, files, cpu_ns)
            self._publish()

    def _publish(self) -> None:
        ended, running = self._ended, self._running
        stats = self.stats
        stats.written = ended[0] + running[0]
        stats.files = ended[2] + running[2]
        stats.writer_cpu_ns = ended[3] + running[3]
        failed = ended[1] + running[1]
        stats.shed += failed - self._failed_counted
        self._failed_counted = failed

    def check(self) -> None:
        """Start the writer again if it died (at most every RESTART_SECONDS); what it had
        not taken is shed."""
        process = self._process
        if process is None or process.poll() is None:
            return
        if self._pipe >= 0:
            log.error("route-record writer exited with %s; restarting it", process.returncode)
            self._close_pipes()
            self.stats.shed += sum(records for records, _ in self._pending)
            self._pending.clear()
        started = self._started_at
        if started is None or self.monotonic() - started >= self.restart_seconds:
            self._spawn()

    def _close_pipes(self) -> None:
        assert self._loop is not None
        assert self._process is not None
        self._stop_writing()
        self._loop.remove_reader(self._report)
        ended, running = self._ended, self._running
        self._ended = (
            ended[0] + running[0],
            ended[1] + running[1],
            ended[2] + running[2],
            ended[3] + running[3],
        )
        self._running = (0, 0, 0, 0)
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()
        self._pipe = self._report = -1

    async def close(self) -> None:
        """Hand the writer what is queued, let it finish its files, and wait for it."""
        process, loop = self._process, self._loop
        if process is None or loop is None:
            self.stats.shed += sum(records for records, _ in self._pending)
            self._pending.clear()
            return
        self.check()
        try:
            if self._pending and self._pipe >= 0:
                self._drained = loop.create_future()
                await asyncio.wait_for(self._drained, CLOSE_TIMEOUT)
            if self._pipe >= 0:
                self._finished = loop.create_future()
                self._stop_writing()
                assert process.stdin is not None
                process.stdin.close()  # end of batches: the writer closes its files and exits
                self._pipe = -1
                await asyncio.wait_for(self._finished, CLOSE_TIMEOUT)
        except TimeoutError:
            log.error("route-record writer did not finish in %.0f s; killed", CLOSE_TIMEOUT)
            process.kill()
        finally:
            self.stats.shed += sum(records for records, _ in self._pending)
            self._pending.clear()
            process.wait(CLOSE_TIMEOUT)  # it closed its stdout: it is exiting
            if process.stdout is not None:
                process.stdout.close()
            if process.stdin is not None:
                process.stdin.close()
            self._process = None
