"""The cluster as operators run it: real `rmb-relay` processes on one real Redis. Three
instances with clients spread over them, one killed with SIGKILL mid-run (its clients
reconnect elsewhere and get what waited for them), and `--workers 2` serving one port."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from rmb_relay.client import RmbClient
from rmb_relay.cluster import keys
from tests.cluster_fixtures import TWINS, recorder, twin_directory
from tests.conftest import WAIT, RedisServer, free_port
from tests.helpers import eventually
from tests.rmb_fixtures import key_for

#: short, so a killed instance is given up within seconds
TTL = "1.5"


class Relays:
    """`rmb-relay` processes started by a test, stopped (or killed) after it."""

    def __init__(self, twins: Path, redis: str) -> None:
        self.twins = twins
        self.redis = redis
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, *extra: str, port: int | None = None, banners: int = 1) -> str:
        port = port or free_port()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rmb_relay",
                "-l",
                f"127.0.0.1:{port}",
                "--twins",
                f"sqlite:{self.twins}",
                "--twin-cache-ttl",
                "0",
                "--redis",
                self.redis,
                "--cluster-ttl",
                TTL,
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert process.stdout is not None
        for _ in range(banners):
            banner = process.stdout.readline()
            assert banner.startswith("rmb-relay listening on "), banner
        self.processes.append(process)
        return f"ws://127.0.0.1:{port}/"

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            process.wait(WAIT)
            assert process.stdout is not None
            process.stdout.close()


@pytest.fixture
def relays(tmp_path: Path, redis_server: RedisServer) -> Iterator[Relays]:
    path = tmp_path / "twins.sqlite3"
    twin_directory(path)
    started = Relays(path, redis_server.url)
    try:
        yield started
    finally:
        started.stop()


async def connect(url: str, twin: int, sid: str | None = None, **handlers: object) -> RmbClient:
    client = RmbClient(twin, key_for(twin, TWINS[twin]), sid=sid)
    for command, handler in handlers.items():
        client.handle(command, handler)  # type: ignore[arg-type]
    await client.open(url)
    return client


async def test_killed_instance_its_clients_reconnect_and_nothing_accepted_is_lost(
    relays: Relays, redis_server: RedisServer
) -> None:
    a, b, c = relays.start(), relays.start(), relays.start()
    alice = await connect(b, 1)
    bob_got: list[bytes] = []
    bob = await connect(c, 2, m=recorder(bob_got))
    carol = await connect(a, 3)
    probe = Redis.from_url(redis_server.url)

    async def held(name: str) -> bool:
        return bool(await probe.exists(keys.presence_key(name)))

    await eventually(lambda: held("r:3"))
    # spread over the three instances: B -> C works while A is alive
    alice.send_request(2, "m", b"before")
    await eventually(lambda: bob_got == [b"before"])

    relays.processes[0].kill()  # A dies without a word: carol's connection drops
    relays.processes[0].wait(WAIT)
    await eventually(lambda: not carol.connected)
    sent = [f"while away {i}".encode() for i in range(20)]
    for payload in sent:  # to A's stream until its presence expires, then to the mailbox
        alice.send_request(3, "m", payload)
    got: list[bytes] = []
    back = await connect(c, 3, m=recorder(got))  # carol is back, on another instance
    await eventually(lambda: sorted(got) == sorted(sent), timeout=30)
    # A's stream was taken over by a live instance
    await eventually(lambda: held("r:3"))
    await probe.aclose()
    for client in (alice, bob, carol, back):
        await client.close()


async def test_two_workers_share_one_port_and_each_others_sessions(
    relays: Relays, redis_server: RedisServer
) -> None:
    port = free_port()
    url = relays.start("--workers", "2", port=port, banners=2)
    probe = Redis.from_url(redis_server.url)
    # the kernel spreads connections over the workers: open sessions until two land apart
    holders: dict[str, RmbClient] = {}
    opened: list[RmbClient] = []
    for i in range(40):
        got: list[bytes] = []
        client = await connect(url, 3, f"s{i}", m=recorder(got, b"from " + str(i).encode()))
        opened.append(client)

        async def claimed(sid: str = f"s{i}") -> bool:
            return bool(await probe.exists(keys.presence_key(f"r:3:{sid}")))

        await eventually(claimed)
        holder = (await probe.get(keys.presence_key(f"r:3:s{i}"))).decode()
        holders.setdefault(holder, client)
        if len(holders) == 2:
            break
    assert len(holders) == 2, "40 connections all landed on one worker"
    assert all(holder.endswith(("-w0", "-w1")) for holder in holders)
    first, second = holders.values()
    # a request from a session on one worker to a session on the other, both ways
    reply = await first.request(3, "m", b"hi", dest_sid=second.sid, timeout=WAIT)
    assert reply.data.startswith(b"from ")
    reply = await second.request(3, "m", b"hi", dest_sid=first.sid, timeout=WAIT)
    assert reply.data.startswith(b"from ")
    for client in opened:
        await client.close()
    await probe.aclose()


def test_workers_need_redis_and_a_fixed_port(tmp_path: Path) -> None:
    for argv, why in (
        (["--workers", "2", "-l", "127.0.0.1:9"], "--workers N needs --redis"),
        (["--workers", "2", "-l", "127.0.0.1:0", "-r", "redis://x"], "needs a fixed port"),
        (["--workers", "0"], "at least 1"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "rmb_relay", *argv], capture_output=True, text=True, timeout=WAIT
        )
        assert run.returncode != 0
        assert why in run.stderr, run.stderr
