"""Accepting pauses near the file-descriptor limit (issue 9, "connection caps"): a relay whose
connection cap is set above its descriptor limit stops accepting with one log line and a metric,
clients that arrive meanwhile wait in the listen backlog and are served once descriptors free
up. Before, uvloop's libuv accepted and at once reset every waiting client, silently."""

from __future__ import annotations

import resource
import socket
from collections.abc import Iterator

import pytest

from tests.conftest import WAIT
from tests.relay_process import RelayProcess

LIMIT = 128


def _low_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, hard))


@pytest.fixture
def relay() -> Iterator[RelayProcess]:
    started = RelayProcess(
        "--max-connections", "1000", "--max-connections-per-ip", "1000", preexec_fn=_low_fd_limit
    )
    try:
        yield started
    finally:
        started.close()


def request(port: str | int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(port)), timeout=WAIT)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n".encode())
    return sock


def answer(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def test_accepting_pauses_near_the_descriptor_limit_and_nobody_waiting_is_reset(
    relay: RelayProcess,
) -> None:
    idle = [socket.create_connection(("127.0.0.1", relay.port)) for _ in range(LIMIT + 20)]
    try:
        line = relay.wait_for_line("accepting paused")
        assert f"file-descriptor limit {LIMIT}" in line
        # arrives while paused: waits in the backlog (connect succeeds in the kernel)
        waiting = request(relay.port, "/health")
    finally:
        for sock in idle:
            sock.close()
    assert answer(waiting).startswith(b"HTTP/1.1 200 ")
    relay.wait_for_line("accepting normally again")
    page = answer(request(relay.port, "/metrics")).decode()
    assert "\nrmb_relay_accept_pauses_total " in page
    pauses = next(
        float(row.split()[1])
        for row in page.splitlines()
        if row.startswith("rmb_relay_accept_pauses_total ")
    )
    assert pauses >= 1
    assert "\nrmb_relay_accept_paused 0.0" in page
    assert relay.stop() == 0
    assert "Traceback" not in "".join(relay.log)
    # one line per episode, not one per refused socket
    assert sum("accepting paused" in line for line in relay.log) == 1
