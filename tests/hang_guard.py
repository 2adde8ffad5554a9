"""A failing or stuck test must fail, never hang the run (registered by conftest.py).

Why pytest-timeout alone did not do it (its default method is SIGALRM, which raises
`Failed` in whatever Python code runs when the alarm fires):

1. An async test stuck in an `await` leaves the event loop idle in epoll. The alarm then runs
   inside the loop's signal callback, and the loop catches what a callback raises (`Failed` is a
   BaseException, which asyncio and uvloop log and swallow): the test never stops. So every
   coroutine test runs under `asyncio.timeout`, due at the test's timeout counted from its
   start (`pytest_runtest_call`), which cancels the stuck await and fails the test where it was
   stuck. Its alarm is moved `ALARM_LAG` later (`pytest_collection_modifyitems`): an alarm that
   lands inside the loop's timer callback aborts that callback, and when it was the timeout's,
   nothing cancels the test any more. The alarm stays as the fallback for a coroutine stuck in
   a synchronous call, where it does raise inside the test.
2. A test that fails before closing its sockets leaves transports open when the loop closes.
   uvloop's `close()` walks the open handles to close them, warning `ResourceWarning` for each;
   `filterwarnings = error` turns that warning into an exception, which the (noexcept) walk
   swallows before closing the handle, and uvloop then runs libuv until nothing is open, which
   is forever, without the GIL, where no alarm can reach. So the loop the tests run on
   (`new_event_loop`) closes with warnings recorded and raises them afterwards: a leak still
   fails the test, at teardown, after everything was closed.
3. Anything else blocked where neither reaches (a C call, a thread join, a teardown after the
   one alarm was spent on the call): a watchdog thread per test (`pytest_runtest_protocol`),
   armed for the test's timeout plus `GRACE`, prints every thread's stack, kills the processes
   the run started and exits the run with status 1. A lost run is bad; a CI job hanging until
   its own limit is worse.

The Spark session some test modules hold is not involved: these hangs reproduce without it.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import inspect
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
import uvloop

#: how long after its timeout a coroutine test gets pytest-timeout's alarm (point 1)
ALARM_LAG = 15.0
#: how long after its timeout a test may still run (teardown included) before the watchdog ends
#: the run: relay processes get `processes.GRACE` (10 s) to exit after SIGTERM, then are killed.
#: RMB_TEST_HANG_GRACE overrides it (the guard's own test, which cannot wait a minute)
GRACE = float(os.environ.get("RMB_TEST_HANG_GRACE", "60"))


class _Loop(uvloop.Loop):
    """uvloop's loop, whose `close()` cannot be stopped halfway by a warning (point 2)."""

    def close(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().close()
        # now that everything is closed, warn again: a leak still fails the test (one warning
        # naming every resource left open)
        leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        for warning in caught:
            if not issubclass(warning.category, ResourceWarning):
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
        if leaks:
            warnings.warn(
                f"the event loop closed with {len(leaks)} resource(s) open: " + "; ".join(leaks),
                ResourceWarning,
                stacklevel=2,
            )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop every async test runs on: uvloop, as in production."""
    return _Loop()


#: an item's own limit, before the alarm was moved (point 1), and when it started
_LIMIT = pytest.StashKey[float]()
_STARTED = pytest.StashKey[float]()


def timeout_of(item: pytest.Item) -> float:
    """The item's pytest-timeout limit in seconds (its marker, else --timeout, else the ini
    value); 0 when it has none or pytest-timeout is not loaded."""
    if _LIMIT in item.stash:
        return item.stash[_LIMIT]
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    else:
        try:
            value = item.config.getoption("timeout")
            if value is None:
                value = item.config.getini("timeout")
        except ValueError:  # pytest-timeout not loaded
            return 0.0
    try:
        return max(0.0, float(value or 0))
    except (TypeError, ValueError):
        return 0.0


def _is_coroutine_test(item: pytest.Item) -> bool:
    return inspect.iscoroutinefunction(getattr(item, "obj", None))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Point 1: a coroutine test's alarm comes `ALARM_LAG` after its own timeout."""
    for item in items:
        limit = timeout_of(item)
        if limit and _is_coroutine_test(item):
            item.stash[_LIMIT] = limit
            item.add_marker(pytest.mark.timeout(limit + ALARM_LAG), append=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, Any, Any]:
    """Point 3: the watchdog, for setup, call and teardown together."""
    item.stash[_STARTED] = time.monotonic()
    limit = timeout_of(item)
    if not limit:
        return (yield)
    watchdog = threading.Timer(limit + GRACE, _abort, (item, limit))
    watchdog.daemon = True
    watchdog.start()
    try:
        return (yield)
    finally:
        watchdog.cancel()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Point 1: a coroutine test is cancelled at its timeout (counted from its setup)."""
    test = getattr(item, "obj", None)
    limit = timeout_of(item)
    if not limit or not inspect.iscoroutinefunction(test):
        return (yield)
    remaining = limit - (time.monotonic() - item.stash.get(_STARTED, time.monotonic()))

    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                return await test(*args, **kwargs)
        except TimeoutError as err:
            raise TimeoutError(f"test still running after its timeout of {limit:g} s") from err

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(item, "obj", bounded)  # what pytest-asyncio runs on the loop
        return (yield)


def _abort(item: pytest.Item, limit: float) -> None:
    """Runs in the watchdog thread while the main thread is stuck: say so where the run's
    output goes (capture suspended, what it held shown), dump every stack, exit."""
    terminal = item.config.get_terminal_writer()
    try:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        captured = ("", "")
        if capture is not None:
            capture.suspend_global_capture(item)
            captured = capture.read_global_capture()
        terminal.sep("+", "hang guard")
        terminal.write(
            f"{item.nodeid} is still running {limit + GRACE:g} s after it started (its timeout "
            f"is {limit:g} s): blocked where no timeout reaches. Every thread's stack follows; "
            "then the processes this run started are killed and the run exits.\n"
        )
        for name, text in zip(("stdout", "stderr"), captured, strict=True):
            if text:
                terminal.sep("~", f"captured {name}")
                terminal.write(text)
        terminal.flush()
        sys.stdout.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _kill_children(os.getpid(), terminal.write)
        terminal.sep("+", "hang guard")
    finally:
        terminal.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _kill_children(parent: int, say: Callable[[str], object]) -> None:
    """SIGKILL every process whose parent is `parent`, and theirs (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pending = list(children.get(parent, ()))
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, ()))
        try:
            os.kill(pid, signal.SIGKILL)
            say(f"killed process {pid}\n")
        except OSError:
            pass
