"""The tunnel as users run it, as real processes: `rmb-relay tenants add`, `rmb-relay` serving
on a free port, `rmb-relay connector`. Shared by the process and acceptance tests so both start
and stop them the same way."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import IO, Any

import httpx

from tests.conftest import WAIT
from tests.helpers import eventually
from tests.processes import relay_env, stop_processes

#: where a process's stdout or stderr goes (a file, subprocess.PIPE or subprocess.DEVNULL)
Sink = IO[str] | int


def rmb_relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "rmb_relay", *args]


async def add_tenant(db: str, env: dict[str, str], tenant: str, secret: str) -> None:
    """`rmb-relay tenants --twins DB add TENANT --secret SECRET`."""
    await asyncio.to_thread(
        subprocess.run,
        rmb_relay("tenants", "--twins", db, "add", tenant, "--secret", secret),
        check=True,
        env=relay_env(env),
        capture_output=True,
    )


def _popen(args: list[str], env: dict[str, str], **options: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(args, text=True, env=relay_env(env), **options)


async def spawn_relay(
    args: list[str], env: dict[str, str], stderr: Sink
) -> tuple[subprocess.Popen[str], str]:
    """Start `rmb-relay` on a free port; returns the process and its base URL (from the banner)."""
    process = await asyncio.to_thread(
        _popen,
        rmb_relay("-l", "127.0.0.1:0", *args),
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    assert process.stdout is not None
    banner = await asyncio.to_thread(process.stdout.readline)
    assert "tunnel" in banner, banner
    return process, f"http://{banner.split()[3].rstrip(';')}"


async def spawn_connector(
    server: str,
    tenant: str,
    secret: str,
    target: str,
    env: dict[str, str],
    *,
    stdout: Sink,
    stderr: Sink,
) -> subprocess.Popen[str]:
    """`rmb-relay connector` serving `app=TARGET` for the tenant."""
    command = rmb_relay("connector", "--server", server, "--tenant", tenant, "--secret", secret)
    return await asyncio.to_thread(
        _popen, [*command, "--target", f"app={target}"], env=env, stdout=stdout, stderr=stderr
    )


async def wait_for_connector(base: str, tenant: str) -> None:
    """Until the relay at `base` reaches a connector of `tenant` (its `$ping` answers 200)."""
    async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:

        async def ready() -> bool:
            return (await client.get(f"/relay/{tenant}/$ping/")).status_code == 200

        await eventually(ready, timeout=30)


def stop(process: subprocess.Popen[str]) -> int:
    """SIGTERM, wait (SIGKILL after the grace: a hang fails the caller's exit-code check
    instead of the run), close its pipes; returns the exit code."""
    stop_processes([process])
    return process.returncode
