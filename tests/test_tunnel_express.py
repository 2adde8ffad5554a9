"""The tunnel's express path (express.py) against its task path (client.py): the same answers
byte for byte (but the Date the target stamps), the fallbacks in the documented order, the
connector protocol's refusals, a client leaving early, the response timeout, and metrics.

Requests go over raw keep-alive sockets with head and body in one write, so the relay reads
each whole in one `data_received` (the express path's condition), as benchmarks and most HTTP
clients send small requests."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from rmb_relay._core import HttpRequest, HttpStreamParser, tunnel_express_request
from rmb_relay.clock import NS
from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.tunnel.client import request_headers
from rmb_relay.dialects.tunnel.express import SPARE, ExpressReply
from rmb_relay.dialects.tunnel.hub import JOB_OVERHEAD, held_size
from rmb_relay.dialects.tunnel.native import LEASE
from rmb_relay.dialects.tunnel.tokens import LEEWAY, TokenAuthority
from rmb_relay.dialects.tunnel.wire import (
    AcknowledgeRequest,
    ClientRequest,
    TargetResponse,
    encode,
)
from tests.conftest import WAIT
from tests.helpers import eventually
from tests.tunnel_fixtures import (
    Response,
    StartTunnel,
    Tunnel,
    deliver_text,
    get_once,
    pattern,
    raw_client,
    raw_connector,
)
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)


SIZES = [0, 1, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1]


async def _exchanges(tunnel: Tunnel) -> list[Response]:
    answers = []
    async with raw_client(tunnel) as client:
        answers.append(
            await client.request("GET", "/relay/acme/app/status/201", headers=[("X-A", "1")])
        )
        answers.append(
            await client.request(
                "GET", "/relay/acme/app/echo?q=1", headers=[("X-Multi", "one"), ("X-Multi", "two")]
            )
        )
        for size in SIZES:
            answers.append(await client.request("POST", "/relay/acme/app/echo", pattern(size)))
            answers.append(await client.request("GET", f"/relay/acme/app/bytes/{size}"))
        answers.append(await client.request("HEAD", "/relay/acme/app/bytes/10"))
        answers.append(await client.request("GET", "/relay/acme/$ping/"))
        # (an answer of 400 or more closes the connection: last)
        answers.append(await client.request("GET", "/relay/acme/nothere/x"))
    return answers


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_express_and_task_paths_give_identical_answers(
    start_tunnel: StartTunnel, binary: bool
) -> None:
    express = await start_tunnel()
    await express.connect(binary=binary)
    fast = await _exchanges(express)
    task = await start_tunnel(express=False, target=express.target)
    await task.connect(binary=binary)
    slow = await _exchanges(task)
    assert fast == slow
    sizes = [len(body) for _, _, body in fast]
    for size in SIZES:
        assert sizes.count(size) >= 2  # sent and received at each size around the limit
    assert [v for n, v in fast[0][1] if n == "set-cookie"] == ["a=1", "b=2"]
    assert [v for n, v in fast[1][1] if n == "x-got-x-multi"] == ["one", "two"]
    # everything but the body over 16 KiB is offered; bodyless requests always come whole
    taken = express.dialect.metrics.express.value("taken")
    assert len(fast) - 3 <= taken <= len(fast) - 1
    assert task.dialect.metrics.express.value("taken") == 0
    async with express.client() as http:
        scrape = (await http.get("/metrics")).text
    assert f'rmb_relay_tunnel_express_total{{dialect="tunnel",outcome="taken"}} {taken}' in scrape
    for labels in [("app", "200"), ("app", "201"), ("-", "404"), ("$ping", "200")]:
        assert express.dialect.metrics.requests.value("acme", *labels) == (
            task.dialect.metrics.requests.value("acme", *labels)
        ), labels
    assert express.dialect.hub.jobs == {}


async def _raw_exchanges(tunnel: Tunnel) -> list[bytes]:
    """`_exchanges`' requests, each answer as the bytes on the wire (less the target's Date)."""
    host, port = tunnel.relay.addresses[0]
    reader, writer = await asyncio.open_connection(host, port)
    requests = [
        ("GET", "/relay/acme/app/status/201", b"", "X-A: 1\r\n"),
        ("GET", "/relay/acme/app/echo?q=1", b"", "X-Multi: one\r\nX-Multi: two\r\n"),
        *[("POST", "/relay/acme/app/echo", pattern(size), "") for size in SIZES],
        *[("GET", f"/relay/acme/app/bytes/{size}", b"", "") for size in SIZES],
        ("HEAD", "/relay/acme/app/bytes/10", b"", ""),
        ("GET", "/relay/acme/$ping/", b"", ""),
        ("GET", "/relay/acme/nothere/x", b"", ""),
    ]
    answers = []
    try:
        for method, path, body, fields in requests:
            length = f"Content-Length: {len(body)}\r\n" if method == "POST" else ""
            head = f"{method} {path} HTTP/1.1\r\nHost: test\r\n{fields}{length}\r\n"
            writer.write(head.encode() + body)
            got = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
            lines = got.split(b"\r\n")
            size = next(
                (int(line[15:]) for line in lines if line.lower().startswith(b"content-length:")),
                0,
            )
            if method != "HEAD" and size:
                got += await asyncio.wait_for(reader.readexactly(size), WAIT)
            answers.append(
                b"\r\n".join(
                    line for line in got.split(b"\r\n") if not line.lower().startswith(b"date:")
                )
            )
    finally:
        writer.close()
    return answers


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_native_and_python_answers_are_the_same_bytes(
    start_tunnel: StartTunnel, binary: bool
) -> None:
    """The Rust core's answers (express.deliver_native) against the ones Python builds
    (`--tunnel-no-native`), byte for byte: statuses, repeated fields, HEAD, bodies around the
    inline limit, a 404 from the connector."""
    native = await start_tunnel()
    await native.connect(binary=binary)
    fast = await _raw_exchanges(native)
    python = await start_tunnel(native=False, target=native.target)
    await python.connect(binary=binary)
    slow = await _raw_exchanges(python)
    assert fast == slow
    assert b"x-got-x-multi: one\r\nx-got-x-multi: two" in fast[1].lower()
    # HEAD, the 404 (it closes) and the body over 16 KiB (it took the task path) are Python's
    native_answers = native.registry.get("rmb_relay_tunnel_native_answers_total")
    assert native_answers.value("tunnel") >= len(fast) - 4
    assert python.dialect.metrics.native_answers == 0
    assert native.dialect.metrics.requests.value("acme", "-", "404") == 1
    for tunnel in (native, python):
        assert tunnel.dialect.hub.jobs == {}
        assert tunnel.dialect.express_deadlines.live == 0
        # (the native table's lease of the budget is held while the tenant's connector is)
        table = tunnel.dialect.native
        lease = LEASE if table is not None and table.table.has_tenant("ACME") else 0
        assert tunnel.dialect.hub.budget.held_by("ACME") == lease
        assert table is None or table.table.held("ACME") == 0


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("body", [b"", b"\x00\xff" * 700])
@pytest.mark.parametrize("ack_url", [None, "/tunnel/acknowledge/o/r/t"])
def test_the_native_request_message_is_wire_encodes(
    binary: bool, body: bytes, ack_url: str | None
) -> None:
    """`tunnel_express_request` against `request_headers`, `held_size` and `wire.encode` of
    the ClientRequest `Hub._send` completes: the same headers, size and bytes."""
    head = (
        "POST /relay/acme/app/x?y=1 HTTP/1.1\r\nHost: test\r\nX-Multi: one\r\n"
        "Connection: keep-alive\r\nX-Latin: caf\xe9\r\nX-Multi: two\r\nTE: trailers\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1")
    request = next(e for e in HttpStreamParser().feed(head + body) if type(e) is HttpRequest)
    assert isinstance(request, HttpRequest)
    headers, text, message = tunnel_express_request(
        request,
        body,
        "r1",
        "o1",
        "app",
        "Acme",
        "x?y=1",
        3 if ack_url else 0,
        120000,
        ack_url,
        binary,
    )
    wire = ClientRequest(
        "r1", "o1", "app", "Acme", "POST", "x?y=1", request_headers(request),
        3 if ack_url else 0, "o1", len(body), len(body), body or None,
        expires_in=120000, acknowledge_url=ack_url,
    )  # fmt: skip
    assert headers == wire.http_headers
    assert headers["x-multi"] == ["one", "two"]
    assert "connection" not in headers
    assert JOB_OVERHEAD + len(body) + len(wire.url) + text == held_size(wire)
    assert message == encode(wire, binary)


async def test_fallbacks_to_the_task_path_in_order(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(request_ttl=0.3)
    tunnel.add_tenant("secure", require_authentication=True)
    tunnel.add_tenant("lonely")
    tunnel.add_tenant("narrow", max_concurrent=1)
    await tunnel.connect()
    await tunnel.connect("narrow")
    express = tunnel.dialect.metrics.express
    # (each on its own connection: an answer of 400 or more closes it)
    assert (await get_once(tunnel, "/relay/acme"))[0] == 404
    assert express.value("path") == 1
    assert (await get_once(tunnel, "/relay/nobody/app/x"))[0] == 404
    assert express.value("tenant") == 1
    # no connector either: the first failed condition is the one counted
    assert (await get_once(tunnel, "/relay/secure/app/x"))[0] == 401
    assert express.value("auth") == 1
    assert (await get_once(tunnel, "/relay/lonely/app/x"))[0] == 408
    assert express.value("no connector") == 1
    assert (await get_once(tunnel, "/relay/acme/app/status/200"))[0] == 200
    assert express.value("taken") == 1
    async with (
        raw_client(tunnel) as first,
        raw_client(tunnel) as second,
        raw_client(tunnel) as third,
    ):
        slow = asyncio.ensure_future(first.request("GET", "/relay/narrow/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        assert express.value("taken") == 2
        waiting = asyncio.ensure_future(second.request("GET", "/relay/narrow/app/status/200"))
        await eventually(lambda: express.value("limit") == 1)
        await eventually(lambda: "NARROW" in tunnel.dialect.hub.pending)
        queued = asyncio.ensure_future(third.request("GET", "/relay/narrow/app/status/202"))
        await eventually(lambda: express.value("queued") == 1)
        tunnel.target.release.set()
        assert (await slow)[0] == 200
        assert (await waiting)[0] == 200
        assert (await queued)[0] == 202
    assert tunnel.dialect.hub.jobs == {}


async def test_over_the_memory_budget_the_task_path_refuses(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(tenant_bytes=100)
    await tunnel.connect()
    status, _, body = await get_once(tunnel, "/relay/acme/app/status/200")
    assert status == 503
    assert b"relay busy" in body
    assert tunnel.dialect.metrics.express.value("budget") == 1


async def test_a_client_leaving_early_leaves_nothing_behind(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    await tunnel.connect()
    async with raw_client(tunnel) as client:
        pending = asyncio.ensure_future(client.request("GET", "/relay/acme/app/slow"))
        await asyncio.wait_for(tunnel.target.entered.wait(), WAIT)
        pending.cancel()
    tunnel.target.release.set()  # the connector answers a job nobody waits for
    await eventually(lambda: tunnel.dialect.hub.jobs == {})
    async with raw_client(tunnel) as client:
        assert (await client.request("GET", "/relay/acme/app/status/200"))[0] == 200
    assert tunnel.dialect.metrics.bad_messages.value() == 0


async def test_no_answer_within_the_response_timeout_is_504(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel(request_ttl=0.1, response_timeout=0.2)
    await tunnel.connect()
    async with raw_client(tunnel) as client:
        status, _, body = await client.request("GET", "/relay/acme/app/slow")
    assert (status, body) == (504, b"the connector did not answer in time\n")
    assert tunnel.dialect.metrics.express.value("taken") == 1
    assert tunnel.dialect.metrics.requests.value("acme", "-", "504") == 1
    tunnel.target.release.set()


async def test_malformed_and_unknown_deliveries_are_refused_while_a_request_waits(
    start_tunnel: StartTunnel,
) -> None:
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws, raw_client(tunnel) as client:
        answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
        request = json.loads(await ws.receive_str(timeout=WAIT))
        assert request["target"] == "RequestTarget"
        argument = request["arguments"][0]
        assert argument["bodyContent"] == "aGk="
        assert tunnel.dialect.metrics.express.value("taken") == 1
        bad = [
            "{",
            '{"target": "Deliver", "arguments": [{"requestId": 1}]}',
            encode(TargetResponse("unknown", "o", 200), False).decode(),
        ]
        for text in bad:
            await ws.send_str(text)
            error = json.loads(await ws.receive_str(timeout=WAIT))
            assert error["target"] == "Error"
            assert error["arguments"][0]["message"]
        assert not answer.done()
        response = TargetResponse(
            argument["requestId"],
            argument["requestOriginId"],
            207,
            {"X-One": ["a", "b"]},
            body_size=2,
            body_content=b"ok",
        )
        await ws.send_str(encode(response, False).decode())
        status, headers, body = await answer
    assert (status, body) == (207, b"ok")
    assert [v for n, v in headers if n == "x-one"] == ["a", "b"]
    assert tunnel.dialect.metrics.bad_messages.value() == len(bad)
    assert tunnel.dialect.hub.jobs == {}


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (204, {}, b"hi"),  # no body may follow a 204
        (42, {}, b""),  # no such status in HTTP/1.1
        (200, {"X-Split": ["a\r\nInjected: 1"]}, b""),  # a field that would split the head
    ],
)
async def test_a_deliver_http_cannot_carry_is_a_500_and_the_connector_keeps_serving(
    start_tunnel: StartTunnel, status: int, headers: dict[str, list[str]], body: bytes
) -> None:
    """Answered inside the connector's read: before, encoding it raised there, the relay
    closed the connector (1011), the client never got an answer and the job stayed held."""
    tunnel = await start_tunnel()
    async with raw_connector(tunnel) as ws:
        for n, (want_status, deliver) in enumerate(
            [(500, (status, headers, body)), (200, (200, {}, b"fine"))]
        ):
            async with raw_client(tunnel) as client:
                answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
                argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
                assert tunnel.dialect.metrics.express.value("taken") == n + 1
                code, fields, content = deliver
                await ws.send_str(
                    encode(
                        TargetResponse(
                            argument["requestId"],
                            argument["requestOriginId"],
                            code,
                            fields,
                            body_size=len(content),
                            body_content=content,
                        ),
                        False,
                    ).decode()
                )
                got, _, _ = await answer
                assert got == want_status
            assert not ws.closed
    assert tunnel.dialect.hub.jobs == {}


@pytest.mark.parametrize(("ack_mode", "want"), [(0, 503), (1, 200)])
async def test_a_connector_gone_mid_request_on_the_native_path(
    start_tunnel: StartTunnel, ack_mode: int, want: int
) -> None:
    """Disabled: the connector took the request for good, so the client gets 503 (Python's
    answer). ConnectorReceived, not acknowledged yet: it is redelivered to the next connector,
    whose `Deliver` the Rust core answers."""
    tunnel = await start_tunnel(ack_mode=ack_mode)
    metrics = tunnel.dialect.metrics
    async with raw_client(tunnel) as client:
        async with raw_connector(tunnel) as first:
            answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
            taken = json.loads(await first.receive_str(timeout=WAIT))["arguments"][0]
            assert metrics.express.value("taken") == 1
        if ack_mode:
            async with raw_connector(tunnel) as second:
                again = json.loads(await second.receive_str(timeout=WAIT))["arguments"][0]
                assert again["requestId"] == taken["requestId"]
                ack = AcknowledgeRequest(again["acknowledgeOriginId"], again["requestId"], True)
                await second.send_str(encode(ack, False).decode())
                await second.send_str(deliver_text(again, 200, b"second"))
                status, headers, body = await answer
            assert (body, [v for n, v in headers if n == "x-by"]) == (b"second", ["raw"])
            assert metrics.redelivered.value() == 1
        else:
            status, _, body = await answer
            assert body == b"connector unavailable\n"
        assert status == want
    assert metrics.native_answers == (1 if ack_mode else 0)
    assert metrics.requests.value("acme", "app" if ack_mode else "-", str(want)) == 1
    await eventually(lambda: not tunnel.dialect.hub.jobs)


async def test_a_deliver_for_a_client_gone_is_dropped_on_the_native_path(
    start_tunnel: StartTunnel,
) -> None:
    """The client left before its answer: the Rust core declines the `Deliver` (its reply
    is finished), Python drops it as before, and the connector keeps serving. (The express
    path in Python; the native table's case is in test_tunnel_native_table.py.)"""
    tunnel = await start_tunnel(native_table=False)
    dialect = tunnel.dialect
    async with raw_connector(tunnel) as ws:
        async with raw_client(tunnel) as client:
            client.writer.write(
                b"POST /relay/acme/app/x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
            )
            argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
            # a reset, so the relay knows it is gone (a FIN may be a half-close)
            sock = client.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.writer.transport.abort()
        await eventually(lambda: dialect.express_deadlines.live == 0)
        await ws.send_str(deliver_text(argument, 200, b"late"))
        async with raw_client(tunnel) as client:
            answer = asyncio.ensure_future(client.request("POST", "/relay/acme/app/x", b"hi"))
            argument = json.loads(await ws.receive_str(timeout=WAIT))["arguments"][0]
            await ws.send_str(deliver_text(argument, 200, b"fresh"))
            status, _, body = await answer
    assert (status, body) == (200, b"fresh")
    assert dialect.metrics.native_answers == 1
    assert dialect.metrics.bad_messages.value() == 0
    assert dialect.hub.jobs == {}


class _Answers:
    """Collects what an express reply answers (the connection's side of ExpressClient)."""

    def __init__(self) -> None:
        self.answers: list[int] = []

    def express_answer(self, response: HttpResponse) -> None:
        self.answers.append(response.status)

    def express_answer_encoded(self, status: int, data: bytes) -> bool:
        return False


async def test_the_deadline_queue_stays_as_small_as_the_requests_in_flight(
    start_tunnel: StartTunnel,
) -> None:
    """One reply that never finishes sits at the head; thousands after it finish. The queue
    is rebuilt without them rather than growing with every request."""
    tunnel = await start_tunnel()
    dialect = tunnel.dialect
    deadlines = dialect.express_deadlines
    stuck = ExpressReply(dialect, _Answers())
    deadlines.add(stuck)
    for _ in range(10 * SPARE):
        reply = ExpressReply(dialect, _Answers())
        deadlines.add(reply)
        reply.abandon()  # finished (a job-less reply: nothing else to do)
        assert len(deadlines.queue) <= 2 * deadlines.live + SPARE + 1
    assert deadlines.live == 1
    stuck.abandon()
    assert deadlines.live == 0


class WallClock:
    """A unix-time clock the test moves (tokens are judged against the wall clock)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000 * NS

    def __call__(self) -> int:
        return self.now


async def _authenticated(tunnel: Tunnel, token: str) -> list[Response]:
    auth = [("Authorization", f"Bearer {token}")]
    answers = []
    async with raw_client(tunnel) as client:
        for _ in range(3):  # the first checks the token (task path), the next find it verified
            answers.append(
                await client.request("GET", "/relay/secure/app/status/201", headers=auth)
            )
        answers.append(
            await client.request("POST", "/relay/secure/app/echo", pattern(100), headers=auth)
        )
    return answers


async def _refused(tunnel: Tunnel, token: str) -> Response:
    """One request with `token` on its own connection (a 401 closes it)."""
    async with raw_client(tunnel) as client:
        return await client.request(
            "GET", "/relay/secure/app/status/200", headers=[("Authorization", f"Bearer {token}")]
        )


async def test_authenticated_requests_take_the_express_path_with_the_task_paths_checks(
    start_tunnel: StartTunnel,
) -> None:
    # both relays share the tenant file, so its signing key: one token is good at both
    express = await start_tunnel()
    express.add_tenant("secure", require_authentication=True)
    task = await start_tunnel(express=False, target=express.target)
    clock = WallClock()
    for tunnel in (express, task):
        tunnel.dialect.tokens.clock = clock
        await tunnel.connect("secure")
    tokens = express.dialect.tokens
    token = tokens.issue("secure")
    metrics = express.dialect.metrics
    taken = metrics.express.value("taken")
    fast = await _authenticated(express, token)
    assert fast == await _authenticated(task, token)
    assert [status for status, _, _ in fast] == [201, 201, 201, 200]
    assert fast[3][2] == pattern(100)
    # only the first request of the token went to the task path, which verified it
    assert metrics.express.value("auth") == 1
    assert metrics.express.value("taken") == taken + 3
    async with express.client() as http:
        scrape = (await http.get("/metrics")).text
    assert f'rmb_relay_tunnel_express_total{{dialect="tunnel",outcome="taken"}} {taken + 3}' in (
        scrape
    )
    assert metrics.requests.value("secure", "app", "201") == 3
    assert tokens.known(token) == "secure"

    # badly signed, another tenant's (though verified), absent: the task path's 401, not served
    forged = TokenAuthority(b"x" * 32, clock=clock).issue("secure")
    other = tokens.issue("acme")
    assert await tokens.verify(other) == "acme"
    assert tokens.known(other) == "acme"
    calls = len(express.target.calls)
    failures = metrics.auth_failures.value("client")
    for bad, why in [(forged, b"token refused"), (other, b"another tenant")]:
        refused = await _refused(express, bad)
        assert refused == await _refused(task, bad)
        assert refused[0] == 401
        assert ("www-authenticate", "Bearer") in refused[1]
        assert why in refused[2]
    assert tokens.known(forged) is None
    assert metrics.express.value("taken") == taken + 3
    assert metrics.express.value("auth") == 3
    assert metrics.auth_failures.value("client") == failures + 2
    assert len(express.target.calls) == calls

    # still good up to exp + leeway, then refused on both paths and forgotten
    clock.now += (tokens.ttl + LEEWAY) * NS
    assert (await _refused(express, token))[0] == 200
    assert metrics.express.value("taken") == taken + 4
    clock.now += 1 * NS
    refused = await _refused(express, token)
    assert refused == await _refused(task, token)
    assert refused[0] == 401
    assert b"token expired" in refused[2]
    assert tokens.known(token) is None
    assert metrics.express.value("taken") == taken + 4
    assert metrics.requests.value("secure", "-", "401") == 3
    assert len(express.target.calls) == calls + 1
    assert express.dialect.hub.jobs == {}
