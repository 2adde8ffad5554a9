"""Throttles for work whose cost a stranger chooses: a bounded thread pool (`WorkPool`) for
expensive computations that must not run on the event loop, and a `FailureLimiter` that
counts failed attempts per client address and per key (a tenant, a twin) so that guessing is
slow and a flood of wrong credentials is refused before it costs anything.

Why a pool with a *bound*: hashing a password (scrypt, ~16 MiB and tens of ms) on the loop
stalls every connection of every dialect; in an unbounded executor a flood queues forever and
holds memory. So at most `workers` jobs run and `queue` more wait; the next is refused at once
with `Busy` (the route answers 503 with Retry-After), which costs nothing.

Why charge a guess when it *starts*: concurrent guesses of a secret (a tenant's, what an auth
hook checks) from one address would otherwise all pass the check before the first one fails.
A success gives its charge back, so an honest client that logs in is never limited by its
own successes. A login that proves itself by a signature (RMB's JWT) or a random token the
relay issued (SBD) has nothing to guess: it is charged only when it fails (`check(...,
secret=False)`, then `failed`), so any number of honest logins at once from one address (a
NAT, a load generator) pass, and a flood of bad ones is still refused after `burst`.

The limiter is a token bucket per key: `burst` attempts at once, refilled at `burst` per
`window` seconds. Its table is bounded (`max_keys`): full buckets are forgotten first, else
the least recently charged key; a forgotten key starts full again, so the bound costs some
precision under a flood of distinct addresses, never memory. IPv6 addresses are grouped by a
prefix (`ip_key`, `--ipv6-prefix`, default /64: one host usually owns a whole /64, so per-/128
limits are free to evade).

An `UploadRate` bounds the bytes per second strangers may upload (the tunnel's request
bodies), per client address (IPv6 by the same prefix) and per tenant. Parsing and storing an
upload costs the relay's one core ~2.5 ms per MB, so four loopback senders at 400 MB/s held it
all and honest p99 went past 10 ms (docs/hardening.md). A body over its rate is not refused:
its bytes were read already and are charged to Rust's `ByteNanosLimiter` (the byte rate SBD's
per-IP limit uses), which answers how long until the key's debt is back within its burst; the
connection stops reading for that long (a loop timer, not a sleep), so TCP slows the sender
down and its upload still arrives whole.

The clock is a parameter (`clock.py`, monotonic nanoseconds), as everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from rmb_relay._core import ByteNanosLimiter
from rmb_relay.clock import NS, Clock, monotonic_clock
from rmb_relay.errors import ConfigError, HttpReject

if TYPE_CHECKING:
    from rmb_relay.telemetry.metrics import Registry

__all__ = [
    "DEFAULT_AUTH_FAILURES",
    "DEFAULT_AUTH_FAILURE_WINDOW",
    "DEFAULT_AUTH_QUEUE",
    "DEFAULT_AUTH_WORKERS",
    "DEFAULT_FAILURE_TABLE",
    "DEFAULT_IPV6_PREFIX",
    "Busy",
    "FailureLimiter",
    "Limited",
    "ThrottleSettings",
    "Throttles",
    "UploadRate",
    "WorkPool",
    "add_arguments",
    "ip_key",
]

T = TypeVar("T")

#: threads hashing passwords at once (each scrypt holds ~16 MiB and a core for ~80 ms): one,
#: so hashing never takes more than one core from the event loop; honest logins are rare
#: (a connector asks for a token per token lifetime), ~12 a second fit
DEFAULT_AUTH_WORKERS = 1
#: jobs waiting for a thread; more are refused with 503 at once
DEFAULT_AUTH_QUEUE = 16
#: failed attempts one address (or one key) may make at once ...
DEFAULT_AUTH_FAILURES = 10
#: ... refilled over this many seconds
DEFAULT_AUTH_FAILURE_WINDOW = 60.0
#: addresses and keys the limiter remembers
DEFAULT_FAILURE_TABLE = 65_536
#: IPv6 addresses sharing this prefix count as one client for per-IP limits
DEFAULT_IPV6_PREFIX = 64
#: what a refused client is told to wait when the pool is full (seconds)
BUSY_RETRY_AFTER = 1
#: an upload rate's burst: this many seconds of the rate pass at once (a body that fits is
#: never paused; a longer one settles at the rate)
UPLOAD_BURST_SECONDS = 0.25
#: the limiter's time per unit is a whole number of nanoseconds: bytes are counted in units of
#: a power of two large enough that this number is at least this (rounding error under 1 %)
UPLOAD_UNIT_NANOS = 100
#: addresses and tenants that uploaded nothing for this long are forgotten (their debt is paid)
UPLOAD_IDLE_NS = 10 * NS


class Busy(HttpReject):
    """The pool is full: 503 with Retry-After (nothing was started)."""

    def __init__(self, pool: str) -> None:
        super().__init__(
            503,
            f"too many {pool} requests at once: try again shortly",
            (("Retry-After", str(BUSY_RETRY_AFTER)),),
        )


class Limited(HttpReject):
    """Too many failed attempts: 429 with Retry-After (whole seconds until one is allowed)."""

    def __init__(self, whose: str, retry_after: float) -> None:
        self.retry_after = max(1, math.ceil(retry_after))
        super().__init__(
            429,
            f"too many failed attempts {whose}: retry in {self.retry_after} s",
            (("Retry-After", str(self.retry_after)),),
        )


def ip_key(host: str, ipv6_prefix: int = DEFAULT_IPV6_PREFIX) -> str:
    """The per-IP limit key of a peer address: IPv4 (and IPv4-mapped IPv6) as is, IPv6 as its
    `/ipv6_prefix` network; anything that is not an address (a unix socket) as given."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if ipv6_prefix < 128:
            network = ipaddress.IPv6Network((address, ipv6_prefix), strict=False)
            return str(network)
    return str(address)


