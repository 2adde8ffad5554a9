"""The baseline HTTP tunnel: the simplest tunnel a Python user would write with `aiohttp` (the
public HTTP side) and `websockets` (the connector's socket), for `bench/tunnel.py` to compare
rmb-relay's tunnel against. No tenants, tokens, TTL, large-body side channel or acks: one
JSON message per request and per response, bodies base64-encoded inline.

    python -m bench.baseline_tunnel server --port 9000
    python -m bench.baseline_tunnel connector --server ws://127.0.0.1:9000/connect \
        --target http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json

import aiohttp
import uvloop
import websockets
from aiohttp import web


async def serve(port: int) -> None:
    futures: dict[int, asyncio.Future[dict[str, object]]] = {}
    sockets: list[web.WebSocketResponse] = []
    ids = itertools.count()

    async def connect(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 30)
        await ws.prepare(request)
        sockets.append(ws)
        try:
            async for message in ws:
                reply = json.loads(message.data)
                future = futures.pop(reply["id"], None)
                if future is not None and not future.done():
                    future.set_result(reply)
        finally:
            sockets.remove(ws)
        return ws

    async def relay(request: web.Request) -> web.Response:
        if not sockets:
            return web.Response(status=503)
        request_id = next(ids)
        body = await request.read()
        future: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        futures[request_id] = future
        await sockets[request_id % len(sockets)].send_str(
            json.dumps(
                {
                    "id": request_id,
                    "method": request.method,
                    "path": request.match_info["path"],
                    "headers": {k: v for k, v in request.headers.items() if k.lower() != "host"},
                    "body": base64.b64encode(body).decode(),
                }
            )
        )
        reply = await future
        return web.Response(
            status=int(reply["status"]),  # type: ignore[call-overload]
            body=base64.b64decode(reply["body"]),  # type: ignore[arg-type]
            content_type="application/octet-stream",
        )

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/connect", connect)
    app.router.add_route("*", "/relay/{path:.*}", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def connector(server: str, target: str) -> None:
    async with (
        aiohttp.ClientSession() as session,
        websockets.connect(server, max_size=1 << 30) as ws,
    ):
        print("ready", flush=True)

        async def handle(message: dict[str, str]) -> None:
            skip = ("content-length", "transfer-encoding", "connection")
            async with session.request(
                message["method"],
                f"{target}/{message['path']}",
                headers={
                    k: v for k, v in dict(message["headers"]).items() if k.lower() not in skip
                },
                data=base64.b64decode(message["body"]),
            ) as reply:
                body = await reply.read()
            await ws.send(
                json.dumps(
                    {
                        "id": message["id"],
                        "status": reply.status,
                        "body": base64.b64encode(body).decode(),
                    }
                )
            )

        tasks = set()
        async for raw in ws:
            task = asyncio.get_running_loop().create_task(handle(json.loads(raw)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, required=True)
    c = sub.add_parser("connector")
    c.add_argument("--server", required=True)
    c.add_argument("--target", required=True)
    args = parser.parse_args()
    if args.role == "server":
        uvloop.run(serve(args.port))
    else:
        uvloop.run(connector(args.server, args.target))


if __name__ == "__main__":
    main()
