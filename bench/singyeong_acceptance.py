"""Issue #12's acceptance run, written only from the seed protocol document: it imports nothing
from rmb-relay (plain `websockets`, `json`, `msgpack`) and drives the gateway as any client
would. It starts a redis-server and two `rmb-relay serve` instances sharing it, then

1. connects 1,000 clients across both instances (json and msgpack), routes SEND by `$eq`, by
   range, by `$in`, with `$min`/`$avg` selectors and with `key`, and checks every receiver is
   a correct one;
2. queues 10,000 messages, consumes them with four consumers on both instances, kills one
   consumer mid-run, and checks every message was acked exactly once or sits in dead letters.

    .venv/bin/python -m bench.singyeong_acceptance        # ~1 minute; exit 0 when all holds
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import websockets
from tests.redis_process import free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 1000
MESSAGES = 10_000
REGIONS = ("eu", "us", "ap")


class Client:
    """One 신경 client: hello, identify, then frames in a background reader."""

    def __init__(self, url: str, encoding: str, index: int) -> None:
        self.url = f"{url}/gateway/websocket?encoding={encoding}"
        self.encoding = encoding
        self.index = index
        self.got: list[Any] = []
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ws: Any = None

    def pack(self, frame: dict[str, Any]) -> str | bytes:
        return json.dumps(frame) if self.encoding == "json" else msgpack.packb(frame)

    def unpack(self, data: str | bytes) -> dict[str, Any]:
        if self.encoding == "json":
            return dict(json.loads(data))
        return dict(msgpack.unpackb(data))

    async def send(self, op: int, d: Any, t: str | None = None) -> None:
        await self.ws.send(self.pack({"op": op, "d": d, "t": t}))

    async def start(self, app: str, client_id: str, metadata: dict[str, Any]) -> None:
        self.ws = await websockets.connect(self.url, max_size=None, ping_interval=None)
        hello = self.unpack(await self.ws.recv())
        assert hello["op"] == 0, hello
        await self.send(1, {"client_id": client_id, "application_id": app, "metadata": metadata})
        ready = self.unpack(await self.ws.recv())
        assert ready["op"] == 2, ready
        asyncio.get_running_loop().create_task(self.read())

    async def read(self) -> None:
        try:
            async for data in self.ws:
                frame = self.unpack(data)
                if frame["op"] == 4 and frame["t"] == "SEND":
                    self.got.append(frame["d"]["payload"])
                else:
                    await self.frames.put(frame)
        except websockets.ConnectionClosed:
            pass


def metadata_of(i: int) -> dict[str, Any]:
    return {
        "n": {"type": "integer", "value": i},
        "region": {"type": "string", "value": REGIONS[i % 3]},
        "load": {"type": "float", "value": round(random.random() * 100, 3)},
        "v": {"type": "version", "value": f"1.{i % 5}.0"},
    }


def http_json(url: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


async def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def routing(urls: list[str], api: list[str]) -> None:
    clients = [Client(urls[i % 2], "msgpack" if i % 4 == 3 else "json", i) for i in range(CLIENTS)]
    metadata = [metadata_of(i) for i in range(CLIENTS)]
    semaphore = asyncio.Semaphore(50)

    async def start(client: Client) -> None:
        async with semaphore:
            await client.start("acc", f"c{client.index}", metadata[client.index])

    await asyncio.gather(*(start(c) for c in clients))
    for url in api:  # both instances see all 1,000
        await wait_for(
            lambda url=url: (
                len(http_json(f"{url}/api/v1/query", {"application": "acc"})) == CLIENTS
            ),
            "replication",
        )
    sender = Client(urls[0], "json", -1)
    await sender.start("acc-sender", "sender", {})
    value = {i: {k: m["value"] for k, m in metadata[i].items()} for i in range(CLIENTS)}
    checks: dict[str, Any] = {}  # payload id -> predicate over the receiver index
    loads = {i: value[i]["load"] for i in range(CLIENTS)}
    us = [i for i in range(CLIENTS) if value[i]["region"] == "us"]
    mean = sum(loads[i] for i in us) / len(us)
    cases: list[tuple[dict[str, Any], Any]] = []
    for k in random.sample(range(CLIENTS), 40):
        cases.append(({"ops": [{"n": {"$eq": k}}]}, lambda i, k=k: i == k))
    for low in random.sample(range(CLIENTS - 10), 40):
        cases.append(
            (
                {
                    "ops": [
                        {"path": "/n", "op": "$gte", "to": {"value": low}},
                        {"path": "/n", "op": "$lt", "to": {"value": low + 10}},
                    ]
                },
                lambda i, low=low: low <= i < low + 10,
            )
        )
    for _ in range(40):
        cases.append(
            (
                {"ops": [{"region": {"$in": ["eu", "ap"]}}, {"v": {"$gte": "1.3.0"}}]},
                lambda i: value[i]["region"] in ("eu", "ap") and i % 5 >= 3,
            )
        )
    cases.append(
        (
            {"ops": [{"region": {"$eq": "us"}}], "selector": {"$min": "load"}},
            lambda i: i == min(us, key=lambda j: loads[j]),
        )
    )
    cases.append(
        (
            {"ops": [{"region": {"$eq": "us"}}], "selector": {"$avg": "load"}},
            lambda i: i == min(us, key=lambda j: abs(loads[j] - mean)),
        )
    )
    for n, (target, check) in enumerate(cases):
        checks[f"p{n}"] = check
        await sender.send(
            4,
            {"target": {"application": "acc", **target}, "nonce": None, "payload": f"p{n}"},
            "SEND",
        )
    # key: the same receiver every time, from either instance
    keyed = [sender, Client(urls[1], "json", -2)]
    await keyed[1].start("acc-sender", "sender-b", {})
    for n in range(20):
        checks[f"k{n}"] = "key"
        await keyed[n % 2].send(
            4,
            {"target": {"application": "acc", "key": "user-42"}, "nonce": None, "payload": f"k{n}"},
            "SEND",
        )
    await wait_for(lambda: sum(len(c.got) for c in clients) == len(checks), "every SEND")
    keyed_receivers = set()
    for client in clients:
        for payload in client.got:
            check = checks[payload]
            if check == "key":
                keyed_receivers.add(client.index)
            else:
                assert check(client.index), f"{payload} reached c{client.index}"
    assert len(keyed_receivers) == 1, keyed_receivers
    print(
        f"routing: {len(checks)} SENDs over 1,000 clients on 2 instances, every receiver correct",
        flush=True,
    )
    await queues(api, clients[:4], sender)
    for client in clients:
        await client.ws.close()


async def queues(api: list[str], consumers: list[Client], producer: Client) -> None:
    acked: dict[int, int] = {}
    target = {"application": "acc", "ops": [{"n": {"$lt": 4}}]}
    for start in range(0, MESSAGES, 1000):
        for n in range(start, start + 1000):
            await producer.send(
                4, {"queue": "acceptance", "target": target, "nonce": None, "payload": n}, "QUEUE"
            )
        for _ in range(1000):
            frame = await asyncio.wait_for(producer.frames.get(), 60)
            assert frame["t"] == "QUEUE_CONFIRM", frame
    doomed = consumers[0]

    async def consume(client: Client, limit: int | None) -> None:
        for _ in range(8):
            await client.send(4, {"queue": "acceptance"}, "QUEUE_REQUEST")
        taken = 0
        while True:
            try:
                frame = await asyncio.wait_for(client.frames.get(), 5)
            except TimeoutError:
                return
            body = frame["d"]["payload"]
            taken += 1
            if limit is not None and taken >= limit:
                client.ws.transport.abort()  # killed holding unacked messages
                return
            acked[body["payload"]] = acked.get(body["payload"], 0) + 1
            await client.send(4, {"queue": "acceptance", "id": body["id"]}, "QUEUE_ACK")
            await client.send(4, {"queue": "acceptance"}, "QUEUE_REQUEST")

    await asyncio.gather(consume(doomed, 1500), *(consume(c, None) for c in consumers[1:]))
    dead = http_json(f"{api[0]}/api/v1/queues/dead-letters?queue=acceptance")
    dead_ids = {letter["payload"] for letter in dead}
    lost = set(range(MESSAGES)) - set(acked) - dead_ids
    twice = [n for n, count in acked.items() if count > 1]
    print(
        f"queues: {MESSAGES:,} queued, {len(acked):,} acked, {len(dead_ids)} dead letters, "
        f"{len(lost)} lost, {len(twice)} acked twice (a consumer killed mid-run)",
        flush=True,
    )
    assert not lost, sorted(lost)[:20]
    assert not twice, twice[:20]


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        redis = start_redis(directory, durable=False)
        gateways = []
        urls = []
        try:
            for node in ("a", "b"):
                port = free_port()
                gateways.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "rmb_relay",
                            "serve",
                            "--no-sbd",
                            "-l",
                            f"127.0.0.1:{port}",
                            "--redis",
                            redis.url,
                            "--instance-id",  # the gateway's node name in a cluster
                            node,
                            "--max-connections-per-ip",
                            "100000",
                        ],
                        stdout=subprocess.PIPE,
                        stderr=open(f"/tmp/sg-acc-{node}.log", "w"),  # noqa: SIM115
                    )
                )
                assert gateways[-1].stdout is not None
                gateways[-1].stdout.readline()
                urls.append(f"ws://127.0.0.1:{port}")
            asyncio.run(routing(urls, [u.replace("ws://", "http://") for u in urls]))
        finally:
            for process in gateways:
                process.terminate()
                process.wait(20)
            redis.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
