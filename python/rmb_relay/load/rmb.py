"""RMB load generator: pairs of sender and receiver twins, one-way latency.

Cheap per message by construction, so the relay saturates before the generator does:
- each pair's envelope is built once with the SDK's `RmbClient` (unsigned: relays never verify
  signatures on the local path) and only its payload, the last field on the wire, changes per
  message: `prefix + seq + send-time + padding`;
- every connection logs in through the SDK's `RelayLink` (the JWT, the log line, the keepalive
  an RMB twin keeps), then writes its batches on the link's websocket directly;
- a sender writes up to `BATCH` messages as masked frames built in one Rust call and one write;
- a receiver reads the sequence number and send time from the payload's fixed offset; no
  protobuf decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import resource
import struct
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from rmb_relay._core import Envelope, SigningKey, WsMessage
from rmb_relay.load.stats import RunStats
from rmb_relay.sdk import RelayLink, RmbClient
from rmb_relay.sdk.websocket import WebSocketClient

#: messages written per batch (one transport.write)
BATCH = 64
#: a paced sender with nothing due sleeps until its next message is due, but at least this
#: long: shorter sleeps return at once (the loop's timers have millisecond resolution), so the
#: generator spun at 100% of its core at any rate and, with two generator processes on two
#: cores, took the relay's core (p99 3.5 ms at 100,000 msg/s, 0.3 ms without the spin)
PACE_TICK = 0.001
#: ... and at most this long, so a stop is noticed
PACE_MAX = 0.01
#: sequence number and send time (ns) at the start of every payload
STAMP = struct.Struct("<QQ")
MIN_SIZE = STAMP.size
#: how long to wait for in-flight messages after the senders stop
DRAIN_TIMEOUT = 5.0


def load_key(twin: int) -> SigningKey:
    """The harness's deterministic identity for a twin id (ed25519: fast to derive)."""
    return SigningKey.ed25519(hashlib.sha256(f"rmb-load twin {twin}".encode()).digest())


@dataclass(frozen=True)
class PairSpec:
    index: int
    sender: int
    receiver: int


@dataclass(frozen=True)
class LoadPlan:
    url: str
    size: int
    rate: float  # messages/s over all pairs of this process; 0 = as fast as the window allows
    window: int
    duration: float | None
    count: int | None  # messages per pair
    warmup: float
    record_samples: bool = False
    #: (twin, key type, 32 secret bytes) of identities taken from a file; others use load_key
    identities: tuple[tuple[int, str, bytes], ...] = ()
    #: receivers connect here instead of `url` (another instance of a cluster)
    receiver_url: str | None = None

    def key(self, twin: int) -> SigningKey:
        for known, key_type, secret in self.identities:
            if known == twin:
                if key_type == "sr25519":
                    return SigningKey.sr25519(secret)
                return SigningKey.ed25519(secret)
        return load_key(twin)


