"""A ready-made fault world: Redis on its own host, relay instances on theirs, each
instance's link to Redis and its clients' link to it through a `FaultProxy`.

```
 test process (clients, proxies, checker; the bridge's address)
   ├─ clients ──proxy── host a: relay "a" ──proxy── host redis: redis-server
   └─ clients ──proxy── host b: relay "b" ──proxy──┘
```
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from rmb_relay.cluster import keys
from rmb_relay.cluster.presence import claim_instance
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.cluster_fixtures import TWINS, twin_directory
from tests.faultlab.netns import Host, Lab
from tests.faultlab.proxy import FaultProxy
from tests.faultlab.services import RELAY_PORT, ChainNode, RedisNode, RelayNode
from tests.processes import relay_env, stop_processes
from tests.rmb_fixtures import key_for


@dataclass
class Instance:
    name: str
    host: Host
    relay: RelayNode
    #: this instance's link to Redis (None: it has none, a federated relay's own)
    to_redis: FaultProxy | None
    #: its clients' link to it
    from_clients: FaultProxy
    #: the other relays' link to it (federation)
    from_peers: FaultProxy | None = None

    @property
    def url(self) -> str:
        host, port = self.from_clients.address
        return f"ws://{host}:{port}/"


@dataclass
class World:
    lab: Lab
    redis: RedisNode | None
    probe: Redis | RedisCluster | None
    logs: Path
    instances: dict[str, Instance] = field(default_factory=dict)
    #: the Redis Cluster's nodes (`ClusterInstances`)
    nodes: list[RedisNode] = field(default_factory=list)
    #: the chain node of the twin directory, and the instances' link to it (`chain_cache_ttl`)
    chain: ChainNode | None = None
    to_chain: FaultProxy | None = None

    async def holders(self, name: str) -> str | None:
        """The instance Redis's presence names for `name` (e.g. "r:1"), if any."""
        assert self.probe is not None
        value = await self.probe.get(keys.presence_key(name))
        if value is None:
            return None
        return claim_instance(value.decode() if isinstance(value, bytes) else str(value))

    def rss_mib(self) -> float:
        return max(instance.relay.rss_mib() for instance in self.instances.values())


class _Maker:
    """What the worlds below share: `async with` builds the world (`_build`, on an exit stack
    that undoes every step, also when a later one fails) and tears it down on the way out."""

    def __init__(self, logs: Path | None) -> None:
        self.logs = logs or Path(tempfile.mkdtemp(prefix="faultlab-logs-"))
        self._stack = AsyncExitStack()

    async def _build(self, stack: AsyncExitStack) -> World:
        raise NotImplementedError

    async def __aenter__(self) -> World:
        try:
            world = await self._build(self._stack)
        except BaseException:
            await self._stack.aclose()
            raise
        # first on the way out, while the proxies still carry their goodbyes; in a thread,
        # for the proxies run on this loop
        processes = [instance.relay.process for instance in world.instances.values()]
        self._stack.push_async_callback(asyncio.to_thread, stop_processes, processes)
        return world

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()


async def _instance(
    stack: AsyncExitStack,
    world: World,
    name: str,
    args: Sequence[str],
    *,
    to_redis: FaultProxy | None = None,
    from_peers: FaultProxy | None = None,
    host: Host | None = None,
) -> Instance:
    """Relay `name` on its own host (made here unless given), its clients' proxy in front of
    it, in `world`."""
    host = host or world.lab.host(name)
    relay = await RelayNode(host, args, world.logs).ready()
    from_clients = await FaultProxy.start(world.lab.gateway, (host.address, relay.port))
    stack.push_async_callback(from_clients.close)
    instance = Instance(name, host, relay, to_redis, from_clients, from_peers=from_peers)
    world.instances[name] = instance
    return instance


