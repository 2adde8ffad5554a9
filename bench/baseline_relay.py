"""The baseline every load scenario is compared with: a minimal relay written with the
`websockets` library alone, the simplest thing a Python user would write.

- RMB at `/?<jwt>`: the claims are read (not verified: the baseline does the least work a
  relay must do), every binary message is parsed with the `protobuf` package to find its
  destination, and forwarded as received to a connected (twin, sid).
- SBD at `/<key>`: the lbrt/areq/ares/lidl/srdy handshake (ed25519 via `cryptography`), then
  forwards with the header rewritten to the sender's key. No rate limit.

    python -m bench.baseline_relay --port 8090
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from tests._proto import types_pb2
from websockets.asyncio.server import ServerConnection, serve

rmb_sessions: dict[tuple[int, str | None], ServerConnection] = {}
sbd_peers: dict[bytes, ServerConnection] = {}
ZERO28 = bytes(28)


def command(tag: bytes, payload: bytes = b"") -> bytes:
    return ZERO28 + tag + payload


async def rmb(ws: ServerConnection, query: str) -> None:
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(query.split(".")[1] + "=="))
    key = (int(claims["sub"]), claims.get("sid"))
    rmb_sessions[key] = ws
    try:
        async for message in ws:
            if isinstance(message, str):
                return
            env = types_pb2.Envelope.FromString(message)
            dest = env.destination
            target = rmb_sessions.get(
                (dest.twin, dest.connection if dest.HasField("connection") else None)
            )
            if target is not None:
                await target.send(message)
    finally:
        if rmb_sessions.get(key) is ws:
            del rmb_sessions[key]


async def sbd(ws: ServerConnection, key: bytes) -> None:
    nonce = os.urandom(32)
    await ws.send(command(b"lbrt", (1).to_bytes(4, "big")))
    await ws.send(command(b"areq", nonce))
    ready = False
    try:
        async for message in ws:
            data = message.encode() if isinstance(message, str) else message
            if data[:28] == ZERO28:
                if data[28:32] == b"ares" and not ready:
                    try:
                        Ed25519PublicKey.from_public_bytes(key).verify(data[32:], nonce)
                    except InvalidSignature:
                        return
                    await ws.send(command(b"lidl", (10000).to_bytes(4, "big")))
                    await ws.send(command(b"srdy"))
                    sbd_peers[key] = ws
                    ready = True
                continue
            target = sbd_peers.get(data[:32])
            if ready and target is not None:
                await target.send(key + data[32:])
    finally:
        if sbd_peers.get(key) is ws:
            del sbd_peers[key]


async def handler(ws: ServerConnection) -> None:
    path, _, query = ws.request.path.partition("?")
    if path == "/":
        await rmb(ws, query)
    else:
        await sbd(ws, base64.urlsafe_b64decode(path[1:] + "="))


async def main(port: int) -> None:
    async with serve(handler, "127.0.0.1", port, max_size=1 << 20, compression=None):
        print(f"baseline relay listening on 127.0.0.1:{port}", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8090)
    asyncio.run(main(parser.parse_args().port))
