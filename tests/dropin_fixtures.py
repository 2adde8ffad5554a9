"""Real processes for the drop-in tests (issue 34): a relay started from a public launch line,
waited for by the line it prints, then scraped and used the way a Helm probe and a twin would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import WAIT
from tests.helpers import http_exchange
from tests.peer_fixtures import Output, mnemonic_for
from tests.processes import relay_env


@dataclass
class Launched:
    """A relay process started from a launch line, with what it printed on stdout."""

    popen: subprocess.Popen[str]
    output: Output

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait(WAIT)
        self.output.join()
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()
        return code


def launch(
    command: Sequence[str], *, env: Mapping[str, str] | None = None, data_home: Path
) -> Launched:
    """`command` (a console-script name's argv, e.g. `["rmb-relay", ...]`) run as
    `python -m rmb_relay ...`; stdout is read by a thread, stderr is merged into it."""
    assert command[0] == "rmb-relay", command
    popen = subprocess.Popen(
        [sys.executable, "-m", "rmb_relay", *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=relay_env(
            {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_DATA_HOME": str(data_home), **(env or {})}
        ),
    )
    return Launched(popen, Output(popen.stdout))


def banner_port(relay: Launched) -> int:
    """The port of `rmb-relay listening on HOST:PORT ...`, once it is printed."""
    relay.output.wait_for("rmb-relay listening on ")
    line = next(line for line in relay.output.lines if "rmb-relay listening on " in line)
    where = line.split("listening on ", 1)[1].split()[0].rstrip(";")
    return int(where.rpartition(":")[2])


async def get(port: int, path: str) -> tuple[int, bytes]:
    """`GET path` on loopback, as a Kubernetes probe does: (status, body)."""
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    reply = await http_exchange("127.0.0.1", port, request)
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def add_local_twin(data_home: Path, twin: int, relay: str) -> None:
    """`rmb-relay twins add` into the embedded directory's default file under `data_home`
    (what a relay started without --twins or --substrate reads)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmb_relay",
            "twins",
            "add",
            "--id",
            str(twin),
            "--mnemonic",
            mnemonic_for(twin),
            "--relay",
            relay,
        ],
        env=relay_env({**os.environ, "XDG_DATA_HOME": str(data_home)}),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 0, done.stderr
