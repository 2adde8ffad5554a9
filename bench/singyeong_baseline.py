"""The baseline for the 신경 scenarios: a minimal gateway written with the `websockets`
library alone, the simplest thing a Python user would write. JSON only; a query is matched by
scanning the application's clients with a small evaluator ($eq $ne $gt $gte $lt $lte $in);
SEND picks at random, BROADCAST sends to all; queues live in memory (confirm, request, ack).

    python -m bench.singyeong_baseline --port 8091
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from collections import deque
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

clients: dict[tuple[str, str], tuple[ServerConnection, dict[str, Any]]] = {}
by_app: dict[str, set[tuple[str, str]]] = {}
queues: dict[str, deque[dict[str, Any]]] = {}
waiting: dict[str, deque[ServerConnection]] = {}
unacked: dict[str, dict[str, Any]] = {}

OPS = {
    "$eq": lambda a, b: a == b,
    "$ne": lambda a, b: a != b,
    "$gt": lambda a, b: a > b,
    "$gte": lambda a, b: a >= b,
    "$lt": lambda a, b: a < b,
    "$lte": lambda a, b: a <= b,
    "$in": lambda a, b: a in b,
}


def frame(op: int, d: Any, t: str | None = None) -> str:
    return json.dumps({"op": op, "d": d, "t": t, "ts": int(time.time() * 1000)})


def matches(metadata: dict[str, Any], ops: list[dict[str, Any]]) -> bool:
    for condition in ops:
        for key, spec in condition.items():
            if key not in metadata:
                return False
            for op, value in spec.items():
                try:
                    if not OPS[op](metadata[key], value):
                        return False
                except TypeError:
                    return False
    return True


def find(target: dict[str, Any]) -> list[ServerConnection]:
    app = target.get("application")
    keys = by_app.get(app, set()) if app is not None else clients.keys()
    ops = target.get("ops") or []
    return [clients[k][0] for k in keys if matches(clients[k][1], ops)]


async def pump(name: str) -> None:
    queue, consumers = queues.get(name), waiting.get(name)
    while queue and consumers:
        message, ws = queue.popleft(), consumers.popleft()
        unacked[message["id"]] = message
        await ws.send(frame(4, {"target": None, "nonce": None, "payload": message}, "QUEUE"))


async def handler(ws: ServerConnection) -> None:
    await ws.send(frame(0, {"heartbeat_interval": 45000}))
    key = None
    try:
        async for raw in ws:
            msg = json.loads(raw)
            op, d = msg.get("op"), msg.get("d")
            if op == 1:
                key = (d["application_id"], d["client_id"])
                metadata = {k: v["value"] for k, v in (d.get("metadata") or {}).items()}
                clients[key] = (ws, metadata)
                by_app.setdefault(key[0], set()).add(key)
                await ws.send(frame(2, {"client_id": d["client_id"], "restricted": False}))
            elif op == 5:
                await ws.send(frame(6, {"client_id": key[1] if key else None}))
            elif op == 4:
                t = msg.get("t")
                if t in ("SEND", "BROADCAST"):
                    found = find(d["target"])
                    out = frame(
                        4, {"target": None, "nonce": d.get("nonce"), "payload": d["payload"]}, t
                    )
                    if not found:
                        await ws.send(frame(3, {"error": "no_route"}))
                    elif t == "SEND":
                        await random.choice(found).send(out)
                    else:
                        for receiver in found:
                            await receiver.send(out)
                elif t == "UPDATE_METADATA" and key is not None:
                    clients[key][1].update({k: v["value"] for k, v in d.items()})
                elif t == "QUEUE":
                    message = {
                        "queue": d["queue"],
                        "payload": d["payload"],
                        "id": str(uuid.uuid4()),
                    }
                    queues.setdefault(d["queue"], deque()).append(message)
                    await ws.send(
                        frame(
                            4,
                            {
                                "target": None,
                                "nonce": d.get("nonce"),
                                "payload": {"queue": d["queue"]},
                            },
                            "QUEUE_CONFIRM",
                        )
                    )
                    await pump(d["queue"])
                elif t == "QUEUE_REQUEST":
                    waiting.setdefault(d["queue"], deque()).append(ws)
                    await pump(d["queue"])
                elif t == "QUEUE_ACK":
                    unacked.pop(d["id"], None)
    finally:
        if key is not None:
            clients.pop(key, None)
            by_app.get(key[0], set()).discard(key)


async def main(port: int) -> None:
    async with serve(handler, "127.0.0.1", port, max_size=None, ping_interval=None):
        print(f"baseline singyeong gateway on 127.0.0.1:{port}", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8091)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(parser.parse_args().port))
