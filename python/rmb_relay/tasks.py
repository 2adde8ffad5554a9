"""Stopping a background task in bounded time, even when it lost its cancellation.

`task.cancel(); await task` is not enough on Python 3.11: `asyncio.wait_for` returns the
awaited result instead of raising `CancelledError` when the cancellation arrives in the same
loop turn as that result (fixed by 3.12's rewrite of `wait_for`). redis-py wraps the send of
every command in `wait_for` when a socket timeout is set, as ours always is, so a task
cancelled while it sends a command can go on as if nothing had happened: a reader looping on
XREADGROUP then reads forever, and whoever awaits it (a relay's shutdown) waits forever. This
was the relay that did not exit after SIGTERM (issue 11).

So `cancel_and_wait` cancels again, every `RECANCEL_INTERVAL`, until the task has ended or the
time is up; and loops that read should also check a stop flag of their own, so they end at the
next turn whatever happened to the cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("rmb_relay.tasks")

#: how long a cancelled task gets before it is cancelled again (a lost cancellation costs this)
RECANCEL_INTERVAL = 0.1
#: how long a service's close waits for each of its background tasks (the relay's own shutdown
#: deadline, `serve.ShutdownDeadline`, is the backstop behind it)
STOP_TIMEOUT = 2.0


async def cancel_and_wait(task: asyncio.Task[Any] | None, timeout: float) -> bool:
    """Cancel `task` (again while it runs on) and wait at most `timeout` seconds for it to
    end; True when it ended (its exception, if any, is retrieved and dropped), False when it
    still runs (logged). None is a task that already ended."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.warning("task %s did not stop within %.1f s of being cancelled", task, timeout)
            return False
        task.cancel()
        await asyncio.wait([task], timeout=min(RECANCEL_INTERVAL, remaining))
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s ended with an error", task, exc_info=task.exception())
    return True


async def finish_or_cancel(task: asyncio.Task[Any] | None, grace: float, timeout: float) -> bool:
    """Let `task` finish on its own for up to `grace` seconds (work worth completing, such as
    a last write), then `cancel_and_wait` it; True when it finished within the grace."""
    if task is None or (await asyncio.wait([task], timeout=grace))[0]:
        return True
    await cancel_and_wait(task, timeout)
    return False
