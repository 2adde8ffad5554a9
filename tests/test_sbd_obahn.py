"""The conformance runner's stdin/stdout protocol (spec/sbd.md §3.1), and the public suite
itself when its binary has been built (`make sbd-conformance` builds it)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import WAIT
from tests.sbd_client import SbdClient

ROOT = Path(__file__).resolve().parent.parent
TESTER = ROOT / ".tools" / "sbd-tester" / "bin" / "sbd-o-bahn-server-tester-bin"
RUNNER = [sys.executable, "-u", "-m", "rmb_relay.commands.sbd_obahn"]


@pytest.fixture
async def runner() -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        *RUNNER,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    yield process
    if process.returncode is None:
        process.kill()
        await process.wait()


async def line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    return (await asyncio.wait_for(process.stdout.readline(), WAIT)).decode()


async def start(process: asyncio.subprocess.Process) -> tuple[str, int]:
    assert process.stdin is not None
    process.stdin.write(b"CMD/START\n")
    await process.stdin.drain()
    answer = await line(process)
    match = re.fullmatch(r"CMD/START/(127\.0\.0\.1):(\d+)\n", answer)
    assert match, answer
    return match[1], int(match[2])


async def test_runner_starts_a_fresh_relay_per_start_and_exits_on_eof(
    runner: asyncio.subprocess.Process,
) -> None:
    assert await line(runner) == "CMD/READY\n"
    host, first_port = await start(runner)
    first = await SbdClient.connect(host, first_port)
    assert first.lbrt == [8000]  # rate limiting on, default budget
    assert first.lidl == 10000
    restart = asyncio.create_task(start(runner))
    assert await first.closed_by_server() == 1001  # the previous relay shuts down
    first.close()
    host, second_port = await restart
    second = await SbdClient.connect(host, second_port)
    assert second.lbrt == [8000]  # fresh state
    second.close()
    assert runner.stdin is not None
    runner.stdin.close()
    assert await asyncio.wait_for(runner.wait(), WAIT) == 0
    assert runner.stdout is not None
    assert await runner.stdout.read() == b""  # nothing but protocol lines on stdout


async def test_runner_refuses_an_unknown_command(runner: asyncio.subprocess.Process) -> None:
    assert await line(runner) == "CMD/READY\n"
    assert runner.stdin is not None
    runner.stdin.write(b"CMD/BOGUS\n")
    await runner.stdin.drain()
    assert await asyncio.wait_for(runner.wait(), WAIT) == 127


@pytest.mark.slow
@pytest.mark.skipif(not TESTER.exists(), reason="run `make sbd-conformance` to build the tester")
def test_public_conformance_suite_passes() -> None:
    result = subprocess.run(
        [str(TESTER), *RUNNER],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    report = result.stdout[result.stdout.find("-- TEST RESULTS --") :]
    assert result.returncode == 0, report or result.stdout[-4000:] + result.stderr[-4000:]
    assert "failed: []" in report
    assert report.count('"') == 16  # the 8 suite rows, each quoted once
