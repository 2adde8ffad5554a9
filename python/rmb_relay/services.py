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

from rmb_relay.errors import ConfigError
from rmb_relay.mailbox import (
    DEFAULT_MAILBOX_MAX,
    DEFAULT_MAILBOX_SESSIONS,
    DEFAULT_MAILBOX_TOTAL_BYTES,
    DEFAULT_MAILBOX_TTL,
    DEFAULT_MAILBOX_TWIN_BYTES,
    Mailbox,
    MailboxBudget,
    MemoryMailbox,
    RedisMailbox,
)
from rmb_relay.switch import Switch
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path

if TYPE_CHECKING:
    from redis.asyncio import Redis

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
        "--twin-cache-ttl",
        type=float,
        default=DEFAULT_TWIN_CACHE_TTL,
        metavar="SECONDS",
        help="how long a twin lookup is cached",
    )


class Services:
    """See the module docstring. Close with `close()` after the listener has stopped."""

    def __init__(
        self,
        metrics: Registry,
        switch: Switch,
        *,
        twins: str | None = None,
        twin_cache_ttl: float = DEFAULT_TWIN_CACHE_TTL,
        redis: Redis | None = None,
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
        try:
            budget = MailboxBudget(
                args.mailbox_twin_bytes, args.mailbox_total_bytes, args.mailbox_sessions
            )
        except ValueError:
            raise ConfigError(
                "--mailbox-twin-bytes, --mailbox-total-bytes and --mailbox-sessions must be "
                "positive"
            ) from None
        redis = await _connect_redis(args.redis) if args.redis else None
        mailbox: Mailbox
        if redis is None:
            mailbox = MemoryMailbox(
                ttl=args.mailbox_ttl, max_per_session=args.mailbox_max, budget=budget
            )
        else:
            mailbox = RedisMailbox(redis, ttl=args.mailbox_ttl, max_per_session=args.mailbox_max)
        return cls(
            Registry(),
            Switch(mailbox),
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


async def _connect_redis(url: str) -> Redis:
    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    redis = Redis.from_url(url)
    try:
        await redis.ping()
    except (RedisError, OSError) as err:
        await redis.aclose()
        raise ConfigError(f"cannot reach redis at {url}: {err}") from None
    return redis
