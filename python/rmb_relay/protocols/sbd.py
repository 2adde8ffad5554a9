"""The SBD dialect (holochain's simple websocket relay) on the shared listener.

Theory of operation (spec/sbd.md and the decisions at its top)
-------------------------------------------------------------
`GET /<base64url ed25519 key>` upgrades; a bad key is refused with 400, a blocked IP with 429, a
full house with 503, all before the 101. On open the server sends `lbrt` (the per-byte rate
budget of this connection) and `areq` (a random nonce). A valid `ares` (ed25519 over the nonce,
checked in Rust) is answered with `lidl` then `srdy`, and the key becomes routable in the same
step, so no forward can overtake `srdy`.

A forward's 32-byte header names the destination; the relay rewrites it to the sender's key
(in Rust) and queues it on the destination's connection, which keeps per-sender order. A forward
to an unknown or not-ready key is dropped silently. Every inbound message (commands included) is
charged to its IP's byte-nanos bucket (Rust); over the burst the connection is dropped without a
close frame and the IP is blocked for `--sbd-block-secs`. Any other violation (short message,
oversize, `ares` twice, forward before the handshake) also drops without a close frame.

Time: every decision takes `clock()` (monotonic nanoseconds). Idle timeouts and pruning run from
a periodic `sweep(now)`, which tests call directly with a fake clock.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ipaddress
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rmb_relay._core import (
    SBD_FORWARD,
    SBD_MAX_MESSAGE,
    ByteNanosLimiter,
    HttpRequest,
    RouteTable,
    SbdError,
    WsMessage,
    encode_request,
    parse_response_head,
    sbd_classify,
    sbd_decode_pubkey_path,
    sbd_encode_command,
    sbd_rewrite_forward,
    verify_ed25519,
)
from rmb_relay.errors import ConfigError
from rmb_relay.protocols.base import Dialect, WebSocketHandler
from rmb_relay.server.connection import Connection
from rmb_relay.server.http import HttpReject, HttpResponse

if TYPE_CHECKING:
    from rmb_relay.server.http import Router
    from rmb_relay.telemetry.metrics import Registry

log = logging.getLogger("rmb_relay.sbd")

Clock = Callable[[], int]

#: defined by the sbd spec (lbrt/lidl payloads are i32 big-endian)
I32_MAX = 2**31 - 1
#: defined by the sbd spec: `ares` is the header plus a 64-byte signature
ARES_LEN = 96
NONCE_LEN = 32
#: defined by the sbd reference server: idle buckets are dropped after 10 s
LIMITER_IDLE_NS = 10_000_000_000
#: spec-auth: request bodies of /authenticate are at most 1024 bytes
AUTH_BODY_MAX = 1024
#: the auth hook must answer within this many seconds (else 502, as the reference server)
AUTH_HOOK_TIMEOUT = 10.0
#: a hook answer is a small JSON object; anything larger is refused
AUTH_HOOK_MAX_RESPONSE = 64 * 1024
#: how often idle connections, expired blocks and tokens are swept
SWEEP_INTERVAL = 1.0

CMD_LBRT = b"lbrt"
CMD_LIDL = b"lidl"
CMD_AREQ = b"areq"
CMD_ARES = b"ares"
CMD_SRDY = b"srdy"


@dataclass(slots=True)
class SbdSettings:
    """Limits of decision 6 (spec/sbd.md), all flags of `rmb-relay` (see `add_sbd_arguments`)."""

    limit_clients: int = 32768
    kbps: int = 1000
    burst: int = 262144
    idle_ms: int = 10000
    disable_rate_limit: bool = False
    block_secs: int = 60
    trusted_ip_header: str | None = None
    auth_hook: str | None = None

    def __post_init__(self) -> None:
        # 8_000_000 / kbps must stay >= 1 ns per byte, or every message would be free
        if not 0 < self.kbps <= 8_000_000:
            raise ConfigError("--sbd-kbps must be between 1 and 8000000")
        if self.burst <= 0:
            raise ConfigError("--sbd-burst must be positive")
        if self.idle_ms <= 0 or self.limit_clients <= 0:
            raise ConfigError("--sbd-idle-ms and --sbd-limit-clients must be positive")
        if self.idle_ms > I32_MAX:
            raise ConfigError("--sbd-idle-ms must fit the 32-bit lidl value")
        if self.block_secs < 0:
            raise ConfigError("--sbd-block-secs must not be negative")
        if self.auth_hook is not None and urlsplit(self.auth_hook).scheme not in ("http", "https"):
            raise ConfigError(f"--sbd-auth-hook must be an http(s) URL, got {self.auth_hook!r}")

    @property
    def nanos_per_byte(self) -> int:
        return 8_000_000 // self.kbps

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SbdSettings:
        return cls(
            limit_clients=args.sbd_limit_clients,
            kbps=args.sbd_kbps,
            burst=args.sbd_burst,
            idle_ms=args.sbd_idle_ms,
            disable_rate_limit=args.sbd_disable_rate_limit,
            block_secs=args.sbd_block_secs,
            trusted_ip_header=args.trusted_ip_header,
            auth_hook=args.sbd_auth_hook,
        )


def add_sbd_arguments(parser: argparse.ArgumentParser) -> None:
    """The SBD flags of `rmb-relay` (decision 6); defaults come from `SbdSettings`."""
    d = SbdSettings()
    sbd = parser.add_argument_group("SBD relay (GET /<base64url ed25519 key>)")
    sbd.add_argument("--no-sbd", action="store_true", help="do not serve SBD")
    sbd.add_argument(
        "--sbd-limit-clients",
        type=int,
        default=d.limit_clients,
        metavar="N",
        help="concurrent SBD connections, handshaking ones included; a full relay answers 503",
    )
    sbd.add_argument(
        "--sbd-kbps",
        type=int,
        default=d.kbps,
        metavar="KBPS",
        help="per-IP inbound budget in kbit/s (8000000/KBPS ns per byte, shared by the IP's "
        "connections)",
    )
    sbd.add_argument(
        "--sbd-burst",
        type=int,
        default=d.burst,
        metavar="BYTES",
        help="per-IP burst allowance; a message beyond it drops the connection and blocks the IP",
    )
    sbd.add_argument(
        "--sbd-idle-ms",
        type=int,
        default=d.idle_ms,
        metavar="MS",
        help="drop a connection with no data message for this long (handshake included); "
        "the lidl value",
    )
    sbd.add_argument(
        "--sbd-disable-rate-limit", action="store_true", help="no per-IP limit (lbrt = 1)"
    )
    sbd.add_argument(
        "--sbd-block-secs",
        type=int,
        default=d.block_secs,
        metavar="SECONDS",
        help="how long an IP that broke its rate limit gets HTTP 429",
    )
    sbd.add_argument(
        "--trusted-ip-header",
        metavar="NAME",
        help="take the client IP from this header, e.g. X-Real-IP (only behind a proxy you "
        "trust; an unparsable value falls back to the TCP peer); default: the TCP peer",
    )
    sbd.add_argument(
        "--sbd-auth-hook",
        metavar="URL",
        help="spec-auth hook, e.g. http://auth.local/authenticate: PUT /authenticate bodies are "
        "forwarded there for a token, and connections must carry one; default: no hook "
        "(/authenticate hands out tokens, none required)",
    )


def sbd_dialect_from_args(args: argparse.Namespace, registry: Registry) -> SbdDialect | None:
    """The SBD dialect the flags ask for, or None with `--no-sbd`. Raises ConfigError."""
    if args.no_sbd:
        return None
    return SbdDialect(SbdSettings.from_args(args), registry)


def ip_key(text: str) -> str:
    """IPv4 maps to IPv6 (`::ffff:a.b.c.d`) as in the reference server; v6 is kept as is."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener reports v4 peers this way
    if isinstance(address, ipaddress.IPv4Address):
        return f"::ffff:{address}"
    return str(address)


