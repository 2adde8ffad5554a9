"""The relay's side of the route-record writer process (record_writer.py is the other side):
starting it, handing it batches, reading what it reports, restarting it if it dies.

Theory of operation
-------------------
The writer is a child process so that the relay stays single-threaded (records.py says why).
A batch reaches it in two parts:

- its columns (32 bytes a record) are copied into the **arena**, shared memory (a memfd both
  processes map) used as a ring of batch regions. The pipe this replaced cost the writer ~7 ns
  a record to read out of (measured); a copy into memory both sides have mapped costs the relay
  about what writing into the pipe did, and the writer nothing. A batch that does not fit (the
  writer fell behind by more than the arena holds) sends its columns through the pipe instead;
- a frame on the writer's stdin pipe: the two lengths, the header (Batch.header: the
  dialect, the rare full records, new key names, where the columns are in the arena) and any
  columns not in the arena. The pipe is non-blocking: the event loop writes what it takes and
  the rest when it has room. `max_pending` frames waiting mean the writer fell behind: further
  batches are shed (the caller counts them).

The writer reports after each batch, on its stdout, its cumulative counters: records written,
records it failed to write, files, CPU ns spent on batches, and arena batches it is done with,
whose regions the ring then reuses. When it dies the next `check` counts what it had not taken
as shed and starts a new one (at most every `restart_seconds`), with a new arena.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import pickle
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rmb_relay._core import Column

log = logging.getLogger("rmb_relay.records")

#: a writer that died is started again at most this often (its batches meanwhile are shed)
RESTART_SECONDS = 5.0
#: how long `close` waits for the writer to take what is queued and finish its files
CLOSE_TIMEOUT = 60.0
#: the writer's pipe is asked to hold this much (Linux caps it at fs.pipe-max-size, 1 MiB by
#: default): a frame that does not fit the arena goes in a few writes, not one per 64 KiB
PIPE_SIZE = 1 << 20
#: shared memory for the columns of batches on their way to the writer: two flushes' worth at
#: 500,000 records a second (the writer takes a batch within milliseconds; pages are only
#: allocated where written)
ARENA_BYTES = 16 << 20
#: a frame's lengths (header, payload): see record_writer.py
FRAME = struct.Struct("<II")

#: any record but the hot path's: (time_ns, src, dst, size, route, outcome, reason, relay_ns,
#: remote)
FullRecord = tuple[int, Any, Any, int, str, str, str | None, int | None, str | None]


@dataclass(slots=True)
class Batch:
    """One flush of one channel, as the writer process is sent it."""

    dialect: str
    weight: float
    #: the rate the writer samples `columns` at (1: sampled here already, or not sampling)
    sample: float
    #: hot-path records in `columns`
    rows: int
    #: the hot path's columns (time_us, src, dst, size; int64 bytes), or None
    columns: Sequence[Column | memoryview] | None
    full: list[FullRecord]
    #: SBD key names from id `names_offset` on, which the writer does not have yet
    names_offset: int
    names: list[str]

    def __len__(self) -> int:
        return self.rows + len(self.full)

    def header(self, offset: int | None) -> bytes:
        """What the writer reads before the columns (record_writer.py); `offset`: where the
        columns are in the shared arena, None when they follow in the pipe."""
        return pickle.dumps(
            (
                self.dialect,
                self.weight,
                self.sample,
                self.rows,
                self.full,
                self.names_offset,
                self.names,
                offset,
            ),
            protocol=pickle.HIGHEST_PROTOCOL,
        )


class RecordStats:
    """Counters read by /metrics (plain ints, bumped on the event loop)."""

    __slots__ = ("files", "shed", "writer_cpu_ns", "written")

    def __init__(self) -> None:
        self.written = 0
        self.shed = 0
        self.files = 0
        #: CPU time of the writer process (what recording costs besides the scanners' append)
        self.writer_cpu_ns = 0


class Arena:
    """Shared memory holding the columns of the batches the writer has not finished, as a
    ring of regions in the order they were placed."""

    def __init__(self, size: int = ARENA_BYTES) -> None:
        self.size = size
        self.fd = os.memfd_create("rmb-records", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        #: (start, end) of each region the writer has not released, oldest first
        self._regions: deque[tuple[int, int]] = deque()

    def place(self, columns: Sequence[Column | memoryview]) -> int | None:
        """Copy the columns one after the other into a free region; its offset, or None if
        no region of that size is free."""
        views = [memoryview(column) for column in columns]
        start = self._free(sum(len(view) for view in views))
        if start is None:
            return None
        position = start
        for view in views:
            self._map[position : position + len(view)] = view
            position += len(view)
        self._regions.append((start, position))
        return start

    def _free(self, need: int) -> int | None:
        regions = self._regions
        if not regions:
            return 0 if need <= self.size else None
        first, last = regions[0][0], regions[-1]
        if last[0] < first:  # wrapped: the free space is between the newest and the oldest
            return last[1] if last[1] + need <= first else None
        if last[1] + need <= self.size:
            return last[1]
        return 0 if need <= first else None

    def release(self, count: int) -> None:
        """The writer is done with the `count` oldest regions."""
        for _ in range(min(count, len(self._regions))):
            self._regions.popleft()

    def __len__(self) -> int:
        """Regions in use."""
        return len(self._regions)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class WriterProcess:
    """See the module docstring. `started` is called whenever a (new) writer starts."""

    def __init__(
        self,
        directory: Path,
        instance: str,
        roll_seconds: float,
        stats: RecordStats,
        started: Callable[[], None],
        *,
        max_pending: int,
        restart_seconds: float,
        monotonic: Callable[[], float],
        arena_bytes: int = ARENA_BYTES,
    ) -> None:
        self.directory = directory
        self.instance = instance
        self.roll_seconds = roll_seconds
        self.stats = stats
        self.started = started
        self.max_pending = max_pending
        self.restart_seconds = restart_seconds
        self.monotonic = monotonic
        self.arena_bytes = arena_bytes
        #: frames not yet wholly in the pipe (the first one maybe in part): (records, chunks)
        self._pending: deque[tuple[int, deque[memoryview]]] = deque()
        self._arena: Arena | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pipe = -1
        self._report = -1
        self._report_tail = b""
        #: (written, failed, files, cpu_ns, released) of the writers that ended, and of the
        #: running one
        self._ended = (0, 0, 0, 0)
        self._running = (0, 0, 0, 0, 0)
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
        self._arena = Arena(self.arena_bytes)
        command = [
            sys.executable,
            "-m",
            "rmb_relay.telemetry.record_writer",
            str(self.directory),
            self.instance,
            repr(self.roll_seconds),
            str(self._arena.fd),
            str(self._arena.size),
        ]
        # its own session: a Ctrl-C to the relay's terminal must not kill it before the relay
        # has handed it the last records (it ends when its stdin closes)
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(self._arena.fd,),
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
        self._running = (0, 0, 0, 0, 0)
        self._loop.add_reader(self._report, self._on_report)
        self.started()

    def send(self, batch: Batch) -> bool:
        """Queue a batch for the writer; False (shed) when `max_pending` frames wait already,
        or the writer died and is not running again yet."""
        if len(self._pending) >= self.max_pending:
            return False
        if self._loop is not None and self._pipe < 0:
            return False
        offset = None
        columns: list[memoryview] = []
        if batch.columns is not None:
            if self._arena is not None:
                offset = self._arena.place(batch.columns)
            if offset is None:
                columns = [memoryview(column) for column in batch.columns]
        header = batch.header(offset)
        lengths = FRAME.pack(len(header), sum(len(c) for c in columns))
        was_idle = not self._pending
        chunks = deque([memoryview(lengths), memoryview(header), *columns])
        self._pending.append((len(batch), chunks))
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
            written, failed, files, cpu_ns, released = (int(v) for v in lines[-1].split())
            if self._arena is not None:
                self._arena.release(released - self._running[4])
            self._running = (written, failed, files, cpu_ns, released)
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
        """Start the writer again if it died (at most every `restart_seconds`); what it had
        not taken is shed."""
        process = self._process
        if process is None or process.poll() is None:
            return
        if self._pipe >= 0:
            log.error("route-record writer exited with %s; restarting it", process.returncode)
            self._close_pipes()
            self._shed_pending()
        started = self._started_at
        if started is None or self.monotonic() - started >= self.restart_seconds:
            self._spawn()

    def _shed_pending(self) -> None:
        self.stats.shed += sum(records for records, _ in self._pending)
        self._pending.clear()

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
        self._running = (0, 0, 0, 0, 0)
        self._pipe = self._report = -1
        self._release(self._process)

    def _release(self, process: subprocess.Popen[bytes]) -> None:
        """Close our ends of the writer's pipes and our map of the arena."""
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    async def close(self) -> None:
        """Hand the writer what is queued, let it finish its files, and wait for it."""
        process, loop = self._process, self._loop
        if process is None or loop is None:
            self._shed_pending()
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
            self._shed_pending()
            process.wait(CLOSE_TIMEOUT)  # it closed its stdout: it is exiting
            self._release(process)
            self._process = None