class WorkPool:
    """A thread pool of `workers` threads with at most `queue` jobs waiting (see the module
    docstring). `run` raises `Busy` instead of queueing past the bound."""

    def __init__(self, name: str, workers: int, queue: int) -> None:
        if workers <= 0 or queue < 0:
            raise ConfigError(f"{name} pool: workers must be positive and queue >= 0")
        self.name = name
        self.workers = workers
        self.queue = queue
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"rmb-{name}")
        #: jobs submitted and not finished (running + waiting)
        self.pending = 0
        self.refused = 0
        self.completed = 0

    @property
    def running(self) -> int:
        return min(self.pending, self.workers)

    @property
    def waiting(self) -> int:
        return max(0, self.pending - self.workers)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a pool thread; `Busy` at once when `workers + queue` are pending."""
        if self.pending >= self.workers + self.queue:
            self.refused += 1
            raise Busy(self.name)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.pending -= 1
            self.completed += 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class FailureLimiter:
    """Failed attempts per key, as token buckets (module docstring). Keys are strings the
    caller makes distinct per scope (`"ip:" + ip_key(...)`, `"tenant:" + name`)."""

    def __init__(
        self,
        burst: int = DEFAULT_AUTH_FAILURES,
        window: float = DEFAULT_AUTH_FAILURE_WINDOW,
        max_keys: int = DEFAULT_FAILURE_TABLE,
        *,
        clock: Clock = monotonic_clock,
    ) -> None:
        if burst <= 0 or not window > 0 or max_keys <= 0:
            raise ConfigError(
                "--auth-failures, --auth-failure-window and --auth-failure-table must be positive"
            )
        self.burst = burst
        self.window_ns = int(window * NS)
        self.max_keys = max_keys
        self.clock = clock
        #: key -> (tokens left, when they were counted); most recently charged last
        self._buckets: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, key: str, now: int) -> float:
        entry = self._buckets.get(key)
        if entry is None:
            return float(self.burst)
        tokens, at = entry
        return min(float(self.burst), tokens + (now - at) * self.burst / self.window_ns)

    def retry_after(self, key: str) -> float | None:
        """Seconds until `key` may try again, or None when it may now."""
        now = self.clock()
        tokens = self._tokens(key, now)
        if tokens >= 1.0:
            return None
        return (1.0 - tokens) * self.window_ns / self.burst / NS

    def clean(self, key: str) -> bool:
        """Whether `key` has no failed attempt it is still paying for."""
        return self._tokens(key, self.clock()) >= self.burst

    def charge(self, key: str) -> None:
        """One attempt by `key` (the caller checked `retry_after` first)."""
        now = self.clock()
        tokens = self._tokens(key, now) - 1.0
        self._buckets[key] = (max(tokens, 0.0), now)
        self._buckets.move_to_end(key)
        if len(self._buckets) > self.max_keys:
            self._evict(now)

    def refund(self, key: str) -> None:
        """The attempt `charge` counted succeeded: give it back."""
        entry = self._buckets.get(key)
        if entry is None:
            return
        now = self.clock()
        tokens = self._tokens(key, now) + 1.0
        if tokens >= self.burst:
            del self._buckets[key]
        else:
            self._buckets[key] = (tokens, now)

    def _evict(self, now: int) -> None:
        """Forget keys whose bucket is full again, or else the least recently charged one."""
        full = [k for k in list(self._buckets)[:64] if self._tokens(k, now) >= self.burst]
        for key in full or [next(iter(self._buckets))]:
            del self._buckets[key]
            self.evicted += 1


@dataclass(frozen=True, slots=True)
class ThrottleSettings:
    auth_workers: int = DEFAULT_AUTH_WORKERS
    auth_queue: int = DEFAULT_AUTH_QUEUE
    auth_failures: int = DEFAULT_AUTH_FAILURES
    auth_failure_window: float = DEFAULT_AUTH_FAILURE_WINDOW
    auth_failure_table: int = DEFAULT_FAILURE_TABLE
    ipv6_prefix: int = DEFAULT_IPV6_PREFIX

    def __post_init__(self) -> None:
        if not 0 <= self.ipv6_prefix <= 128:
            raise ConfigError("--ipv6-prefix must be 0-128")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ThrottleSettings:
        return cls(
            auth_workers=args.auth_workers,
            auth_queue=args.auth_queue,
            auth_failures=args.auth_failures,
            auth_failure_window=args.auth_failure_window,
            auth_failure_table=args.auth_failure_table,
            ipv6_prefix=args.ipv6_prefix,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The throttle flags (shared by every dialect that authenticates strangers)."""
    group = parser.add_argument_group("throttles for unauthenticated clients (every dialect)")
    group.add_argument(
        "--auth-workers",
        type=int,
        default=DEFAULT_AUTH_WORKERS,
        metavar="N",
        help="threads that verify passwords (scrypt) off the event loop",
    )
    group.add_argument(
        "--auth-queue",
        type=int,
        default=DEFAULT_AUTH_QUEUE,
        metavar="N",
        help="verifications waiting for a thread; more are refused with 503 and Retry-After",
    )
    group.add_argument(
        "--auth-failures",
        type=int,
        default=DEFAULT_AUTH_FAILURES,
        metavar="N",
        help="failed logins one address (or one tenant) may make at once before 429 with "
        "Retry-After; refilled over --auth-failure-window",
    )
    group.add_argument(
        "--auth-failure-window",
        type=float,
        default=DEFAULT_AUTH_FAILURE_WINDOW,
        metavar="SECONDS",
        help="time over which --auth-failures attempts come back",
    )
    group.add_argument(
        "--auth-failure-table",
        type=int,
        default=DEFAULT_FAILURE_TABLE,
        metavar="N",
        help="addresses and keys whose failures are remembered (full ones are forgotten first)",
    )
    group.add_argument(
        "--ipv6-prefix",
        type=int,
        default=DEFAULT_IPV6_PREFIX,
        metavar="BITS",
        help="IPv6 clients sharing this prefix count as one address for per-IP limits",
    )