class HotCounters:
    """Counters bumped for every message: plain ints rendered by the metrics page, because a
    metrics `Counter.inc` costs ~190 ns against ~70 ns for an int (three per forward)."""

    __slots__ = ("bytes_in", "bytes_out", "forward_drops", "forwards", "messages_in")

    def __init__(self) -> None:
        self.messages_in = 0
        self.bytes_in = 0
        self.forwards = 0
        self.bytes_out = 0
        self.forward_drops = 0


class SbdMetrics:
    def __init__(self, registry: Registry) -> None:
        hot = self.hot = HotCounters()
        registry.counter_of(
            "sbd_messages_in_total",
            "SBD messages received (commands and forwards)",
            lambda: [((), hot.messages_in)],
        )
        registry.counter_of(
            "sbd_bytes_in_total", "SBD message bytes received", lambda: [((), hot.bytes_in)]
        )
        registry.counter_of(
            "sbd_bytes_out_total", "SBD forward bytes sent", lambda: [((), hot.bytes_out)]
        )
        registry.counter_of(
            "sbd_forwards_total", "SBD forwards relayed", lambda: [((), hot.forwards)]
        )
        registry.counter_of(
            "sbd_forward_drops_total",
            "Forwards to an unknown or not-ready key (dropped)",
            lambda: [((), hot.forward_drops)],
        )
        self.rate_limited = registry.counter(
            "sbd_rate_limited_total", "Connections dropped for exceeding the IP byte budget"
        )
        self.idle_closed = registry.counter(
            "sbd_idle_closed_total", "Connections dropped for idleness (or a slow handshake)"
        )
        self.violations = registry.counter(
            "sbd_violations_total", "Connections dropped for protocol violations", ("reason",)
        )
        self.auth_failures = registry.counter(
            "sbd_auth_failures_total", "Refused handshakes or tokens", ("reason",)
        )
        self.refused = registry.counter(
            "sbd_upgrades_refused_total", "Upgrades refused before 101", ("status",)
        )


