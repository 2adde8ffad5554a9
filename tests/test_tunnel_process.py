"""The tunnel as users run it: `rmb-relay tenants add`, `rmb-relay serve` and `rmb-relay
connector` as real processes, curl as the client, an aiohttp server as the target; large
bodies both ways byte for byte with the relay's peak RSS measured."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tunnel_fixtures import TargetApp, pattern, start_target
from tests.tunnel_processes import (
    add_tenant,
    spawn_connector,
    spawn_relay,
    stop,
    wait_for_connector,
)

SECRET = "process-secret"


@dataclass
class Processes:
    relay: subprocess.Popen[str]
    connector: subprocess.Popen[str]
    base: str
    target: TargetApp


def _relay_rss_peak(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Processes]:
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    await add_tenant(db, env, "acme", SECRET)
    args = ["--twins", db, "--tunnel-body-store", str(tmp_path / "bodies")]
    args.append("--tunnel-require-connection")
    relay, base = await spawn_relay(args, env, stderr=subprocess.PIPE)
    async with AsyncExitStack() as stack:
        target = await start_target(stack)
        connector = await spawn_connector(
            base, "acme", SECRET, target.url, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            await wait_for_connector(base, "acme")
            yield Processes(relay, connector, base, target)
        finally:
            assert stop(connector) == 0
            assert stop(relay) == 0


async def curl(*args: str) -> bytes:
    process = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "--fail-with-body",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err
    return out


@pytest.mark.timeout(120)
async def test_curl_through_relay_and_connector_processes(
    processes: Processes, tmp_path: Path
) -> None:
    base = processes.base
    assert await curl(f"{base}/relay/acme/$ping/") == b"PONG"
    for method in ("GET", "POST", "PUT", "DELETE"):
        out = await curl(
            "-X", method, "-D", "-", "--data-binary", "hello", f"{base}/relay/acme/app/echo/x?q=1"
        )
        assert out.endswith(b"hello")
        assert f"x-method: {method}".lower().encode() in out.lower()
    body = tmp_path / "body.bin"
    size = 10 << 20
    body.write_bytes(pattern(size))
    out = await curl("--data-binary", f"@{body}", f"{base}/relay/acme/app/echo")
    assert hashlib.sha256(out).digest() == hashlib.sha256(pattern(size)).digest()


HUGE = 200 << 20


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_200_mib_both_ways_with_bounded_relay_memory(
    processes: Processes, tmp_path: Path
) -> None:
    base = processes.base
    before = _relay_rss_peak(processes.relay.pid)
    body = tmp_path / "huge.bin"
    with body.open("wb") as out:
        block = pattern(1 << 20)
        for _ in range(HUGE >> 20):
            out.write(block)
    expected = hashlib.sha256(body.read_bytes()).hexdigest()
    up = await curl("--data-binary", f"@{body}", f"{base}/relay/acme/app/sha")
    assert f'"sha256": "{expected}"'.encode() in up
    down = await curl("-o", str(tmp_path / "down.bin"), f"{base}/relay/acme/app/bytes/{HUGE}")
    assert down == b""
    assert hashlib.sha256((tmp_path / "down.bin").read_bytes()).hexdigest() == expected
    growth = _relay_rss_peak(processes.relay.pid) - before
    print(f"relay peak RSS growth over 2 x 200 MiB: {growth / 2**20:.1f} MiB")
    assert growth < 64 << 20
