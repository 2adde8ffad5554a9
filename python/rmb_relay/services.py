"""What the dialects of one relay process share: metrics, the switch (with its mailbox), the
twin directory and the Redis connection. Built once by `rmb-relay serve` from its flags and
handed to every dialect's `build`, so two dialects that need the directory or Redis use one.

The flags that configure these live here too (`add_arguments`): they belong to the process,
not to any one dialect.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from rmb_relay.cluster import options as cluster_options
from rmb_relay.cluster.connect import connect_redis
from rmb_relay.errors import ConfigError
from rmb_relay.mailbox import (
    DEFAULT_MAILBOX_MAX,
    DEFAULT_MAILBOX_TTL,
    Mailbox,
    MemoryMailbox,
    RedisMailbox,
)
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient
    from rmb_relay.twins import TwinDirectory

log = logging.getLogger("rmb_relay")

#: how long a twin lookup is cached (seconds)
DEFAULT_TWIN_CACHE_TTL = 60.0


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
        "--twins",
        metavar="sqlite:PATH",
        default=None,
        help=f"embedded twin directory (default: sqlite:{default_twins_path()})",
    )
    shared.add_argument(
        "--twin-cache-ttl",
        type=float,
        default=DEFAULT_TWIN_CACHE_TTL,
        metavar="SECONDS",
        help="how long a twin lookup is cached",
    )
    cluster_options.add_arguments(parser)


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
    ) -> None:
        self.metrics = metrics
        self.switch = switch
        self.redis = redis
        self._twins_url = twins
        self._twin_cache_ttl = twin_cache_ttl
        self._directory: CachedTwinDirectory | None = None

    @classmethod
    async def from_args(cls, args: argparse.Namespace) -> Services:
        """Connect what the flags name; raises ConfigError when a dependency is unreachable."""
        if args.mailbox_ttl <= 0 or args.mailbox_max <= 0:
            raise ConfigError("--mailbox-ttl and --mailbox-max must be positive")
        redis = None
        if args.redis:
            redis = await connect_redis(args.redis, cluster=args.redis_cluster)
        elif args.redis_cluster:
            raise ConfigError("--redis-cluster needs --redis URL (a node of the cluster)")
        mailbox: Mailbox
        if redis is None:
            mailbox = MemoryMailbox(ttl=args.mailbox_ttl, max_per_session=args.mailbox_max)
        else:
            mailbox = RedisMailbox(redis, ttl=args.mailbox_ttl, max_per_session=args.mailbox_max)
        registry, switch = Registry(), Switch(mailbox)
        if redis is not None:
            try:
                await cluster_options.start_cluster(args, redis, switch, registry)
            except BaseException:
                await redis.aclose()
                raise
        return cls(
            registry,
            switch,
            twins=args.twins,
            twin_cache_ttl=args.twin_cache_ttl,
            redis=redis,
        )

    def twin_directory(self) -> TwinDirectory:
        """The cached twin directory, opened on first use (one for every dialect)."""
        if self._directory is None:
            from rmb_relay.twins.cli import parse_twins_url

            path = parse_twins_url(self._twins_url) if self._twins_url else default_twins_path()
            self._directory = CachedTwinDirectory(
                SqliteTwinDirectory(path), ttl=self._twin_cache_ttl
            )
        return self._directory

    async def close(self) -> None:
        """Close the switch (and its mailbox's Redis connection) and the directory."""
        await self.switch.close()
        if self._directory is not None:
            await self._directory.close()
