"""The dialect registry and path patterns: a dialect added from outside the package (this test
module) brings its flags and serves on the listener without any shared file edited; two
dialects claiming one path are refused at startup; the most specific pattern wins."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from rmb_relay._core import HttpRequest, WsMessage
from rmb_relay.commands import serve
from rmb_relay.config import ListenerConfig
from rmb_relay.dialects import registry
from rmb_relay.dialects.base import (
    Dialect,
    DialectEntry,
    HttpClient,
    HttpResponse,
    Peer,
    Routes,
    WebSocketHandler,
)
from rmb_relay.dialects.paths import PathKind, PathPattern, PathTable
from rmb_relay.errors import ConfigError
from rmb_relay.server.http import Router
from rmb_relay.server.listener import RelayServer
from rmb_relay.services import Services
from tests.conftest import StartRelay
from tests.dialects import EchoDialect, PipeDialect
from tests.helpers import RawWebSocket, http_exchange


class ShoutHandler(WebSocketHandler):
    def __init__(self, peer: Peer, suffix: bytes) -> None:
        super().__init__(peer)
        self.suffix = suffix

    def on_message(self, message: WsMessage) -> None:
        self.peer.send(message.data.upper() + self.suffix)


class ShoutDialect(Dialect):
    """Test-only: `/shout/...` answers every message in capitals, plus its `--shout-suffix`."""

    name = "shout"
    paths = ("/shout/*",)

    def __init__(self, suffix: bytes) -> None:
        self.suffix = suffix

    async def accept(self, request: HttpRequest, peer: Peer) -> WebSocketHandler:
        return ShoutHandler(peer, self.suffix)

    def add_routes(self, router: Routes) -> None:
        router.add("GET", "/shout-status", self._status)

    async def _status(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return HttpResponse(200, b"shouting")


def _add_shout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shout (test dialect)")
    group.add_argument("--shout-suffix", default="!", help="appended to every answer")
    group.add_argument("--no-shout", action="store_true", help="do not serve shout")


async def _build_shout(args: argparse.Namespace, services: Services) -> ShoutDialect | None:
    return None if args.no_shout else ShoutDialect(args.shout_suffix.encode())


SHOUT = DialectEntry(
    name="shout",
    summary="capitals at /shout/*",
    add_arguments=_add_shout_arguments,
    build=_build_shout,
)


@pytest.fixture
def shout_registered() -> Iterator[None]:
    registry.register(SHOUT)
    try:
        yield
    finally:
        registry.unregister("shout")


async def _serve(tmp_path: Path, *argv: str) -> tuple[RelayServer, Services]:
    args = serve.parser().parse_args(
        ["-l", "127.0.0.1:0", "--twins", f"sqlite:{tmp_path / 'twins.sqlite3'}", *argv]
    )
    server, services = await serve.build_server(args)
    await server.start()
    return server, services


async def test_registered_dialect_serves_with_its_own_flags(
    shout_registered: None, tmp_path: Path
) -> None:
    server, services = await _serve(tmp_path, "--shout-suffix", "?!")
    try:
        assert "shout" in server.banner()
        assert "rmb" in server.banner()
        host, port = server.addresses[0]
        ws = await RawWebSocket.connect(host, port, "/shout/room")
        ws.send_binary(b"hello")
        event = await ws.next_event()
        assert isinstance(event, WsMessage)
        assert event.data == b"HELLO?!"
        ws.close()
        answer = await http_exchange(
            host, port, b"GET /shout-status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b"shouting")
    finally:
        await server.shutdown()
        await services.close()


async def test_registered_dialect_is_in_serve_help(shout_registered: None) -> None:
    text = serve.parser().format_help()
    assert "--shout-suffix" in text
    assert "capitals at /shout/*" in text


async def test_registered_dialect_can_be_switched_off_by_its_flag(
    shout_registered: None, tmp_path: Path
) -> None:
    server, services = await _serve(tmp_path, "--no-shout")
    try:
        assert "shout" not in server.banner()
    finally:
        await server.shutdown()
        await services.close()


def test_registering_a_name_twice_is_refused(shout_registered: None) -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register(SHOUT)


def test_two_dialects_claiming_one_path_are_refused_at_startup() -> None:
    class Other(EchoDialect):
        name = "other"

    with pytest.raises(ConfigError, match=r"path /echo is claimed twice \(by dialect other\)"):
        RelayServer(ListenerConfig(port=0), [EchoDialect(), Other()])


def test_a_dialect_without_paths_is_refused() -> None:
    class Pathless(EchoDialect):
        paths = ()

    with pytest.raises(ConfigError, match="declares no websocket path"):
        RelayServer(ListenerConfig(port=0), [Pathless()])


async def test_most_specific_pattern_wins_over_a_segment_wildcard(
    start_relay: StartRelay,
) -> None:
    """SBD-like `/{key}` would match `/echo`; the exact path wins whatever the order."""

    class AnySegment(EchoDialect):
        name = "segment"
        paths = ("/{anything}",)

    echo = EchoDialect()
    segment = AnySegment()
    server = await start_relay([segment, echo])
    host, port = server.addresses[0]
    ws = await RawWebSocket.connect(host, port, "/echo")
    ws.close()
    other = await RawWebSocket.connect(host, port, "/zzz")
    other.close()
    assert echo.opened == 1
    assert segment.opened == 1


async def test_prefix_dialect_serves_everything_below_its_prefix(start_relay: StartRelay) -> None:
    pipe = PipeDialect()
    server = await start_relay([pipe])
    host, port = server.addresses[0]
    a = await RawWebSocket.connect(host, port, "/pipe/a")
    b = await RawWebSocket.connect(host, port, "/pipe/b")
    b.send_binary(b"a:hi")
    event = await a.next_event()
    assert isinstance(event, WsMessage)
    assert event.data == b"hi"
    a.close()
    b.close()
    refused = await http_exchange(
        host,
        port,
        b"GET /pipes HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    assert refused.startswith(b"HTTP/1.1 404")


@pytest.mark.parametrize(
    ("text", "kind", "matching", "not_matching"),
    [
        ("/", PathKind.EXACT, ["/"], ["/a", ""]),
        ("/gateway/websocket", PathKind.EXACT, ["/gateway/websocket"], ["/gateway"]),
        ("/relay/*", PathKind.PREFIX, ["/relay", "/relay/t/x/y"], ["/relays", "/"]),
        ("/{key}", PathKind.SEGMENT, ["/abc"], ["/", "/a/b", "//"]),
    ],
)
def test_path_patterns(
    text: str, kind: PathKind, matching: list[str], not_matching: list[str]
) -> None:
    pattern = PathPattern.parse(text)
    assert pattern.kind is kind
    assert all(pattern.matches(p) for p in matching)
    assert not any(pattern.matches(p) for p in not_matching)


@pytest.mark.parametrize("text", ["relay", "/a/*/b", "/a*", "/{a}/b", "/x{y}"])
def test_bad_path_patterns_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        PathPattern.parse(text)


def test_path_table_prefers_exact_then_longest_prefix_then_segment() -> None:
    table: PathTable[str] = PathTable()
    for pattern in ["/{seg}", "/a/*", "/a/b/*", "/a/b/c"]:
        table.add(pattern, pattern)
    assert table.find("/a/b/c") == "/a/b/c"
    assert table.find("/a/b/d") == "/a/b/*"
    assert table.find("/a/x") == "/a/*"
    assert table.find("/a") == "/a/*"
    assert table.find("/q") == "/{seg}"
    assert table.find("/q/r") is None


async def _ok(request: HttpRequest, client: HttpClient) -> HttpResponse:
    return HttpResponse(200, request.path.encode())


def test_router_prefix_routes_and_405() -> None:
    router = Router()
    router.add("POST", "/relay/*", _ok)
    router.add("GET", "/relay/special", _ok)
    handler, _ = router.find("POST", "/relay/tenant/target/x")
    assert handler is _ok
    handler, allowed = router.find("DELETE", "/relay/tenant")
    assert handler is None
    assert allowed == ["POST"]
    handler, allowed = router.find("POST", "/relay/special")
    assert handler is None
    assert allowed == ["GET", "HEAD"]
    with pytest.raises(ConfigError, match="registered twice"):
        router.add("POST", "/relay/*", _ok)
