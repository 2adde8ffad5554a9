"""A Hypothesis-driven fuzzer for the Python dialect layer, over real sockets (issue 9).

One `rmb-relay` process serves every dialect on one listener (RMB with an in-memory mailbox,
SBD without rate limits), as users run it, for the whole module; its RSS is measured from /proc.
Each example opens a connection and sends what Hypothesis makes of it: HTTP heads built from
the grammar's parts and from the seed corpus (`fuzz/corpus/http_request`), websocket frames
with any header bits after a real RMB login, RMB envelopes with any routing fields (and raw
bytes) inside well-formed frames, and SBD messages after a real handshake. Then it half-closes
and reads until the relay closes.

What must hold, for every input: the relay answers or closes (no hang), never logs an error
or a traceback, keeps no connection or session behind once the client is gone, and still
answers `/health`. The budget keeps `make test` fast (RMB_FUZZ_EXAMPLES examples per test,
default 60); `make fuzz-sockets` runs the same tests with many more, in chunks of 25,000
(docs/hardening.md has figures).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import string
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmb_relay._core import ClientFrameEncoder, SigningKey, sbd_encode_command
from rmb_relay.identity import make_jwt
from rmb_relay.sdk.envelope import Envelope
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT
from tests.helpers import RawWebSocket, eventually, http_exchange
from tests.relay_process import RelayProcess
from tests.rmb_fixtures import key_for
from tests.sbd_client import SbdClient, key_path
from tests.scrape import scrape

EXAMPLES = int(os.environ.get("RMB_FUZZ_EXAMPLES", "60"))
#: a long run is cut into chunks (a parametrized test each) so that Hypothesis's own memory,
#: which grows with the examples of one run, starts afresh; the relay process runs through all
CHUNK = 25_000
CHUNKS = max(1, -(-EXAMPLES // CHUNK))
FUZZ = settings(
    max_examples=-(-EXAMPLES // CHUNKS),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
chunks = pytest.mark.parametrize("chunk", range(CHUNKS))
CORPUS = Path(__file__).parent.parent / "fuzz" / "corpus"


def corpus(target: str, cut: bool) -> list[bytes]:
    """The seed corpus of a Rust fuzz target (without the split byte where it has one)."""
    seeds = sorted((CORPUS / target).iterdir())
    return [path.read_bytes()[1:] if cut else path.read_bytes() for path in seeds]


@dataclass
class FuzzRelay:
    address: tuple[str, int]


class Progress:
    """Examples sent so far and the relay's RSS along the run: at the start, after the first
    tenth (warm-up: its caches and pools exist by then, so what grows after it is what a
    longer run would keep growing) and now."""

    def __init__(self) -> None:
        self.examples = 0
        self.relay: RelayProcess | None = None
        self.rss_start = 0.0
        self.rss_warm: float | None = None
        self.last_rss = 0.0

    def begin(self, relay: RelayProcess) -> None:
        self.relay = relay
        self.rss_start = relay.rss_mib()

    def count(self) -> None:
        self.examples += 1
        if (
            self.rss_warm is None
            and self.relay is not None
            and self.examples >= max(1, 4 * EXAMPLES // 10)
        ):
            self.rss_warm = self.relay.rss_mib()


PROGRESS = Progress()


@pytest.fixture(scope="module")
def relay_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    """One `rmb-relay` process serving every dialect for the whole module, as users run it
    (RMB with an in-memory mailbox and small budgets, SBD without rate limits), so that its
    RSS is its own and is followed across every example of every test."""
    path = tmp_path_factory.mktemp("fuzz") / "twins.sqlite3"
    with SqliteTwinDirectory(path) as directory:
        for twin_id in (1, 2, 3):
            directory.add(
                Twin(twin_id, key_for(twin_id).public_key, frozenset({"relay.test"}), None)
            )
    relay = RelayProcess(
        "--twins",
        f"sqlite:{path}",
        "--mailbox-twin-bytes",
        str(1 << 20),
        "--mailbox-total-bytes",
        str(4 << 20),
        "--max-message",
        str(64 << 10),
        "--http-idle-timeout",
        str(WAIT),
        "--sbd-disable-rate-limit",
        "--max-connections-per-ip",
        "100000",
        keep_log=False,
    )
    PROGRESS.begin(relay)
    try:
        yield relay
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
        report = os.environ.get("RMB_FUZZ_REPORT")
        if report:  # `make fuzz`: how the relay's memory moved over the run
            warm = PROGRESS.rss_warm
            append(
                report,
                f"{PROGRESS.examples} examples through the sockets, 0 errors or tracebacks in "
                f"the relay's log; relay RSS {PROGRESS.rss_start:.1f} MiB at the start, "
                f"{'n/a' if warm is None else f'{warm:.1f}'} after {4 * EXAMPLES // 10} "
                f"examples, {PROGRESS.last_rss:.1f} MiB at the end\n",
            )
    finally:
        relay.close()


async def idle(relay: RelayProcess) -> bool:
    """No websocket connection or session left, and only our own scrape connected."""
    page = await scrape(*relay.address)
    open_ws = sum(
        page.value("rmb_relay_connections", **labels)
        for labels in page.series("rmb_relay_connections")
        if labels["dialect"] != "http"
    )
    sessions = sum(
        page.value("rmb_relay_sessions", **labels) for labels in page.series("rmb_relay_sessions")
    )
    return open_ws == 0 and sessions == 0


@pytest.fixture
async def relay(relay_process: RelayProcess) -> AsyncIterator[FuzzRelay]:
    """The shared relay, checked after each test: no error or traceback logged, nothing left
    behind once every client is gone, still serving."""
    problems = len(relay_process.problems)
    yield FuzzRelay(relay_process.address)
    assert relay_process.problems[problems:] == []
    await eventually(lambda: idle(relay_process))
    health = await http_exchange(
        *relay_process.address, b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"
    )
    assert health.startswith(b"HTTP/1.1 200 ")
    PROGRESS.last_rss = relay_process.rss_mib()


def append(path: str, line: str) -> None:
    with open(path, "a") as out:
        out.write(line)


async def send_and_read_to_eof(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> bytes:
    """Send, half-close, and read until the relay closes (a hang fails the example)."""
    PROGRESS.count()
    try:
        writer.write(data)
        if writer.can_write_eof():
            writer.write_eof()
        chunks = []
        while chunk := await asyncio.wait_for(reader.read(65536), WAIT):
            chunks.append(chunk)
        return b"".join(chunks)
    except (ConnectionResetError, BrokenPipeError):
        return b""  # the relay dropped us: an answer too
    finally:
        writer.close()


# ---- HTTP heads ------------------------------------------------------------------------------

SBD_PATH = key_path(SigningKey.ed25519(hashlib.sha256(b"fuzz sbd").digest()).public_key)
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="
texts = st.text(alphabet=string.printable + "\x00\x7f\u00e9\ud800", max_size=24)
methods = st.sampled_from(["GET", "HEAD", "POST", "PUT", "OPTIONS", "BREW", "get", ""]) | texts
paths = (
    st.sampled_from(["/", "/health", "/metrics", "/?a.b.c", SBD_PATH, "/authenticate", "*"]) | texts
)
header_names = (
    st.sampled_from(
        [
            "Host",
            "Content-Length",
            "Transfer-Encoding",
            "Upgrade",
            "Connection",
            "Sec-WebSocket-Key",
            "Sec-WebSocket-Version",
            "Expect",
            "Authorization",
        ]
    )
    | texts
)
header_values = (
    st.sampled_from(
        [
            "relay",
            "0",
            "5",
            "-1",
            "chunked",
            "gzip, chunked",
            "websocket",
            "Upgrade",
            "13",
            "100-continue",
            WS_KEY,
            "Bearer x",
            "99999999999999999999",
        ]
    )
    | texts
)
line_ends = st.sampled_from(["\r\n", "\n", "\r", ""])


@st.composite
def http_heads(draw: st.DrawFn) -> bytes:
    eol = draw(line_ends)
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1 ", ""]))
    lines = [f"{draw(methods)} {draw(paths)} {version}"]
    for name, value in draw(st.lists(st.tuples(header_names, header_values), max_size=8)):
        lines.append(f"{name}: {value}")
    head = (eol.join(lines) + eol + draw(line_ends)).encode("utf-8", "surrogatepass")
    return head + draw(st.binary(max_size=64))


@chunks
@FUZZ
@given(
    data=http_heads()
    | st.binary(max_size=512)
    | st.sampled_from(corpus("http_request", cut=True))
    | st.tuples(st.sampled_from(corpus("http_request", cut=True)), st.binary(max_size=32)).map(
        lambda pair: pair[0][: len(pair[1]) * 4] + pair[1]
    )
)
async def test_any_http_head_is_answered_or_closed(
    relay: FuzzRelay, data: bytes, chunk: int
) -> None:
    reader, writer = await asyncio.open_connection(*relay.address)
    answer = await send_and_read_to_eof(reader, writer, data)
    assert not answer or answer.startswith(b"HTTP/1.1 ")


# ---- websocket frames after an RMB login ----------------------------------------------------


@st.composite
def ws_frames(draw: st.DrawFn) -> bytes:
    """One frame with any header bits, a length in any of the three encodings (honest or not),
    masked or not."""
    fin = draw(st.booleans())
    rsv = draw(st.integers(0, 7))
    opcode = draw(st.integers(0, 15))
    payload = draw(st.binary(max_size=300))
    masked = draw(st.booleans())
    length = draw(st.sampled_from([len(payload), len(payload)]) | st.integers(0, 2**64 - 1))
    encoding = draw(st.sampled_from([7, 16, 64]))
    head = bytes([(fin << 7) | (rsv << 4) | opcode])
    mask_bit = 0x80 if masked else 0
    if encoding == 7 and length < 126:
        head += bytes([mask_bit | length])
    elif encoding in (7, 16) and length < 65536:
        head += bytes([mask_bit | 126]) + length.to_bytes(2, "big")
    else:
        head += bytes([mask_bit | 127]) + length.to_bytes(8, "big")
    if masked:
        key = draw(st.binary(min_size=4, max_size=4))
        payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
        head += key
    return head + payload


async def rmb_login(relay: FuzzRelay, twin: int = 1) -> RawWebSocket:
    sid = os.urandom(6).hex()
    token = make_jwt(key_for(twin), twin, sid, int(time.time()))
    return await RawWebSocket.connect(*relay.address, f"/?{token}")


@chunks
@FUZZ
@given(frames=st.lists(ws_frames(), min_size=1, max_size=4) | st.lists(st.binary(), max_size=3))
async def test_any_frames_after_an_rmb_login(
    relay: FuzzRelay, frames: list[bytes], chunk: int
) -> None:
    ws = await rmb_login(relay)
    await send_and_read_to_eof(ws.reader, ws.writer, b"".join(frames))


# ---- RMB envelopes in well-formed frames ----------------------------------------------------

TWINS = st.sampled_from([0, 1, 2, 3, 404, 2**32 - 1])
SIDS = st.none() | st.sampled_from(["", "app", "x" * 300]) | st.text(max_size=12)


@st.composite
def envelopes(draw: st.DrawFn) -> bytes:
    env = Envelope(uid=draw(st.text(max_size=40)))
    env.timestamp = draw(st.sampled_from([0, int(time.time())]) | st.integers(0, 2**64 - 1))
    env.expiration = draw(st.sampled_from([0, 5, 300]) | st.integers(0, 2**64 - 1))
    env.source.twin = draw(st.sampled_from([1, 1, 2]) | st.integers(0, 2**32 - 1))
    source_sid = draw(SIDS)
    if source_sid is not None:
        env.source.connection = source_sid
    env.destination.twin = draw(TWINS)
    dest_sid = draw(SIDS)
    if dest_sid is not None:
        env.destination.connection = dest_sid
    kind = draw(st.sampled_from(["request", "response", "ping", "pong", "error", None]))
    if kind == "request":
        env.request.command = draw(st.text(max_size=20))
    elif kind == "error":
        env.error.code = draw(st.integers(0, 2**32 - 1))
    elif kind is not None:
        getattr(env, kind).SetInParent()
    if draw(st.booleans()):
        env.tags = draw(st.sampled_from(["fail-fast", "a,fail-fast", ""]) | st.text(max_size=12))
    env.plain = draw(st.binary(max_size=200))
    wire = env.SerializeToString()
    cut = draw(st.integers(0, len(wire)))
    return wire if draw(st.booleans()) else wire[:cut] + draw(st.binary(max_size=16))


@chunks
@FUZZ
@given(
    messages=st.lists(
        envelopes() | st.binary(max_size=300) | st.sampled_from(corpus("rmb_envelope", cut=False)),
        min_size=1,
        max_size=6,
    )
)
async def test_any_envelope_from_a_logged_in_twin(
    relay: FuzzRelay, messages: list[bytes], chunk: int
) -> None:
    ws = await rmb_login(relay)
    data = b"".join(ws.encoder.binary(message) for message in messages)
    await send_and_read_to_eof(ws.reader, ws.writer, data)


# ---- SBD messages after a handshake ---------------------------------------------------------

TAGS = st.sampled_from([b"lbrt", b"lidl", b"areq", b"ares", b"srdy", b"keep", b"none"])


@chunks
@FUZZ
@given(
    messages=st.lists(
        st.builds(lambda tag, rest: sbd_encode_command(tag, rest), TAGS, st.binary(max_size=70))
        | st.binary(max_size=80)
        | st.builds(lambda rest: bytes(32) + rest, st.binary(max_size=40)),
        min_size=1,
        max_size=6,
    ),
    to_self=st.booleans(),
)
async def test_any_sbd_messages_after_a_handshake(
    relay: FuzzRelay, messages: list[bytes], to_self: bool, chunk: int
) -> None:
    client = await SbdClient.connect(*relay.address)
    if to_self:
        messages = [client.pubkey + message for message in messages]
    encoder: ClientFrameEncoder = client.ws.encoder
    data = b"".join(encoder.binary(message) for message in messages)
    await send_and_read_to_eof(client.ws.reader, client.ws.writer, data)