class SbdDialect(Dialect):
    name = "sbd"
    # the codec refuses anything larger before buffering it; abort_on_violation turns that
    # refusal into a dropped connection with no close frame, as the spec demands
    max_message = SBD_MAX_MESSAGE
    abort_on_violation = True

    def __init__(
        self,
        settings: SbdSettings,
        registry: Registry,
        clock: Clock = time.monotonic_ns,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = SbdMetrics(registry)
        self.routes = RouteTable()
        self.limiter = ByteNanosLimiter(settings.nanos_per_byte, settings.burst)
        #: every SBD connection, handshaking or ready, by connection id
        self.sessions: dict[int, SbdSession] = {}
        #: connections per IP key (for lbrt and the client limit)
        self.by_ip: dict[str, set[SbdSession]] = {}
        self.blocked: dict[str, int] = {}  # ip -> unblock time (ns)
        self.tokens: dict[str, int] = {}  # auth token -> last use (ns)
        self._sweeper: asyncio.TimerHandle | None = None
        registry.gauge(
            "sbd_connections",
            "SBD connections (handshaking and ready)",
            read=lambda: [((), len(self.sessions))],
        )
        registry.gauge(
            "sbd_blocked_ips",
            "IPs blocked for rate violations",
            read=lambda: [((), len(self.blocked))],
        )

    # ---- upgrade ---------------------------------------------------------------------------

    def matches(self, request: HttpRequest) -> bool:
        path = request.path
        return len(path) > 1 and path.count("/") == 1

    def client_ip(self, request: HttpRequest, conn: Connection) -> str:
        header = self.settings.trusted_ip_header
        if header:
            value = request.header(header)
            if value is not None:
                try:
                    return ip_key(str(ipaddress.ip_address(value.decode().strip())))
                except (ValueError, UnicodeDecodeError):
                    pass  # unparsable (e.g. a list): fall back to the TCP peer, as the reference
        return ip_key(conn.peer_host)

    async def accept(self, request: HttpRequest, conn: Connection) -> WebSocketHandler:
        self._ensure_sweeper()
        now = self.clock()
        token = self._check_authorization(request, now)
        try:
            pubkey = sbd_decode_pubkey_path(request.path[1:])
        except SbdError as err:
            self.metrics.refused.inc(1, "400")
            raise HttpReject(400, f"invalid sbd public key: {err}") from None
        ip = self.client_ip(request, conn)
        until = self.blocked.get(ip)
        if until is not None:
            if until > now:
                self.metrics.refused.inc(1, "429")
                raise HttpReject(429, "too many requests: this address is blocked for a while")
            del self.blocked[ip]
        if len(self.sessions) >= self.settings.limit_clients:
            self.metrics.refused.inc(1, "503")
            raise HttpReject(503, "sbd relay is full: try again later")
        return SbdSession(conn, self, pubkey, ip, token)

    def _check_authorization(self, request: HttpRequest, now: int) -> str | None:
        """spec-auth: a present header must carry a live token, also without a hook."""
        header = request.header("authorization")
        if header is None:
            if self.settings.auth_hook is not None:
                self.metrics.auth_failures.inc(1, "missing token")
                raise HttpReject(401, "Unauthorized")
            return None
        text = header.decode(errors="replace")
        token = text[len("Bearer ") :] if text.startswith("Bearer ") else None
        if token is None or not self._token_alive(token, now):
            self.metrics.auth_failures.inc(1, "bad token")
            raise HttpReject(401, "Unauthorized")
        return token

    def _token_alive(self, token: str, now: int) -> bool:
        last = self.tokens.get(token)
        if last is None or now - last >= self.settings.idle_ms * 1_000_000:
            self.tokens.pop(token, None)
            return False
        self.tokens[token] = now
        return True

    # ---- per-IP bookkeeping ----------------------------------------------------------------

    def lbrt_value(self, ip: str) -> int:
        if self.settings.disable_rate_limit:
            return 1
        return min(I32_MAX, self.settings.nanos_per_byte * len(self.by_ip.get(ip, ())))

    def ip_count_changed(self, ip: str) -> None:
        """Decision 5: every connection of the IP hears the new per-connection budget."""
        members = self.by_ip.get(ip)
        if not members:
            return
        frame = sbd_encode_command(CMD_LBRT, self.lbrt_value(ip).to_bytes(4, "big"))
        for session in members:
            session.send(frame)

    def charge(self, session: SbdSession, size: int, now: int) -> bool:
        if self.settings.disable_rate_limit:
            return True
        if self.limiter.check(session.ip, size, now):
            return True
        self.blocked[session.ip] = now + self.settings.block_secs * 1_000_000_000
        self.metrics.rate_limited.inc()
        log.info(
            "sbd: %s over its byte budget; blocked for %ds", session.ip, self.settings.block_secs
        )
        return False

    # ---- maintenance -----------------------------------------------------------------------

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_INTERVAL, self._tick)

    def _tick(self) -> None:
        self._sweeper = None
        self.sweep(self.clock())
        if self.sessions or self.blocked or self.tokens:
            self._ensure_sweeper()

    def sweep(self, now: int) -> None:
        """Drop idle connections, expired blocks, idle rate buckets and stale tokens."""
        idle_ns = self.settings.idle_ms * 1_000_000
        for session in list(self.sessions.values()):
            if now - session.last_activity >= idle_ns:
                self.metrics.idle_closed.inc()
                session.drop("idle")
        for ip, until in list(self.blocked.items()):
            if until <= now:
                del self.blocked[ip]
        self.limiter.prune(now, LIMITER_IDLE_NS)
        for token, last in list(self.tokens.items()):
            if now - last >= idle_ns:
                del self.tokens[token]

    # ---- HTTP: spec-auth -------------------------------------------------------------------

    def add_routes(self, router: Router) -> None:
        router.add("PUT", "/authenticate", self._authenticate)

    async def _authenticate(self, request: HttpRequest, conn: Connection) -> HttpResponse:
        body = request.body
        if len(body) > AUTH_BODY_MAX:
            return HttpResponse(413, b"auth body over 1024 bytes")
        if self.settings.auth_hook is None:
            token = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
        else:
            try:
                token = await call_auth_hook(self.settings.auth_hook, body)
            except PermissionError:
                self.metrics.auth_failures.inc(1, "hook refused")
                return HttpResponse(401, b"Unauthorized")
            except (OSError, ValueError, TimeoutError) as err:
                log.warning("sbd auth hook %s failed: %s", self.settings.auth_hook, err)
                return HttpResponse(502, f"BAD_GATEWAY: {err}".encode())
        self.tokens[token] = self.clock()
        self._ensure_sweeper()
        return HttpResponse(
            200, f'{{"authToken":"{token}"}}'.encode(), content_type="application/json"
        )

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()


