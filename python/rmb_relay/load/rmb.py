"""`rmb-load rmb`: pairs of sender and receiver twins, one-way latency.

Cheap per message by construction, so the relay saturates before the generator does:
- each pair's envelope is built once with the SDK's `RmbClient` and only its payload, the last
  field on the wire, changes per message: `prefix + seq + send-time + padding`; unsigned on one
  relay or across instances (relays never verify signatures then), signed per message in Rust
  for federation (`--sign`, or `--domains` naming two domains: the receiving relay checks
  them), over the SDK's challenge around the payload (`sdk.envelope.challenge_around_payload`);
- every connection logs in through the SDK's `RelayLink` (the JWT, the log line, the keepalive
  an RMB twin keeps), then writes its batches on the link's websocket directly;
- a sender writes up to `engine.BATCH` messages as masked frames built in one Rust call
  (`_core.StampedBatch`: the template, each message's stamp written in) and one write;
- a receiver's websocket decoder reads the sequence number and send time from the payload's
  fixed offset and records the latency, for every message of a read in its one call into Rust
  (`_core.StampScanner`); no protobuf decode, and Python sees only what carries no stamp.

`--relays A,B` puts the senders on relay A and the receivers on relay B: two relays that
federate (give each its twins' domains with `--domains`), or two instances of one clustered
relay (cross-instance delivery). Envelopes may then arrive out of order (federation posts in
parallel, as rmb-rs); only a second copy counts as a duplicate.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rmb_relay._core import (
    STAMP_LEN,
    Envelope,
    SigningKey,
    StampedBatch,
    StampScanner,
    WsMessage,
)
from rmb_relay.errors import ConfigError, HandshakeError
from rmb_relay.load.engine import Refused, Run, Settle, Stream, Streams, record_in_feed
from rmb_relay.sdk import RelayLink, RmbClient
from rmb_relay.sdk.envelope import challenge_around_payload
from rmb_relay.sdk.websocket import WebSocketClient

#: every payload starts with its stamp: sequence number and send time (ns), little-endian
#: int64s, written and read by rust/load.rs
MIN_SIZE = STAMP_LEN
MAX_SIZE = 1 << 20
#: twin ids the harness provisions start here (far from real twins in a shared directory)
DEFAULT_TWIN_BASE = 1_000_000
#: the relay domain provisioned twins name unless --domains says otherwise
DEFAULT_DOMAIN = "load.local"


def load_key(twin: int) -> SigningKey:
    """The harness's deterministic identity for a twin id (ed25519: fast to derive)."""
    return SigningKey.ed25519(hashlib.sha256(f"rmb-load twin {twin}".encode()).digest())


@dataclass(frozen=True)
class PairSpec:
    index: int
    sender: int
    receiver: int


def closed_why(client: WebSocketClient) -> str:
    """How a stream's websocket ended (for a run's failure line)."""
    return f"websocket closed ({client.close_code}): {client.close_reason or 'connection closed'}"


@dataclass(frozen=True)
class Endpoints:
    """Where the pairs log in and with which keys (picklable: sent to generator processes)."""

    url: str
    receiver_url: str
    #: (twin, key type, 32 secret bytes) of identities taken from a file; others use load_key
    identities: tuple[tuple[int, str, bytes], ...] = ()
    #: each envelope is signed (federation: the receiving relay checks them)
    signed: bool = False

    def key(self, twin: int) -> SigningKey:
        for known, key_type, secret in self.identities:
            if known == twin:
                if key_type == "sr25519":
                    return SigningKey.sr25519(secret)
                return SigningKey.ed25519(secret)
        return load_key(twin)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="ws://127.0.0.1:8080/", help="relay websocket URL")
    parser.add_argument(
        "--relays",
        metavar="A,B",
        help="senders log in at relay A, receivers at relay B (federation, or two instances "
        "of one relay); replaces --url",
    )
    parser.add_argument(
        "--receiver-url", help="receivers connect here instead of --url (same as --relays)"
    )
    parser.add_argument("--pairs", type=int, default=1, help="sender/receiver pairs")
    parser.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        help="provision the pairs' twins in this directory (default: the relay's default file)",
    )
    parser.add_argument(
        "--domains",
        metavar="DA,DB",
        help="relay domains the provisioned senders and receivers name (federation: the two "
        f"relays' --domain); default {DEFAULT_DOMAIN} for both",
    )
    parser.add_argument(
        "--sign",
        action="store_true",
        help="sign each envelope (federation: the receiving relay checks signatures; ~30 us "
        "per message in the generator); on when --domains names two different domains",
    )
    parser.add_argument(
        "--twin-base", type=int, default=DEFAULT_TWIN_BASE, help="first twin id to provision"
    )
    parser.add_argument(
        "--no-provision",
        action="store_true",
        help="the twins already exist (e.g. a relay on another host)",
    )
    parser.add_argument(
        "--identities",
        type=Path,
        metavar="FILE",
        help='JSON list of {"twin": ID, "key_type": "sr25519|ed25519", "secret": "mnemonic or '
        "0x seed\"} of twins that exist in the relay's directory; consecutive entries are "
        "(sender, receiver) pairs; implies --no-provision and sets --pairs",
    )


