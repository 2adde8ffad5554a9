"""Hostile connections against a real relay process (issue 33, "every connection pays for what
it causes"): a client that asks for answers and never reads them stops being read once its own
output is over the write high-water mark, so the relay's memory stays bounded; it is served
again once it reads, and loses nothing; honest clients in parallel are served all along; the
relay logs no traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from rmb_relay._core import MSG_PING, MSG_REQUEST, Envelope, WsMessage
from rmb_relay.identity import make_jwt
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT, StartRelay
from tests.faultlab.netns import Lab, LabUnavailable, check_available, check_ipv6
from tests.faultlab.services import RelayNode
from tests.helpers import RawWebSocket, eventually, http_exchange
from tests.redis_process import free_port
from tests.relay_process import PROBLEMS, RelayProcess
from tests.rmb_fixtures import key_for
from tests.sbd_client import SbdClient
from tests.scrape import scrape
from tests.sg_client import SgClient

#: relay RSS growth allowed while a client does not read: the 1 MiB write high-water mark,
#: one read of its requests in the parser, the kernel's socket buffers are not ours, plus
#: the allocator's slack
RSS_GROWTH_MIB = 24
#: requests the greedy client pipelines: answered all, their /metrics pages are ~100 MiB that
#: an unbounded relay would have queued in memory
PIPELINED = 4000
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: relay\r\n\r\n"
#: answers (bytes) a relay may have made for a client that reads none: its 1 MiB high-water
#: mark plus the kernel's socket buffers between the two (up to a few MiB)
HELD_BYTES = 16 << 20
STATUS_LINE = b"HTTP/1.1 200 OK\r\n"
#: the nonce of a QUERY_NODES answer (it comes before the listed clients)
NONCE = re.compile(rb'"nonce":\s*(\d+)')


@pytest.fixture
def relay() -> Iterator[RelayProcess]:
    process = RelayProcess("--sbd-disable-rate-limit")
    try:
        yield process
    finally:
        process.close()


async def _greedy_connection(
    host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with a small receive buffer, so the relay's output backs up at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock, limit=1 << 20)


async def _reply_pauses(relay: RelayProcess, dialect: str) -> bool:
    """Whether the relay has stopped reading a connection of `dialect` for its own output."""
    page = await scrape(*relay.address)
    try:
        return page.value("rmb_relay_reply_backpressure_pauses_total", dialect=dialect) > 0
    except KeyError:
        return False


async def _paused_within_bound(relay: RelayProcess, dialect: str, rss_before: float) -> bool:
    """Waits until the relay stops reading a connection of `dialect` for its own output, or
    its RSS has grown by the bound; asserts the growth is under the bound and returns whether
    it paused. A relay that never pauses (built before the bound) so fails on what it did,
    not on a metric it lacks."""

    async def paused_or_over() -> bool:
        over = relay.rss_mib() - rss_before >= RSS_GROWTH_MIB
        return over or await _reply_pauses(relay, dialect)

    with contextlib.suppress(AssertionError):  # judged below, by what the relay did
        await eventually(paused_or_over, timeout=WAIT)
    growth = relay.rss_mib() - rss_before
    assert growth < RSS_GROWTH_MIB, f"relay RSS +{growth:.1f} MiB while the client did not read"
    return await _reply_pauses(relay, dialect)


async def _count(reader: asyncio.StreamReader, marker: bytes, wanted: int) -> int:
    """Read until `marker` has been seen `wanted` times (a marker split across reads counts)."""
    seen, tail = 0, b""
    while seen < wanted:
        chunk = await asyncio.wait_for(reader.read(1 << 20), WAIT)
        if not chunk:
            break
        data = tail + chunk
        seen += data.count(marker)
        tail = data[-(len(marker) - 1) :]
        seen -= tail.count(marker)  # (a tail shorter than the marker holds none)
    return seen


@contextlib.asynccontextmanager
async def honest_health(relay: RelayProcess) -> AsyncIterator[None]:
    """`/health` asked in a loop while the block runs: every answer must be 200."""
    stop = asyncio.Event()

    async def ask() -> list[bytes]:
        answers = []
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        while not stop.is_set():
            answers.append(await http_exchange(*relay.address, request))
        return answers

    task = asyncio.ensure_future(ask())
    try:
        yield
    finally:
        stop.set()
        answers = await asyncio.wait_for(task, WAIT)
    assert answers
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers)


async def test_pipelined_requests_never_read_stop_being_read(relay: RelayProcess) -> None:
    async with honest_health(relay):
        await _pipeline_and_never_read(relay)
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def _pipeline_and_never_read(relay: RelayProcess) -> None:
    page = await http_exchange(
        *relay.address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    asked = 1  # our own GET /metrics requests, counted with the greedy client's

    async def answered() -> float:
        """Answers the relay made for the greedy client (ours subtracted)."""
        nonlocal asked
        scraped = await scrape(*relay.address)
        asked += 1
        return scraped.value("rmb_relay_http_requests_total", method="GET", status="200") - asked

    async def paused_or_too_much() -> bool:
        return await _reply_pauses(relay, "http") or await answered() * len(page) > HELD_BYTES

    rss_before = relay.rss_mib()
    reader, writer = await _greedy_connection(*relay.address)
    try:
        writer.write(REQUEST * PIPELINED)
        # the relay stops: what it answered fits its high-water mark and the socket buffers
        # (one without the bound answers on, each answer held for a client that reads none)
        with contextlib.suppress(AssertionError):  # judged below, by what the relay did
            await eventually(paused_or_too_much, timeout=WAIT)
        made = await answered()
        assert made * len(page) < HELD_BYTES, f"{made:.0f} answers made, none read"
        assert await _paused_within_bound(relay, "http", rss_before)
        # once the client reads, every request is answered, in order
        assert await _count(reader, STATUS_LINE, PIPELINED) == PIPELINED
    finally:
        writer.close()


async def test_pings_never_read_stop_the_websocket_being_read(relay: RelayProcess) -> None:
    async with honest_health(relay):
        await _ping_and_never_read(relay)
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def _ping_and_never_read(relay: RelayProcess) -> None:
    greedy = await SbdClient.connect(*relay.address)
    ws: RawWebSocket = greedy.ws
    a = await SbdClient.connect(*relay.address)
    b = await SbdClient.connect(*relay.address)
    rss_before = relay.rss_mib()
    ping = ws.encoder.ping(b"p" * 125)
    sent = 300_000  # 38 MB of pongs: more than the kernel buffers between us and the bound
    ws.send_raw(ping * sent)
    assert await _paused_within_bound(relay, "sbd", rss_before)
    # honest SBD clients still forward to each other meanwhile
    a.ws.send_binary(b.pubkey + b"hello")
    assert await b.next_message() == a.pubkey + b"hello"
    # the greedy one reads: every ping was answered
    pong_frame = b"\x8a\x7d" + b"p" * 125
    assert await _count(ws.reader, pong_frame, sent) == sent
    for client in (greedy, a, b):
        client.ws.close()


async def test_metrics_listen_moves_the_operations_routes_off_the_public_listener() -> None:
    ops_port = free_port()
    relay = RelayProcess("--metrics-listen", f"127.0.0.1:{ops_port}", "--no-tunnel")
    try:
        line = relay.wait_for_line("open to strangers")
        assert "federation POST /" in line
        assert "sbd: any key may connect" in line
        assert "/metrics" not in line  # moved off the public listener
        host, port = relay.address
        async with (
            httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=WAIT) as public,
            httpx.AsyncClient(base_url=f"http://{host}:{ops_port}", timeout=WAIT) as ops,
        ):
            for path in ("/metrics", "/health", "/monitor/server"):
                assert (await public.get(path)).status_code == 404, path
                assert (await ops.get(path)).status_code == 200, path
            # nothing else is served on the operations listener: no route, no upgrade
            assert (await ops.post("/", content=b"x")).status_code == 404
            upgrade = {
                "Upgrade": "websocket",
                "Connection": "Upgrade",
                "Sec-WebSocket-Version": "13",
            }
            upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
            assert (await ops.get("/AAAA", headers=upgrade)).status_code == 404
            # the public one still serves the dialects
            assert (await public.post("/", content=b"x")).status_code == 400
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()


async def test_default_relay_says_what_is_open_in_one_line() -> None:
    relay = RelayProcess()
    try:
        line = relay.wait_for_line("open to strangers")
        for surface in ("rmb: federation POST /", "sbd: any key", "on the public listener"):
            assert surface in line, line
        assert sum("open to strangers" in logged for logged in relay.log) == 1
    finally:
        relay.close()


async def test_per_ip_caps_group_ipv6_by_prefix() -> None:
    from rmb_relay.config import ListenerConfig
    from rmb_relay.server.listener import RelayServer

    server = RelayServer(ListenerConfig(ipv6_prefix=64))
    assert server.ip_key("2001:db8:0:1::a") == server.ip_key("2001:db8:0:1:ffff::b")
    assert server.ip_key("2001:db8:0:2::a") != server.ip_key("2001:db8:0:1::a")
    assert server.ip_key("192.0.2.1") == "192.0.2.1"
    per_host = RelayServer(ListenerConfig(ipv6_prefix=128))
    assert per_host.ip_key("2001:db8:0:1::a") != per_host.ip_key("2001:db8:0:1::b")


async def _health_from(local: str, relay: tuple[str, int]) -> tuple[bytes, asyncio.StreamWriter]:
    """`GET /health` on a keep-alive connection from the local address `local`: the status
    line, and the connection (held open: it counts against its address's cap until closed)."""
    reader, writer = await asyncio.open_connection(*relay, local_addr=(local, 0))
    writer.write(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    return head.split(b"\r\n", 1)[0], writer


async def test_per_ip_caps_count_an_ipv6_64_as_one_address_on_a_relay_process(
    tmp_path: Path,
) -> None:
    """A relay on an IPv6 address of a fault-lab host, clients bound to addresses of the lab's
    bridge: three held connections from three addresses of one /64 fill its
    `--max-connections-per-ip 3`, a fourth address of that /64 is refused 429, a client of
    another /64 is served all along; once one closes, the /64 is served again."""
    try:
        check_available()
        check_ipv6()
    except LabUnavailable as err:
        pytest.skip(f"fault lab unavailable: {err}")
    with Lab() as lab:
        host = lab.host("relay")
        relay = RelayNode(
            host,
            ["--max-connections-per-ip", "3", "--ipv6-prefix", "64"],
            tmp_path,
            address=host.add_ipv6(),
        )
        await relay.ready()
        address = (relay.address, relay.port)
        one_64 = [lab.address6() for _ in range(4)]
        other_64 = lab.address6(subnet=1)
        held = []
        try:
            for local in one_64[:3]:
                status, writer = await _health_from(local, address)
                assert status == STATUS_LINE.rstrip(), (local, status)
                held.append(writer)
            refused, refused_writer = await _health_from(one_64[3], address)
            refused_writer.close()
            assert refused == b"HTTP/1.1 429 Too Many Requests", refused
            for _ in range(20):  # the other /64 is another address
                status, writer = await _health_from(other_64, address)
                writer.close()
                assert status == STATUS_LINE.rstrip()
            held.pop().close()

            async def served_again() -> bool:
                status, writer = await _health_from(one_64[3], address)
                writer.close()
                return status == STATUS_LINE.rstrip()

            await eventually(served_again)
            reader, writer = await asyncio.open_connection(*address, local_addr=(other_64, 0))
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
            page = (await asyncio.wait_for(reader.read(), WAIT)).decode()
            writer.close()
            assert re.search(r'connections_refused_total\{reason="per-ip limit"\} [1-9]', page)
        finally:
            for writer in held:
                writer.close()
        assert [line for line in relay.log.lines if any(p in line for p in PROBLEMS)] == []


async def test_rmb_errors_never_read_stop_the_sender_being_read(tmp_path: Path) -> None:
    """Requests to a twin nobody knows are each answered with an error envelope: a sender that
    never reads them stops being read (its own output is over the high-water mark), instead of
    the relay queueing errors for it without end; once it reads, every one arrives."""
    db = tmp_path / "twins.sqlite3"
    with SqliteTwinDirectory(db) as twins:
        twins.add(Twin(5, key_for(5).public_key, None))
    relay = RelayProcess("--twins", f"sqlite:{db}", "--no-tunnel")
    try:
        async with honest_health(relay):
            jwt = make_jwt(key_for(5), 5, None, int(time.time()))
            ws = await RawWebSocket.connect(*relay.address, f"/?{jwt}")
            rss_before = relay.rss_mib()
            sent = 40_000
            for n in range(0, sent, 1000):  # ~1 KiB each, their errors as large: ~42 MiB
                batch = []
                for uid in range(n, n + 1000):
                    env = Envelope(f"{uid:08d}" + "u" * 1000)
                    env.source_twin, env.dest_twin = 5, 77_777
                    env.kind, env.command = MSG_REQUEST, "x"
                    env.timestamp, env.expiration = int(time.time()), 300
                    batch.append(env.encode())
                ws.send_raw(ws.encoder.binary_batch(batch))  # (buffered here: never drained)
            assert await _paused_within_bound(relay, "rmb", rss_before)
            errors = await _count(ws.reader, b"unknown twin destination", sent)
            assert errors == sent
            ws.close()
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()


async def test_rmb_ping_envelopes_never_read_stop_the_sender_being_read(tmp_path: Path) -> None:
    """Each ping envelope is answered with a pong envelope to its sender: one that pings and
    never reads stops being read once its pongs are over the high-water mark; honest twins
    exchange messages meanwhile; once it reads, every pong arrives."""
    db = tmp_path / "twins.sqlite3"
    with SqliteTwinDirectory(db) as twins:
        for twin in (5, 6, 7):
            twins.add(Twin(twin, key_for(twin).public_key, None))
    relay = RelayProcess("--twins", f"sqlite:{db}", "--no-tunnel")
    try:
        async with honest_health(relay):
            now = int(time.time())
            ws = await RawWebSocket.connect(
                *relay.address, f"/?{make_jwt(key_for(5), 5, None, now)}"
            )
            a = await RawWebSocket.connect(
                *relay.address, f"/?{make_jwt(key_for(6), 6, None, now)}"
            )
            b = await RawWebSocket.connect(
                *relay.address, f"/?{make_jwt(key_for(7), 7, None, now)}"
            )
            rss_before = relay.rss_mib()
            sent = 40_000
            marker = b"P" * 1000  # in each pong's uid: ~40 MiB of pongs
            for n in range(0, sent, 1000):
                batch = []
                for uid in range(n, n + 1000):
                    env = Envelope(f"{uid:08d}" + marker.decode())
                    env.source_twin, env.dest_twin = 5, 5
                    env.kind = MSG_PING
                    env.timestamp, env.expiration = now, 300
                    batch.append(env.encode())
                ws.send_raw(ws.encoder.binary_batch(batch))  # (buffered here: never drained)
            assert await _paused_within_bound(relay, "rmb", rss_before)
            # honest twins are served meanwhile
            for n in range(20):
                env = Envelope(f"honest-{n}")
                env.source_twin, env.dest_twin = 6, 7
                env.kind, env.command = MSG_REQUEST, "x"
                env.timestamp, env.expiration = now, 300
                env.plain = b"hello %d" % n
                a.send_binary(env.encode())
                event = await b.next_event()
                assert isinstance(event, WsMessage)
                assert Envelope.decode(event.data).plain == b"hello %d" % n
            assert await _count(ws.reader, marker, sent) == sent
            for conn in (ws, a, b):
                conn.close()
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()


async def test_sbd_forwards_to_oneself_never_read_stop_being_read(relay: RelayProcess) -> None:
    async with honest_health(relay):
        greedy = await SbdClient.connect(*relay.address)
        rss_before = relay.rss_mib()
        sent = 40_000
        payload = b"m" * 1000  # ~40 MiB back to itself
        for _ in range(sent // 1000):
            greedy.ws.send_raw(greedy.ws.encoder.binary_batch([greedy.pubkey + payload] * 1000))
        assert await _paused_within_bound(relay, "sbd", rss_before)
        assert await _count(greedy.ws.reader, greedy.pubkey + payload, sent) == sent
        greedy.ws.close()
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def test_singyeong_answers_never_read_stop_the_asker_being_read(
    relay: RelayProcess,
) -> None:
    """QUERY_NODES answers go back to the asker, each listing the matching clients with their
    metadata: one that pipelines queries and never reads stops being read once its answers are
    over the high-water mark (before, they queued without end); honest 신경 clients exchange
    messages meanwhile; once it reads, every answer arrives."""
    members = [await SgClient.connect(*relay.address) for _ in range(4)]
    tx, rx = await SgClient.connect(*relay.address), await SgClient.connect(*relay.address)
    ws = await RawWebSocket.connect(*relay.address, "/gateway/websocket?encoding=json")
    try:
        await _ask_and_never_read(relay, members, tx, rx, ws)
    finally:
        ws.close()
        for client in (*members, tx, rx):
            await client.close()
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def _ask_and_never_read(
    relay: RelayProcess, members: list[SgClient], tx: SgClient, rx: SgClient, ws: RawWebSocket
) -> None:
    for i, member in enumerate(members):  # ~40 KiB of metadata each, within the bounds
        values = {f"k{j}": {"type": "string", "value": "v" * 10240} for j in range(4)}
        await member.identify(f"big{i}", "big", metadata=values)
    await rx.identify("rx", "honest-rx")
    await tx.identify("tx", "honest-tx")
    async with honest_health(relay):
        identify = {"op": 1, "d": {"client_id": "asker", "application_id": "askers"}}
        for op, frame in ((0, None), (2, identify)):
            if frame is not None:
                ws.send_raw(ws.encoder.text(json.dumps(frame)))
            event = await ws.next_event()
            assert isinstance(event, WsMessage)
            assert json.loads(event.data)["op"] == op
        rss_before = relay.rss_mib()
        sent = 1_000  # each answer ~160 KiB: ~160 MiB of answers
        queries = b"".join(
            ws.encoder.text(
                json.dumps({"op": 4, "t": "QUERY_NODES", "d": {"application": "big", "nonce": n}})
            )
            for n in range(sent)
        )
        ws.send_raw(queries)  # (buffered here: never drained)
        assert await _paused_within_bound(relay, "singyeong", rss_before)
        for n in range(20):  # honest clients are served meanwhile
            await tx.dispatch(
                "SEND", {"target": {"application": "honest-rx"}, "nonce": n, "payload": n}
            )
            frame = await rx.expect(4, "SEND")
            assert frame["d"]["payload"] == n
        # once it reads, every answer arrives, in the order asked (the relay stopped and
        # resumed in the middle of its reads)
        nonces = []
        for _ in range(sent):
            event = await ws.next_event()
            assert isinstance(event, WsMessage)
            found = NONCE.search(event.data)
            assert found is not None, event.data[:200]
            nonces.append(int(found[1]))
        assert nonces == list(range(sent))


async def _linger_aborts(host: str, port: int, dialect: str) -> float:
    page = await scrape(host, port)
    try:
        return page.value("rmb_relay_close_linger_aborts_total", dialect=dialect)
    except KeyError:
        return 0.0


async def _reset_or_eof(reader: asyncio.StreamReader) -> bool:
    """Whether the relay has dropped the connection (reading what it had sent until then)."""
    try:
        while await asyncio.wait_for(reader.read(1 << 20), WAIT):
            pass
    except ConnectionResetError:
        pass
    return True


async def test_a_websocket_peer_that_closes_and_never_reads_is_dropped_at_the_linger_bound() -> (
    None
):
    """An SBD client makes the relay queue output for it, never reads it (a zero TCP
    window), and sends its close frame: the relay echoes the close and closes TCP after what
    is queued, which never goes; `--close-linger` drops the connection, counted and logged,
    and the relay serves the rest as before."""
    relay = RelayProcess("--sbd-disable-rate-limit", "--close-linger", "1")
    try:
        victim = await SbdClient.connect(*relay.address)
        sender = await SbdClient.connect(*relay.address)
        honest = await SbdClient.connect(*relay.address)
        payload = b"m" * 1000
        batch = sender.ws.encoder.binary_batch([victim.pubkey + payload] * 1000)

        async def victim_congested() -> bool:
            page = await scrape(*relay.address)
            try:
                return page.value("rmb_relay_backpressure_pauses_total", dialect="sbd") > 0
            except KeyError:
                sender.ws.send_raw(batch)  # 1 MB more for the victim
                return False

        await eventually(victim_congested, timeout=WAIT)
        victim.ws.send_raw(victim.ws.encoder.close(1000))
        await eventually(lambda: _linger_aborts(*relay.address, "sbd"), timeout=WAIT)
        assert await _linger_aborts(*relay.address, "sbd") == 1
        assert await _reset_or_eof(victim.ws.reader)
        sender.ws.send_binary(honest.pubkey + b"still here")
        assert await honest.next_message() == sender.pubkey + b"still here"
        for client in (victim, sender, honest):
            client.ws.close()
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
        assert any("bytes not read 1 s after its close" in line for line in relay.log)
    finally:
        relay.close()


async def test_an_http_client_that_never_reads_its_last_answer_is_dropped_at_the_linger_bound(
    start_relay: StartRelay,
) -> None:
    """HTTP has the same gap: answers to pipelined requests, the last one `Connection: close`,
    never read. (A write high-water mark above what they come to, so that none is held back
    and the close comes with them still queued: the 1 MiB default holds a client that never
    reads before, and its idle timeout drops it.)"""
    relay = await start_relay(write_high_water=256 << 20, close_linger=0.5)
    host, port = relay.addresses[0]
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        closing = b"GET /metrics HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n"
        # ~10 MB of answers (2.5 KB each): more than the kernel's buffers between us take
        await loop.sock_sendall(sock, REQUEST * 3999 + closing)
        await eventually(lambda: _linger_aborts(host, port, "http"), timeout=WAIT)
        with contextlib.suppress(ConnectionResetError):
            while await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), WAIT):
                pass
    assert await _linger_aborts(host, port, "http") == 1