async def call_auth_hook(url: str, body: bytes, timeout: float = AUTH_HOOK_TIMEOUT) -> str:
    """PUT the auth bytes to the operator's hook (spec-auth); returns its `authToken`.

    A one-request HTTP/1.1 client on asyncio streams with the Rust request encoder and response
    head parser. The body is read by Content-Length, chunked, or to EOF, so a hook that keeps
    the connection open despite `Connection: close` still answers at once.

    Raises PermissionError for 401, ValueError for any other unusable answer, OSError or
    TimeoutError when the hook cannot be reached in time."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"auth hook must be an http(s) URL, got {url!r}")
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(
            host, port, ssl=parts.scheme == "https" or None
        )
        try:
            writer.write(
                encode_request(
                    "PUT",
                    target,
                    [
                        ("Host", parts.netloc),
                        ("Content-Type", "application/octet-stream"),
                        ("Connection", "close"),
                    ],
                    body,
                )
            )
            status, answer = await _read_response(reader)
        finally:
            writer.close()
    if status == 401:
        raise PermissionError("auth hook refused")
    if status != 200:
        raise ValueError(f"auth hook answered {status}")
    try:
        token = json.loads(answer)["authToken"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("auth hook answer has no authToken") from None
    if not isinstance(token, str) or not token:
        raise ValueError("auth hook authToken is not a non-empty string")
    return token


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response; ValueError when malformed or too large."""
    buffer = b""
    while (head := parse_response_head(buffer)) is None:
        if len(buffer) > AUTH_HOOK_MAX_RESPONSE:
            raise ValueError("auth hook response head too large")
        chunk = await reader.read(4096)
        if not chunk:
            raise ValueError("auth hook closed before a complete response head")
        buffer += chunk
    status, headers, head_len = head
    fields = {name: value for name, value in headers}
    rest = buffer[head_len:]
    stream = _Prefixed(rest, reader)
    if b"chunked" in fields.get("transfer-encoding", b"").lower():
        body = b""
        while True:
            size_line = await stream.readline()
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ValueError("auth hook sent a bad chunk size") from None
            if size == 0:
                return status, body
            if len(body) + size > AUTH_HOOK_MAX_RESPONSE:
                raise ValueError("auth hook response too large")
            body += await stream.readexactly(size)
            await stream.readexactly(2)  # CRLF after the chunk
    length = fields.get("content-length")
    if length is not None:
        try:
            size = int(length)
        except ValueError:
            raise ValueError("auth hook sent a bad Content-Length") from None
        if not 0 <= size <= AUTH_HOOK_MAX_RESPONSE:
            raise ValueError("auth hook response too large")
        return status, await stream.readexactly(size)
    return status, await stream.read_to_eof(AUTH_HOOK_MAX_RESPONSE)


