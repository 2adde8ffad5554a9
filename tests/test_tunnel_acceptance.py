"""Issue 13's acceptance point, as users would check it: unmodified HTTP clients (curl and
httpx) reach a real HTTP server behind an `rmb-relay connector` process through two `rmb-relay`
processes sharing a real redis-server. The connector holds a websocket to relay A only; every
client talks to relay B, so each request crosses Redis (the tenant's request stream, then the
answer on B's response stream) and, above 16 KiB, the shared body store.

Bodies are random bytes (not a repeating pattern, which would hide a shifted or repeated
block) and are compared byte for byte: every method from 0 B to 8 MiB here, 200 MiB each way
in the `slow` test."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import subprocess
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import WAIT, RedisServer
from tests.conftest import redis_server as redis_server
from tests.tunnel_fixtures import TargetApp, start_target
from tests.tunnel_processes import (
    add_tenant,
    spawn_connector,
    spawn_relay,
    stop,
    wait_for_connector,
)

SECRET = "acceptance-secret"
METHODS = ("GET", "POST", "PUT", "DELETE")
#: around the inline limit (16 KiB) and well into the body store
SIZES = (0, 1, 16 * 1024, 16 * 1024 + 1, 1 << 20, 8 << 20)
HUGE = 200 << 20


@dataclass
class Cluster:
    """Relay A holds the connector; clients use relay B."""

    a: str
    b: str
    target: TargetApp
    connector: subprocess.Popen[str]


def _random_file(path: Path, size: int, seed: int) -> str:
    """Write `size` random bytes to `path` a MiB at a time; returns their sha256."""
    rng = random.Random(seed)
    digest = hashlib.sha256()
    with path.open("wb") as out:
        left = size
        while left:
            block = rng.randbytes(min(left, 1 << 20))
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while block := data.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture
async def cluster(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Cluster]:
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    await add_tenant(db, env, "acme", SECRET)
    # one tenant database and one body store for both relays, as the scale-out docs require
    shared = ["--twins", db, "--redis", redis_server.url, "--no-sbd"]
    shared += ["--tunnel-body-store", str(tmp_path / "bodies"), "--tunnel-require-connection"]
    with (tmp_path / "relays.log").open("w") as log:
        processes: list[subprocess.Popen[str]] = []
        try:
            relay_a, a = await spawn_relay(shared, env, log)
            processes.append(relay_a)
            relay_b, b = await spawn_relay(shared, env, log)
            processes.append(relay_b)
            async with AsyncExitStack() as stack:
                target = await start_target(stack)
                connector = await spawn_connector(
                    a, "acme", SECRET, target.url, env, stdout=subprocess.DEVNULL, stderr=log
                )
                processes.append(connector)
                # B answers 503 until A has published the connector's presence in Redis
                await wait_for_connector(b, "acme")
                yield Cluster(a, b, target, connector)
                assert stop(processes.pop()) == 0  # the connector, while the target is up
        finally:
            for process in reversed(processes):
                assert stop(process) == 0


async def curl(*args: str) -> tuple[bytes, bytes]:
    """Run curl; returns the final response head and the body of its `-D -` dump."""
    process = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "--fail-with-body",
        "-D",
        "-",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err
    head, _, body = out.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 100"):  # curl sends Expect: 100-continue above 1 MiB
        head, _, body = body.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.timeout(180)
async def test_curl_and_httpx_every_method_and_size_across_two_relays(
    cluster: Cluster, tmp_path: Path
) -> None:
    bodies = {}
    for seed, size in enumerate(SIZES):
        path = tmp_path / f"body-{size}.bin"
        _random_file(path, size, seed)
        bodies[size] = path
    async with httpx.AsyncClient(base_url=cluster.b, timeout=WAIT) as client:
        for method in METHODS:
            for size, path in bodies.items():
                url = f"{cluster.b}/relay/acme/app/echo/{method}/{size}?q=a%20b"
                head, body = await curl("-X", method, "--data-binary", f"@{path}", url)
                assert body == path.read_bytes(), (method, size, head)
                assert f"x-method: {method}".lower().encode() in head.lower()
                sent = path.read_bytes()
                reply = await client.request(method, f"/relay/acme/app/echo/{size}", content=sent)
                assert (reply.status_code, reply.content) == (200, sent), (method, size)
        # responses of unknown length (chunked by the target) arrive whole too
        for size in (0, 16 * 1024 + 1, 3 << 20):
            reply = await client.get(f"/relay/acme/app/bytes/{size}", params={"chunked": "1"})
            assert reply.status_code == 200
            assert len(reply.content) == size
    # the target saw what the clients sent, path and query included
    assert "PUT /echo/PUT/16385?q=a%20b" in cluster.target.calls
    assert cluster.connector.poll() is None


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_200_mib_each_way_across_two_relays(cluster: Cluster, tmp_path: Path) -> None:
    up = tmp_path / "up.bin"
    expected = await asyncio.to_thread(_random_file, up, HUGE, 200)
    down = tmp_path / "down.bin"
    head, _body = await curl(
        "-X", "PUT", "--data-binary", f"@{up}", "-o", str(down), f"{cluster.b}/relay/acme/app/echo"
    )
    assert b" 200" in head.split(b"\r\n")[0]
    assert f"content-length: {HUGE}".encode() in head.lower()
    assert down.stat().st_size == HUGE
    assert await asyncio.to_thread(_sha256_file, down) == expected