class TwoInstances(_Maker):
    """`async with TwoInstances(ttl=...) as world:` Redis and relay instances "a" and "b" (or
    `names`), all on their own hosts; everything is stopped and removed on the way out."""

    def __init__(
        self,
        *,
        ttl: float,
        names: Sequence[str] = ("a", "b"),
        extra: Sequence[str] = (),
        logs: Path | None = None,
        chain_cache_ttl: float | None = None,
        tenants: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.ttl = ttl
        #: HTTP tunnel tenants (name, secret) in the instances' directory
        self.tenants = tenants
        self.chain_cache_ttl = chain_cache_ttl
        self.names = names
        self.extra = extra
        super().__init__(logs)

    async def _build(self, stack: AsyncExitStack) -> World:
        lab = stack.enter_context(Lab())
        redis = await RedisNode(lab.host("redis")).ready()
        probe = Redis(host=redis.host.address, port=redis.port, socket_timeout=10)
        stack.push_async_callback(probe.aclose)
        world = World(lab, redis, probe, self.logs)
        twins = self.logs / "twins.sqlite3"
        twin_directory(twins)
        await _add_tenants(twins, self.tenants)
        directory = ["--twins", f"sqlite:{twins}", "--twin-cache-ttl", "0"]
        if self.chain_cache_ttl is not None:
            # the twin directory on a chain node of its own, behind a proxy of the world's
            chain = await ChainNode(lab.host("chain"), twins, self.logs).ready()
            world.chain = chain
            world.to_chain = await FaultProxy.start(lab.gateway, chain.address)
            stack.push_async_callback(world.to_chain.close)
            url = f"ws://{world.to_chain.address[0]}:{world.to_chain.address[1]}"
            directory = ["--substrate", url, "--substrate-timeout", "2"]
            directory += ["--twin-cache-ttl", str(self.chain_cache_ttl)]
        for name in self.names:
            to_redis = await FaultProxy.start(lab.gateway, redis.address)
            stack.push_async_callback(to_redis.close)
            args = [
                *directory,
                "--redis",
                f"redis://{to_redis.address[0]}:{to_redis.address[1]}/0",
                "--cluster-ttl",
                str(self.ttl),
                "--instance-id",
                name,
                *self.extra,
            ]
            await _instance(stack, world, name, args, to_redis=to_redis)
        return world


async def _add_tenants(twins: Path, tenants: Sequence[tuple[str, str]]) -> None:
    for tenant, secret in tenants:
        await _run(
            sys.executable, "-m", "rmb_relay", "tenants", "--twins", f"sqlite:{twins}",
            "add", tenant, "--secret", secret,
        )  # fmt: skip


async def _run(*argv: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv, env=relay_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.decode()}")


async def wait_until(predicate: object, timeout: float, step: float = 0.02) -> float:
    """Poll `predicate()` (sync or async) until true; returns the seconds it took, raises
    TimeoutError after `timeout` (for states no event announces: a Redis key)."""
    started = time.monotonic()
    async with asyncio.timeout(timeout):
        while True:
            result = predicate()  # type: ignore[operator]
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return time.monotonic() - started
            await asyncio.sleep(step)


class FederatedPair(_Maker):
    """`async with FederatedPair() as world:` two relays "a" and "b" without Redis, each
    serving its own domain (twin 1 on a's, twin 2 on b's) and posting to the other's through
    a proxy (`Instance.from_peers`): a partition between them is that proxy black-holed."""

    def __init__(self, *, extra: Sequence[str] = (), logs: Path | None = None) -> None:
        self.extra = extra
        super().__init__(logs)

    async def _build(self, stack: AsyncExitStack) -> World:
        lab = stack.enter_context(Lab())
        world = World(lab, None, None, self.logs)
        hosts = {name: lab.host(name) for name in ("a", "b")}
        # the peers' proxies first: their addresses are the domains
        peers = {}
        for name, host in hosts.items():
            target = (host.address, RELAY_PORT)
            peers[name] = await FaultProxy.start(lab.address(), target, port=RELAY_PORT)
            stack.push_async_callback(peers[name].close)
        domains = {name: proxy.address[0] for name, proxy in peers.items()}
        twins = self.logs / "twins.sqlite3"
        directory = SqliteTwinDirectory(twins)
        for twin, name in ((1, "a"), (2, "b")):
            key = key_for(twin, TWINS[twin]).public_key
            directory.add(Twin(twin, key, frozenset({domains[name]}), None))
        for name, host in hosts.items():
            args = ["--twins", f"sqlite:{twins}", "--twin-cache-ttl", "0"]
            args += [
                "-m",
                domains[name],
                "--federation-url-template",
                f"http://{{domain}}:{RELAY_PORT}/",
            ]
            await _instance(
                stack, world, name, [*args, *self.extra], from_peers=peers[name], host=host
            )
        return world


class ClusterInstances(_Maker):
    """`async with ClusterInstances(ttl=...) as world:` a Redis Cluster of `masters` primaries
    with one replica each, every node on its own host, and relay instances "a" and "b" on
    it (`--redis-cluster`; they reach the nodes directly: the cluster announces its nodes'
    addresses). `world.redis` is the first node; `world.nodes` all of them."""

    def __init__(
        self,
        *,
        ttl: float,
        masters: int = 3,
        node_timeout_ms: int = 1000,
        extra: Sequence[str] = (),
        logs: Path | None = None,
        tenants: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.ttl = ttl
        #: HTTP tunnel tenants (name, secret) in the instances' directory
        self.tenants = tenants
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.extra = extra
        super().__init__(logs)

    async def _build(self, stack: AsyncExitStack) -> World:
        lab = stack.enter_context(Lab())
        options: tuple[str, ...] = (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        )
        options += ("--cluster-node-timeout", str(self.node_timeout_ms))
        nodes = [
            await RedisNode(lab.host(f"redis{i}"), options).ready() for i in range(self.masters * 2)
        ]
        create = await asyncio.create_subprocess_exec(
            *("redis-cli", "--cluster", "create"),
            *(f"{node.host.address}:{node.port}" for node in nodes),
            *("--cluster-replicas", "1", "--cluster-yes"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(create.communicate(), 60)
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.decode()}")
        first = nodes[0]
        probe = RedisCluster(host=first.host.address, port=first.port, socket_timeout=5)
        stack.push_async_callback(probe.aclose)
        world = World(lab, first, probe, self.logs, nodes=nodes)
        await wait_until(lambda: cluster_settled(world), 60, step=0.1)
        twins = self.logs / "twins.sqlite3"
        twin_directory(twins)
        await _add_tenants(twins, self.tenants)
        for name in ("a", "b"):
            args = ["--twins", f"sqlite:{twins}", "--twin-cache-ttl", "0"]
            args += ["--redis", f"redis://{first.host.address}:{first.port}/0"]
            args += ["--redis-cluster", "--cluster-ttl", str(self.ttl)]
            args += ["--instance-id", name, *self.extra]
            await _instance(stack, world, name, args)
        return world


@dataclass(frozen=True)
class ClusterNode:
    node_id: str
    address: str
    master: bool
    #: the primary's id, for a replica
    of: str | None
    failed: bool
    slots: tuple[tuple[int, int], ...]


async def node_command(node: RedisNode, *args: str, timeout: float = 5.0) -> str:
    """One command to one node, its reply as text (a simple or bulk string; raises RedisError
    for an error reply, OSError / TimeoutError when the node does not answer). Raw RESP:
    redis-py parses CLUSTER NODES / INFO into shapes of its own."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(node.host.address, node.port)
        try:
            request = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
            writer.write(request.encode())
            head = (await reader.readline()).decode().rstrip("\r\n")
            if head.startswith("-"):
                raise RedisError(head[1:])
            if head.startswith("$"):
                size = int(head[1:])
                return "" if size < 0 else (await reader.readexactly(size + 2))[:-2].decode()
            return head[1:]
        finally:
            writer.close()


async def cluster_view(node: RedisNode) -> list[ClusterNode]:
    """CLUSTER NODES as `node` sees it (raises when it does not answer)."""
    text = await node_command(node, "CLUSTER", "NODES")
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        flags = fields[2].split(",")
        slots = []
        for item in fields[8:]:
            if item.startswith("["):
                continue
            low, _, high = item.partition("-")
            slots.append((int(low), int(high or low)))
        found.append(
            ClusterNode(
                fields[0],
                fields[1].split("@")[0],
                "master" in flags,
                None if fields[3] == "-" else fields[3],
                "fail" in flags or "fail?" in flags,
                tuple(slots),
            )
        )
    return found


async def cluster_settled(world: World) -> bool:
    """Every live node reports cluster_state:ok, every live replica is synced with its
    primary, and all 16384 slots are served by live primaries (live: not killed by the
    scenario)."""
    live = [node for node in world.nodes if node.process.poll() is None]
    try:
        for node in live:
            if "cluster_state:ok" not in await node_command(node, "CLUSTER", "INFO"):
                return False
            replication = await node_command(node, "INFO", "replication")
            if "role:slave" in replication and "master_link_status:up" not in replication:
                return False
        view = await cluster_view(live[0])
    except (OSError, TimeoutError, RedisError):
        return False
    addresses = {f"{node.host.address}:{node.port}" for node in live}
    masters = [n for n in view if n.master and not n.failed and n.address in addresses]
    covered = sum(high - low + 1 for n in masters for low, high in n.slots)
    return covered == 16384
