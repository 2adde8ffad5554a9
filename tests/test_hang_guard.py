"""A failing or stuck test fails and the run goes on, or at worst ends; it never hangs
(tests/hang_guard.py says why pytest-timeout alone let it hang). Each case runs pytest on a few
tests written here, with the project's conftest hooks, in a subprocess whose own bound is the
proof."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: far over what each run needs when nothing hangs (pytest start-up and a few seconds of tests),
#: far under a hang
RUN_BOUND = 90

CONFTEST = """
from tests.conftest import pytest_asyncio_loop_factories, pytest_configure  # noqa: F401
"""
INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
filterwarnings = error
timeout = {timeout}
"""


def run_pytest(directory: Path, tests: str, timeout: float, **env: str) -> tuple[int, str]:
    (directory / "conftest.py").write_text(CONFTEST)
    (directory / "pytest.ini").write_text(INI.format(timeout=timeout))
    (directory / "test_cases.py").write_text(textwrap.dedent(tests))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
         "-c", str(directory / "pytest.ini"), "--rootdir", str(directory), str(directory)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_BOUND,
        env={**os.environ, **env},
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_a_test_that_fails_with_sockets_open_fails_and_the_run_goes_on(tmp_path: Path) -> None:
    # before: uvloop's close ran forever on the handles a ResourceWarning-turned-error kept open
    code, out = run_pytest(
        tmp_path,
        """
        import asyncio

        async def test_leaks_a_connection():
            server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            await asyncio.open_connection("127.0.0.1", port)
            assert False, "fails before closing its connection"

        def test_next():
            pass
        """,
        timeout=60,
    )
    assert code == 1, out
    assert "fails before closing its connection" in out
    # the leak is still reported: as the guard's summary when uvloop's close warns (up to
    # uvloop 0.22), else as the transports' own ResourceWarning, which fails the test too
    assert "the event loop closed with 2 resource(s) open" in out or "ResourceWarning" in out
    assert "<TCPTransport" in out
    assert "test_next" in out  # the run went on


def test_a_test_stuck_in_an_await_fails_at_its_timeout_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    # before: pytest-timeout's alarm was swallowed by the idle loop and nothing ever stopped it
    code, out = run_pytest(
        tmp_path,
        """
        import asyncio

        async def test_stuck():
            await asyncio.Event().wait()

        def test_next():
            pass
        """,
        timeout=2,
    )
    assert code == 1, out
    assert "test still running after its timeout of 2 s" in out
    assert ">       await asyncio.Event().wait()" in out  # where it was stuck
    assert "1 failed, 1 passed" in out


def test_a_test_blocked_where_no_timeout_reaches_ends_the_run_and_its_processes(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child.pid"
    code, out = run_pytest(
        tmp_path,
        f"""
        import signal
        import subprocess
        import threading

        def test_blocked():
            child = subprocess.Popen(["sleep", "600"])
            with open({str(pid_file)!r}, "w") as out:
                out.write(str(child.pid))
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})  # no alarm gets in
            threading.Event().wait()
        """,
        timeout=1,
        RMB_TEST_HANG_GRACE="2",
    )
    assert code == 1, out
    assert "test_cases.py::test_blocked is still running 3 s after it started" in out
    assert "in test_blocked" in out  # its stack
    child = int(pid_file.read_text())
    assert f"killed process {child}" in out
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)


def _state(pid: int) -> str:
    """The process's state letter (a killed child not reaped yet is a zombie, Z)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
