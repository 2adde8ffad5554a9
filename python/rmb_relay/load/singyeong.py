"""`rmb-load singyeong`: 신경 clients through the relay's gateway (`/gateway/websocket`).

Each generator process connects `--clients` receivers, identified in an application of its
own (`<--application>-<run id>-<first stream>`: no process's query matches another's clients,
no run reads a queue an earlier one left) with the integer metadata `id` = `n` = i and
`group` = i // `--group`, then its share of the `--senders` sender streams. Modes:

- `send_eq`: SEND to `id $eq k` (one receiver each, k cycling over the clients);
- `send_range`: SEND to `n $gte k, n $lt k+10` (the gateway picks one of the ten);
- `broadcast`: BROADCAST to `group $eq g`: `--group` deliveries per message (fan-out);
- `queue`: QUEUE to the first `--consumers` clients, which QUEUE_REQUEST, and ACK each
  message they get (with a new QUEUE_REQUEST); delivered = consumed and acknowledged.

Frames are built with the gateway's own codec (`dialects/singyeong/codec.py`, json or
msgpack) once per target, and only the payload string, a fixed-width stamp (stream, sequence
number, send time) padded to `--size` bytes, changes per message: a send batch is framed and
masked in one call (`_core.SingyeongBatch`) and written once. Receivers record inside
their websocket decoder's feed (`_core.StampScanner`, rust/load.rs: the stamp behind the
opening of the DISPATCH's payload string names its stream), one call into Rust per read;
frames without a stamp (heartbeat acks) still reach Python. QUEUE consumers decode each
message in Python: they answer it with its id. A password refused (the gateway admits the
client as restricted) and a refused IDENTIFY stop the run (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from rmb_relay._core import (
    ClientFrameEncoder,
    SingyeongBatch,
    StampScanner,
)
from rmb_relay.errors import ConfigError, HandshakeError
from rmb_relay.load.engine import Refused, Run, Settle, Stream, record_in_feed

MODES = ("send_eq", "send_range", "broadcast", "queue")
#: stream index (6 digits), sequence number (12), send time ns (20): the payload's first bytes
#: (rust/load.rs: `write_sg_stamp` writes them, `singyeong_stamp` reads them)
STAMP_WIDTH = 38
RANGE = 10
#: distinct SEND targets per sender (k cycles through these frames)
TEMPLATES = 4096
#: QUEUE_REQUESTs each consumer keeps outstanding (its share of the queue's capacity)
CONSUMER_CREDIT = 32
#: receivers connecting at once (thousands of handshakes in one burst overflow the backlog)
CONNECT_CONCURRENCY = 50
#: seconds to wait for HELLO and READY
HANDSHAKE_TIMEOUT = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="ws://127.0.0.1:8080/", help="relay websocket URL")
    parser.add_argument("--mode", choices=MODES, default="send_eq", help="what the senders do")
    parser.add_argument("--clients", type=int, default=10, help="receivers per generator process")
    parser.add_argument("--senders", type=int, default=1, help="sender streams")
    parser.add_argument(
        "--group", type=int, default=None, help="broadcast: clients per group (default all)"
    )
    parser.add_argument(
        "--consumers", type=int, default=None, help="queue: consuming clients (default <= 20)"
    )
    parser.add_argument("--encoding", choices=("json", "msgpack"), default="json")
    parser.add_argument("--application", default="rmb-load", help="application id prefix")
    parser.add_argument("--password", help="the gateway's password (IDENTIFY auth)")


@contextlib.contextmanager
def prepare(args: argparse.Namespace) -> Iterator[list[Any]]:
    if args.size is None:
        args.size = 64
    if not STAMP_WIDTH <= args.size <= 1 << 20:
        raise ConfigError(f"--size must be {STAMP_WIDTH}..{1 << 20} for singyeong")
    if args.clients < 1 or args.senders < 1:
        raise ConfigError("--clients and --senders must be positive")
    if args.mode == "send_range" and args.clients < RANGE:
        raise ConfigError(f"send_range needs --clients >= {RANGE}")
    group = args.group or args.clients
    if group < 1 or args.clients % group:
        raise ConfigError("--group must divide --clients")
    args.group = group
    args.consumers = min(args.clients, args.consumers or 20)
    # a run of its own: a queue left over from an earlier run (messages it never acked) must
    # not feed this one
    args.run_id = os.urandom(4).hex()
    yield list(range(args.senders))


def describe(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "url": args.url,
        "mode": args.mode,
        "encoding": args.encoding,
        "clients": args.clients,
        "streams": args.senders,
        **({"group": args.group} if args.mode == "broadcast" else {}),
        **({"consumers": args.consumers} if args.mode == "queue" else {}),
    }


def workload(args: argparse.Namespace, shares: list[int], run: Run) -> Gateway:
    return Gateway(args, shares, run)


def read_stamp(payload: bytes) -> tuple[int, int, int]:
    return int(payload[0:6]), int(payload[6:18]), int(payload[18:38])


class Client:
    """One gateway connection: the handshake, heartbeats, frames in both directions."""

    def __init__(self, gateway: Gateway, client_id: str, metadata: dict[str, int]) -> None:
        self.gateway = gateway
        self.client_id = client_id
        self.metadata = metadata
        self.ws: Any = None
        self.heartbeat: asyncio.TimerHandle | None = None

    async def connect(self, on_frame: Any) -> None:
        from rmb_relay.dialects.singyeong import codec
        from rmb_relay.dialects.singyeong.frames import Op
        from rmb_relay.sdk.websocket import WebSocketClient

        gw = self.gateway
        url = f"{gw.base}/gateway/websocket?encoding={gw.encoding.value}"
        started = time.perf_counter_ns()
        try:
            ws = self.ws = await WebSocketClient.connect(url)
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                hello = codec.decode(gw.encoding, (await ws.recv()).data)
                if hello.get("op") != Op.HELLO:
                    raise Refused(f"singyeong: {url} did not say HELLO: {hello}")
                identify: dict[str, Any] = {
                    "client_id": self.client_id,
                    "application_id": gw.application,
                    "metadata": {
                        k: {"type": "integer", "value": v} for k, v in self.metadata.items()
                    },
                }
                if gw.password is not None:
                    identify["auth"] = gw.password
                gw.write(ws, codec.encode(gw.encoding, {"op": Op.IDENTIFY, "d": identify}))
                ready = codec.decode(gw.encoding, (await ws.recv()).data)
        except (OSError, TimeoutError, ConnectionError, HandshakeError) as err:
            raise Refused(
                f"singyeong: gateway {url} unreachable: {err or type(err).__name__}"
            ) from None
        except codec.DecodeError as err:
            raise Refused(f"singyeong: {url}: undecodable frame: {err}") from None
        if ready.get("op") != Op.READY:
            raise Refused(f"singyeong: IDENTIFY refused by {url}: {ready.get('d')}")
        if gw.password is not None and (ready.get("d") or {}).get("restricted"):
            raise Refused(
                f"singyeong: password refused by {url} (the client was admitted as restricted)"
            )
        gw.run.stats.connect_ns.append(time.perf_counter_ns() - started)
        ws.on_message = on_frame
        interval = float((hello.get("d") or {}).get("heartbeat_interval", 45_000)) / 1000
        beat = codec.encode(gw.encoding, {"op": Op.HEARTBEAT, "d": {"client_id": self.client_id}})
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if ws.closed.done():
                return
            with contextlib.suppress(ConnectionError):
                gw.write(ws, beat)
            self.heartbeat = loop.call_later(interval * 0.8, tick)

        self.heartbeat = loop.call_later(interval * 0.8, tick)

    async def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        if self.ws is not None:
            await self.ws.close()


class Gateway:
    """This process's receivers and senders."""

    def __init__(self, args: argparse.Namespace, shares: list[int], run: Run) -> None:
        from rmb_relay.dialects.singyeong.codec import Encoding

        self.args = args
        self.run = run
        self.base = args.url.rstrip("/")
        self.encoding = Encoding(args.encoding)
        self.password: str | None = args.password
        self.application = f"{args.application}-{args.run_id}-{shares[0] if shares else 0}"
        self.queue = f"{self.application}-queue"
        self.size = run.plan.size
        self.streams: list[Stream] = [Sender(self, index, run) for index in shares]
        self.by_index = {stream.index: stream for stream in self.streams}
        #: what a receiver's stamp reader maps a stamp's stream index to (the copy rule)
        self.fanouts = {stream.index: stream.fanout for stream in self.streams}
        self.dialect = f"singyeong-{self.encoding.value}"
        self.receivers: list[Client] = []
        #: what every receiver's deliveries wake (made with the first receiver, in the loop)
        self.settle: Settle | None = None

    def write(self, ws: Any, data: bytes) -> None:
        if self.encoding.value == "json":
            ws.send_text(data.decode())
        else:
            ws.send_binary(data)

    async def connect(self) -> None:
        args, run = self.args, self.run
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

        async def one(i: int, client: Client) -> None:
            consumer = args.mode == "queue" and i < args.consumers
            async with gate:
                if consumer:
                    await client.connect(self._consume(client))
                    return
                stamps = StampScanner(run.recorder, self.fanouts, self.size, self.dialect, i)
                await client.connect(self._receive(stamps))
                self._read_stamps(client.ws, stamps)

        for i in range(args.clients):
            metadata = {"id": i, "n": i, "group": i // args.group}
            self.receivers.append(Client(self, f"receiver-{i}", metadata))
        await asyncio.gather(*(one(i, client) for i, client in enumerate(self.receivers)))
        for stream in self.streams:
            assert isinstance(stream, Sender)
            await stream.connect()
        if args.mode == "queue":
            from rmb_relay.dialects.singyeong.codec import encode

            request = encode(self.encoding, self._request_frame())
            for client in self.receivers[: args.consumers]:
                for _ in range(CONSUMER_CREDIT):
                    self.write(client.ws, request)

    def _request_frame(self) -> dict[str, Any]:
        return {"op": 4, "t": "QUEUE_REQUEST", "d": {"queue": self.queue}}

    def _read_stamps(self, client: Any, stamps: StampScanner) -> None:
        """From the next read on, `client`'s decoder records the stamps itself (each receiver
        sees each broadcast once: its copy is this receiver's), one call into Rust per read;
        the senders' windows are checked once per loop turn for all receivers."""
        if self.settle is None:
            streams = self.streams

            def settle() -> None:
                for stream in streams:
                    if stream.waiting:
                        stream.settled()

            self.settle = Settle(settle)
        record_in_feed(client, stamps, self.settle)

    def _receive(self, stamps: StampScanner) -> Any:
        """What the stamp reader left to Python: a frame decoded before it was set, or one
        without a stamp (a heartbeat ack)."""
        streams = self.streams

        def on_frame(message: Any) -> None:
            if stamps.record_message(message.data, time.time_ns()):
                for stream in streams:
                    if stream.waiting:
                        stream.settled()

        return on_frame

    def _consume(self, client: Client) -> Any:
        """A consumer: every QUEUE message is acknowledged and asked again for, and what one
        read brought is answered with one write (a write per message cost the generator more
        than the gateway spent on it)."""
        from rmb_relay.dialects.singyeong.codec import decode, encode

        run, size, encoding = self.run, self.size, self.encoding
        request = encode(encoding, self._request_frame())
        text = encoding.value == "json"
        pending: list[bytes] = []
        loop = asyncio.get_running_loop()

        def frame(data: bytes) -> bytes:
            encoder: ClientFrameEncoder = client.ws.encoder
            return encoder.text(data.decode()) if text else encoder.binary(data)

        def flush() -> None:
            frames = b"".join(pending)
            pending.clear()
            with contextlib.suppress(ConnectionError):
                client.ws.send_frames(frames)

        def on_frame(message: Any) -> None:
            body = message.data
            if b"QUEUE" not in body:
                return
            queued = decode(encoding, body)
            if queued.get("t") != "QUEUE":
                return
            now = time.time_ns()
            d = queued["d"]["payload"]  # the queued message: queue, payload, id, attempt
            index, seq, sent_ns = read_stamp(str(d["payload"]).encode())
            ack = {"op": 4, "t": "QUEUE_ACK", "d": {"queue": self.queue, "id": d["id"]}}
            if not pending:
                loop.call_soon(flush)
            pending.append(frame(encode(encoding, ack)))
            pending.append(frame(request))
            stream = self.by_index.get(index)
            if stream is not None:
                run.delivered(stream, sent_ns, now, size, seq)

        return on_frame

    async def close(self) -> None:
        for stream in self.streams:
            await stream.close()
        await asyncio.gather(*(c.close() for c in self.receivers), return_exceptions=True)


class Sender(Stream):
    """One sender stream: SEND, BROADCAST or QUEUE frames from prebuilt templates."""

    def __init__(self, gateway: Gateway, index: int, run: Run) -> None:
        super().__init__(index, run)
        self.gateway = gateway
        args = gateway.args
        if args.mode == "broadcast":
            self.fanout = args.group
        self.client = Client(gateway, f"sender-{index}", {})
        #: message i: template i % len, its payload the stamp then "#" padding (rust/load.rs)
        self.batch = SingyeongBatch(
            self._templates(),
            run.plan.size - STAMP_WIDTH,
            index,
            gateway.encoding.value == "json",
            os.urandom(32),
        )

    def _target(self, k: int) -> dict[str, Any]:
        args, app = self.gateway.args, self.gateway.application
        if args.mode == "send_eq":
            ops: list[dict[str, Any]] = [{"id": {"$eq": k % args.clients}}]
        elif args.mode == "send_range":
            low = k % (args.clients - RANGE + 1)
            ops = [{"n": {"$gte": low}}, {"n": {"$lt": low + RANGE}}]
        elif args.mode == "broadcast":
            ops = [{"group": {"$eq": k % (args.clients // args.group)}}]
        else:
            ops = [{"id": {"$lt": args.consumers}}]
        return {"application": app, "ops": ops}

    def _templates(self) -> list[tuple[bytes, bytes]]:
        """(bytes before the payload's text, bytes after it) per target."""
        from rmb_relay.dialects.singyeong.codec import encode

        gw, args = self.gateway, self.gateway.args
        marker = "#" * self.run.plan.size
        event = {"send_eq": "SEND", "send_range": "SEND", "broadcast": "BROADCAST"}.get(
            args.mode, "QUEUE"
        )
        count = 1 if args.mode == "queue" else min(TEMPLATES, args.clients)
        templates = []
        for k in range(count):
            d: dict[str, Any] = {"target": self._target(k * 7919), "nonce": None}
            if event == "QUEUE":
                d["queue"] = gw.queue
            d["payload"] = marker
            frame = encode(gw.encoding, {"op": 4, "t": event, "d": d})
            at = frame.index(marker.encode())
            templates.append((frame[:at], frame[at + len(marker) :]))
        return templates

    async def connect(self) -> None:
        await self.client.connect(self._on_frame)

    def _on_frame(self, message: Any) -> None:
        """The gateway writes to a sender to confirm a QUEUE or to report an error."""
        body = message.data
        if b"QUEUE_CONFIRM" in body or b"HEARTBEAT" in body or b'"op":6' in body:
            return
        from rmb_relay.dialects.singyeong.codec import decode

        frame = decode(self.gateway.encoding, body)
        if frame.get("op") in (3, 8):  # INVALID, ERROR
            d = frame.get("d") or {}
            self.run.refused(self, str(d.get("error", d)), self.fanout)

    def write(self, n: int) -> int:
        self.client.ws.send_frames(self.batch.frames(self.sent, n, time.time_ns()))
        return n

    @property
    def congested(self) -> bool:
        return bool(self.client.ws.congested)

    async def send(self, n: int) -> int:
        went = self.write(n)
        if self.congested:
            await self.client.ws.drain()
        return went

    async def close(self) -> None:
        await self.client.close()
