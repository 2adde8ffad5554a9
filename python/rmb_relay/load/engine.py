"""One load run, whatever the dialect: pacing, windows, the latency recorder, generator
processes, live progress, and what a run ends with (a summary, a JSON file, Parquet samples).

Every generator (`rmb`, `sbd`, `singyeong`, `tunnel`, `peer`) is a `Workload` of `Stream`s. A
stream is one independent sequence of messages: an RMB pair, a 신경 sender, one HTTP keep-alive
connection, one msgbus client. The engine owns what is the same for all of them, once:

- pacing (`Pacer`, woken by one `Timer` per process to the microsecond): `--rate` shared by
  the streams of a run, each message at its own time (`--arrivals even` or `poisson`), or
  saturation (a stream sends whenever its window has room);
- the window: at most `--window` messages of a stream in flight (`Stream.in_flight`);
- the latency recorder (`Run.recorder`, `_core.LoadRecorder`, rust/load.rs): every delivery's
  latency, bytes and second, duplicates per stream and, with `--samples`, its row. RMB and SBD
  receivers record inside the websocket decoder's one call per read (`_core.StampScanner`);
  the others through `Run.delivered`, into the same recorder;
- the stop: `--duration` seconds after `--warmup`, or `--count` messages per stream, then a
  bounded drain of what is still in flight;
- `--procs` generator processes (spawned, each on uvloop) whose counters and samples merge;
- refusals: a workload raises `Refused` naming what failed (the relay, the tenant secret, the
  peer's Redis, the 신경 password); the run stops, reports what it measured until then and the
  command exits 2.

The generator processes report their progress through a shared array the parent reads for the
live line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import heapq
import importlib
import itertools
import multiprocessing
import os
import random
import resource
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rmb_relay._core import LoadRecorder
from rmb_relay.load.stats import RunStats

if TYPE_CHECKING:
    from rmb_relay._core import StampScanner, WsDecoder, WsEvent

#: messages written per batch (one transport write): half the default window, the most a
#: stream's window frees before its sender wakes (`Stream.settled`), so a refill is one write
BATCH = 128
#: how long to wait for in-flight messages after the streams stop sending
DRAIN_TIMEOUT = 5.0
#: how often a generator process publishes its counters (and checks its deadline)
TICK = 0.25


class Refused(Exception):
    """Something the run cannot go on without failed or refused: one line naming it."""


@dataclass(frozen=True)
class Plan:
    """What every workload of a run shares (one process's view: `rate` is its share)."""

    dialect: str
    size: int
    rate: float  # messages/s over this process's streams; 0 = as fast as the windows allow
    window: int
    duration: float | None
    count: int | None  # messages per stream
    warmup: float
    record_samples: bool
    arrivals: str = "even"


#: how paced streams space their messages (`--arrivals`)
ARRIVALS = ("even", "poisson")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Timer:
    """Wakes paced streams at their send times to the microsecond: one `timerfd` (Linux,
    CLOCK_MONOTONIC) armed for the earliest pending wakeup and watched by the loop like a
    socket. The loop's own timers run on a millisecond clock: every send due within a
    millisecond would leave in the same loop turn, so 64 streams at 7,000 messages/s would
    arrive as bursts of ~7 each millisecond instead of one every ~140 us, and the latency
    measured would be the queueing of that burst."""

    TFD_TIMER_ABSTIME = 1
    CLOCK_MONOTONIC = 1

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.timerfd_create(self.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.fd = fd
        self.loop = loop
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._armed = 0.0
        loop.add_reader(fd, self._fire)

    def at(self, when: float) -> asyncio.Future[None]:
        """A future done at `when` (time.monotonic() seconds)."""
        future = self.loop.create_future()
        heapq.heappush(self._heap, (when, next(self._seq), future))
        if self._heap[0][0] == when and when != self._armed:
            self._arm(when)
        return future

    def _arm(self, when: float) -> None:
        self._armed = when
        spec = _Itimerspec()
        seconds = int(when)
        spec.it_value.tv_sec = seconds
        spec.it_value.tv_nsec = max(1, int((when - seconds) * 1e9))
        self._libc.timerfd_settime(self.fd, self.TFD_TIMER_ABSTIME, ctypes.byref(spec), None)

    def _fire(self) -> None:
        with contextlib.suppress(BlockingIOError):  # read already, or not yet due
            os.read(self.fd, 8)
        heap, now = self._heap, time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, future = heapq.heappop(heap)
            if not future.done():
                future.set_result(None)
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        os.close(self.fd)
        for _, _, future in self._heap:
            future.cancel()


class Pacer:
    """When a stream's messages are due at `rate` messages/s (0: always). `even` spaces them
    1/rate apart, the streams' phases spread by `offset`; `poisson` draws exponential gaps of
    mean 1/rate, so the streams together are a Poisson stream. A stream that falls behind
    (its window full) sends what is due at once when it can: the schedule is not stretched."""

    def __init__(
        self,
        rate: float,
        timer: Timer | None = None,
        arrivals: str = "even",
        offset: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.rate = rate
        self.timer = timer
        self.poisson = arrivals == "poisson"
        self.rng = rng or random.Random(13)
        self.next_at = time.monotonic() + offset
        #: messages whose time has come and that have not gone out yet
        self.owed = 0

    def _gap(self) -> float:
        return self.rng.expovariate(self.rate) if self.poisson else 1 / self.rate

    def due(self) -> int:
        """How many messages may go now (a large number when unpaced)."""
        if self.rate <= 0:
            return 1 << 62
        now = time.monotonic()
        while self.next_at <= now and self.owed < 1 << 20:
            self.owed += 1
            self.next_at += self._gap()
        return self.owed

    def took(self, n: int) -> None:
        if self.rate > 0:
            self.owed = max(0, self.owed - n)

    async def wait(self) -> None:
        """Until the next message is due."""
        if self.timer is not None:
            await self.timer.at(self.next_at)
        else:
            await asyncio.sleep(max(0.0, self.next_at - time.monotonic()))


class Run:
    """One process's run state and its latency recorder."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.stats = RunStats()
        self.stopping = False
        #: every delivery of this process: counts per stream, duplicates, latencies, the
        #: timeline and (with --samples) the (send time, stream, latency) rows
        self.recorder = LoadRecorder(plan.record_samples)
        #: set by `fail`: the first refusal or lost connection ends the run
        self.failed = asyncio.Event()

    def delivered(
        self,
        stream: Stream,
        sent_ns: int,
        now_ns: int,
        size: int,
        seq: int | None = None,
        copy: int = 0,
    ) -> None:
        """A message (or one fan-out copy: `copy` says which receiver) arrived: record it, and
        its latency while measuring; a second arrival of `seq` counts as a duplicate only."""
        if self.recorder.record(stream.index, sent_ns, now_ns, size, seq, copy) and stream.waiting:
            stream.settled()

    def samples(self) -> bytes | None:
        """The (send time ns, stream, latency ns) int64 triples with --samples."""
        return self.recorder.samples()

    def collect(self) -> None:
        """The recorder's figures into `stats` (at the end of the process's run)."""
        recorder, stats = self.recorder, self.stats
        stats.measured = recorder.measured
        stats.bytes_delivered = recorder.bytes_delivered
        stats.duplicated = recorder.duplicated
        if recorder.out_of_range:
            stats.error("stamp out of range", recorder.out_of_range)
        stats.latencies_ns = array("q", recorder.latencies())
        stats.timeline = dict(enumerate(recorder.timeline))

    def refused(self, stream: Stream, reason: str, copies: int = 1) -> None:
        """The relay answered a message with an error: it will never arrive."""
        self.stats.error(reason)
        stream.refused += copies
        stream.settled()

    def fail(self, reason: str) -> None:
        """A refusal or a lost connection: the run stops with `reason` (exit code 2)."""
        if self.stats.fatal is None:
            self.stats.fatal = reason
        self.stopping = True
        self.failed.set()


class Stream:
    """One independent sequence of messages and its counters; subclasses write them."""

    #: copies a message is delivered as (a BROADCAST to N clients: N)
    fanout = 1

    def __init__(self, index: int, run: Run) -> None:
        self.index = index
        self.run = run
        self.sent = 0
        #: deliveries the relay refused (they leave the window like delivered ones)
        self.refused = 0
        self.wakeup = asyncio.Event()
        #: the sender waits for its window (only then do deliveries check whether to wake it)
        self.waiting = False
        #: saturating (no pacer, no --count): a delivery that frees half the window writes
        #: the next batch itself (`refill`) instead of waking the sender's task
        self.refills = False

    @property
    def delivered(self) -> int:
        """Deliveries (fan-out copies count one each), from the run's recorder."""
        return self.run.recorder.delivered(self.index)

    def in_flight(self) -> int:
        """Messages sent and not yet settled (a fan-out message until its last copy)."""
        open_copies = self.sent * self.fanout - self.delivered - self.refused
        return -(-open_copies // self.fanout)

    def settled(self) -> None:
        in_flight, run = self.in_flight(), self.run
        if in_flight > run.plan.window // 2 and not run.stopping:
            return
        if self.refills and not run.stopping and self.refill(run.plan.window - in_flight):
            return
        self.waiting = False
        self.wakeup.set()

    def refill(self, n: int) -> bool:
        """Write `n` more messages now, from the delivery that freed the window (saturating
        runs: waking the sender's task for each batch, an event, a future and a loop turn,
        cost the generator more per message than the relay spent on it); False when the
        sender must take over (a congested socket to wait for, a stream that cannot write
        without waiting)."""
        if self.congested:
            return False
        try:
            went = self.write(min(n, BATCH))
        except (OSError, ConnectionError) as err:
            run = self.run
            run.fail(f"{run.plan.dialect}: stream {self.index} lost its connection: {err}")
            return False
        if went is None:
            return False
        self.sent += went
        return True

    def write(self, n: int) -> int | None:
        """Write up to `n` messages at once, numbered from `self.sent`, without waiting; None
        when this stream cannot (`send` then does)."""
        return None

    @property
    def congested(self) -> bool:
        """The stream's socket buffer is over its high-water mark (`send` waits for it)."""
        return False

    async def connect(self) -> None:
        """Open this stream's connections (raise `Refused` naming what refused)."""

    async def close(self) -> None:
        """Close them (also after a failed connect)."""

    async def send(self, n: int) -> int:
        """Write up to `n` messages, numbered from `self.sent`; return how many went out (the
        engine counts them)."""
        raise NotImplementedError

    def watch(self, closed: asyncio.Future[None], why: Callable[[], str]) -> None:
        """A connection of this stream that ends before the run stops ends the run (exit 2,
        with what was measured until then): a relay that drops a receiver would otherwise
        leave its sender waiting on a full window, the run passing with messages lost."""

        def ended(_: asyncio.Future[None]) -> None:
            run = self.run
            if not run.stopping:
                run.fail(f"{run.plan.dialect}: stream {self.index} lost its connection: {why()}")

        closed.add_done_callback(ended)

    async def send_loop(self, pacer: Pacer) -> None:
        plan, run = self.run.plan, self.run
        self.refills = pacer.rate <= 0 and plan.count is None
        while not run.stopping:
            if plan.count is not None and self.sent >= plan.count:
                break
            allowed = plan.window - self.in_flight()
            if pacer.rate > 0:
                due = pacer.due()
                if due <= 0:
                    await pacer.wait()
                    continue
                allowed = min(allowed, due)
            if plan.count is not None:
                allowed = min(allowed, plan.count - self.sent)
            if allowed <= 0:
                self.wakeup.clear()
                self.waiting = True
                await self.wakeup.wait()
                continue
            n = min(allowed, BATCH)
            try:
                went = await self.send(n)
                self.sent += went
                pacer.took(went)
            except (OSError, ConnectionError) as err:
                run.fail(f"{plan.dialect}: stream {self.index} lost its connection: {err}")
                return
            # no yield per batch: a full window (or the pacer) makes the sender wait, and a
            # loop turn per batch cost as much as the batch's Python; but a send that wrote
            # nothing must not spin
            if not went:
                await asyncio.sleep(0)


class Workload(Protocol):
    """A generator's streams in one process."""

    streams: list[Stream]

    async def connect(self) -> None:
        """Open every connection (raise `Refused` naming what refused)."""

    async def close(self) -> None: ...


class Streams:
    """A workload that is its streams: each connects and closes on its own."""

    def __init__(self, streams: list[Stream]) -> None:
        self.streams = streams

    async def connect(self) -> None:
        await asyncio.gather(*(stream.connect() for stream in self.streams))

    async def close(self) -> None:
        for stream in self.streams:
            await stream.close()


class Generator(Protocol):
    """A generator module: `rmb_relay.load.<dialect>`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def prepare(self, args: argparse.Namespace) -> contextlib.AbstractContextManager[list[Any]]:
        """Parent side, around the run (provision twins, start a target): one share per stream;
        raises ConfigError or Refused."""
        ...

    def workload(self, args: argparse.Namespace, shares: list[Any], run: Run) -> Workload: ...

    def describe(self, args: argparse.Namespace) -> dict[str, Any]:
        """The run's settings for the summary (JSON-able)."""
        ...


def generator(dialect: str) -> Generator:
    module: Any = importlib.import_module(f"rmb_relay.load.{dialect}")
    return module  # type: ignore[no-any-return]


async def run_process(
    workload: Workload, run: Run, progress: Callable[[int, int], None] | None = None
) -> RunStats:
    """Connect, send for the plan's duration or count, drain, close: one process's share."""
    plan, stats = run.plan, run.stats
    wall0, cpu0 = time.perf_counter(), _cpu()
    loop = asyncio.get_running_loop()
    streams = workload.streams
    timer: Timer | None = None
    try:
        try:
            await workload.connect()
        except Refused as err:
            run.fail(str(err))
        except (OSError, TimeoutError, ConnectionError) as err:
            run.fail(f"{plan.dialect}: connect failed: {err or type(err).__name__}")
        if run.stopping:
            return stats
        # what the connects made lives until the end: out of the cyclic GC's way, whose full
        # collections otherwise walk every client's objects again (6% of a 2,000-receiver
        # 신경 generator's samples)
        gc.freeze()
        rate = plan.rate / len(streams) if plan.rate > 0 and streams else 0.0
        if rate > 0:
            timer = Timer(loop)
            rng = random.Random(13)
            pacers = []
            for i in range(len(streams)):
                if plan.arrivals == "poisson":  # memoryless: stationary from the start
                    offset = rng.expovariate(rate)
                else:
                    offset = i / len(streams) / rate
                pacers.append(Pacer(rate, timer, plan.arrivals, offset, rng))
        else:
            pacers = [Pacer(0.0) for _ in streams]
        senders = [loop.create_task(s.send_loop(p)) for s, p in zip(streams, pacers, strict=True)]
        if plan.warmup > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.failed.wait(), plan.warmup)
        run.recorder.start_measuring(time.time_ns())
        measure_start = loop.time()
        deadline = measure_start + plan.duration if plan.duration else None
        while not run.stopping:
            if progress is not None:
                progress(sum(s.sent for s in streams), sum(s.delivered for s in streams))
            if deadline is not None and loop.time() >= deadline:
                break
            if all(task.done() for task in senders):
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.failed.wait(), TICK)
        run.stopping = True
        for stream in streams:
            stream.wakeup.set()
        await asyncio.gather(*senders, return_exceptions=True)
        stats.measure_seconds = loop.time() - measure_start
        await _drain(streams, run, loop)
        run.recorder.stop_measuring()
    finally:
        if timer is not None:
            timer.close()
        stats.sent = sum(s.sent for s in streams)
        stats.expected = sum(s.sent * s.fanout for s in streams)
        stats.delivered = sum(s.delivered for s in streams)
        stats.refused = sum(s.refused for s in streams)
        run.collect()
        if progress is not None:
            progress(stats.sent, stats.delivered)
        with contextlib.suppress(Exception):
            await workload.close()
        stats.wall_seconds = time.perf_counter() - wall0
        stats.cpu_seconds = _cpu() - cpu0
    return stats


async def _drain(streams: list[Stream], run: Run, loop: asyncio.AbstractEventLoop) -> None:
    """In-flight messages arrive after the streams stop; wait for them (bounded)."""
    if run.stats.fatal is not None:
        return
    drained = asyncio.Event()
    give_up = loop.time() + DRAIN_TIMEOUT

    def check() -> None:
        if all(s.in_flight() <= 0 for s in streams) or run.stats.fatal is not None:
            drained.set()
        elif loop.time() < give_up:
            loop.call_later(0.02, check)

    check()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- the parent: processes, progress, merge -----------------------------------------------

_shared: Any = None


def _init_child(shared: Any) -> None:
    global _shared
    _shared = shared


def _child(
    args: argparse.Namespace, plan: Plan, shares: list[Any], slot: int
) -> tuple[dict[str, Any], bytes | None]:
    """One generator process: its streams on uvloop; progress through shared counters."""
    import uvloop

    shared = _shared

    def progress(sent: int, delivered: int) -> None:
        shared[2 * slot] = sent
        shared[2 * slot + 1] = delivered

    results: list[tuple[dict[str, Any], bytes | None]] = []

    async def main() -> None:
        run = Run(plan)
        workload = generator(plan.dialect).workload(args, shares, run)
        stats = await run_process(workload, run, progress)
        results.append((stats.to_wire(), run.samples()))

    # the task's result stays None: asyncio.Runner checks its SIGINT handler with
    # signal.getsignal, which formats the repr of a partial holding the task, and a task's
    # repr holds its result's (a run's latencies: millions of ints formatted twice at exit)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    return results[0]


def _progress_line(shared: Any, procs: int, started: float) -> str:
    sent = sum(shared[2 * i] for i in range(procs))
    delivered = sum(shared[2 * i + 1] for i in range(procs))
    elapsed = time.monotonic() - started
    rate = delivered / elapsed if elapsed > 0 else 0
    return f"{elapsed:6.1f}s  sent {sent:>10,}  delivered {delivered:>10,}  ~{rate:>10,.0f} msg/s"


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _watched(named: dict[str, int]) -> Iterator[dict[str, float]]:
    """CPU seconds each process of `named` (the relay, a connector, peers) spends inside the
    block, by name."""
    spent: dict[str, float] = {}
    before = {}
    for name, pid in named.items():
        try:
            before[name] = (pid, process_cpu(pid))
        except OSError:
            raise Refused(f"--watch-pid {pid}: no such process") from None
    yield spent
    for name, (pid, cpu) in before.items():
        with contextlib.suppress(OSError):
            spent[name] = process_cpu(pid) - cpu


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run from the parsed command line: the summary (also written to --json)."""
    from rmb_relay.errors import ConfigError
    from rmb_relay.load.stats import summary

    if args.procs < 1 or args.window < 1:
        raise ConfigError("--procs and --window must be positive")
    if args.count is not None and args.count < 1:
        raise ConfigError("--count must be positive")
    if args.rate < 0:
        raise ConfigError("--rate must be >= 0 (0: as fast as the windows allow)")
    duration = args.duration if args.duration is not None or args.count else 10.0
    gen = generator(args.dialect)
    with gen.prepare(args) as streams:
        procs = max(1, min(args.procs, len(streams)))
        plan = Plan(
            dialect=args.dialect,
            size=args.size,
            rate=args.rate / procs,
            window=args.window,
            duration=duration,
            count=args.count,
            warmup=args.warmup,
            record_samples=args.samples is not None,
            arrivals=args.arrivals,
        )
        shares = [streams[i::procs] for i in range(procs)]
        named = {f"pid {pid}": pid for pid in args.watch_pid}
        named.update(getattr(args, "started", {}))  # processes the generator started
        with _watched(named) as watched:
            results = _run_processes(args, plan, shares)
        config = {
            "dialect": args.dialect,
            **gen.describe(args),
            "size": args.size,
            "rate": args.rate,
            "window": args.window,
            "duration": duration,
            "count": args.count,
            "procs": procs,
            "warmup": args.warmup,
            "arrivals": args.arrivals if args.rate else None,
        }
    merged = RunStats()
    samples = array("q")
    for wire, sample_bytes in results:
        merged.merge(RunStats.from_wire(wire))
        if sample_bytes:
            samples.frombytes(sample_bytes)
    result = summary(merged, config, watched)
    if args.samples is not None:
        write_samples(args.samples, samples, args.dialect, args.size)
    if args.json is not None:
        args.json.write_text(_json(result))
    return result


def _json(result: dict[str, Any]) -> str:
    import json

    return json.dumps(result, indent=2) + "\n"


def _run_processes(
    args: argparse.Namespace, plan: Plan, shares: list[list[Any]]
) -> list[tuple[dict[str, Any], bytes | None]]:
    procs = len(shares)
    context = multiprocessing.get_context("spawn")
    shared = context.Array("q", 2 * procs, lock=False)
    started = time.monotonic()
    with context.Pool(procs, initializer=_init_child, initargs=(shared,)) as pool:
        pending = [
            pool.apply_async(_child, (args, plan, share, slot)) for slot, share in enumerate(shares)
        ]
        live = None
        if not args.quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            live = Live("", refresh_per_second=4, transient=True, console=Console(stderr=True))
            live.start()
        try:
            while waiting := [p for p in pending if not p.ready()]:
                if live is not None:
                    live.update(_progress_line(shared, procs, started))
                waiting[0].wait(TICK)
        finally:
            if live is not None:
                live.stop()
        return [p.get() for p in pending]


def write_samples(path: Path, samples: array[int], dialect: str, size: int) -> None:
    """Per-message records: send time, stream, size, latency, outcome, dialect (the columns
    `rmb-analytics --samples` reads into its load_latency table)."""
    from rmb_relay.errors import ConfigError

    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError("--samples FILE.parquet needs pyarrow; use .jsonl") from None
        n = len(samples) // 3
        table = pa.table(
            {
                "timestamp_ns": pa.array(samples[0::3], pa.int64()),
                "pair": pa.array(samples[1::3], pa.int64()),
                "size": pa.array([size] * n, pa.int64()),
                "latency_ns": pa.array(samples[2::3], pa.int64()),
                "outcome": pa.array(["delivered"] * n, pa.string()),
                "dialect": pa.array([dialect] * n, pa.string()),
            }
        )
        pq.write_table(table, path)
        return
    import json

    with path.open("w") as out:
        for i in range(0, len(samples), 3):
            row = {
                "timestamp_ns": samples[i],
                "pair": samples[i + 1],
                "size": size,
                "latency_ns": samples[i + 2],
                "outcome": "delivered",
                "dialect": dialect,
            }
            out.write(json.dumps(row) + "\n")


class Settle:
    """What deliveries wake: `settle` (streams waiting for their window) runs once per event
    loop turn in which reads recorded deliveries, after them all. A 신경 generator's thousands
    of receivers each read one delivery at a time; checking the senders' windows after every
    read was a third of its Python per delivery."""

    def __init__(self, settle: Callable[[], None]) -> None:
        self.settle = settle
        self.pending = False
        self.loop = asyncio.get_running_loop()

    def ask(self) -> None:
        self.pending = True
        self.loop.call_soon(self._run)

    def _run(self) -> None:
        self.pending = False
        self.settle()


def record_in_feed(client: Any, stamps: StampScanner, settle: Settle) -> None:
    """From the next read on, `client`'s websocket decoder records the stamps of what it reads
    itself (`stamps`, rust/load.rs): one call into Rust per read, whatever the number of
    messages in it; `settle` (one for the connections whose deliveries settle the same
    streams) runs after the loop turn's reads."""
    now = time.time_ns

    def steady(decoder: WsDecoder, data: memoryview) -> list[WsEvent]:
        events = decoder.feed(data, now())
        if not settle.pending:
            settle.ask()
        return events

    def first(decoder: WsDecoder, data: memoryview) -> list[WsEvent]:
        decoder.set_scanner(stamps)
        client.on_data = steady
        return steady(decoder, data)

    hook: Callable[[WsDecoder, memoryview], list[WsEvent]] = first
    client.on_data = hook
