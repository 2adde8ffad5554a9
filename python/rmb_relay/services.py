"""What the dialects of one relay process share: metrics, the switch (with its mailbox), the
twin directory and the Redis connection. Built once by `rmb-relay serve` from its flags and
handed to every dialect's `build`, so two dialects that need the directory or Redis use one.

The flags that configure these live here too (`add_arguments`): they belong to the process,
not to any one dialect.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmb_relay.cluster import options as cluster_options
from rmb_relay.cluster.connect import connect_redis
from rmb_relay.errors import ConfigError
from rmb_relay.mailbox import (
    DEFAULT_MAILBOX_MAX,
    DEFAULT_MAILBOX_SESSIONS,
    DEFAULT_MAILBOX_SOURCE_BYTES,
    DEFAULT_MAILBOX_TOTAL_BYTES,
    DEFAULT_MAILBOX_TTL,
    DEFAULT_MAILBOX_TWIN_BYTES,
    DEFAULT_REDIS_INFLIGHT_BYTES,
    DEFAULT_REDIS_TIMEOUT,
    Mailbox,
    MailboxBudget,
    MemoryMailbox,
    RedisMailbox,
)
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Read, Registry
from rmb_relay.telemetry.record_flags import add_record_arguments, recorder_from_args
from rmb_relay.throttle import Throttles, ThrottleSettings
from rmb_relay.throttle import add_arguments as add_throttle_arguments
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path, parse_twins_url

if TYPE_CHECKING:
    from pathlib import Path

    from rmb_relay.cluster import Cluster
    from rmb_relay.cluster.connect import RedisClient
    from rmb_relay.twins import TwinDirectory
    from rmb_relay.twins.events import TwinEventListener
    from rmb_relay.twins.substrate import SubstrateClient

log = logging.getLogger("rmb_relay")

#: how long a twin lookup is cached (seconds)
DEFAULT_TWIN_CACHE_TTL = 60.0
#: per-attempt timeout towards a chain node (rmb-rs: 12 s per connect), and missed blocks
#: past which the twin cache is cleared (rmb-rs: 600): twins/substrate.py's and events.py's
#: defaults, repeated here so a relay without --substrate does not import the chain code
DEFAULT_SUBSTRATE_TIMEOUT = 12.0
DEFAULT_CATCHUP_THRESHOLD = 600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the shared parts: delivery (Redis, mailbox) and the twin directory."""
    shared = parser.add_argument_group("delivery and directory (shared by every dialect)")
    shared.add_argument(
        "-r",
        "--redis",
        metavar="URL",
        help="redis://HOST:PORT/DB for durable mailboxes; without it mailboxes live in memory",
    )
    shared.add_argument(
        "--redis-timeout",
        type=float,
        default=DEFAULT_REDIS_TIMEOUT,
        metavar="SECONDS",
        help="longest a Redis operation (and connecting) may take; a stalled Redis then fails "
        "fast: the sender hears that the mailbox is unavailable, live delivery goes on",
    )
    shared.add_argument(
        "--redis-inflight-bytes",
        type=int,
        default=DEFAULT_REDIS_INFLIGHT_BYTES,
        metavar="BYTES",
        help="envelope bytes waiting on Redis at once; more is refused at once",
    )
    shared.add_argument(
        "--mailbox-ttl",
        type=int,
        default=DEFAULT_MAILBOX_TTL,
        metavar="SECONDS",
        help="longest time a message waits for an offline twin (its own expiry may be sooner)",
    )
    shared.add_argument(
        "--mailbox-max",
        type=int,
        default=DEFAULT_MAILBOX_MAX,
        metavar="N",
        help="messages kept per offline session; the oldest are dropped first",
    )
    shared.add_argument(
        "--mailbox-twin-bytes",
        type=int,
        default=DEFAULT_MAILBOX_TWIN_BYTES,
        metavar="BYTES",
        help="in-memory mailbox: bytes kept for one twin (all its sessions); more is refused "
        "with an error to the sender",
    )
    shared.add_argument(
        "--mailbox-total-bytes",
        type=int,
        default=DEFAULT_MAILBOX_TOTAL_BYTES,
        metavar="BYTES",
        help="in-memory mailbox: bytes kept in all; more is refused with an error to the sender",
    )
    shared.add_argument(
        "--mailbox-source-bytes",
        type=int,
        default=DEFAULT_MAILBOX_SOURCE_BYTES,
        metavar="BYTES",
        help="in-memory mailbox: bytes one source twin, or one relay posting to us, may have "
        "waiting in all mailboxes together (its share); more is refused",
    )
    shared.add_argument(
        "--mailbox-sessions",
        type=int,
        default=DEFAULT_MAILBOX_SESSIONS,
        metavar="N",
        help="in-memory mailbox: sessions (sids) of one twin with mail waiting",
    )
    shared.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        default=None,
        help=f"embedded twin directory (default: sqlite:{default_twins_path()})",
    )
    shared.add_argument(
        "-s",
        "--substrate",
        action="extend",
        nargs="+",
        metavar="URL",
        help="read twins from tfchain through these nodes, ws://HOST:PORT or wss://... (one "
        "or more per flag, the flag repeatable, as rmb-rs: failover in order); replaces --twins",
    )
    shared.add_argument(
        "--substrate-timeout",
        type=float,
        default=DEFAULT_SUBSTRATE_TIMEOUT,
        metavar="SECONDS",
        help="per-attempt timeout (connect or one request) before the next node is tried",
    )
    shared.add_argument(
        "--catchup-threshold",
        type=int,
        default=DEFAULT_CATCHUP_THRESHOLD,
        metavar="BLOCKS",
        help="after a chain reconnect, more missed blocks than this clear the twin cache "
        "instead of being caught up",
    )
    shared.add_argument(
        "--twin-cache-ttl",
        type=float,
        default=DEFAULT_TWIN_CACHE_TTL,
        metavar="SECONDS",
        help="how long a twin lookup is cached",
    )
    add_record_arguments(parser)
    cluster_options.add_arguments(parser)
    add_throttle_arguments(parser)


