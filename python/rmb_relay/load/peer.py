"""`rmb-load peer`: msgbus round trips through the rmb-peers of a running deployment, as any
client sees them: plain JSON over Redis (docs/peer.md, "The msgbus").

A request is `LPUSH`ed to `msgbus.system.local` on the sending peer's Redis (`--redis`), names
`--dst` and `--command`, and its reply comes back on this process's return queue; latency is
the round trip. With `--serve-redis` (the destination peer's Redis) the generator is also the
service: it pops `msgbus.<command>` there and answers each request with its own data on
`msgbus.system.reply`; without it, something at the destination must answer the command.

Each stream is one client with up to `--window` requests out; its sequence number and send
time travel in the request's `ref`, which the peer hands back. A reply with `err` counts as
an error (by code and message). A Redis that does not answer stops the run (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from rmb_relay.errors import ConfigError, RedisUnavailable
from rmb_relay.load.engine import Refused, Run, Stream
from rmb_relay.sdk.msgbus import command_queue
from rmb_relay.sdk.resp import RespClient

LOCAL = b"msgbus.system.local"
REPLY = b"msgbus.system.reply"
#: replies (or requests) popped per Redis round trip
POP_BATCH = 256
#: BRPOP's timeout (seconds): how long a stopping reader may wait for its last pop
POP_TIMEOUT = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis", default="redis://127.0.0.1:6379", help="the sending peer's Redis"
    )
    parser.add_argument(
        "--serve-redis",
        help="the destination peer's Redis: answer --command there (an echo service)",
    )
    parser.add_argument("--dst", type=int, required=True, help="the destination twin")
    parser.add_argument("--command", default="rmb-load.echo", help="the request's cmd")
    parser.add_argument("--clients", type=int, default=1, help="client streams")
    parser.add_argument("--expiration", type=int, default=300, help="request exp (seconds)")


@contextlib.contextmanager
def prepare(args: argparse.Namespace) -> Iterator[list[Any]]:
    if args.size is None:
        args.size = 100
    if not 0 <= args.size <= 1 << 20:
        raise ConfigError("--size must be 0..1 MiB for peer")
    if args.clients < 1:
        raise ConfigError("--clients must be positive")
    args.run_id = os.urandom(4).hex()
    yield list(range(args.clients))


def describe(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "url": args.redis,
        "serve_redis": args.serve_redis,
        "dst": args.dst,
        "command": args.command,
        "streams": args.clients,
    }


def workload(args: argparse.Namespace, shares: list[int], run: Run) -> Msgbus:
    return Msgbus(args, shares, run)


class Msgbus:
    """This process's clients, their return queue's reader and, optionally, the service."""

    def __init__(self, args: argparse.Namespace, shares: list[int], run: Run) -> None:
        self.args = args
        self.run = run
        self.ret = f"rmb-load.{args.run_id}.{shares[0] if shares else 0}"
        self.redis = RespClient(args.redis)
        self.reader = self.redis.blocking()
        self.served = RespClient(args.serve_redis) if args.serve_redis else None
        self.streams: list[Stream] = [Client(self, index, run) for index in shares]
        self.by_index = {stream.index: stream for stream in self.streams}
        self.tasks: list[asyncio.Task[None]] = []

    async def connect(self) -> None:
        clients = [(self.args.redis, self.redis), (self.args.redis, self.reader)]
        if self.served is not None:
            clients.append((self.args.serve_redis, self.served))
        for url, client in clients:
            try:
                await client.execute((b"PING",))
            except RedisUnavailable as err:
                raise Refused(f"peer: redis {url} does not answer: {err}") from None
        loop = asyncio.get_running_loop()
        self.tasks.append(loop.create_task(self._read()))
        if self.served is not None:
            self.tasks.append(loop.create_task(self._serve(self.served)))

    async def _read(self) -> None:
        run, by_index, size = self.run, self.by_index, self.run.plan.size
        ret = self.ret.encode()
        try:
            while True:
                popped, more = await self.reader.pipeline(
                    [(b"BRPOP", ret, POP_TIMEOUT), (b"RPOP", ret, POP_BATCH)]
                )
                if popped is None:
                    continue
                now = time.time_ns()
                for raw in [popped[1], *(more or ())]:
                    reply = json.loads(raw)
                    index, seq, sent_ns = (int(x) for x in str(reply["ref"]).split(":"))
                    stream = by_index.get(index)
                    if stream is None:
                        continue
                    err = reply.get("err")
                    if err:
                        run.refused(stream, f"{err.get('code')} {err.get('message')}")
                    else:
                        run.delivered(stream, sent_ns, now, size, seq)
        except RedisUnavailable as err:
            if not run.stopping:
                run.fail(f"peer: redis {self.args.redis} failed: {err}")

    async def _serve(self, redis: RespClient) -> None:
        """The echo service: pops requests in batches, answers each batch in one pipeline."""
        blocking = redis.blocking()
        queue = command_queue(self.args.command)
        try:
            while True:
                popped, more = await blocking.pipeline(
                    [(b"BRPOP", queue, POP_TIMEOUT), (b"RPOP", queue, POP_BATCH)]
                )
                if popped is None:
                    continue
                now = int(time.time())
                replies = [REPLY]
                for raw in [popped[1], *(more or ())]:
                    request = json.loads(raw)
                    reply = {
                        "ver": 1,
                        "ref": request["ref"],
                        "dat": request["dat"],
                        "dst": request["src"],
                        "shm": None,
                        "now": now,
                    }
                    replies.append(json.dumps(reply, separators=(",", ":")).encode())
                await redis.pipeline([(b"LPUSH", *replies)])
        except RedisUnavailable as err:
            if not self.run.stopping:
                self.run.fail(f"peer: redis {self.args.serve_redis} failed: {err}")
        finally:
            await blocking.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for client in (self.redis, self.reader, self.served):
            if client is not None:
                await client.close()


class Client(Stream):
    """One msgbus client: its requests go out in one LPUSH per batch."""

    def __init__(self, bus: Msgbus, index: int, run: Run) -> None:
        super().__init__(index, run)
        self.bus = bus
        args = bus.args
        dat = base64.b64encode(os.urandom(run.plan.size)).decode()
        # everything but the ref and the time, as JSON text around them
        self.before = '{"ver":1,"ref":"'
        self.after = (
            f'","cmd":{json.dumps(args.command)},"exp":{args.expiration},"dat":"{dat}",'
            f'"tag":null,"dst":[{args.dst}],"ret":"{bus.ret}","shm":null,"now":'
        )

    async def send(self, n: int) -> int:
        now_ns, seq, index = time.time_ns(), self.sent, self.index
        now = now_ns // 1_000_000_000
        before, after = self.before, self.after
        messages = [
            f"{before}{index}:{i}:{now_ns}{after}{now}}}".encode() for i in range(seq, seq + n)
        ]
        try:
            await self.bus.redis.pipeline([(b"LPUSH", LOCAL, *messages)])
        except RedisUnavailable as err:
            raise ConnectionError(f"redis {self.bus.args.redis}: {err}") from None
        return n
