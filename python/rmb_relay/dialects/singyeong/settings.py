"""The gateway's limits and flags (spec decisions 1-13), all in one dataclass."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field

from rmb_relay.dialects.singyeong.query import QueryLimits
from rmb_relay.dialects.singyeong.queues import (
    DEFAULT_DEAD_LETTER_BYTES,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_TOTAL_BYTES,
)
from rmb_relay.errors import ConfigError

#: the public server's advertised interval (spec §3, op 0)
DEFAULT_HEARTBEAT_MS = 45_000
#: the seed document's metadata update rate (decision 8)
DEFAULT_METADATA_RATE = 50
#: decision 11
DEFAULT_ACK_TIMEOUT = 15.0
DEFAULT_MAX_ATTEMPTS = 5
#: a proxied request is abandoned after this long (issue #12 point 7: "bound the time")
DEFAULT_PROXY_TIMEOUT = 30.0
#: the password can come from the environment, so it stays out of `ps`
AUTH_ENV = "SINGYEONG_AUTH"
#: what `GET /api/version` answers (the public server's shape)
API_VERSION = {"singyeong": "0.0.1", "api": "v1"}


@dataclass(slots=True)
class SgSettings:
    """See `add_arguments` for what each field means."""

    auth: str | None = None
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS
    metadata_rate: int = DEFAULT_METADATA_RATE
    ack_timeout: float = DEFAULT_ACK_TIMEOUT
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    #: memory budget of the in-memory queues (queues.py): bytes per queue, in all, and of
    #: dead letters (all queues); a QUEUE over it gets op 3 queue_full
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    queue_total_bytes: int = DEFAULT_QUEUE_TOTAL_BYTES
    dead_letter_bytes: int = DEFAULT_DEAD_LETTER_BYTES
    proxy_allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(default=())
    proxy_timeout: float = DEFAULT_PROXY_TIMEOUT
    #: this instance's name in QUERY_NODES answers and Redis presence
    node: str = "local"
    #: what one query may cost (nesting, conditions, `$in`/`$nin` values); beyond: op 3
    query_limits: QueryLimits = field(default_factory=QueryLimits)

    def __post_init__(self) -> None:
        if self.heartbeat_ms <= 0:
            raise ConfigError("--sg-heartbeat-interval must be positive")
        if self.metadata_rate <= 0:
            raise ConfigError("--sg-metadata-rate must be positive")
        if self.ack_timeout <= 0:
            raise ConfigError("--sg-ack-timeout must be positive")
        if self.max_attempts <= 0:
            raise ConfigError("--sg-max-attempts must be positive")
        if self.proxy_timeout <= 0:
            raise ConfigError("--sg-proxy-timeout must be positive")
        for flag, value in (
            ("--sg-queue-bytes", self.queue_bytes),
            ("--sg-queue-total-bytes", self.queue_total_bytes),
            ("--sg-dead-letter-bytes", self.dead_letter_bytes),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be positive")
        for flag, value in (
            ("--sg-query-max-depth", self.query_limits.max_depth),
            ("--sg-query-max-ops", self.query_limits.max_ops),
            ("--sg-query-max-list", self.query_limits.max_list),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be positive")

    @property
    def heartbeat_timeout_ns(self) -> int:
        """Decision 7: 1.5 x the advertised interval without a heartbeat closes the socket."""
        return self.heartbeat_ms * 1_500_000

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SgSettings:
        networks = []
        for text in args.sg_proxy_allow:
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                raise ConfigError(f"--sg-proxy-allow: {text!r} is not a network") from None
        return cls(
            auth=args.sg_auth if args.sg_auth is not None else os.environ.get(AUTH_ENV) or None,
            heartbeat_ms=args.sg_heartbeat_interval,
            metadata_rate=args.sg_metadata_rate,
            ack_timeout=args.sg_ack_timeout,
            max_attempts=args.sg_max_attempts,
            queue_bytes=args.sg_queue_bytes,
            queue_total_bytes=args.sg_queue_total_bytes,
            dead_letter_bytes=args.sg_dead_letter_bytes,
            proxy_allow=tuple(networks),
            proxy_timeout=args.sg_proxy_timeout,
            node=args.sg_node or f"{os.uname().nodename}:{os.getpid()}",
            query_limits=QueryLimits(
                args.sg_query_max_depth, args.sg_query_max_ops, args.sg_query_max_list
            ),
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The 신경 flags of `rmb-relay serve`; defaults come from `SgSettings`."""
    d = SgSettings()
    sg = parser.add_argument_group("singyeong gateway (GET /gateway/websocket)")
    sg.add_argument("--no-singyeong", action="store_true", help="do not serve the gateway")
    sg.add_argument(
        "--sg-auth",
        metavar="PASSWORD",
        help=f"gateway password (default: ${AUTH_ENV}); clients without it are restricted, "
        "and the HTTP API wants it in Authorization",
    )
    sg.add_argument(
        "--sg-heartbeat-interval",
        type=int,
        default=d.heartbeat_ms,
        metavar="MS",
        help="advertised in hello; a client silent for 1.5x this long is closed",
    )
    limits = d.query_limits
    sg.add_argument(
        "--sg-query-max-depth",
        type=int,
        default=limits.max_depth,
        metavar="N",
        help="logical operators ($and/$or/$nor) a query may nest; deeper: op 3 invalid query",
    )
    sg.add_argument(
        "--sg-query-max-ops",
        type=int,
        default=limits.max_ops,
        metavar="N",
        help="conditions and operators one query may hold in all; more: op 3 invalid query",
    )
    sg.add_argument(
        "--sg-query-max-list",
        type=int,
        default=limits.max_list,
        metavar="N",
        help="values one $in/$nin list may hold; more: op 3 invalid query",
    )
    sg.add_argument(
        "--sg-metadata-rate",
        type=int,
        default=d.metadata_rate,
        metavar="N",
        help="metadata updates applied per client per second; more wait (merged), never dropped",
    )
    sg.add_argument(
        "--sg-ack-timeout",
        type=float,
        default=d.ack_timeout,
        metavar="SECONDS",
        help="a queued message not acked for this long is delivered again",
    )
    sg.add_argument(
        "--sg-max-attempts",
        type=int,
        default=d.max_attempts,
        metavar="N",
        help="deliveries of a queued message before it becomes a dead letter",
    )
    sg.add_argument(
        "--sg-queue-bytes",
        type=int,
        default=d.queue_bytes,
        metavar="BYTES",
        help="in-memory queues (no Redis): bytes one queue may hold, waiting, unacked and dead "
        "letters together; a QUEUE beyond it is refused with op 3 queue_full",
    )
    sg.add_argument(
        "--sg-queue-total-bytes",
        type=int,
        default=d.queue_total_bytes,
        metavar="BYTES",
        help="in-memory queues: bytes all queues may hold together (op 3 queue_full beyond)",
    )
    sg.add_argument(
        "--sg-dead-letter-bytes",
        type=int,
        default=d.dead_letter_bytes,
        metavar="BYTES",
        help="in-memory queues: bytes of dead letters (all queues); beyond it a message at its "
        "last attempt stays in its queue instead (logged, counted), never dropped",
    )
    sg.add_argument(
        "--sg-proxy-allow",
        action="append",
        default=[],
        metavar="CIDR",
        help="networks /api/v1/proxy may reach besides each client's own address (repeatable)",
    )
    sg.add_argument(
        "--sg-proxy-timeout",
        type=float,
        default=d.proxy_timeout,
        metavar="SECONDS",
        help="a proxied request not answered within this long gets 504",
    )
    sg.add_argument(
        "--sg-node",
        metavar="NAME",
        help="this instance's name in QUERY_NODES and queue delivery tokens (default: "
        "host:pid); in a cluster (--redis) the cluster's --instance-id is used instead",
    )
