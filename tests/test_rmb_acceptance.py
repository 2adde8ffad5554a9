"""Acceptance: the relay as `make run` starts it (the CLI, embedded defaults, no Redis), twins
provisioned with `rmb-relay twins add`, and two SDK clients exchanging 10,000 request/response
pairs with nothing lost."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rmb_relay.sdk import IncomingRequest, RmbClient
from tests.conftest import WAIT
from tests.processes import relay_env
from tests.rmb_fixtures import key_for

PAIRS = 10_000
WINDOW = 200


def rmb_relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "rmb_relay", *args]


@pytest.fixture
def relay_process(tmp_path: Path) -> Iterator[str]:
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    for twin, key_type in ((1, "sr25519"), (2, "ed25519")):
        subprocess.run(
            rmb_relay(
                "twins",
                "add",
                "--twins",
                twins,
                "--id",
                str(twin),
                "--account",
                key_for(twin, key_type).public_key.hex(),
                "--relay",
                "relay.test",
            ),
            check=True,
            env=relay_env(),
            capture_output=True,
        )
    process = subprocess.Popen(
        rmb_relay("-l", "127.0.0.1:0", "--twins", twins),
        env=relay_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    banner = process.stdout.readline()
    assert banner.startswith("rmb-relay listening on "), banner
    address = banner.split()[3].rstrip(";")
    try:
        yield f"ws://{address}/"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT) == 0
        process.stdout.close()


async def test_ten_thousand_request_response_pairs_lose_nothing(relay_process: str) -> None:
    alice = await RmbClient.connect(relay_process, 1, key_for(1), sid="alice")
    bob = await RmbClient.connect(relay_process, 2, key_for(2, "ed25519"), sid="bob")
    served = 0

    def answer(request: IncomingRequest) -> bytes:
        nonlocal served
        served += 1
        return request.data[::-1]

    bob.handle("test.reverse", answer)
    window = asyncio.Semaphore(WINDOW)
    mismatches = 0

    async def one(i: int) -> None:
        nonlocal mismatches
        payload = f"{i:08d}".encode() * 128  # 1 KiB
        async with window:
            reply = await alice.request(2, "test.reverse", payload, dest_sid="bob", timeout=60)
        if reply.data != payload[::-1]:
            mismatches += 1

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(PAIRS))), 300)
    assert mismatches == 0
    assert served == PAIRS
    await alice.close()
    await bob.close()
