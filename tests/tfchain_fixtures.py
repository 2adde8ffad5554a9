"""Real processes for the tfchain tests: `rmb-relay devchain` nodes (waited for by the line they
print), twins put on them with `rmb-relay twins add --devchain`, and a misbehaving JSON-RPC
node for the failure tests (a real websocket server answering garbage, wrong types, or
nothing)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import WSMsgType, web

from tests.conftest import WAIT
from tests.peer_fixtures import Process, mnemonic_for, rmb_relay, spawn
from tests.processes import relay_env


@dataclass
class DevChainNode:
    process: Process
    url: str

    @property
    def port(self) -> int:
        return int(self.url.rpartition(":")[2])

    def stop(self) -> int:
        return self.process.stop()


def start_devchain(twins: Path, *extra: str, block_time: float = 1.0) -> DevChainNode:
    """A devchain on a free port over the twin file `twins` (several nodes may share one)."""
    process = spawn(
        rmb_relay(
            "devchain",
            "--twins",
            str(twins),
            "-l",
            "127.0.0.1:0",
            "--block-time",
            str(block_time),
            *extra,
        ),
        stream="stdout",
    )
    process.output.wait_for("devchain listening on ")
    line = next(line for line in process.output.lines if "devchain listening on" in line)
    return DevChainNode(process, line.split()[-1])


def put_twin(
    url: str, twin: int, *relays: str, key_type: str = "sr25519", pk: str | None = None
) -> None:
    """`rmb-relay twins add --devchain URL` with the test mnemonic of `twin`."""
    args = [
        "twins",
        "add",
        "--devchain",
        url,
        "--id",
        str(twin),
        "--mnemonic",
        mnemonic_for(twin),
        "--key-type",
        key_type,
    ]
    for relay in relays:
        args += ["--relay", relay]
    if pk is not None:
        args += ["--pk", pk]
    done = subprocess.run(
        rmb_relay(*args), env=relay_env(), capture_output=True, text=True, timeout=WAIT
    )
    assert done.returncode == 0, done.stderr


@asynccontextmanager
async def bad_node(behaviour: str) -> AsyncIterator[str]:
    """A websocket JSON-RPC 'node' on a free port that answers every request wrongly:
    `garbage` (not JSON), `wrong-types` (JSON-RPC with a number where hex belongs),
    `rpc-error` (a JSON-RPC error object) or `hang` (never answers). Yields its ws:// URL."""

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type != WSMsgType.TEXT:
                continue
            call = json.loads(message.data)
            if behaviour == "garbage":
                await ws.send_str("}{ this is not json")
            elif behaviour == "wrong-types":
                await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": call["id"], "result": 42}))
            elif behaviour == "rpc-error":
                error = {"code": -32601, "message": "Method not found"}
                await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": call["id"], "error": error}))
            # "hang": read and never answer
        return ws

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        await asyncio.wait_for(runner.cleanup(), WAIT)


@asynccontextmanager
async def silent_tcp() -> AsyncIterator[str]:
    """A TCP server that accepts and never says anything (not even the websocket upgrade)."""
    writers: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)
