"""The cluster as operators run it: real `rmb-relay` processes on one real Redis. Three
instances with clients spread over them, one killed with SIGKILL mid-run (its clients
reconnect elsewhere and get what waited for them; its gateway clients leave the others'
replicas), and `--processes 2` serving one port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from rmb_relay.cluster import keys
from rmb_relay.cluster.presence import claim_instance
from rmb_relay.sdk import RmbClient
from tests.cluster_fixtures import TWINS, recorder, twin_directory
from tests.conftest import WAIT, RedisServer, free_port
from tests.helpers import eventually
from tests.processes import GRACE, relay_env, stop_processes
from tests.rmb_fixtures import key_for
from tests.sg_client import SgClient
from tests.tunnel_fixtures import start_target
from tests.tunnel_processes import add_tenant, spawn_connector, spawn_relay, wait_for_connector

#: short, so a killed instance is given up within seconds
TTL = "1.5"
TUNNEL_SECRET = "cluster-process-secret"


class Relays:
    """`rmb-relay` processes started by a test, and the clients it opened: all stopped after
    it in bounded time (clients closed, relays sent SIGTERM and killed if they have not exited
    within `processes.GRACE`). A relay that needed killing fails the test with its log."""

    def __init__(self, twins: Path, redis: str, logs: Path) -> None:
        self.twins = twins
        self.redis = redis
        self.logs = logs
        self.processes: list[subprocess.Popen[str]] = []
        self.clients: list[RmbClient] = []

    def start(self, *extra: str, port: int | None = None, banners: int = 1) -> str:
        port = port or free_port()
        log = self.logs / f"relay-{len(self.processes)}.log"
        with log.open("w") as stderr:  # the child keeps its own descriptor
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
                    "--instance-id",
                    self.instance_id(len(self.processes)),
                    *extra,
                ],
                env=relay_env(),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.processes.append(process)
        assert process.stdout is not None
        for _ in range(banners):
            banner = process.stdout.readline()
            assert banner.startswith("rmb-relay listening on "), banner + self.log(process)
        return f"ws://127.0.0.1:{port}/"

    @staticmethod
    def instance_id(index: int) -> str:
        """The cluster name of the `index`-th relay started (with --processes: its base)."""
        return f"relay-{index}"

    async def connect(
        self, url: str, twin: int, sid: str | None = None, **handlers: object
    ) -> RmbClient:
        client = RmbClient(twin, key_for(twin, TWINS[twin]), sid=sid)
        self.clients.append(client)
        for command, handler in handlers.items():
            client.handle(command, handler)  # type: ignore[arg-type]
        await asyncio.wait_for(client.open(url), WAIT)
        return client

    def log(self, process: subprocess.Popen[str]) -> str:
        path = self.logs / f"relay-{self.processes.index(process)}.log"
        return f"\n--- {path.name} (pid {process.pid}) ---\n{path.read_text()}"

    async def close_clients(self) -> None:
        for client in self.clients:
            # its sockets go with the relays; the loop reports what stayed open
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.close(), WAIT)

    def stop(self) -> None:
        running = [process for process in self.processes if process.poll() is None]
        killed = stop_processes(self.processes)
        if killed:
            pytest.fail(
                f"{len(killed)} relay(s) did not exit within {GRACE:.0f} s of SIGTERM (killed)"
                + "".join(self.log(process) for process in killed),
                pytrace=False,
            )
        unclean = [process for process in running if process.returncode != 0]
        if unclean:
            pytest.fail(
                f"{len(unclean)} relay(s) did not stop cleanly on SIGTERM (exit status "
                f"{', '.join(str(process.returncode) for process in unclean)})"
                + "".join(self.log(process) for process in unclean),
                pytrace=False,
            )


@pytest.fixture
async def relays(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Relays]:
    path = tmp_path / "twins.sqlite3"
    twin_directory(path)
    started = Relays(path, redis_server.url, tmp_path)
    try:
        yield started
    finally:
        try:
            await started.close_clients()
        finally:
            started.stop()


async def test_killed_instance_its_clients_reconnect_and_nothing_accepted_is_lost(
    relays: Relays, redis_server: RedisServer
) -> None:
    a, b, c = relays.start(), relays.start(), relays.start()
    alice = await relays.connect(b, 1)
    bob_got: list[bytes] = []
    await relays.connect(c, 2, m=recorder(bob_got))
    carol = await relays.connect(a, 3)
    async with Redis.from_url(redis_server.url) as probe:

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
        back = await relays.connect(c, 3, m=recorder(got))  # carol is back, on another instance
        await eventually(lambda: sorted(got) == sorted(sent), timeout=30)
        # A's stream was taken over by a live instance, which did not close her new session
        a_stream = keys.bus_key(relays.instance_id(0))
        await eventually(lambda: _empty(probe, a_stream), timeout=30)
        assert await probe.get(keys.presence_key("r:3")) is not None
        assert back.connected
        assert (await back.ping()).data == b"hello world"
        assert sorted(got) == sorted(sent)  # once each


async def _empty(redis: Redis, stream: str) -> bool:
    return not await redis.xlen(stream)


async def test_a_killed_instances_gateway_clients_leave_the_others_replicas(
    relays: Relays, redis_server: RedisServer
) -> None:
    """The 신경 gateway on the cluster's liveness: SIGKILL one relay and the other drops its
    clients (HTTP query, QUERY_NODES, SEND see them no more) once the cluster gives it up."""
    a, b = relays.start(), relays.start()
    ports = [int(url.rstrip("/").rsplit(":", 1)[1]) for url in (a, b)]
    clients: list[SgClient] = []
    try:
        for name, port in (("a0", ports[0]), ("b0", ports[1]), ("b1", ports[1])):
            client = await SgClient.connect("127.0.0.1", port)
            clients.append(client)
            await client.identify(name, "api")

        async def seen_by_a() -> list[str]:
            async with httpx.AsyncClient(timeout=WAIT) as http:
                reply = await http.post(
                    f"http://127.0.0.1:{ports[0]}/api/v1/query", json={"application": "api"}
                )
            return sorted(found["client_id"] for found in reply.json())

        await eventually(lambda: _equals(seen_by_a(), ["a0", "b0", "b1"]))
        relays.processes[1].kill()
        relays.processes[1].wait(WAIT)
        await eventually(lambda: _equals(seen_by_a(), ["a0"]), timeout=30)
        async with Redis.from_url(redis_server.url) as probe:
            gone = keys.table_key("sg", relays.instance_id(1))
            await eventually(lambda: _missing(probe, gone))
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()


async def _equals(value: Awaitable[list[str]], expected: list[str]) -> bool:
    return await value == expected


async def _missing(redis: Redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_a_relay_whose_redis_froze_still_exits_soon_after_sigterm(
    relays: Relays, redis_server: RedisServer
) -> None:
    """A relay exits within its deadline (`serve.ShutdownDeadline`) after SIGTERM whatever is
    stuck: here every Redis call of every service waits for its socket timeout and retries."""
    url = relays.start()
    await relays.connect(url, 3)  # something to release on the way out
    relay = relays.processes[0]
    redis_server.process.send_signal(signal.SIGSTOP)  # answers nothing, closes nothing
    try:
        relay.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(relay.wait, GRACE)
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    log = relays.log(relay)
    assert "received SIGTERM: shutting down" in log
    # 0: every step gave up in time; 1: the deadline ended it, saying what was stuck
    assert code == 0 or (code == 1 and "shutdown did not finish within" in log), log


async def test_two_workers_share_one_port_and_each_others_sessions(
    relays: Relays, redis_server: RedisServer
) -> None:
    port = free_port()
    url = relays.start("--processes", "2", port=port, banners=2)
    async with Redis.from_url(redis_server.url) as probe:
        # the kernel spreads connections over the workers: open sessions until two land apart
        holders: dict[str, RmbClient] = {}
        for i in range(40):
            got: list[bytes] = []
            client = await relays.connect(
                url, 3, f"s{i}", m=recorder(got, b"from " + str(i).encode())
            )

            async def claimed(sid: str = f"s{i}") -> bool:
                return bool(await probe.exists(keys.presence_key(f"r:3:{sid}")))

            await eventually(claimed)
            claim = await probe.get(keys.presence_key(f"r:3:s{i}"))
            holder = claim_instance(claim.decode())
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


def test_workers_need_redis_and_a_fixed_port(tmp_path: Path) -> None:
    for argv, why in (
        (["--processes", "2", "-l", "127.0.0.1:9"], "--processes N needs --redis"),
        (["--processes", "2", "-l", "127.0.0.1:0", "-r", "redis://x"], "needs a fixed port"),
        (["--processes", "0"], "at least 1"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "rmb_relay", *argv], capture_output=True, text=True, timeout=WAIT
        )
        assert run.returncode != 0
        assert why in run.stderr, run.stderr


async def test_a_tunnel_request_taken_by_a_killed_relay_is_answered_504(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Relay B's connector runs a request of relay A's client; SIGKILL B: A hears of it from
    the cluster (B's liveness expires) and answers 504 at once (B may have run it), not after
    the response timeout."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    await add_tenant(db, env, "acme", TUNNEL_SECRET)
    shared = ["--twins", db, "--redis", redis_server.url, "--no-sbd", "--cluster-ttl", TTL]
    shared += ["--tunnel-body-store", str(tmp_path / "bodies")]
    processes: list[subprocess.Popen[str]] = []
    with (tmp_path / "relays.log").open("w") as log:
        try:
            relay_a, a = await spawn_relay([*shared, "--instance-id", "tunnel-a"], env, log)
            processes.append(relay_a)
            relay_b, b = await spawn_relay([*shared, "--instance-id", "tunnel-b"], env, log)
            processes.append(relay_b)
            async with AsyncExitStack() as stack:
                target = await start_target(stack)
                connector = await spawn_connector(
                    b, "acme", TUNNEL_SECRET, target.url, env, stdout=subprocess.DEVNULL, stderr=log
                )
                processes.append(connector)
                await wait_for_connector(a, "acme")  # through B, over the cluster
                async with Redis.from_url(redis_server.url) as probe:
                    before = await _entries_read(probe, "tunnel-a")
                    async with httpx.AsyncClient(base_url=a, timeout=WAIT * 3) as client:
                        waiting = asyncio.get_running_loop().create_task(
                            client.get("/relay/acme/app/slow")
                        )
                        await asyncio.wait_for(target.entered.wait(), WAIT)
                        # B's `taken` reached A's bus stream and was read
                        await eventually(lambda: _more(_entries_read(probe, "tunnel-a"), before))
                        relay_b.kill()
                        relay_b.wait(WAIT)
                        reply = await asyncio.wait_for(waiting, WAIT * 2)
                assert reply.status_code == 504, reply.text
                target.release.set()
        finally:
            # in reverse: the connector first, while relay A is up; every pipe closed (the
            # connector, waiting to reconnect to B, ends on SIGTERM too)
            killed = stop_processes(reversed(processes))
        assert not killed, (tmp_path / "relays.log").read_text()
        assert relay_a.returncode == 0, (tmp_path / "relays.log").read_text()


async def _entries_read(probe: Redis, instance: str) -> int:
    groups = await probe.xinfo_groups(keys.bus_key(instance))
    return int(groups[0]["entries-read"] or 0)


async def _more(value: Awaitable[int], than: int) -> bool:
    return await value > than
