"""SBD limits (decision 6 of spec/sbd.md), their flags, and the constants of the SBD spec."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlsplit

from rmb_relay.errors import ConfigError

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
#: an IP's connections hear a changed `lbrt` at most once per this many seconds: the first
#: change after a quiet second goes out at once, later ones are coalesced into one update at
#: the end of the interval, so N connections arriving from one IP cost O(N) frames, not O(N^2)
LBRT_INTERVAL = 1.0

CMD_LBRT = b"lbrt"
CMD_LIDL = b"lidl"
CMD_AREQ = b"areq"
CMD_ARES = b"ares"
CMD_SRDY = b"srdy"


@dataclass(slots=True)
class SbdSettings:
    """Limits of decision 6 (spec/sbd.md), all flags of `rmb-relay` (see `add_sbd_arguments`)."""

    limit_clients: int = 32768
    #: connections of one IP that have not completed the handshake: an anonymous IP cannot
    #: hold more slots than this (the reference server has no such cap; 429 beyond it)
    limit_handshaking_per_ip: int = 256
    kbps: int = 1000
    burst: int = 262144
    idle_ms: int = 10000
    disable_rate_limit: bool = False
    block_secs: int = 60
    trusted_ip_header: str | None = None
    auth_hook: str | None = None
    #: live tokens `PUT /authenticate` has handed out (each lives until idle for `idle_ms`):
    #: without a hook anyone gets one, so the table is bounded (503 beyond)
    max_tokens: int = 100_000

    def __post_init__(self) -> None:
        # 8_000_000 / kbps must stay >= 1 ns per byte, or every message would be free
        if not 0 < self.kbps <= 8_000_000:
            raise ConfigError("--sbd-kbps must be between 1 and 8000000")
        if self.burst <= 0:
            raise ConfigError("--sbd-burst must be positive")
        if self.idle_ms <= 0 or self.limit_clients <= 0 or self.limit_handshaking_per_ip <= 0:
            raise ConfigError(
                "--sbd-idle-ms, --sbd-limit-clients and --sbd-limit-handshaking-per-ip must be "
                "positive"
            )
        if self.idle_ms > I32_MAX:
            raise ConfigError("--sbd-idle-ms must fit the 32-bit lidl value")
        if self.max_tokens <= 0:
            raise ConfigError("--sbd-max-tokens must be positive")
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
            limit_handshaking_per_ip=args.sbd_limit_handshaking_per_ip,
            kbps=args.sbd_kbps,
            burst=args.sbd_burst,
            idle_ms=args.sbd_idle_ms,
            disable_rate_limit=args.sbd_disable_rate_limit,
            block_secs=args.sbd_block_secs,
            trusted_ip_header=args.trusted_ip_header,
            auth_hook=args.sbd_auth_hook,
            max_tokens=args.sbd_max_tokens,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--sbd-limit-handshaking-per-ip",
        type=int,
        default=d.limit_handshaking_per_ip,
        metavar="N",
        help="connections of one IP that have not completed the handshake; more get 429",
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
        "trust; an unparsable value falls back to the TCP peer); default: the TCP peer. "
        "SBD and 신경 (whose /api/v1/proxy connects only to that address; for a list such as "
        "X-Forwarded-For it takes the last entry)",
    )
    sbd.add_argument(
        "--sbd-max-tokens",
        type=int,
        default=d.max_tokens,
        metavar="N",
        help="live tokens PUT /authenticate has handed out (each until idle for --sbd-idle-ms); "
        "more are refused with 503 and Retry-After",
    )
    sbd.add_argument(
        "--sbd-auth-hook",
        metavar="URL",
        help="spec-auth hook, e.g. http://auth.local/authenticate: PUT /authenticate bodies are "
        "forwarded there for a token, and connections must carry one; default: no hook "
        "(/authenticate hands out tokens, none required)",
    )