class Services:
    """See the module docstring. Close with `close()` after the listener has stopped."""

    def __init__(
        self,
        metrics: Registry,
        switch: Switch,
        *,
        twins: str | None = None,
        twin_cache_ttl: float = DEFAULT_TWIN_CACHE_TTL,
        redis: RedisClient | None = None,
        substrate: list[str] | None = None,
        substrate_timeout: float = DEFAULT_SUBSTRATE_TIMEOUT,
        catchup_threshold: int = DEFAULT_CATCHUP_THRESHOLD,
        throttles: ThrottleSettings | None = None,
    ) -> None:
        self.metrics = metrics
        #: the auth pool and failed-login limiter every dialect that authenticates shares
        self.throttles = Throttles(metrics, throttles)
        self.switch = switch
        self.redis = redis
        #: this instance's membership of the cluster (`--redis` without `--no-cluster`), the
        #: one every dialect uses: RMB and SBD through the switch, the gateway and the tunnel
        #: directly (docs/cluster.md, "Using it from another dialect")
        self.cluster: Cluster | None = None
        self._twins_url = twins
        self._twin_cache_ttl = twin_cache_ttl
        self._directory: CachedTwinDirectory | None = None
        self._substrate = list(substrate or [])
        self._substrate_timeout = substrate_timeout
        self._catchup_threshold = catchup_threshold
        self._events: TwinEventListener | None = None
        self._chain: SubstrateClient | None = None
        self._register_twin_metrics()

    def _register_twin_metrics(self) -> None:
        """Twin directory and chain counters, read at scrape (0 until the directory opens, and
        for the chain ones without --substrate)."""

        def read(value: Callable[[], int]) -> Read:
            return lambda: [((), value())]

        counters: list[tuple[str, str, Callable[[], int]]] = [
            (
                "rmb_relay_twin_lookups_total",
                "twin lookups the directory backend answered (cache misses)",
                lambda: self._directory.lookups if self._directory else 0,
            ),
            (
                "rmb_relay_twin_cache_hits_total",
                "twin lookups answered from the cache",
                lambda: self._directory.hits if self._directory else 0,
            ),
            (
                "rmb_relay_chain_failovers_total",
                "tfchain connections given up for the next node",
                lambda: self._chain.failovers if self._chain else 0,
            ),
            (
                "rmb_relay_chain_blocks_total",
                "chain blocks whose events the twin listener read",
                lambda: self._events.blocks_seen if self._events else 0,
            ),
            (
                "rmb_relay_chain_twin_events_total",
                "TwinStored/TwinUpdated events written into the twin cache",
                lambda: self._events.events_applied if self._events else 0,
            ),
            (
                "rmb_relay_chain_cache_flushes_total",
                "twin cache flushes after missing more than --catchup-threshold blocks",
                lambda: self._events.flushes if self._events else 0,
            ),
        ]
        for name, help_text, value in counters:
            self.metrics.counter_of(name, help_text, read(value))

    @classmethod
    async def from_args(cls, args: argparse.Namespace) -> Services:
        """Connect what the flags name; raises ConfigError when a dependency is unreachable."""
        if args.mailbox_ttl <= 0 or args.mailbox_max <= 0:
            raise ConfigError("--mailbox-ttl and --mailbox-max must be positive")
        substrate = getattr(args, "substrate", None) or []
        if substrate and args.twins:
            raise ConfigError("--substrate and --twins name two directories: give one")
        if substrate:
            from rmb_relay.twins.substrate import SubstrateClient

            # checks the URLs and timeout now, before anything listens
            SubstrateClient(substrate, timeout=args.substrate_timeout)
        if args.catchup_threshold < 0:
            raise ConfigError("--catchup-threshold must be >= 0 blocks")
        try:
            budget = MailboxBudget(
                args.mailbox_twin_bytes,
                args.mailbox_total_bytes,
                args.mailbox_sessions,
                args.mailbox_source_bytes,
            )
        except ValueError:
            raise ConfigError(
                "--mailbox-twin-bytes, --mailbox-total-bytes, --mailbox-sessions and "
                "--mailbox-source-bytes must be positive"
            ) from None
        if not args.redis_timeout > 0 or args.redis_inflight_bytes <= 0:
            raise ConfigError("--redis-timeout and --redis-inflight-bytes must be positive")
        redis = None
        if args.redis:
            redis = await connect_redis(
                args.redis, cluster=args.redis_cluster, timeout=args.redis_timeout
            )
        elif args.redis_cluster:
            raise ConfigError("--redis-cluster needs --redis URL (a node of the cluster)")
        mailbox: Mailbox
        if redis is None:
            mailbox = MemoryMailbox(
                ttl=args.mailbox_ttl, max_per_session=args.mailbox_max, budget=budget
            )
        else:
            mailbox = RedisMailbox(
                redis,
                ttl=args.mailbox_ttl,
                max_per_session=args.mailbox_max,
                timeout=args.redis_timeout,
                max_inflight_bytes=args.redis_inflight_bytes,
            )
        throttles = ThrottleSettings.from_args(args)
        services = cls(
            Registry(),
            Switch(mailbox),
            twins=args.twins,
            twin_cache_ttl=args.twin_cache_ttl,
            redis=redis,
            substrate=substrate,
            substrate_timeout=args.substrate_timeout,
            catchup_threshold=args.catchup_threshold,
            throttles=throttles,
        )
        # route records (--records): the switch carries the recorder to every dialect; with
        # Redis, the other instances sharing it (cluster/)
        try:
            services.switch.records = recorder_from_args(args, services.metrics)
            if redis is not None:
                services.cluster = await cluster_options.start_cluster(
                    args, redis, services.switch, services.metrics
                )
        except BaseException:
            await services.close()
            raise
        return services

    def twins_path(self) -> Path:
        """The embedded SQLite file (`--twins`); the tunnel keeps its tenants there too."""
        return parse_twins_url(self._twins_url) if self._twins_url else default_twins_path()

    def twin_directory(self) -> TwinDirectory:
        """The cached twin directory, opened on first use (one for every dialect)."""
        if self._directory is None and self._substrate:
            from rmb_relay.twins.events import TwinEventListener
            from rmb_relay.twins.substrate import SubstrateClient, SubstrateTwinDirectory

            self._chain = SubstrateClient(self._substrate, timeout=self._substrate_timeout)
            chain = SubstrateTwinDirectory(self._chain)
            self._directory = CachedTwinDirectory(chain, ttl=self._twin_cache_ttl)
            self._events = TwinEventListener(
                chain, self._directory, catchup_threshold=self._catchup_threshold
            )
            self._events.start()
        if self._directory is None:
            self._directory = CachedTwinDirectory(
                SqliteTwinDirectory(self.twins_path()), ttl=self._twin_cache_ttl
            )
        return self._directory

    async def close(self) -> None:
        """Close the switch (and its mailbox's Redis connection) and the directory."""
        await self.switch.close()
        self.throttles.close()
        if self._events is not None:
            await self._events.close()
        if self.switch.records is not None:
            await self.switch.records.close()
        if self._directory is not None:
            await self._directory.close()