class _Prefixed:
    """A StreamReader with bytes already read put back in front."""

    def __init__(self, prefix: bytes, reader: asyncio.StreamReader) -> None:
        self.buffer = prefix
        self.reader = reader

    async def _fill(self) -> None:
        chunk = await self.reader.read(4096)
        if not chunk:
            raise ValueError("auth hook closed mid-response")
        self.buffer += chunk

    async def readexactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    async def readline(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if len(self.buffer) > 1024:
                raise ValueError("auth hook sent an overlong line")
            await self._fill()
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    async def read_to_eof(self, limit: int) -> bytes:
        while chunk := await self.reader.read(4096):
            self.buffer += chunk
            if len(self.buffer) > limit:
                raise ValueError("auth hook response too large")
        return self.buffer


class SbdSession(WebSocketHandler):
    """One SBD connection: handshaking until a valid `ares`, then ready."""

    def __init__(
        self, conn: Connection, dialect: SbdDialect, pubkey: bytes, ip: str, token: str | None
    ) -> None:
        super().__init__(conn)
        self.dialect = dialect
        self.pubkey = pubkey
        self.ip = ip
        self.token = token
        self.nonce = os.urandom(NONCE_LEN)
        self.ready = False
        self.open = False
        self.last_activity = dialect.clock()

    def send(self, message: bytes) -> None:
        self.conn.send_binary(message)

    def on_open(self) -> None:
        dialect = self.dialect
        self.open = True
        dialect.sessions[self.conn.conn_id] = self
        dialect.by_ip.setdefault(self.ip, set()).add(self)
        dialect.ip_count_changed(self.ip)  # includes this connection's first lbrt
        self.send(sbd_encode_command(CMD_AREQ, self.nonce))

    def drop(self, reason: str) -> None:
        """Abort without a close frame (the spec's answer to every violation)."""
        if reason not in ("idle", "rate"):
            self.dialect.metrics.violations.inc(1, reason)
        log.debug("sbd: dropping %s from %s: %s", self.key_text, self.ip, reason)
        self.conn.abort()

    @property
    def key_text(self) -> str:
        return base64.urlsafe_b64encode(self.pubkey).rstrip(b"=").decode()

    def on_message(self, message: WsMessage) -> None:
        dialect = self.dialect
        data = message.data  # text frames count as their UTF-8 bytes, as in the reference
        size = len(data)
        now = dialect.clock()
        hot = dialect.metrics.hot
        hot.messages_in += 1
        hot.bytes_in += size
        if not dialect.charge(self, size, now):
            self.drop("rate")
            return
        self.last_activity = now
        if self.token is not None:
            dialect.tokens[self.token] = now
        try:
            classified = sbd_classify(data)
        except SbdError:
            self.drop("short message")
            return
        if classified.kind == SBD_FORWARD:
            if not self.ready:
                self.drop("forward before handshake")
                return
            target_id = dialect.routes.lookup_pubkey(classified.peer)
            target = dialect.sessions.get(target_id) if target_id is not None else None
            if target is None or not target.ready:
                hot.forward_drops += 1
                return
            target.conn.send_binary(sbd_rewrite_forward(data, self.pubkey))
            hot.forwards += 1
            hot.bytes_out += size
            return
        if classified.tag == CMD_ARES:
            self._on_ares(data, classified.payload)
        # keep, none and any other command: ignored (but charged above)

    def _on_ares(self, data: bytes, signature: bytes) -> None:
        dialect = self.dialect
        if self.ready:
            self.drop("ares after handshake")
            return
        if len(data) != ARES_LEN or not verify_ed25519(self.pubkey, self.nonce, signature):
            dialect.metrics.auth_failures.inc(1, "bad signature")
            self.drop("bad handshake signature")
            return
        idle = dialect.settings.idle_ms.to_bytes(4, "big")
        self.send(sbd_encode_command(CMD_LIDL, idle))
        self.send(sbd_encode_command(CMD_SRDY))
        # routable in the same step as srdy is queued: nothing can overtake it
        self.ready = True
        displaced = dialect.routes.register_pubkey(self.pubkey, self.conn.conn_id)
        if displaced is not None:
            older = dialect.sessions.get(displaced)
            if older is not None:
                older.ready = False  # decision 4: the newest connection takes the routing
                older.conn.close(1000, "replaced by a newer connection with the same key")

    def on_close(self, code: int | None) -> None:
        if not self.open:
            return
        self.open = False
        dialect = self.dialect
        dialect.sessions.pop(self.conn.conn_id, None)
        dialect.routes.unregister_pubkey(self.pubkey, self.conn.conn_id)
        members = dialect.by_ip.get(self.ip)
        if members is not None:
            members.discard(self)
            if members:
                dialect.ip_count_changed(self.ip)
            else:
                del dialect.by_ip[self.ip]