def endpoints(args: argparse.Namespace) -> Endpoints:
    url, receiver_url = args.url, args.receiver_url or args.url
    if args.relays:
        parts = [part.strip() for part in args.relays.split(",")]
        if len(parts) != 2 or not all(parts):
            raise ConfigError("--relays takes two websocket URLs: A,B")
        url, receiver_url = parts
    return Endpoints(url, receiver_url, signed=args.sign or len(set(_domains(args))) > 1)


def _domains(args: argparse.Namespace) -> list[str]:
    domains: list[str] = (args.domains or f"{DEFAULT_DOMAIN},{DEFAULT_DOMAIN}").split(",")
    if len(domains) != 2 or not all(domains):
        raise ConfigError("--domains takes two relay domains: DA,DB")
    return domains


def _read_identities(path: Path) -> tuple[tuple[int, str, bytes], ...]:
    from rmb_relay.identity import secret_from_phrase

    try:
        entries = json.loads(path.read_text())
        identities = tuple(
            (int(e["twin"]), str(e.get("key_type", "sr25519")), secret_from_phrase(e["secret"]))
            for e in entries
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--identities {path}: {err}") from None
    if len(identities) < 2 or len(identities) % 2:
        raise ConfigError(f"--identities {path}: need an even number (>= 2) of identities")
    for _, key_type, _ in identities:
        if key_type not in ("sr25519", "ed25519"):
            raise ConfigError(f"--identities {path}: unknown key_type {key_type!r}")
    return identities


def _provision(args: argparse.Namespace, pairs: list[PairSpec]) -> None:
    from rmb_relay.twins import Twin
    from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path, parse_twins_url

    domains = _domains(args)
    path = parse_twins_url(args.twins) if args.twins else default_twins_path()
    directory = SqliteTwinDirectory(path)
    for pair in pairs:
        for twin, domain in ((pair.sender, domains[0]), (pair.receiver, domains[1])):
            directory.add(Twin(twin, load_key(twin).public_key, frozenset({domain})))


def check_size(args: argparse.Namespace, low: int, high: int) -> None:
    if args.size is None:
        return
    if not low <= args.size <= high:
        raise ConfigError(f"--size must be {low}..{high} for {args.dialect}")


@contextlib.contextmanager
def prepare(args: argparse.Namespace) -> Iterator[list[Any]]:
    if args.size is None:
        args.size = 1024
    check_size(args, MIN_SIZE, MAX_SIZE)
    if args.pairs < 1:
        raise ConfigError("--pairs must be positive")
    ends = endpoints(args)
    if args.identities is not None:
        identities = _read_identities(args.identities)
        args.endpoints = Endpoints(ends.url, ends.receiver_url, identities, ends.signed)
        pairs = [
            PairSpec(i, identities[2 * i][0], identities[2 * i + 1][0])
            for i in range(len(identities) // 2)
        ]
        args.pairs = len(pairs)
    else:
        args.endpoints = ends
        base = args.twin_base
        pairs = [PairSpec(i, base + 2 * i, base + 2 * i + 1) for i in range(args.pairs)]
        if not args.no_provision:
            _provision(args, pairs)
    yield list(pairs)


def describe(args: argparse.Namespace) -> dict[str, Any]:
    ends: Endpoints = args.endpoints
    described: dict[str, Any] = {"url": ends.url, "pairs": args.pairs}
    if ends.receiver_url != ends.url:
        described["receiver_url"] = ends.receiver_url
    if ends.signed:
        described["signed"] = True
    return described


def workload(args: argparse.Namespace, shares: list[PairSpec], run: Run) -> Streams:
    return Streams([Pair(spec, args.endpoints, run) for spec in shares])


#: (bytes before the stamp, bytes after it, how each message is signed: None, or the key, the
#: challenge before and after the payload and the signature's offset: `StampedBatch.sign_with`)
Template = tuple[bytes, bytes, tuple[SigningKey, bytes, bytes, int] | None]


class Pair(Stream):
    """One sender/receiver pair of twins."""

    def __init__(self, spec: PairSpec, ends: Endpoints, run: Run) -> None:
        super().__init__(spec.index, run)
        self.spec = spec
        self.ends = ends
        self.size = run.plan.size
        self.sender: WebSocketClient | None = None
        self.receiver: WebSocketClient | None = None
        self.links: list[RelayLink] = []
        prefix, padding, signing = self.template()
        self.batch = StampedBatch(prefix + bytes(STAMP_LEN) + padding, len(prefix), os.urandom(32))
        if signing is not None:
            self.batch.sign_with(*signing)
        self.stamps = StampScanner(run.recorder, spec.index, self.size, self.dialect)

    #: where the receivers' stamp reader finds the stamp (`_core.StampScanner`)
    dialect = "rmb"

    @property
    def sid(self) -> str:
        return f"load-{self.spec.index}"

    def template(self) -> Template:
        """(bytes before the stamp, bytes after it) of every message of this pair, and when
        they are signed (key, challenge before and after the payload, signature offset)."""
        spec, ends = self.spec, self.ends
        key = ends.key(spec.sender)
        client = RmbClient(spec.sender, key, sid=self.sid, sign=ends.signed)
        payload = bytes(self.size)
        env = client.envelope(spec.receiver, dest_sid=self.sid, expiration=3600)
        env.request.command = "load"
        env.plain = payload
        wire = client.seal(env)
        if not wire.endswith(payload):
            raise AssertionError("the payload must be the envelope's last field on the wire")
        prefix = wire[: len(wire) - self.size]
        signing = None
        if ends.signed:
            before, after = challenge_around_payload(env)
            signing = (key, before, after, prefix.index(env.signature))
        return prefix, bytes(self.size - MIN_SIZE), signing

    async def connect(self) -> None:
        for role, twin, url in (
            ("receiver", self.spec.receiver, self.ends.receiver_url),
            ("sender", self.spec.sender, self.ends.url),
        ):
            client = RmbClient(twin, self.ends.key(twin), sid=self.sid)
            link = RelayLink(
                url,
                client.login_token,
                self.on_receive if role == "receiver" else self.on_sender_message,
            )
            started = time.perf_counter_ns()
            try:
                await link.connect()
            except (OSError, TimeoutError, ConnectionError, HandshakeError) as err:
                raise Refused(
                    f"rmb: relay {url} unreachable: {err or type(err).__name__}"
                ) from None
            self.run.stats.connect_ns.append(time.perf_counter_ns() - started)
            self.links.append(link)
            setattr(self, role, link.ws)
            if link.ws is not None:
                self.watch(link.ws.closed, functools.partial(closed_why, link.ws))
            if role == "receiver":
                self.read_stamps(link.ws)

    def read_stamps(self, client: WebSocketClient | None) -> None:
        """From the next read on, `client`'s decoder records the stamps itself: one call into
        Rust per read, whatever the number of messages in it."""
        assert client is not None

        def settle() -> None:
            if self.waiting:
                self.settled()

        record_in_feed(client, self.stamps, Settle(settle))

    def on_receive(self, message: WsMessage) -> None:
        """What the stamp reader left to Python: a message decoded before it was set, or one
        without a stamp."""
        if self.stamps.record_message(message.data, time.time_ns()):
            if self.waiting:
                self.settled()
        else:
            self.run.stats.error("message without a stamp")

    def on_sender_message(self, message: WsMessage) -> None:
        """The relay only writes to a sender to report an error (rate limit, unknown twin...)."""
        try:
            env = Envelope.decode(message.data)  # Rust decode: no protobuf object needed here
            reason = env.error_message or "unexpected message"
        except ValueError:
            self.run.stats.error("undecodable message")
            return
        # without this, a window's worth of refused messages stalled the pair for good
        self.run.refused(self, reason)

    def write(self, n: int) -> int:
        sender = self.sender
        assert sender is not None
        sender.send_frames(self.batch.frames(self.sent, n, time.time_ns()))
        return n

    @property
    def congested(self) -> bool:
        return self.sender is not None and self.sender.congested

    async def send(self, n: int) -> int:
        went = self.write(n)
        if self.congested:
            assert self.sender is not None
            await self.sender.drain()
        return went

    async def close(self) -> None:
        for link in self.links:
            await link.close()
        for client in (self.sender, self.receiver):
            if client is not None:
                await client.close()
