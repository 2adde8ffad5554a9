"""Stopping background tasks in bounded time (`rmb_relay.tasks`), and the Python 3.11 behaviour
that makes it necessary: `asyncio.wait_for` loses a cancellation that comes in the same loop
turn as its result (redis-py sends every command through `wait_for`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from rmb_relay.tasks import cancel_and_wait
from tests.conftest import WAIT


async def test_wait_for_loses_a_cancellation_that_comes_with_its_result_before_3_12() -> None:
    loop = asyncio.get_running_loop()
    sent: asyncio.Future[str] = loop.create_future()

    async def send_a_command() -> str:
        return await asyncio.wait_for(sent, WAIT)  # what redis-py does around each send

    task = loop.create_task(send_a_command())
    await asyncio.sleep(0)  # it waits inside wait_for
    sent.set_result("sent")
    task.cancel()  # the same loop turn
    await asyncio.wait([task], timeout=WAIT)
    if sys.version_info < (3, 12):
        assert task.result() == "sent"  # carried on: the cancellation is gone
    else:
        assert task.cancelled()


async def test_cancel_and_wait_stops_a_task_that_lost_its_cancellation() -> None:
    lost = []

    async def reader() -> None:
        while True:  # a read loop whose first cancellation was lost (above)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(True)

    task = asyncio.get_running_loop().create_task(reader())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, WAIT)
    assert task.cancelled()
    assert lost == [True]


async def test_cancel_and_wait_gives_up_on_a_task_that_never_stops() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    assert not await cancel_and_wait(task, 0.3)
    assert not task.done()
    release.set()
    await asyncio.wait([task], timeout=WAIT)
    assert task.done()


async def test_cancel_and_wait_on_nothing_or_an_ended_task() -> None:
    assert await cancel_and_wait(None, WAIT)

    async def done() -> int:
        return 1

    task = asyncio.get_running_loop().create_task(done())
    await task
    assert await cancel_and_wait(task, WAIT)