class Pair:
    """One sender/receiver pair and its counters."""

    def __init__(self, spec: PairSpec, plan: LoadPlan, stats: RunStats, run: Run) -> None:
        self.spec = spec
        self.plan = plan
        self.stats = stats
        self.run = run
        self.sent = 0
        self.delivered = 0
        #: messages the relay refused with an error envelope (rate limit, unknown twin...):
        #: they will never arrive, so they leave the window like delivered ones
        self.refused = 0
        self.next_seq = 0
        self.wakeup = asyncio.Event()
        self.sender: WebSocketClient | None = None
        self.receiver: WebSocketClient | None = None
        self.links: list[RelayLink] = []
        self.prefix, self.padding = self.template()

    @property
    def sid(self) -> str:
        return f"load-{self.spec.index}"

    def template(self) -> tuple[bytes, bytes]:
        """(bytes before the stamp, bytes after it) of every message of this pair."""
        spec, plan = self.spec, self.plan
        client = RmbClient(spec.sender, plan.key(spec.sender), sid=self.sid, sign=False)
        payload = bytes(plan.size)
        _, wire = client.request_envelope(
            spec.receiver, "load", payload, dest_sid=self.sid, expiration=3600
        )
        if not wire.endswith(payload):
            raise AssertionError("the payload must be the envelope's last field on the wire")
        return wire[: len(wire) - plan.size], bytes(plan.size - MIN_SIZE)

    async def connect(self) -> None:
        for role, twin in (("receiver", self.spec.receiver), ("sender", self.spec.sender)):
            client = RmbClient(twin, self.plan.key(twin), sid=self.sid)
            url = self.plan.url
            if role == "receiver" and self.plan.receiver_url:
                url = self.plan.receiver_url
            link = RelayLink(
                url,
                client.login_token,
                self.on_receive if role == "receiver" else self.on_sender_message,
            )
            started = time.perf_counter_ns()
            await link.connect()
            self.stats.connect_ns.append(time.perf_counter_ns() - started)
            self.links.append(link)
            setattr(self, role, link.ws)

    def on_receive(self, message: WsMessage) -> None:
        data = message.data
        now = time.time_ns()
        seq, sent_ns = STAMP.unpack_from(data, self.stamp_offset(data))
        if seq < self.next_seq:
            self.stats.duplicated += 1
            return
        self.next_seq = seq + 1
        self.delivered += 1
        run = self.run
        if run.measuring:
            stats = self.stats
            stats.measured += 1
            stats.bytes_delivered += self.plan.size
            latency = now - sent_ns
            stats.latencies_ns.append(latency)
            second = int(now / 1e9 - run.started_wall)
            stats.timeline[second] = stats.timeline.get(second, 0) + 1
            if run.samples is not None:
                run.samples.extend((sent_ns, self.spec.index, latency))
        self._settled()

    def _settled(self) -> None:
        if self.sent - self.delivered - self.refused <= self.plan.window // 2:
            self.wakeup.set()

    def stamp_offset(self, data: bytes) -> int:
        return len(data) - self.plan.size

    def on_sender_message(self, message: WsMessage) -> None:
        """The relay only writes to a sender to report an error (rate limit, unknown twin...)."""
        try:
            env = Envelope.decode(message.data)  # Rust decode: no protobuf object needed here
            self.stats.error(env.error_message or "unexpected message")
        except ValueError:
            self.stats.error("undecodable message")
            return
        # without this, a window's worth of refused messages stalled the pair for good
        self.refused += 1
        self._settled()

    async def send_loop(self, per_pair_rate: float) -> None:
        sender = self.sender
        assert sender is not None
        plan = self.plan
        loop = asyncio.get_running_loop()
        started = loop.time()
        prefix, padding, pack = self.prefix, self.padding, STAMP.pack
        while not self.run.stopping:
            if plan.count is not None and self.sent >= plan.count:
                break
            allowed = plan.window - (self.sent - self.delivered - self.refused)
            if per_pair_rate > 0:
                elapsed = loop.time() - started
                due = int(elapsed * per_pair_rate) - self.sent
                if due <= 0:
                    next_due = (self.sent + 1) / per_pair_rate - elapsed
                    await asyncio.sleep(min(PACE_MAX, max(PACE_TICK, next_due)))
                    continue
                allowed = min(allowed, due)
            if plan.count is not None:
                allowed = min(allowed, plan.count - self.sent)
            if allowed <= 0:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            n = min(allowed, BATCH)
            now = time.time_ns()
            seq = self.sent
            sender.send_binaries([prefix + pack(seq + i, now) + padding for i in range(n)])
            self.sent += n
            await sender.drain()
            await asyncio.sleep(0)

    async def close(self) -> None:
        for link in self.links:
            await link.close()
        for client in (self.sender, self.receiver):
            if client is not None:
                await client.close()


class Run:
    """Shared run state: are we still warming up, and when did measuring start."""

    def __init__(self, record_samples: bool) -> None:
        self.measuring = False
        self.stopping = False
        self.started_wall = time.time()
        self.samples: array[int] | None = array("q") if record_samples else None


async def run_pairs(
    plan: LoadPlan,
    specs: list[PairSpec],
    progress: Callable[[int, int], None] | None = None,
    pair_class: type[Pair] | None = None,
) -> tuple[RunStats, array[int] | None]:
    """Run this process's share of the pairs; returns its stats (and optional samples)."""
    stats = RunStats()
    run = Run(plan.record_samples)
    make = pair_class or Pair
    pairs = [make(spec, plan, stats, run) for spec in specs]
    wall0, cpu0 = time.perf_counter(), _cpu()
    try:
        await asyncio.gather(*(pair.connect() for pair in pairs))
    except (OSError, TimeoutError) as err:
        stats.error(f"connect failed: {err}")
        for pair in pairs:
            await pair.close()
        return stats, run.samples
    per_pair_rate = plan.rate / len(pairs) if plan.rate > 0 and pairs else 0.0
    senders = [asyncio.create_task(pair.send_loop(per_pair_rate)) for pair in pairs]
    loop = asyncio.get_running_loop()
    if plan.warmup > 0:
        await asyncio.sleep(plan.warmup)
    run.measuring = True
    run.started_wall = time.time()
    measure_start = loop.time()
    deadline = measure_start + plan.duration if plan.duration else None
    while True:
        if progress is not None:
            progress(sum(p.sent for p in pairs), sum(p.delivered for p in pairs))
        if deadline is not None and loop.time() >= deadline:
            break
        if all(task.done() for task in senders):
            break
        await asyncio.sleep(0.25)
    run.stopping = True
    for pair in pairs:
        pair.wakeup.set()
    await asyncio.gather(*senders, return_exceptions=True)
    stats.measure_seconds = loop.time() - measure_start
    # in-flight messages arrive after the senders stop; wait for them (bounded)
    drained = asyncio.Event()
    give_up = loop.time() + DRAIN_TIMEOUT

    def check_drained() -> None:
        if all(p.delivered >= p.sent for p in pairs):
            drained.set()
        elif loop.time() < give_up:
            loop.call_later(0.02, check_drained)

    check_drained()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT)
    stats.sent = sum(p.sent for p in pairs)
    stats.delivered = sum(p.delivered for p in pairs)
    if progress is not None:
        progress(stats.sent, stats.delivered)
    for pair in pairs:
        await pair.close()
    stats.wall_seconds = time.perf_counter() - wall0
    stats.cpu_seconds = _cpu() - cpu0
    return stats, run.samples


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
