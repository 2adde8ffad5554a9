"""The tunnel's settings and flags (spec/tunnel.md decisions), with RelayServer's defaults where
it has one (spec §14)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from rmb_relay.dialects.tunnel.tenants import ACK_MODES
from rmb_relay.errors import ConfigError

#: the body store's bounds: one body, one tenant's files, every file (bytes)
DEFAULT_MAX_BODY = 1 << 30
DEFAULT_TENANT_DISK = 2 << 30
DEFAULT_TOTAL_DISK = 8 << 30


def default_body_store() -> Path:
    """`$XDG_STATE_HOME/rmb-relay/bodies`, else `~/.local/state/rmb-relay/bodies`: a directory
    of this user's, not the shared temp directory, where anyone may have made it first."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "state"
    return root / "rmb-relay" / "bodies"


#: bodies up to this size travel inside the websocket message (RelayServer's SignalR threshold)
INLINE_LIMIT = 16 * 1024
#: largest connector message accepted: an inline body base64-encoded plus headers
CONNECTOR_MAX_MESSAGE = 256 * 1024
BALANCE = ("round-robin", "least-inflight")
#: bytes waiting requests of one tenant may hold in this relay's memory (4096 requests with
#: the largest inline body): a tenant whose connector is away stops here
DEFAULT_TENANT_BYTES = 64 << 20
#: bytes waiting requests of all tenants may hold together
DEFAULT_TOTAL_BYTES = 256 << 20
#: upload bytes per second one client address may send in request bodies (all its
#: connections together), and all clients of one tenant: 64 MiB/s (~540 Mbit/s) and 128 MiB/s
#: (~1.1 Gbit/s), a sixth and a third of what the relay parses and stores on one core
#: (~400 MB/s, docs/hardening.md), so one address cannot take the core from everyone else and
#: one open tenant not more than a third of it, while an honest uploader on a gigabit link is
#: hardly slowed (throttle.py `UploadRate`; 0: no limit)
DEFAULT_UPLOAD_RATE_PER_IP = 64 << 20
DEFAULT_UPLOAD_RATE_PER_TENANT = 128 << 20
#: bytes of answers one relay holds for relays the cluster gave up (scale-out: they may only be
#: cut off, and their clients still wait): 4 MiB, the RMB dialect's --retry-hold-bytes, about
#: 40 s of 100 small answers a second, the length of a long cut (docs/faults.md)
DEFAULT_ANSWERS_HELD_BYTES = 4 << 20


