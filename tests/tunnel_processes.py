"""The tunnel as users run it, as real processes: `rmb-relay tenants add`, `rmb-relay` serving
on a free port, `rmb-relay connector`. Shared by the process, acceptance and hostile-client
tests so all start and stop them the same way: `TunnelRelay` puts them together (a relay
process with tenants, connectors and a target), `honest_echo` is the traffic that must be
served, all of it, while a hostile client does its worst."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from tests import relay_process, tunnel_fixtures
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.processes import relay_env, stop_processes

#: where a process's stdout or stderr goes (a file, subprocess.PIPE or subprocess.DEVNULL)
Sink = IO[str] | int


def rmb_relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "rmb_relay", *args]


async def add_tenant(db: str, env: dict[str, str], tenant: str, secret: str, *flags: str) -> None:
    """`rmb-relay tenants --twins DB add TENANT --secret SECRET [FLAGS]`."""
    await tenants(db, env, "add", tenant, "--secret", secret, *flags)


async def tenants(db: str, env: dict[str, str], *args: str) -> None:
    """`rmb-relay tenants --twins DB ARGS` (add, set, rm: on the file a relay may be serving)."""
    await asyncio.to_thread(
        subprocess.run,
        rmb_relay("tenants", "--twins", db, *args),
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


async def wait_for_connector(base: str, tenant: str, headers: dict[str, str] | None = None) -> None:
    """Until the relay at `base` reaches a connector of `tenant` (its `$ping` answers 200;
    `headers`: a client token's, for a tenant that requires one)."""
    async with httpx.AsyncClient(base_url=base, timeout=WAIT, headers=headers) as client:

        async def ready() -> bool:
            return (await client.get(f"/relay/{tenant}/$ping/")).status_code == 200

        await eventually(ready, timeout=30)


def stop(process: subprocess.Popen[str]) -> int:
    """SIGTERM, wait (SIGKILL after the grace: a hang fails the caller's exit-code check
    instead of the run), close its pipes; returns the exit code."""
    stop_processes([process])
    return process.returncode


#: the secret of TunnelRelay's tenants unless told otherwise
TENANT_SECRET = "process-tenant-secret"


class TunnelRelay:
    """`async with TunnelRelay(home, *flags) as tunnel`: a relay process (`RelayProcess`, its
    log checked for problems by the caller) with its data and state in `home`: the SQLite file
    and the body store at their default paths there. Tenants are added with `rmb-relay
    tenants`, before or while it runs; connectors are `rmb-relay connector` processes serving
    `app` = one aiohttp target (tunnel_fixtures.py). Leaving stops the connectors, then the
    relay."""

    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        self.env = {**os.environ, "XDG_DATA_HOME": str(home), "XDG_STATE_HOME": str(home)}
        #: the default path of the SQLite file under `home` (the relay is not told it)
        self.db = f"sqlite:{home / 'rmb-relay' / 'twins.sqlite3'}"
        self.args = args
        self.connectors: list[subprocess.Popen[str]] = []
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> TunnelRelay:
        try:
            self.target: tunnel_fixtures.TargetApp = await tunnel_fixtures.start_target(self._stack)
            self.relay = relay_process.RelayProcess(*self.args, env=self.env)
            self._stack.callback(self.relay.close)
            self._stack.callback(lambda: stop_processes(self.connectors))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.relay.port}"

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base, timeout=WAIT)

    async def add_tenant(self, name: str, *flags: str, secret: str = TENANT_SECRET) -> None:
        await add_tenant(self.db, self.env, name, secret, *flags)

    async def tenants(self, *args: str) -> None:
        await tenants(self.db, self.env, *args)

    async def connect(
        self, tenant: str, secret: str = TENANT_SECRET, *, requires_auth: bool = False
    ) -> None:
        """A connector process for `tenant`, once the relay reaches it (`requires_auth`: the
        tenant's clients need a token, so the wait shows one)."""
        connector = await spawn_connector(
            self.base,
            tenant,
            secret,
            self.target.url,
            self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.connectors.append(connector)
        headers = None
        if requires_auth:
            headers = {"Authorization": f"Bearer {await self.token(tenant, 'client', secret)}"}
        await wait_for_connector(self.base, tenant, headers)

    @asynccontextmanager
    async def honest(self, tenant: str = "honest") -> AsyncIterator[None]:
        """The tenant `tenant` added, a connector process of it attached, and its echo
        requests served while the block runs, every one (`honest_echo`)."""
        await self.add_tenant(tenant)
        await self.connect(tenant)
        async with honest_echo(self.base, tenant):
            yield

    async def token(self, tenant: str, scope: str, secret: str = TENANT_SECRET) -> str:
        """A token of `scope` from the relay's `POST /tunnel/token`."""
        form = {
            "grant_type": "client_credentials",
            "client_id": tenant,
            "client_secret": secret,
            "scope": scope,
        }
        async with self.client() as client:
            answer = await client.post("/tunnel/token", data=form)
        assert answer.status_code == 200, answer.text
        return str(answer.json()["access_token"])


@asynccontextmanager
async def honest_echo(base: str, tenant: str, minimum: int = 20) -> AsyncIterator[None]:
    """Echo requests through `tenant`'s connector, one after another while the block runs
    (and at least `minimum`): each must come back 200 with its own body, none lost."""
    stop = asyncio.Event()

    async def ask() -> int:
        sent = 0
        async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:
            while not stop.is_set() or sent < minimum:
                body = f"honest {sent}".encode()
                answer = await client.post(f"/relay/{tenant}/app/echo", content=body)
                assert (answer.status_code, answer.content) == (200, body)
                sent += 1
        return sent

    task = asyncio.ensure_future(ask())
    try:
        yield
    finally:
        stop.set()
        served = await asyncio.wait_for(task, 3 * WAIT)
    assert served >= minimum
