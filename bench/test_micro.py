"""Micro benchmarks: each group runs the Rust core and a pure-Python baseline on the same input.

Run with `make bench`; the ratio table is printed at the end and saved in bench/results/.
Every benchmark checks its result, so one that silently does nothing fails instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from bench.baselines import (
    PyFixedWindowLimiter,
    PyFrameDecoder,
    PyRouteTable,
    py_encode_binary,
    py_mask_frame,
)
from rmb_relay._core import (
    SBD_FORWARD,
    SBD_MAX_MESSAGE,
    ByteNanosLimiter,
    ClientFrameEncoder,
    Envelope,
    EnvelopeScanner,
    FixedWindowLimiter,
    RouteTable,
    SbdRouting,
    SbdScanner,
    WsDecoder,
    encode_binary,
    encode_binary_batch,
    sbd_classify,
    sbd_rewrite_forward,
    scan_envelope,
)

Bench = Callable[..., Any]


def measure(benchmark: Any, fn: Callable[[], Any], iterations: int = 1000) -> Any:
    """Many iterations per round, so the timer's own cost does not swamp sub-microsecond work."""
    return benchmark.pedantic(fn, iterations=iterations, rounds=30, warmup_rounds=2)


def sample_envelope(size: int = 1024) -> bytes:
    env = Envelope("c1b8a8c2-1234-4bd4-9a4e-0c2f53d1d5a1")
    env.tags = "fail-fast"
    env.timestamp = 1_700_000_000
    env.expiration = 300
    env.source_twin = 7
    env.source_connection = "app-1"
    env.dest_twin = 9
    env.dest_connection = "svc"
    env.kind = 1
    env.command = "calc.add"
    env.schema = "application/json"
    env.plain = os.urandom(size)
    env.signature = b"s" + os.urandom(64)
    return env.encode()


ENVELOPE = sample_envelope()


# ---- envelope scan vs the protobuf package's full parse ------------------------------------


@pytest.mark.benchmark(group="envelope scan (1 KiB)")
def test_scan_rust(benchmark: Bench) -> None:
    def scan() -> int:
        env = scan_envelope(ENVELOPE)
        return env.dest_twin + env.source_twin + len(env.uid) + env.kind

    assert measure(benchmark, scan) == 9 + 7 + 36 + 1


@pytest.mark.benchmark(group="envelope scan (1 KiB)")
def test_scan_python(benchmark: Bench) -> None:
    from tests._proto import types_pb2

    def parse() -> int:
        env = types_pb2.Envelope.FromString(ENVELOPE)
        env.HasField("tags")
        env.WhichOneof("message")
        env.timestamp + env.expiration
        env.source.HasField("connection")
        env.destination.HasField("connection")
        return env.destination.twin + env.source.twin + len(env.uid) + 1

    assert measure(benchmark, parse) == 9 + 7 + 36 + 1


# ---- the relay's real read path: decode 100 RMB frames and scan their envelopes -------------

RMB_READ = ClientFrameEncoder(os.urandom(32)).binary_batch([ENVELOPE] * 100)


@pytest.mark.benchmark(group="read path: decode + scan 100 x 1 KiB envelopes")
def test_read_path_rust(benchmark: Bench) -> None:
    decoder = WsDecoder(scanner=EnvelopeScanner())

    def read() -> int:
        total = 0
        for message in decoder.feed(RMB_READ):
            routing = message.routing
            total += routing.dest_twin + routing.kind  # what the relay's fast path reads
        return total

    assert measure(benchmark, read) == 100 * (9 + 1)


@pytest.mark.benchmark(group="read path: decode + scan 100 x 1 KiB envelopes")
def test_read_path_python(benchmark: Bench) -> None:
    from tests._proto import types_pb2

    decoder = PyFrameDecoder()

    def read() -> int:
        total = 0
        for payload in decoder.feed(RMB_READ):
            env = types_pb2.Envelope.FromString(payload)
            total += env.destination.twin + (env.WhichOneof("message") == "request")
        return total

    assert measure(benchmark, read) == 100 * (9 + 1)


# ---- the SBD read path: 100 forwards in one read, scanner vs one call per step per message ---
# Both sides run the Rust core; the "python" side is the path the SBD dialect took before the
# scanner: a feed, then limiter.check + sbd_classify + lookup_pubkey + sbd_rewrite_forward per
# message from Python. The scanner does all of it inside the one feed.

SBD_SENDER = bytes([2]) * 32
SBD_DEST = bytes([1]) * 32
SBD_IP = "::ffff:10.0.0.1"
SBD_READ = ClientFrameEncoder(os.urandom(32)).binary_batch([SBD_DEST + os.urandom(968)] * 100)
#: each round charges 100 kB at the same instant: a budget no run of the benchmark exhausts
SBD_BURST = 1 << 40


def sbd_routes() -> RouteTable:
    routes = RouteTable()
    routes.register_pubkey(SBD_DEST, 5)
    return routes


@pytest.mark.benchmark(group="SBD read path: 100 x 1000-byte forwards")
def test_sbd_read_scanner_rust(benchmark: Bench) -> None:
    scanner = SbdScanner(sbd_routes(), SBD_SENDER, ByteNanosLimiter(1, SBD_BURST), SBD_IP)
    scanner.ready = True
    decoder = WsDecoder(max_message=SBD_MAX_MESSAGE, scanner=scanner)
    (first, *_) = decoder.feed(SBD_READ, 1)
    assert first.data[:32] == SBD_SENDER, "forwards come out rewritten"

    def read() -> int:
        total = 0
        for message in decoder.feed(SBD_READ, 1):
            routing: SbdRouting = message.routing
            if routing.over_limit or routing.dest_conn_id is None:
                return -1
            total += routing.dest_conn_id + len(message.data)  # what the relay's fast path reads
        return total

    assert measure(benchmark, read) == 100 * (5 + 1000)


