"""The gateway's limits and flags (spec decisions 1-13), all in one dataclass."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field

from rmb_relay.dialects.singyeong.metadata import (
    DEFAULT_METADATA_BYTES,
    DEFAULT_METADATA_KEYS,
    DEFAULT_METADATA_TOTAL_BYTES,
    DEFAULT_REPLICA_TOTAL_BYTES,
)
from rmb_relay.dialects.singyeong.query import QueryLimits
from rmb_relay.dialects.singyeong.queues import (
    DEFAULT_DEAD_LETTER_BYTES,
    DEFAULT_DEAD_LETTERS_PAGE,
    DEFAULT_HELD_BYTES,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_TOTAL_BYTES,
    DEFAULT_QUEUES_PER_APP,
    DEFAULT_QUEUES_TOTAL,
    DEFAULT_VERDICT_TIMEOUT,
    MAX_REQUESTS_PER_CLIENT,
    MAX_REQUESTS_TOTAL,
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
#: clients one QUERY_NODES or /api/v1/query answer may list (each up to --sg-metadata-bytes)
DEFAULT_QUERY_MAX_RESULTS = 1000
#: proxied requests in flight at once (each may hold an answer of up to 16 MiB)
DEFAULT_PROXY_CONCURRENCY = 16
#: bytes of parsed QUEUE targets kept for reuse (dialect.py `_cached_target`)
DEFAULT_TARGET_CACHE_BYTES = 8 << 20
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
    #: dead letters one GET /api/v1/queues/dead-letters answer lists (the rest: next page)
    dead_letters_page: int = DEFAULT_DEAD_LETTERS_PAGE
    #: queues that may exist at once, per application (of the client that made one) and in all
    queues_per_app: int = DEFAULT_QUEUES_PER_APP
    queues_total: int = DEFAULT_QUEUES_TOTAL
    #: outstanding QUEUE_REQUESTs per client (all queues) and of all clients
    requests_per_client: int = MAX_REQUESTS_PER_CLIENT
    requests_total: int = MAX_REQUESTS_TOTAL
    #: with Redis: how long a QUEUE whose store failed waits for its withdrawal's verdict
    verdict_timeout: float = DEFAULT_VERDICT_TIMEOUT
    #: with Redis: bytes of QUEUEs held unwritten while Redis is known down (redis_queues.py)
    held_bytes: int = DEFAULT_HELD_BYTES
    #: what one client's metadata may hold (metadata.py `MetadataAccount`)
    metadata_keys: int = DEFAULT_METADATA_KEYS
    metadata_bytes: int = DEFAULT_METADATA_BYTES
    metadata_total_bytes: int = DEFAULT_METADATA_TOTAL_BYTES
    #: what the replicas of other instances' clients may hold together (cluster.py)
    replica_total_bytes: int = DEFAULT_REPLICA_TOTAL_BYTES
    #: the most clients a QUERY_NODES or /api/v1/query answer lists
    query_max_results: int = DEFAULT_QUERY_MAX_RESULTS
    #: the QUEUE target cache's budget (dialect.py)
    target_cache_bytes: int = DEFAULT_TARGET_CACHE_BYTES
    #: a header of the websocket upgrade naming the client's address, set by a front proxy
    #: (`--trusted-ip-header`, shared with SBD)
    client_ip_header: str | None = None
    proxy_allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(default=())
    proxy_timeout: float = DEFAULT_PROXY_TIMEOUT
    proxy_concurrency: int = DEFAULT_PROXY_CONCURRENCY
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
        if self.verdict_timeout <= 0:
            raise ConfigError("--sg-queue-verdict-timeout must be positive")
        for flag, value in (
            ("--sg-queue-bytes", self.queue_bytes),
            ("--sg-queue-total-bytes", self.queue_total_bytes),
            ("--sg-queue-held-bytes", self.held_bytes),
            ("--sg-dead-letter-bytes", self.dead_letter_bytes),
            ("--sg-dead-letters-page", self.dead_letters_page),
            ("--sg-queues-per-app", self.queues_per_app),
            ("--sg-queues-total", self.queues_total),
            ("--sg-queue-requests-per-client", self.requests_per_client),
            ("--sg-queue-requests-total", self.requests_total),
            ("--sg-metadata-keys", self.metadata_keys),
            ("--sg-metadata-bytes", self.metadata_bytes),
            ("--sg-metadata-total-bytes", self.metadata_total_bytes),
            ("--sg-replica-total-bytes", self.replica_total_bytes),
            ("--sg-query-max-results", self.query_max_results),
            ("--sg-target-cache-bytes", self.target_cache_bytes),
            ("--sg-proxy-concurrency", self.proxy_concurrency),
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
            dead_letters_page=args.sg_dead_letters_page,
            queues_per_app=args.sg_queues_per_app,
            queues_total=args.sg_queues_total,
            requests_per_client=args.sg_queue_requests_per_client,
            requests_total=args.sg_queue_requests_total,
            verdict_timeout=args.sg_queue_verdict_timeout,
            held_bytes=args.sg_queue_held_bytes,
            metadata_keys=args.sg_metadata_keys,
            metadata_bytes=args.sg_metadata_bytes,
            metadata_total_bytes=args.sg_metadata_total_bytes,
            replica_total_bytes=args.sg_replica_total_bytes,
            query_max_results=args.sg_query_max_results,
            target_cache_bytes=args.sg_target_cache_bytes,
            # one flag for every dialect that reads a client's address from a front proxy
            client_ip_header=getattr(args, "trusted_ip_header", None) or None,
            proxy_allow=tuple(networks),
            proxy_timeout=args.sg_proxy_timeout,
            proxy_concurrency=args.sg_proxy_concurrency,
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
        help="bytes one queue may hold, waiting, unacked and dead letters together (in memory, "
        "or in Redis with --redis); a QUEUE beyond it is refused with op 3 queue_full",
    )
    sg.add_argument(
        "--sg-queue-total-bytes",
        type=int,
        default=d.queue_total_bytes,
        metavar="BYTES",
        help="bytes all queues may hold together, in memory or in Redis (op 3 queue_full beyond)",
    )
    sg.add_argument(
        "--sg-queues-per-app",
        type=int,
        default=d.queues_per_app,
        metavar="N",
        help="queues the clients of one application may create (a QUEUE or QUEUE_REQUEST "
        "naming a new queue beyond it gets op 3 too_many_queues); a queue ends when empty",
    )
    sg.add_argument(
        "--sg-queues-total",
        type=int,
        default=d.queues_total,
        metavar="N",
        help="queues that may exist at once, all applications (op 3 too_many_queues beyond)",
    )
    sg.add_argument(
        "--sg-queue-requests-per-client",
        type=int,
        default=d.requests_per_client,
        metavar="N",
        help="QUEUE_REQUESTs one client may have waiting for a message, all queues together "
        "(op 3 too many outstanding QUEUE_REQUESTs beyond)",
    )
    sg.add_argument(
        "--sg-queue-requests-total",
        type=int,
        default=d.requests_total,
        metavar="N",
        help="QUEUE_REQUESTs all clients may have waiting (op 3 beyond)",
    )
    sg.add_argument(
        "--sg-queue-verdict-timeout",
        type=float,
        default=d.verdict_timeout,
        metavar="SECONDS",
        help="with --redis: a QUEUE whose store failed (its write may still land) is withdrawn "
        "before it is refused; without a verdict within this long it is refused with op 3 "
        "'queue unknown' (it may be stored or not) instead of 'queue unavailable' (not stored)",
    )
    sg.add_argument(
        "--sg-queue-held-bytes",
        type=int,
        default=d.held_bytes,
        metavar="BYTES",
        help="with --redis: QUEUEs arriving while the cluster knows Redis is down are held in "
        "this instance's memory, unwritten, until it is back (then stored and confirmed) or "
        "until --sg-queue-verdict-timeout (then op 3 'queue unavailable': never written); "
        "this bounds the bytes so held (a record and its overhead each), so an outage cannot "
        "fill the heap; beyond it a QUEUE is refused at once with 'queue unavailable'",
    )
    sg.add_argument(
        "--sg-metadata-keys",
        type=int,
        default=d.metadata_keys,
        metavar="N",
        help="metadata keys one client may hold; an update beyond it is refused whole "
        "(op 3 metadata_full; at identify: op 8 and close)",
    )
    sg.add_argument(
        "--sg-metadata-bytes",
        type=int,
        default=d.metadata_bytes,
        metavar="BYTES",
        help="bytes of metadata one client may hold (values and keys; op 3 metadata_full beyond)",
    )
    sg.add_argument(
        "--sg-metadata-total-bytes",
        type=int,
        default=d.metadata_total_bytes,
        metavar="BYTES",
        help="bytes of metadata all clients of this instance may hold together (op 3 "
        "metadata_full, limit total, beyond)",
    )
    sg.add_argument(
        "--sg-replica-total-bytes",
        type=int,
        default=d.replica_total_bytes,
        metavar="BYTES",
        help="in a cluster: bytes of metadata the replicas of other instances' clients may "
        "hold together; a replica beyond it, or beyond this instance's per-client bounds, is "
        "not kept (logged, counted)",
    )
    sg.add_argument(
        "--sg-query-max-results",
        type=int,
        default=d.query_max_results,
        metavar="N",
        help="clients a QUERY_NODES or POST /api/v1/query answer may list; a query matching "
        "more is refused (op 3 too_many_results, HTTP 400) saying how many it matched",
    )
    sg.add_argument(
        "--sg-target-cache-bytes",
        type=int,
        default=d.target_cache_bytes,
        metavar="BYTES",
        help="memory for parsed QUEUE targets kept for reuse; the cache starts over when full, "
        "and a target over a sixteenth of it is parsed each time instead",
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
        "--sg-dead-letters-page",
        type=int,
        default=d.dead_letters_page,
        metavar="N",
        help="dead letters one GET /api/v1/queues/dead-letters answer lists (and at most 4 MiB "
        "of them); a longer listing is cut, its Link header (rel=next) names the next page",
    )
    sg.add_argument(
        "--sg-proxy-allow",
        action="append",
        default=[],
        metavar="CIDR",
        help="networks /api/v1/proxy may reach (repeatable; default: any but loopback and "
        "link-local): it connects only to the address the gateway saw for the client, and only "
        "if that is in one of these",
    )
    sg.add_argument(
        "--sg-proxy-timeout",
        type=float,
        default=d.proxy_timeout,
        metavar="SECONDS",
        help="a proxied request not answered within this long gets 504",
    )
    sg.add_argument(
        "--sg-proxy-concurrency",
        type=int,
        default=d.proxy_concurrency,
        metavar="N",
        help="proxied requests in flight at once (each may hold a 16 MiB answer); more get 503",
    )
    sg.add_argument(
        "--sg-node",
        metavar="NAME",
        help="this instance's name in QUERY_NODES and queue delivery tokens (default: "
        "host:pid); in a cluster (--redis) the cluster's --instance-id is used instead",
    )
