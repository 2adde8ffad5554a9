"""The relay's side of the route-record writer process (telemetry/record_process.py): the
shared-memory arena the columns travel in, and the pipe they fall back to."""

from __future__ import annotations

import mmap
from pathlib import Path

from rmb_relay._core import Column, RecordBuffer
from rmb_relay.telemetry.record_process import Arena
from rmb_relay.telemetry.record_schema import read_table
from rmb_relay.telemetry.records import Recorder
from tests.helpers import FakeClock

T0 = 1_700_002_000 * 1_000_000_000


def columns(count: int, first: int = 0) -> list[Column]:
    """`count` records' four columns (32 bytes a record) as the scanners hand them over."""
    buffer = RecordBuffer()
    for i in range(first, first + count):
        buffer.push(T0 + i * 1000, i, i, i)
    time_us, src, dst, size, _ = buffer.take()
    return [time_us, src, dst, size]


def test_batches_are_placed_one_after_the_other_and_their_bytes_are_shared() -> None:
    arena = Arena(320)  # ten records
    try:
        assert arena.place(columns(3)) == 0
        assert arena.place(columns(2, first=3)) == 96
        # what the writer maps: time, src, dst, size of the second batch, one after the other
        view = mmap.mmap(arena.fd, 320, access=mmap.ACCESS_READ)
        src = int.from_bytes(view[96 + 16 : 96 + 24], "little", signed=True)
        assert src == 3
        view.close()
    finally:
        arena.close()


def test_released_regions_are_reused_after_wrapping_and_a_full_arena_says_so() -> None:
    arena = Arena(320)
    try:
        assert arena.place(columns(4)) == 0
        assert arena.place(columns(4)) == 128
        assert arena.place(columns(4)) is None  # 64 bytes left at the end, 0 at the start
        arena.release(1)
        assert arena.place(columns(4)) == 0  # wrapped into what the writer released
        assert arena.place(columns(1)) is None  # between newest (ends at 128) and oldest (128)
        assert len(arena) == 2
        arena.release(2)
        assert len(arena) == 0
        assert arena.place(columns(10)) == 0  # empty: from the start, all of it
        assert arena.place(columns(11)) is None
    finally:
        arena.close()


async def test_a_batch_larger_than_the_arena_goes_through_the_pipe(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, "r", clock=FakeClock(T0), arena_bytes=64)
    recorder.start()
    rmb = recorder.channel("rmb")
    for i in range(100):  # 3,200 bytes of columns: through the pipe
        rmb.native.push(T0 + i * 1000, 1, 2, i)
    recorder.flush()
    rmb.native.push(T0 + 10**9, 3, 4, 5)  # 32 bytes: through the arena
    await recorder.close()
    rows = read_table(tmp_path).sort_by("time").to_pylist()
    assert [r["size"] for r in rows] == [*range(100), 5]
    assert (rows[-1]["src"], rows[-1]["dst"]) == ("3", "4")
    assert recorder.stats.written == 101
