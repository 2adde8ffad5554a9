"""Runner for the public SBD conformance suite (`sbd-o-bahn-server-tester`, spec/sbd.md §3.1).

    sbd-o-bahn-server-tester-bin python -u -m rmb_relay.commands.sbd_obahn

Protocol: print `CMD/READY`; for every `CMD/START` line on stdin, stop the previous relay and
start a fresh one (fresh rate buckets and slots) on an ephemeral loopback port, then print
`CMD/START/<addr>`. Nothing else goes to stdout (logs go to stderr); EOF ends the run.
The relay is the same as `rmb-relay` serves (RMB and SBD on one listener), with the reference
runner's settings: default rate limits and 100 client slots.

    sbd-o-bahn-server-tester-bin python -u -m rmb_relay.commands.sbd_obahn --sbd-serverd

runs the suite against sbd-serverd's launch line instead: every `CMD/START` starts a process
`rmb-relay sbd-serverd --bind 127.0.0.1:0 --limit-clients 100` and answers with the address of
its `#sbd-serverd#listening#` line once it printed `#sbd-serverd#ready#`.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from rmb_relay.config import ListenerConfig
from rmb_relay.dialects.rmb import RmbDialect, RmbSettings
from rmb_relay.dialects.sbd import SbdDialect, SbdSettings
from rmb_relay.server.listener import RelayServer
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.twins.local import SqliteTwinDirectory

#: the reference runner's `limit_clients`
LIMIT_CLIENTS = 100


async def start_relay() -> RelayServer:
    registry = Registry()
    switch = Switch()
    dialects = [
        RmbDialect(RmbSettings(), SqliteTwinDirectory(":memory:"), registry, switch=switch),
        SbdDialect(SbdSettings(limit_clients=LIMIT_CLIENTS), registry, switch=switch),
    ]
    server = RelayServer(ListenerConfig(host="127.0.0.1", port=0), dialects, registry)
    await server.start()
    return server


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


#: how long a started sbd-serverd may take to print its ready line
SERVERD_START_TIMEOUT = 60.0


def _die_with_parent() -> None:
    """The tester kills this runner without a word; its sbd-serverd must not outlive it (an
    orphan would hold the tester's stderr open). Linux's PR_SET_PDEATHSIG."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


async def start_serverd() -> tuple[asyncio.subprocess.Process, str]:
    """`rmb-relay sbd-serverd` as its launch lines run it; (process, first listening address)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rmb_relay",
        "sbd-serverd",
        "--bind",
        "127.0.0.1:0",
        "--limit-clients",
        str(LIMIT_CLIENTS),
        stdout=asyncio.subprocess.PIPE,
        preexec_fn=_die_with_parent,
    )
    assert process.stdout is not None
    listening: list[str] = []
    async with asyncio.timeout(SERVERD_START_TIMEOUT):
        while line := (await process.stdout.readline()).decode():
            if line.startswith("#sbd-serverd#listening# "):
                listening.append(line.split(" ", 1)[1].strip())
            elif line.startswith("#sbd-serverd#ready#"):
                break
    if not listening:
        raise SystemExit(f"sbd-serverd did not start (exit {await process.wait()})")
    return process, listening[0]


async def stop_serverd(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
    await process.wait()


async def main(serverd: bool = False) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    say("CMD/READY")
    server: RelayServer | None = None
    process: asyncio.subprocess.Process | None = None
    try:
        while line := await reader.readline():
            command = line.decode().strip()
            if command != "CMD/START":
                logging.error("sbd_obahn: unexpected command %r", command)
                raise SystemExit(127)
            if server is not None:
                await server.shutdown()
            if process is not None:
                await stop_serverd(process)
            if serverd:
                process, address = await start_serverd()
                say(f"CMD/START/{address}")
                continue
            server = await start_relay()
            host, port = server.addresses[0]
            say(f"CMD/START/{host}:{port}")
    finally:
        if server is not None:
            await server.shutdown()
        if process is not None:
            await stop_serverd(process)


def run() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(serverd="--sbd-serverd" in sys.argv[1:]))


if __name__ == "__main__":
    run()