class Throttles:
    """The process's pool and limiter (one of each, shared by every dialect), with their
    metrics. `guard` wraps one login attempt."""

    def __init__(
        self,
        registry: Registry,
        settings: ThrottleSettings | None = None,
        *,
        clock: Clock = monotonic_clock,
    ) -> None:
        self.settings = s = settings or ThrottleSettings()
        self.pool = WorkPool("auth", s.auth_workers, s.auth_queue)
        self.failures = FailureLimiter(
            s.auth_failures, s.auth_failure_window, s.auth_failure_table, clock=clock
        )
        self.limited = registry.counter(
            "rmb_relay_auth_throttled_total",
            "Login attempts refused before any work, by dialect and why (ip, key: too many "
            "failures, 429; busy: the verification pool was full, 503)",
            ("dialect", "reason"),
            allowed={"reason": ("ip", "key", "busy")},
        )
        registry.gauge(
            "rmb_relay_auth_pool_pending",
            "Verifications running or waiting in the auth pool (bounded by --auth-workers "
            "plus --auth-queue)",
            (),
            lambda: [((), float(self.pool.pending))],
        )
        registry.gauge(
            "rmb_relay_auth_failure_keys",
            "Addresses and keys with recent failed logins (bounded by --auth-failure-table)",
            (),
            lambda: [((), float(len(self.failures)))],
        )

    def ip(self, host: str) -> str:
        return "ip:" + ip_key(host, self.settings.ipv6_prefix)

    def check(
        self, dialect: str, host: str, key: str | None = None, *, secret: bool = True
    ) -> tuple[str, ...]:
        """Charge one attempt from `host` (and on `key`, e.g. `"tenant:NAME"`), or refuse it
        with `Limited` (counted) when the address is out of attempts, or the key is and the
        address has failed recently too: a key under attack stays open to addresses with a
        clean record, so a guesser cannot lock its owner out, and each new address it brings
        gets one guess. Returns the keys charged, for `refund`. With `secret=False` (nothing
        to guess: module docstring) nothing is charged yet: the keys returned are for
        `failed`, should the attempt fail."""
        ip = self.ip(host)
        wait = self.failures.retry_after(ip)
        if wait is not None:
            self.limited.inc(1, dialect, "ip")
            raise Limited("from this address", wait)
        charged: tuple[str, ...] = (ip,)
        if key is not None:
            wait = self.failures.retry_after(key)
            if wait is not None and not self.failures.clean(ip):
                self.limited.inc(1, dialect, "key")
                raise Limited(f"for this {scope_name(key)}", wait)
            charged = (ip, key)
        if secret:
            for each in charged:
                self.failures.charge(each)
        return charged

    def failed(self, keys: Sequence[str]) -> None:
        """An attempt `check(..., secret=False)` let through failed: charge it now."""
        for key in keys:
            self.failures.charge(key)

    def refund(self, charged: Sequence[str]) -> None:
        """The attempt `check` charged succeeded (or was never made): give it back."""
        for key in charged:
            self.failures.refund(key)

    async def run(self, dialect: str, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the auth pool; `Busy` (counted) when it is full."""
        try:
            return await self.pool.run(fn, *args)
        except Busy:
            self.limited.inc(1, dialect, "busy")
            raise

    def close(self) -> None:
        self.pool.close()


class UploadRate:
    """Upload bytes per second per client address and per tenant (module docstring); a rate
    of 0 is no limit. `charge` returns how long the connection must not read, and counts it
    (`rmb_relay_tunnel_upload_paused_seconds_total{limit}`, `..._pauses_total{limit}`: the
    limit that asked for the longer pause)."""

    def __init__(
        self,
        registry: Registry,
        per_ip: int,
        per_tenant: int,
        *,
        ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
        clock: Clock = monotonic_clock,
    ) -> None:
        if per_ip < 0 or per_tenant < 0:
            raise ConfigError(
                "--tunnel-upload-rate-per-ip and --tunnel-upload-rate-per-tenant must not be "
                "negative"
            )
        self.ipv6_prefix = ipv6_prefix
        self.clock = clock
        self._ip, self._ip_unit = _byte_rate(per_ip)
        self._tenant, self._tenant_unit = _byte_rate(per_tenant)
        self._pruned = clock()
        self.paused = registry.counter(
            "rmb_relay_tunnel_upload_paused_seconds_total",
            "Seconds tunnel uploads were not read because their client address or tenant was "
            "over its upload rate (--tunnel-upload-rate-per-ip, -per-tenant), by the limit "
            "that held them longer",
            ("limit",),
            allowed={"limit": ("ip", "tenant")},
        )
        self.pauses = registry.counter(
            "rmb_relay_tunnel_upload_pauses_total",
            "Times a tunnel upload stopped being read for its upload rate, by limit",
            ("limit",),
            allowed={"limit": ("ip", "tenant")},
        )

    @property
    def enabled(self) -> bool:
        return self._ip is not None or self._tenant is not None

    def key(self, host: str) -> str:
        """The address key of a client (IPv6 by the prefix)."""
        return ip_key(host, self.ipv6_prefix)

    def charge(self, ip: str, tenant: str, size: int) -> float:
        """`size` more bytes read from address key `ip` for `tenant`: seconds not to read."""
        now = self.clock()
        ip_wait = tenant_wait = 0
        if self._ip is not None:
            ip_wait = self._ip.delay(ip, -(-size // self._ip_unit), now)
        if self._tenant is not None:
            tenant_wait = self._tenant.delay(tenant, -(-size // self._tenant_unit), now)
        if now - self._pruned > UPLOAD_IDLE_NS:
            self._pruned = now
            for limiter in (self._ip, self._tenant):
                if limiter is not None:
                    limiter.prune(now, UPLOAD_IDLE_NS)
        wait = max(ip_wait, tenant_wait)
        if not wait:
            return 0.0
        limit = "ip" if ip_wait >= tenant_wait else "tenant"
        self.pauses.inc(1, limit)
        self.paused.inc(wait / NS, limit)
        return wait / NS

    def __len__(self) -> int:
        return sum(len(limiter) for limiter in (self._ip, self._tenant) if limiter is not None)


def _byte_rate(rate: int) -> tuple[ByteNanosLimiter | None, int]:
    """A limiter of `rate` bytes/s (None for 0) and its unit in bytes (`UPLOAD_UNIT_NANOS`)."""
    if rate == 0:
        return None, 1
    unit = 1
    while unit * NS // rate < UPLOAD_UNIT_NANOS:
        unit *= 2
    burst = max(1, int(rate * UPLOAD_BURST_SECONDS) // unit)
    return ByteNanosLimiter(unit * NS // rate, burst), unit


def scope_name(key: str) -> str:
    """What a refusal names for a key: `tenant:x` -> "tenant"."""
    return key.split(":", 1)[0]
