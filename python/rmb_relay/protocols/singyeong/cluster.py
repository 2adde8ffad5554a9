"""Several instances on one Redis form one gateway (decision 12): every instance keeps a
replica of every other instance's clients, so SEND, BROADCAST, selectors, `key` and the HTTP
query run locally over all clients, and a frame for a client held elsewhere goes to its
instance's channel.

Kept small and isolated so it can move onto a shared cluster layer (presence and per-instance
streams) when the relay has one: the dialect calls `joined`, `changed`, `left` and
`forward`, and reads remote clients from the same `ClientIndex` (their `node` is set).

Redis
-----
```text
sg:nodes              zset  node -> last beat (unix ms); a node silent for NODE_TIMEOUT is gone
sg:clients:NODE       hash  "app\\0client" -> client state (JSON), the snapshot a new node loads
sg:events             pub/sub: {"node", "kind": join|update|leave|gone, "client": state}
sg:deliver:NODE       pub/sub: {"t", "nonce", "payload", "to": [[app, client], ...]}
```
Each state carries a per-client `version`; a replica ignores anything older than what it
holds, so the snapshot and the live events can arrive in any order. Heartbeat times are not
replicated (they would cost a message per heartbeat). Pub/sub is at-most-once: a frame sent
while an instance's subscription is down is lost, like the public server's "at-least-zero"
SEND; queues (redis_queues.py) are the path that loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rmb_relay.protocols.singyeong.clients import Client

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient as Redis  # a server or a Cluster
    from rmb_relay.protocols.singyeong.clients import ClientIndex

log = logging.getLogger("rmb_relay.singyeong")

NODES = "sg:nodes"
EVENTS = "sg:events"
#: how often a node says it is alive (seconds)
BEAT_INTERVAL = 2.0
#: a node silent this long (ms) is taken for gone: its clients leave every replica
NODE_TIMEOUT_MS = 10_000


def _client_key(app_id: str, client_id: str) -> str:
    return f"{app_id}\0{client_id}"


def _state(client: Client) -> dict[str, Any]:
    return {
        "app_id": client.app_id,
        "client_id": client.client_id,
        "restricted": client.restricted,
        "encoding": client.encoding,
        "socket_ip": client.socket_ip,
        "metadata": client.metadata,
        "types": client.types,
        "queues": sorted(client.queues),
        "version": client.version,
    }


class SgCluster:
    def __init__(
        self,
        redis: Redis,
        node: str,
        index: ClientIndex,
        deliver_local: Callable[[list[Client], str, Any, Any], None],
        wall_ms: Callable[[], int],
    ) -> None:
        self.redis = redis
        self.node = node
        self.index = index
        self.deliver_local = deliver_local
        self.wall_ms = wall_ms
        self.ready = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._main: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._outbox: list[tuple[str, str]] = []  # (channel, message) written in order
        self._flushing = False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._main = loop.create_task(self._run())
        self._beat = loop.create_task(self._beat_loop())

    async def _run(self) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(EVENTS, f"sg:deliver:{self.node}")
                await self._load_snapshot()
                self.ready.set()
                async for item in pubsub.listen():
                    if item.get("type") == "message":
                        self._on_message(item["channel"], item["data"])
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.ready.clear()
                log.warning("singyeong cluster: %s; resubscribing", err)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _load_snapshot(self) -> None:
        now = self.wall_ms()
        entries: Any = await self.redis.zrange(NODES, 0, -1, withscores=True)
        for raw_node, beat in entries:
            node = raw_node.decode() if isinstance(raw_node, bytes) else str(raw_node)
            if node == self.node or now - beat > NODE_TIMEOUT_MS:
                continue
            for raw in (await self.redis.hgetall(f"sg:clients:{node}")).values():
                self._apply(node, json.loads(raw))

    async def _beat_loop(self) -> None:
        while True:
            try:
                now = self.wall_ms()
                await self.redis.zadd(NODES, {self.node: now})
                for raw_node in await self.redis.zrangebyscore(
                    NODES, "-inf", now - NODE_TIMEOUT_MS
                ):
                    node = raw_node.decode() if isinstance(raw_node, bytes) else str(raw_node)
                    await self.redis.zrem(NODES, node)
                    await self.redis.delete(f"sg:clients:{node}")
                    self._forget_node(node)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("singyeong cluster beat: %s", err)
            await asyncio.sleep(BEAT_INTERVAL)

    async def close(self) -> None:
        for task in (self._main, self._beat):
            if task is not None:
                task.cancel()
        with contextlib.suppress(Exception):
            await self._flush()
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(NODES, self.node)
                pipe.delete(f"sg:clients:{self.node}")
                pipe.publish(EVENTS, json.dumps({"node": self.node, "kind": "gone"}))
                await pipe.execute()
        for task in (self._main, self._beat, *self._tasks):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # ---- local changes out -----------------------------------------------------------------

    def _publish_state(self, kind: str, client: Client) -> None:
        client.version += 1
        state = _state(client)
        self._send(EVENTS, json.dumps({"node": self.node, "kind": kind, "client": state}))
        key = _client_key(client.app_id, client.client_id)
        if kind == "leave":
            self._outbox.append(("hdel", key))
        else:
            self._outbox.append(("hset", key + "\n" + json.dumps(state)))
        self._kick()

    def joined(self, client: Client) -> None:
        self._publish_state("join", client)

    def changed(self, client: Client) -> None:
        self._publish_state("update", client)

    def left(self, client: Client) -> None:
        self._publish_state("leave", client)

    def forward(self, receivers: list[Client], t: str, payload: Any, nonce: Any) -> None:
        """Frames for clients held by other instances, one message per instance."""
        by_node: dict[str, list[list[str]]] = {}
        for client in receivers:
            assert client.node is not None
            by_node.setdefault(client.node, []).append([client.app_id, client.client_id])
        for node, targets in by_node.items():
            body = {"t": t, "nonce": nonce, "payload": payload, "to": targets}
            self._send(f"sg:deliver:{node}", json.dumps(body, separators=(",", ":")))

    def _send(self, channel: str, message: str) -> None:
        self._outbox.append((channel, message))
        self._kick()

    def _kick(self) -> None:
        if not self._flushing:
            self._flushing = True
            task = asyncio.get_running_loop().create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        """Everything queued in this loop turn, in order, in one pipeline."""
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                async with self.redis.pipeline(transaction=False) as pipe:
                    for channel, message in batch:
                        if channel == "hset":
                            key, _, state = message.partition("\n")
                            pipe.hset(f"sg:clients:{self.node}", key, state)
                        elif channel == "hdel":
                            pipe.hdel(f"sg:clients:{self.node}", message)
                        else:
                            pipe.publish(channel, message)
                    await pipe.execute()
        except Exception as err:
            log.warning("singyeong cluster: publishing failed: %s", err)
        finally:
            self._flushing = False

    # ---- remote changes in -----------------------------------------------------------------

    def _on_message(self, channel: Any, data: Any) -> None:
        name = channel.decode() if isinstance(channel, bytes) else str(channel)
        try:
            body = json.loads(data)
        except ValueError:
            return
        if name == EVENTS:
            node = body.get("node")
            if node == self.node or not isinstance(node, str):
                return
            kind = body.get("kind")
            if kind == "gone":
                self._forget_node(node)
            elif kind == "leave":
                self._remove(node, body["client"])
            else:
                self._apply(node, body["client"])
            return
        receivers = [
            client
            for app_id, client_id in body.get("to", ())
            if (client := self.index.get(app_id, client_id)) is not None and client.node is None
        ]
        if receivers:
            self.deliver_local(receivers, body["t"], body.get("payload"), body.get("nonce"))

    def _apply(self, node: str, state: dict[str, Any]) -> None:
        existing = self.index.get(state["app_id"], state["client_id"])
        if existing is not None:
            if existing.node != node or existing.version >= state["version"]:
                return  # ours, another node's, or older than what we hold
            self.index.remove(existing)
        client = Client(
            state["app_id"],
            state["client_id"],
            restricted=state["restricted"],
            encoding=state["encoding"],
            socket_ip=state["socket_ip"],
        )
        client.node = node
        client.version = state["version"]
        client.types.update(state["types"])
        client.metadata.update(state["metadata"])
        client.queues.update(state["queues"])
        self.index.add(client)

    def _remove(self, node: str, state: dict[str, Any]) -> None:
        existing = self.index.get(state["app_id"], state["client_id"])
        if existing is not None and existing.node == node:
            self.index.remove(existing)

    def _forget_node(self, node: str) -> None:
        for client in [c for c in self.index.clients.values() if c.node == node]:
            self.index.remove(client)
