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

import asyncio
import base64
import ipaddress
import logging
import secrets
from typing import TYPE_CHECKING

from rmb_relay._core import (
    SBD_MAX_MESSAGE,
    ByteNanosLimiter,
    HttpRequest,
    SbdError,
    sbd_decode_pubkey_path,
    sbd_encode_command,
)
from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.dialects.base import (
    Dialect,
    HttpClient,
    HttpResponse,
    Peer,
    Routes,
    WebSocketHandler,
)
from rmb_relay.dialects.sbd.auth_hook import AuthHookClient
from rmb_relay.dialects.sbd.metrics import SbdMetrics
from rmb_relay.dialects.sbd.session import SbdSession
from rmb_relay.dialects.sbd.settings import (
    AUTH_BODY_MAX,
    CMD_LBRT,
    I32_MAX,
    LBRT_INTERVAL,
    LIMITER_IDLE_NS,
    SWEEP_INTERVAL,
    SbdSettings,
)
from rmb_relay.errors import HttpReject
from rmb_relay.switch import Switch
from rmb_relay.throttle import Throttles

if TYPE_CHECKING:
    from rmb_relay.telemetry.metrics import Registry

log = logging.getLogger("rmb_relay.sbd")


def ip_key(text: str, ipv6_prefix: int = 128) -> str:
    """IPv4 maps to IPv6 (`::ffff:a.b.c.d`) as in the reference server; v6 is kept as is, or
    as its `/ipv6_prefix` network (`--ipv6-prefix`: one host usually owns a whole /64, so per
    /128 its limits would be free to evade)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener reports v4 peers this way
    if isinstance(address, ipaddress.IPv4Address):
        return f"::ffff:{address}"
    if ipv6_prefix < 128:
        return str(ipaddress.IPv6Network((address, ipv6_prefix), strict=False))
    return str(address)


class SbdDialect(Dialect):
    name = "sbd"
    paths = ("/{pubkey}",)
    # the codec refuses anything larger before buffering it; abort_on_violation turns that
    # refusal into a dropped connection with no close frame, as the spec demands
    max_message = SBD_MAX_MESSAGE
    abort_on_violation = True

    def __init__(
        self,
        settings: SbdSettings,
        registry: Registry,
        clock: Clock = monotonic_clock,
        *,
        switch: Switch | None = None,
        throttles: Throttles | None = None,
    ) -> None:
        """`switch` is the process's shared one (tests may leave it out: a private one);
        `throttles` the process's failed-login limiter (throttle.py; default: its own)."""
        self.settings = settings
        self.throttles = throttles if throttles is not None else Throttles(registry)
        self.clock = clock
        # the decoder's scanner charges the rate limiter at this clock's reading, once per read
        self.scan_clock = clock
        self.switch = switch if switch is not None else Switch()
        self.metrics = SbdMetrics(registry, self.switch.outboxes)
        self.limiter = ByteNanosLimiter(settings.nanos_per_byte, settings.burst)
        #: every SBD connection, handshaking or ready, by connection id
        self.sessions: dict[int, SbdSession] = {}
        #: connections per IP key (for lbrt and the client limit)
        self.by_ip: dict[str, set[SbdSession]] = {}
        #: connections per IP key that have not completed the handshake (capped)
        self.handshaking: dict[str, int] = {}
        #: lbrt bookkeeping: when each IP's connections last heard a new value (ns), the IPs
        #: whose count changed since, and how many lbrt frames were sent in all
        self._lbrt_at: dict[str, int] = {}
        self._lbrt_dirty: set[str] = set()
        self._lbrt_timer: asyncio.TimerHandle | None = None
        self.lbrt_frames = 0
        self.blocked: dict[str, int] = {}  # ip -> unblock time (ns)
        self.tokens: dict[str, int] = {}  # auth token -> last use (ns)
        self._sweeper: asyncio.TimerHandle | None = None
        #: one HTTP session for every hook call (opened on first use, closed in close())
        self.auth_hook = AuthHookClient()
        registry.gauge(
            "rmb_relay_sessions",
            "Sessions a dialect holds (RMB: logged in; SBD: handshaking and ready)",
            read=lambda: [((), len(self.sessions))],
            const={"dialect": "sbd"},
        )
        registry.gauge(
            "rmb_relay_blocked_ips",
            "IP addresses blocked for rate violations, by dialect",
            read=lambda: [((), len(self.blocked))],
            const={"dialect": "sbd"},
        )

    # ---- upgrade ---------------------------------------------------------------------------

    def client_ip(self, request: HttpRequest, conn: Peer | HttpClient) -> str:
        prefix = self.throttles.settings.ipv6_prefix
        header = self.settings.trusted_ip_header
        if header:
            value = request.header(header)
            if value is not None:
                try:
                    return ip_key(str(ipaddress.ip_address(value.decode().strip())), prefix)
                except (ValueError, UnicodeDecodeError):
                    pass  # unparsable (e.g. a list): fall back to the TCP peer, as the reference
        return ip_key(conn.peer_host, prefix)

    async def accept(self, request: HttpRequest, conn: Peer) -> WebSocketHandler:
        self._ensure_sweeper()
        now = self.clock()
        if request.header("authorization") is None and self.settings.auth_hook is None:
            token = None
        else:
            # wrong tokens: --auth-failures per address, then 429 (throttle.py); a token the
            # relay issued is 32 random bytes, nothing to guess: only failures are charged
            keys = self.throttles.check("sbd", self.client_ip(request, conn), secret=False)
            try:
                token = self._check_authorization(request, now)
            except HttpReject:
                self.throttles.failed(keys)
                raise
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
        if self.handshaking.get(ip, 0) >= self.settings.limit_handshaking_per_ip:
            self.metrics.refused.inc(1, "429")
            raise HttpReject(429, "too many handshaking connections from this address")
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
        idle_ns = self.settings.idle_ms * 1_000_000
        if last is not None and now - last >= idle_ns:
            self._sync_tokens()
            last = self.tokens.get(token, last)
        if last is None or now - last >= idle_ns:
            self.tokens.pop(token, None)
            return False
        self.tokens[token] = now
        return True

    # ---- per-IP bookkeeping ----------------------------------------------------------------

    def _sync_tokens(self) -> None:
        """Bring each token's last use up to its connections' last message: the fast path's
        forwards count too (they do not refresh `tokens` message by message)."""
        for session in self.sessions.values():
            token = session.token
            if token is not None and session.scanner.active_at > self.tokens.get(token, 0):
                self.tokens[token] = session.scanner.active_at

    def lbrt_value(self, ip: str) -> int:
        if self.settings.disable_rate_limit:
            return 1
        return min(I32_MAX, self.settings.nanos_per_byte * len(self.by_ip.get(ip, ())))

    def handshake_started(self, session: SbdSession) -> None:
        session.handshaking = True
        self.handshaking[session.ip] = self.handshaking.get(session.ip, 0) + 1

    def handshake_done(self, session: SbdSession) -> None:
        """The session completed its handshake or closed (once per session)."""
        if not session.handshaking:
            return
        session.handshaking = False
        left = self.handshaking[session.ip] - 1
        if left:
            self.handshaking[session.ip] = left
        else:
            del self.handshaking[session.ip]

    def send_lbrt(self, session: SbdSession) -> None:
        """Tell one connection its IP's current per-connection budget, if it changed."""
        value = self.lbrt_value(session.ip)
        if session.lbrt_sent != value:
            session.lbrt_sent = value
            session.send(sbd_encode_command(CMD_LBRT, value.to_bytes(4, "big")))
            self.lbrt_frames += 1

    def ip_count_changed(self, ip: str) -> None:
        """Decision 5: every connection of the IP hears the new per-connection budget, at most
        once per `LBRT_INTERVAL` (see there): at once after a quiet interval, else coalesced."""
        now = self.clock()
        last = self._lbrt_at.get(ip)
        if last is None or now - last >= LBRT_INTERVAL * 1_000_000_000:
            self._broadcast_lbrt(ip, now)
            return
        self._lbrt_dirty.add(ip)
        if self._lbrt_timer is None:
            loop = asyncio.get_running_loop()
            self._lbrt_timer = loop.call_later(LBRT_INTERVAL, self._flush_lbrt)

    def _broadcast_lbrt(self, ip: str, now: int) -> None:
        self._lbrt_at[ip] = now
        for session in self.by_ip.get(ip, ()):
            self.send_lbrt(session)

    def _flush_lbrt(self) -> None:
        self._lbrt_timer = None
        dirty, self._lbrt_dirty = self._lbrt_dirty, set()
        now = self.clock()
        for ip in dirty:
            self._broadcast_lbrt(ip, now)

    def rate_violation(self, session: SbdSession) -> None:
        """The session's IP went over its byte budget (charged by the decoder's scanner):
        block the IP for `--sbd-block-secs`."""
        now = self.clock()
        self.blocked[session.ip] = now + self.settings.block_secs * 1_000_000_000
        self.metrics.rate_limited.inc()
        log.info(
            "sbd: %s over its byte budget; blocked for %ds", session.ip, self.settings.block_secs
        )

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
            if now - session.active_at >= idle_ns:
                self.metrics.idle_closed.inc()
                session.drop("idle")
        for ip, until in list(self.blocked.items()):
            if until <= now:
                del self.blocked[ip]
        interval = LBRT_INTERVAL * 1_000_000_000
        for ip, at in list(self._lbrt_at.items()):
            if ip not in self.by_ip and now - at >= interval:
                del self._lbrt_at[ip]
        self.limiter.prune(now, LIMITER_IDLE_NS)
        self._forget_idle_tokens(now)

    def _forget_idle_tokens(self, now: int) -> None:
        idle_ns = self.settings.idle_ms * 1_000_000
        self._sync_tokens()
        for token, last in list(self.tokens.items()):
            if now - last >= idle_ns:
                del self.tokens[token]

    def open_surfaces(self) -> list[str]:
        if self.settings.auth_hook is not None:
            return []
        return ["any key may connect and relay (no --sbd-auth-hook)"]

    # ---- HTTP: spec-auth -------------------------------------------------------------------

    def add_routes(self, router: Routes) -> None:
        router.add("PUT", "/authenticate", self._authenticate)

    async def _authenticate(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        body = request.body
        if len(body) > AUTH_BODY_MAX:
            return HttpResponse(413, b"auth body over 1024 bytes")
        if len(self.tokens) >= self.settings.max_tokens:
            self._forget_idle_tokens(self.clock())
            if len(self.tokens) >= self.settings.max_tokens:
                self.throttles.limited.inc(1, "sbd", "busy")
                return HttpResponse(
                    503,
                    f"{self.settings.max_tokens} tokens are live: try again shortly".encode(),
                    headers=(("Retry-After", "1"),),
                )
        if self.settings.auth_hook is None:
            token = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
        else:
            # each attempt costs a hook call: refused ones are limited per address (429)
            charged = self.throttles.check("sbd", self.client_ip(request, client))
            try:
                token = await self.auth_hook.call(self.settings.auth_hook, body)
            except PermissionError:
                self.metrics.auth_failures.inc(1, "hook refused")
                return HttpResponse(401, b"Unauthorized")
            except (OSError, ValueError, TimeoutError) as err:
                self.throttles.refund(charged)  # the hook's failure, not the client's
                log.warning("sbd auth hook %s failed: %s", self.settings.auth_hook, err)
                return HttpResponse(502, f"BAD_GATEWAY: {err}".encode())
            self.throttles.refund(charged)
        self.tokens[token] = self.clock()
        self._ensure_sweeper()
        return HttpResponse(
            200, f'{{"authToken":"{token}"}}'.encode(), content_type="application/json"
        )

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._lbrt_timer is not None:
            self._lbrt_timer.cancel()
        await self.auth_hook.close()