@dataclass(slots=True)
class TunnelSettings:
    #: a request not taken by a connector within this many seconds is answered 408 and dropped
    request_ttl: float = 120.0
    #: after a connector took it, how long the client waits for its answer (then 504)
    response_timeout: float = 120.0
    #: requests of one tenant in flight at once on this relay (0: unlimited)
    max_concurrent: int = 0
    #: AcknowledgeMode of requests whose tenant sets none
    ack_mode: int = 0
    balance: str = "round-robin"
    #: answer 503 at once when the tenant has no connector (else the request waits up to its TTL)
    require_connection: bool = False
    inline_limit: int = INLINE_LIMIT
    body_store: str = ""
    #: one request's or response's body at most (bytes); a larger one is answered 413
    max_body: int = DEFAULT_MAX_BODY
    #: bytes of body files one tenant's requests and responses may hold on disk at once
    tenant_disk: int = DEFAULT_TENANT_DISK
    #: bytes of body files of all tenants at once
    total_disk: int = DEFAULT_TOTAL_DISK
    #: seconds a body file is kept past its request's TTL and response timeout before the
    #: sweeper may take it for an orphan (a connector that fetches late still finds it)
    body_grace: float = 60.0
    #: seconds between the sweeper's passes over the body store
    body_sweep: float = 30.0
    #: embedded token lifetime (seconds)
    token_ttl: int = 300
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    management_key: str | None = None
    #: connectors are told to reconnect after a random delay in [min, max] seconds
    reconnect_min: float = 1.0
    reconnect_max: float = 30.0
    keep_alive: float = 15.0
    #: tenant lookups are cached this long (seconds), misses too (RelayServer: 10 s)
    tenant_cache_ttl: float = 10.0
    #: tenant lookups kept at most besides tenants with connectors or requests here (a client
    #: naming ever new tenants costs bounded memory)
    tenant_cache_max: int = 10_000
    #: tenant and target names as metric labels (else every series says "*": /metrics is
    #: often less protected than the management API, and names are the tenants' business)
    tenant_labels: bool = False
    #: answer a request from a connector of this relay when there is one (scale-out shortcut)
    shortcut: bool = True
    #: in-memory bytes of requests held until answered, per tenant and in all (the hub's
    #: memory budget); a request beyond them is answered 503 and never executed
    tenant_bytes: int = DEFAULT_TENANT_BYTES
    total_bytes: int = DEFAULT_TOTAL_BYTES
    #: request-body bytes per second per client address and per tenant (0: unlimited); a
    #: sender over them is slowed (its connection not read for a while), never refused
    upload_rate_per_ip: int = DEFAULT_UPLOAD_RATE_PER_IP
    upload_rate_per_tenant: int = DEFAULT_UPLOAD_RATE_PER_TENANT
    #: answers held for given-up relays at most (bytes); past it they are dropped (504)
    answers_held_bytes: int = DEFAULT_ANSWERS_HELD_BYTES

    def __post_init__(self) -> None:
        for name in ("request_ttl", "response_timeout", "token_ttl", "keep_alive", "body_sweep"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--tunnel-{name.replace('_', '-')} must be positive")
        if self.tenant_bytes <= 0 or self.total_bytes <= 0:
            raise ConfigError("--tunnel-tenant-bytes and --tunnel-total-bytes must be positive")
        if self.tenant_cache_max <= 0:
            raise ConfigError("--tunnel-tenant-cache must be positive")
        if self.max_concurrent < 0:
            raise ConfigError("--tunnel-max-concurrent must not be negative")
        if self.ack_mode not in ACK_MODES.values():
            raise ConfigError("--tunnel-ack-mode must be one of " + ", ".join(ACK_MODES))
        if self.balance not in BALANCE:
            raise ConfigError("--tunnel-balance must be round-robin or least-inflight")
        if not 0 <= self.reconnect_min <= self.reconnect_max:
            raise ConfigError("--tunnel-reconnect-delay needs 0 <= MIN <= MAX")
        if (self.oidc_issuer is None) != (self.oidc_audience is None):
            raise ConfigError("--oidc-issuer and --oidc-audience go together")
        if self.management_key is not None and len(self.management_key) < 16:
            raise ConfigError("--management-key must be at least 16 characters")
        if not self.body_store:
            self.body_store = str(default_body_store())
        if self.body_grace < 0:
            raise ConfigError("--tunnel-body-grace must not be negative")
        for flag, value in (
            ("--tunnel-max-body", self.max_body),
            ("--tunnel-tenant-disk", self.tenant_disk),
            ("--tunnel-total-disk", self.total_disk),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be positive")
        for flag, value in (
            ("--tunnel-upload-rate-per-ip", self.upload_rate_per_ip),
            ("--tunnel-upload-rate-per-tenant", self.upload_rate_per_tenant),
            ("--tunnel-answers-held-bytes", self.answers_held_bytes),
        ):
            if value < 0:
                raise ConfigError(f"{flag} must not be negative (0: no limit)")

    @property
    def body_max_age(self) -> float:
        """Seconds after which a body file no live request holds is an orphan: no request can
        still want it (its TTL and its response timeout are over), plus the grace."""
        return self.request_ttl + self.response_timeout + self.body_grace

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TunnelSettings:
        low, high = _delay_pair(args.tunnel_reconnect_delay)
        return cls(
            request_ttl=args.tunnel_request_ttl,
            response_timeout=args.tunnel_response_timeout,
            max_concurrent=args.tunnel_max_concurrent,
            ack_mode=ACK_MODES[args.tunnel_ack_mode],
            balance=args.tunnel_balance,
            require_connection=args.tunnel_require_connection,
            body_store=args.tunnel_body_store or "",
            max_body=args.tunnel_max_body,
            tenant_disk=args.tunnel_tenant_disk,
            total_disk=args.tunnel_total_disk,
            body_grace=args.tunnel_body_grace,
            body_sweep=args.tunnel_body_sweep,
            token_ttl=args.tunnel_token_ttl,
            oidc_issuer=args.oidc_issuer,
            oidc_audience=args.oidc_audience,
            management_key=args.management_key,
            reconnect_min=low,
            reconnect_max=high,
            tenant_bytes=args.tunnel_tenant_bytes,
            total_bytes=args.tunnel_total_bytes,
            tenant_cache_max=args.tunnel_tenant_cache,
            tenant_labels=args.tunnel_tenant_labels,
            upload_rate_per_ip=args.tunnel_upload_rate_per_ip,
            upload_rate_per_tenant=args.tunnel_upload_rate_per_tenant,
            answers_held_bytes=args.tunnel_answers_held_bytes,
        )


def _delay_pair(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(",")
    try:
        pair = (float(low), float(high if sep else low))
    except ValueError:
        raise ConfigError(f"--tunnel-reconnect-delay {text!r}: expected MIN,MAX seconds") from None
    return pair


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TunnelSettings(body_store="-")
    group = parser.add_argument_group(
        "HTTP tunnel (/relay|queue|trace/{tenant}/{target}/..., GET /tunnel/connector)"
    )
    group.add_argument("--no-tunnel", action="store_true", help="do not serve the HTTP tunnel")
    group.add_argument(
        "--tunnel-request-ttl",
        type=float,
        default=d.request_ttl,
        metavar="SECONDS",
        help="a request no connector took within this long is answered 408 and never executed",
    )
    group.add_argument(
        "--tunnel-response-timeout",
        type=float,
        default=d.response_timeout,
        metavar="SECONDS",
        help="how long a client waits for the connector's answer once it took the request (504)",
    )
    group.add_argument(
        "--tunnel-max-concurrent",
        type=int,
        default=d.max_concurrent,
        metavar="N",
        help="requests of one tenant in flight at once on this relay, 0 = unlimited (a tenant's "
        "maximumConcurrentConnectorRequests wins)",
    )
    group.add_argument(
        "--tunnel-tenant-bytes",
        type=int,
        default=d.tenant_bytes,
        metavar="BYTES",
        help="in-memory bytes (inline bodies, URLs, headers) of one tenant's requests held "
        "until answered; beyond it a request gets 503 at once and is never executed",
    )
    group.add_argument(
        "--tunnel-total-bytes",
        type=int,
        default=d.total_bytes,
        metavar="BYTES",
        help="the same, for all tenants together",
    )
    group.add_argument(
        "--tunnel-ack-mode",
        choices=tuple(ACK_MODES),
        default="disabled",
        help="acknowledgement mode of tenants that set none; the others redeliver requests "
        "of a lost connector (at least once)",
    )
    group.add_argument(
        "--tunnel-balance",
        choices=BALANCE,
        default=d.balance,
        help="how requests are spread over a tenant's connectors",
    )
    group.add_argument(
        "--tunnel-require-connection",
        action="store_true",
        help="503 at once for a tenant with no connector, instead of waiting up to the TTL",
    )
    group.add_argument(
        "--tunnel-body-store",
        metavar="DIR",
        help="private directory (0700, this user's) of bodies over 16 KiB, shared by relays "
        "on one host; default: $XDG_STATE_HOME/rmb-relay/bodies, else "
        "~/.local/state/rmb-relay/bodies",
    )
    group.add_argument(
        "--tunnel-max-body",
        type=int,
        default=d.max_body,
        metavar="BYTES",
        help="largest request or response body; a larger one is answered 413 while it streams "
        '(metric rmb_relay_tunnel_bodies_refused_total{limit="body"})',
    )
    group.add_argument(
        "--tunnel-tenant-disk",
        type=int,
        default=d.tenant_disk,
        metavar="BYTES",
        help="bytes of body files one tenant may hold in the body store at once (413 beyond; "
        "metric rmb_relay_tunnel_body_store_bytes)",
    )
    group.add_argument(
        "--tunnel-total-disk",
        type=int,
        default=d.total_disk,
        metavar="BYTES",
        help="bytes of body files all tenants may hold in the body store at once (413 beyond)",
    )
    group.add_argument(
        "--tunnel-upload-rate-per-ip",
        type=int,
        default=d.upload_rate_per_ip,
        metavar="BYTES_PER_S",
        help="request-body bytes per second one client address (IPv6 by --ipv6-prefix) may "
        "upload over all its connections; a faster sender is not read for a while (slowed, "
        "not refused; metric rmb_relay_tunnel_upload_paused_seconds_total); 0 = no limit",
    )
    group.add_argument(
        "--tunnel-upload-rate-per-tenant",
        type=int,
        default=d.upload_rate_per_tenant,
        metavar="BYTES_PER_S",
        help="the same for all clients of one tenant together; 0 = no limit",
    )
    group.add_argument(
        "--tunnel-answers-held-bytes",
        type=int,
        default=d.answers_held_bytes,
        metavar="BYTES",
        help="with --redis: answers for a relay the cluster gave up (it may only be cut off "
        "from Redis, its clients still waiting) are held this many bytes at most and sent "
        "again once it is back; past it an answer is dropped and its client gets 504 "
        "(rmb_relay_tunnel_answers_held_bytes, rmb_relay_tunnel_answers_dropped_total)",
    )
    group.add_argument(
        "--tunnel-body-grace",
        type=float,
        default=d.body_grace,
        metavar="SECONDS",
        help="a body file no live request holds is removed once older than the request TTL + "
        "response timeout + this; lower it to free a tight disk sooner after clients or "
        "connectors vanish, raise it for connectors slow to fetch bodies",
    )
    group.add_argument(
        "--tunnel-body-sweep",
        type=float,
        default=d.body_sweep,
        metavar="SECONDS",
        help="how often the body store is swept for such files (each pass looks at every "
        "tracked file); an orphan lives up to this much past its age",
    )
    group.add_argument(
        "--tunnel-tenant-cache",
        type=int,
        default=d.tenant_cache_max,
        metavar="N",
        help="tenant lookups (found or not) kept for 10 s besides the tenants with connectors "
        "or requests here; beyond it the oldest go (metric rmb_relay_tunnel_tenants_cached)",
    )
    group.add_argument(
        "--tunnel-tenant-labels",
        action="store_true",
        help="label the tunnel's metrics with tenant and target names (default: every series "
        "says '*', so /metrics does not list the tenants to whoever can read it)",
    )
    group.add_argument(
        "--tunnel-token-ttl",
        type=int,
        default=d.token_ttl,
        metavar="SECONDS",
        help="lifetime of tokens from POST /tunnel/token",
    )
    group.add_argument(
        "--tunnel-reconnect-delay",
        default=f"{d.reconnect_min:g},{d.reconnect_max:g}",
        metavar="MIN,MAX",
        help="connectors reconnect after a random delay in this range (seconds)",
    )
    group.add_argument(
        "--oidc-issuer", metavar="URL", help="also accept connector tokens of this OIDC issuer"
    )
    group.add_argument("--oidc-audience", metavar="AUD", help="the audience those tokens carry")
    group.add_argument(
        "--management-key",
        metavar="KEY",
        help="serve /management/tenants to requests with header Api-Key: KEY; default: off",
    )
