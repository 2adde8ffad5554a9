"""`rmb-load sbd`: pairs of fresh ed25519 identities forwarding through the relay.

A message is `receiver key (32) || seq, send time (16) || padding`, `--size` bytes in all (the
SBD limit is 20000 with the header). Receivers see the sender's key in the header and read the
stamp at offset 32. Run the relay with `--sbd-disable-rate-limit` to measure the relay rather
than the per-IP budget (all generator connections share one IP).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

from rmb_relay._core import (
    SBD_COMMAND,
    SBD_MAX_MESSAGE,
    SigningKey,
    WsMessage,
    sbd_classify,
    sbd_encode_command,
)
from rmb_relay.errors import ConfigError, HandshakeError
from rmb_relay.load.engine import Refused, Run, Streams
from rmb_relay.load.rmb import (
    MIN_SIZE,
    Endpoints,
    Pair,
    PairSpec,
    Template,
    check_size,
    closed_why,
)
from rmb_relay.sdk.websocket import WebSocketClient

HEADER = 32
SBD_MIN_SIZE = HEADER + MIN_SIZE


def key_segment(public_key: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(public_key).rstrip(b"=").decode()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="ws://127.0.0.1:8080/", help="relay websocket URL")
    parser.add_argument("--pairs", type=int, default=1, help="sender/receiver pairs")


@contextlib.contextmanager
def prepare(args: argparse.Namespace) -> Iterator[list[Any]]:
    if args.size is None:
        args.size = 1000
    check_size(args, SBD_MIN_SIZE, SBD_MAX_MESSAGE)
    if args.pairs < 1:
        raise ConfigError("--pairs must be positive")
    yield [PairSpec(i, 0, 0) for i in range(args.pairs)]


def describe(args: argparse.Namespace) -> dict[str, Any]:
    return {"url": args.url, "pairs": args.pairs}


def workload(args: argparse.Namespace, shares: list[PairSpec], run: Run) -> Streams:
    ends = Endpoints(args.url, args.url)
    return Streams([SbdPair(spec, ends, run) for spec in shares])


class SbdPair(Pair):
    """One sender/receiver pair of SBD clients."""

    def template(self) -> Template:
        self.keys = {
            "sender": SigningKey.ed25519(os.urandom(32)),
            "receiver": SigningKey.ed25519(os.urandom(32)),
        }
        return self.keys["receiver"].public_key, bytes(self.size - SBD_MIN_SIZE), None

    dialect = "sbd"

    async def connect(self) -> None:
        base = self.ends.url.rstrip("/")
        for role in ("receiver", "sender"):
            key = self.keys[role]
            started = time.perf_counter_ns()
            try:
                client = await WebSocketClient.connect(f"{base}/{key_segment(key.public_key)}")
                idle_ms = await _handshake(client, key)
            except (OSError, TimeoutError, ConnectionError, HandshakeError) as err:
                raise Refused(
                    f"sbd: relay {base} unreachable: {err or type(err).__name__}"
                ) from None
            client.on_message = self.on_receive if role == "receiver" else self._ignore
            if role == "receiver":
                self.read_stamps(client)
            self.run.stats.connect_ns.append(time.perf_counter_ns() - started)
            setattr(self, role, client)
            self.watch(client.closed, functools.partial(closed_why, client))
            # like the reference client: a `keep` every lidl/2 so an idle side is not dropped
            _keepalive(client, idle_ms / 2000)

    def on_receive(self, message: WsMessage) -> None:
        if sbd_classify(message.data).kind == SBD_COMMAND:
            return  # lbrt updates as connections come and go
        super().on_receive(message)

    def _ignore(self, message: WsMessage) -> None:
        pass


#: the reference client's default when the server sends no `lidl`
DEFAULT_IDLE_MS = 10_000
KEEP = sbd_encode_command(b"keep")


async def _handshake(client: WebSocketClient, key: SigningKey) -> int:
    """lbrt/areq -> ares -> lidl/srdy, per spec/sbd.md §1.4; returns the server's idle ms."""
    idle_ms = DEFAULT_IDLE_MS
    while True:
        message = await client.recv()
        classified = sbd_classify(message.data)
        if classified.kind != SBD_COMMAND:
            raise ConnectionError("sbd: forward before the handshake finished")
        if classified.tag == b"areq":
            client.send_binary(sbd_encode_command(b"ares", key.sign(classified.payload)))
        elif classified.tag == b"lidl":
            idle_ms = int.from_bytes(classified.payload, "big", signed=True)
        elif classified.tag == b"srdy":
            return idle_ms


def _keepalive(client: WebSocketClient, interval: float) -> None:
    loop = asyncio.get_running_loop()

    def tick() -> None:
        if client.closed.done():
            return
        with contextlib.suppress(ConnectionError):
            client.send_binary(KEEP)
        loop.call_later(interval, tick)

    loop.call_later(interval, tick)
