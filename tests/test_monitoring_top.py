"""`rmb-relay top` in a real terminal (tmux, 80 columns) against a relay under load: the
screen shows the top sender first, the order follows the sort key the user switches to with a
key press, and `q` and Ctrl-C leave with status 0. The screen is read with capture-pane and
waited on with a bounded poll (nothing announces that a terminal was redrawn)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from rmb_relay.commands import serve
from rmb_relay.server.listener import RelayServer
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.sbd_client import SbdClient, key_path

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


async def tmux(socket: str, *args: str, output: bool = True) -> str:
    """Run a tmux client command on the test's own tmux server. The one that starts the
    server gets no pipes (the server would hold them open: no end of output to wait for)."""
    pipe = asyncio.subprocess.PIPE if output else asyncio.subprocess.DEVNULL
    process = await asyncio.create_subprocess_exec(
        "tmux", "-L", socket, *args, stdout=pipe, stderr=pipe
    )
    out, err = await asyncio.wait_for(process.communicate(), WAIT)
    assert process.returncode == 0, (err or b"").decode()
    return (out or b"").decode()


@contextlib.asynccontextmanager
async def loaded_relay(tmp_path: Path) -> AsyncIterator[tuple[RelayServer, dict[str, int]]]:
    """A relay where one SBD client sends ten times what another does, both to a third that
    reads everything; yields the relay and the connection ids of heavy, light and sink."""
    args = serve.parser().parse_args(
        [
            "-l",
            "127.0.0.1:0",
            "--twins",
            f"sqlite:{tmp_path / 'twins.sqlite3'}",
            "--sbd-disable-rate-limit",
            # the sink only receives: SBD's idle rule would drop it
            "--sbd-idle-ms",
            "600000",
            "--no-tunnel",
        ]
    )
    server, services = await serve.build_server(args)
    await server.start()
    host, port = server.addresses[0]
    heavy, light, sink = [await SbdClient.connect(host, port) for _ in range(3)]

    # a flag as well as the cancel: Python 3.11's wait_for (inside next_message) can swallow
    # a cancellation that arrives as its read completes, which under this load it often does
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            for _ in range(10):
                heavy.forward(sink.pubkey, b"h" * 64)
            light.forward(sink.pubkey, b"l" * 64)
            for _ in range(11):
                await sink.next_message()

    task = asyncio.get_running_loop().create_task(load())
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=WAIT) as http:
            rows = (await http.get("/monitor/connections?dialect=sbd&limit=all")).json()
        ids = {
            name: next(
                r["id"]
                for r in rows["connections"]
                if r["identity"]["key"] == key_path(client.pubkey)[1:]
            )
            for name, client in (("heavy", heavy), ("light", light), ("sink", sink))
        }
        yield server, ids
    finally:
        stop.set()
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT)
        for client in (heavy, light, sink):
            client.ws.close()
        await asyncio.wait_for(server.shutdown(), WAIT)
        await services.close()


def first_row(screen: str, heading: str) -> int | None:
    """The connection id of the first row under `heading` on the screen, if drawn."""
    lines = screen.splitlines()
    for n, line in enumerate(lines):
        if line.strip().startswith(heading):
            for row in lines[n + 1 :]:
                first = row.split()[:1]
                if first and first[0].isdigit():
                    return int(first[0])
            return None
    return None


@contextlib.asynccontextmanager
async def top_in_tmux(tmp_path: Path, url: str) -> AsyncIterator[tuple[str, Path]]:
    socket = f"rmb-top-{os.getpid()}-{id(tmp_path)}"
    status = tmp_path / f"status-{socket}"
    command = f"{sys.executable} -m rmb_relay top --url {url}; echo $? > {status}"
    await tmux(
        socket, "new-session", "-d", "-x", "80", "-y", "30", "-s", "top", command, output=False
    )
    try:
        yield socket, status
    finally:
        with contextlib.suppress(AssertionError):
            await tmux(socket, "kill-server")


async def test_top_shows_the_top_sender_first_follows_the_sort_key_and_quits(
    tmp_path: Path,
) -> None:
    async with loaded_relay(tmp_path) as (server, ids):
        host, port = server.addresses[0]
        async with top_in_tmux(tmp_path, f"http://{host}:{port}") as (socket, status):
            screen = ""

            async def shows(heading: str, conn_id: int) -> bool:
                nonlocal screen
                screen = await tmux(socket, "capture-pane", "-p", "-t", "top")
                return first_row(screen, heading) == conn_id

            await eventually(lambda: shows("top by msgs_in", ids["heavy"]), 3 * WAIT)
            (tmp_path / "screen.txt").write_text(screen)  # (docs/monitoring.md's capture)
            assert "rmb-relay" in screen
            assert "conns" in screen
            assert all(len(line) <= 80 for line in screen.splitlines())
            # `2`: by messages out, where the sink (it receives everything) leads
            await tmux(socket, "send-keys", "-t", "top", "2")
            await eventually(lambda: shows("top by msgs_out", ids["sink"]), 3 * WAIT)
            # `s`: the next key (bytes in): the heavy sender again
            await tmux(socket, "send-keys", "-t", "top", "s")
            await eventually(lambda: shows("top by bytes_in", ids["heavy"]), 3 * WAIT)
            await tmux(socket, "send-keys", "-t", "top", "q")
            await eventually(lambda: status.exists() and status.read_text() != "", 3 * WAIT)
            assert status.read_text().strip() == "0"


async def test_top_leaves_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    async with loaded_relay(tmp_path) as (server, _ids):
        host, port = server.addresses[0]
        async with top_in_tmux(tmp_path, f"http://{host}:{port}") as (socket, status):

            async def drawn() -> bool:
                screen = await tmux(socket, "capture-pane", "-p", "-t", "top")
                return first_row(screen, "top by msgs_in") is not None

            await eventually(drawn, 3 * WAIT)
            await tmux(socket, "send-keys", "-t", "top", "C-c")
            await eventually(lambda: status.exists() and status.read_text() != "", 3 * WAIT)
            assert status.read_text().strip() == "0"
