"""The outbound queue's hand-over to workers (federation/queue.py): a woken worker takes every
envelope ready, so a burst goes out in one batch instead of one envelope per worker."""

from __future__ import annotations

import asyncio

from rmb_relay.federation.queue import MemoryQueue
from tests.conftest import WAIT


async def test_one_woken_worker_takes_everything_ready() -> None:
    queue = MemoryQueue(100)
    first = asyncio.create_task(queue.get_many(10))
    second = asyncio.create_task(queue.get_many(10))
    await asyncio.sleep(0)  # both wait (a yield to let them start, not a timing assumption)
    for n in range(5):
        await queue.put(b"%d" % n)
    items = await asyncio.wait_for(first, WAIT)
    assert [item.data for item in items] == [b"0", b"1", b"2", b"3", b"4"]
    assert not second.done()  # only one worker was woken for the burst
    await queue.put(b"5")
    assert [item.data for item in await asyncio.wait_for(second, WAIT)] == [b"5"]
    assert queue.depth() == 6
    await queue.done_many(items)
    assert queue.depth() == 1


async def test_what_a_worker_leaves_wakes_the_next() -> None:
    queue = MemoryQueue(100)
    first = asyncio.create_task(queue.get_many(2))
    second = asyncio.create_task(queue.get_many(2))
    await asyncio.sleep(0)
    for n in range(3):
        await queue.put(b"%d" % n)
    assert len(await asyncio.wait_for(first, WAIT)) == 2
    assert [item.data for item in await asyncio.wait_for(second, WAIT)] == [b"2"]


async def test_a_worker_cancelled_after_its_wake_up_passes_it_on() -> None:
    queue = MemoryQueue(100)
    first = asyncio.create_task(queue.get_many(10))
    second = asyncio.create_task(queue.get_many(10))
    await asyncio.sleep(0)
    await queue.put(b"x")  # wakes `first`, which is cancelled before it runs
    first.cancel()
    assert [item.data for item in await asyncio.wait_for(second, WAIT)] == [b"x"]