@pytest.mark.benchmark(group="SBD read path: 100 x 1000-byte forwards")
def test_sbd_read_per_message_python(benchmark: Bench) -> None:
    routes = sbd_routes()
    limiter = ByteNanosLimiter(1, SBD_BURST)
    decoder = WsDecoder(max_message=SBD_MAX_MESSAGE)

    def read() -> int:
        total = 0
        for message in decoder.feed(SBD_READ):
            data = message.data
            if not limiter.check(SBD_IP, len(data), 1):
                return -1
            classified = sbd_classify(data)
            if classified.kind != SBD_FORWARD:
                return -1
            conn_id = routes.lookup_pubkey(classified.peer)
            if conn_id is None:
                return -1
            total += conn_id + len(sbd_rewrite_forward(data, SBD_SENDER))
        return total

    assert measure(benchmark, read) == 100 * (5 + 1000)


# ---- websocket decode: 100 masked 1 KiB frames in one read ---------------------------------

FRAMES_1K = ClientFrameEncoder(os.urandom(32)).binary_batch([os.urandom(1024)] * 100)
FRAMES_64 = ClientFrameEncoder(os.urandom(32)).binary_batch([os.urandom(64)] * 100)


@pytest.mark.benchmark(group="ws decode 100 x 1 KiB")
def test_decode_1k_rust(benchmark: Bench) -> None:
    decoder = WsDecoder()
    assert len(measure(benchmark, lambda: decoder.feed(FRAMES_1K))) == 100


@pytest.mark.benchmark(group="ws decode 100 x 1 KiB")
def test_decode_1k_python(benchmark: Bench) -> None:
    decoder = PyFrameDecoder()
    assert len(measure(benchmark, lambda: decoder.feed(FRAMES_1K))) == 100


@pytest.mark.benchmark(group="ws decode 100 x 64 B")
def test_decode_64_rust(benchmark: Bench) -> None:
    decoder = WsDecoder()
    assert len(measure(benchmark, lambda: decoder.feed(FRAMES_64))) == 100


@pytest.mark.benchmark(group="ws decode 100 x 64 B")
def test_decode_64_python(benchmark: Bench) -> None:
    decoder = PyFrameDecoder()
    assert len(measure(benchmark, lambda: decoder.feed(FRAMES_64))) == 100


# ---- websocket encode ----------------------------------------------------------------------

PAYLOADS = [os.urandom(1024) for _ in range(100)]


@pytest.mark.benchmark(group="ws encode 100 x 1 KiB (server, one buffer)")
def test_encode_batch_rust(benchmark: Bench) -> None:
    assert len(measure(benchmark, lambda: encode_binary_batch(PAYLOADS))) == 100 * (1024 + 4)


@pytest.mark.benchmark(group="ws encode 100 x 1 KiB (server, one buffer)")
def test_encode_batch_python(benchmark: Bench) -> None:
    def encode() -> bytes:
        return b"".join([py_encode_binary(p) for p in PAYLOADS])

    assert len(measure(benchmark, encode)) == 100 * (1024 + 4)


@pytest.mark.benchmark(group="ws encode 1 x 1 KiB (server)")
def test_encode_one_rust(benchmark: Bench) -> None:
    assert len(measure(benchmark, lambda: encode_binary(PAYLOADS[0]))) == 1028


@pytest.mark.benchmark(group="ws encode 1 x 1 KiB (server)")
def test_encode_one_python(benchmark: Bench) -> None:
    assert len(measure(benchmark, lambda: py_encode_binary(PAYLOADS[0]))) == 1028


@pytest.mark.benchmark(group="ws encode 100 x 1 KiB (client, masked)")
def test_mask_rust(benchmark: Bench) -> None:
    encoder = ClientFrameEncoder(os.urandom(32))
    assert len(measure(benchmark, lambda: encoder.binary_batch(PAYLOADS))) == 100 * (1024 + 8)


@pytest.mark.benchmark(group="ws encode 100 x 1 KiB (client, masked)")
def test_mask_python(benchmark: Bench) -> None:
    mask = os.urandom(4)

    def encode() -> bytes:
        return b"".join([py_mask_frame(p, mask) for p in PAYLOADS])

    assert len(measure(benchmark, encode)) == 100 * (1024 + 8)


# ---- limiter and routes --------------------------------------------------------------------


@pytest.mark.benchmark(group="fixed-window limiter check")
def test_limiter_rust(benchmark: Bench) -> None:
    limiter = FixedWindowLimiter(1 << 30, 1 << 40, 60)
    assert measure(benchmark, lambda: limiter.check(7, 1024, 1_700_000_000)) is True


@pytest.mark.benchmark(group="fixed-window limiter check")
def test_limiter_python(benchmark: Bench) -> None:
    limiter = PyFixedWindowLimiter(1 << 30, 1 << 40, 60)
    assert measure(benchmark, lambda: limiter.check(7, 1024, 1_700_000_000)) is True


@pytest.mark.benchmark(group="route lookup (10k sessions)")
def test_routes_rust(benchmark: Bench) -> None:
    table = RouteTable()
    for twin in range(10_000):
        table.register_session(twin, "s", twin + 1)
    assert measure(benchmark, lambda: table.lookup_session(4242, "s")) == 4243


@pytest.mark.benchmark(group="route lookup (10k sessions)")
def test_routes_python(benchmark: Bench) -> None:
    table = PyRouteTable()
    for twin in range(10_000):
        table.register_session(twin, "s", twin + 1)
    assert measure(benchmark, lambda: table.lookup_session(4242, "s")) == 4243
