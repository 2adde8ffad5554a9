"""Federation's flags of `rmb-relay serve` and building it from them.

Without `--redis` the outbound queue lives in memory (bounded by `--federation-queue-max`);
with it, it is the Redis stream every instance sharing that Redis reads (queue.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmb_relay.errors import ConfigError
from rmb_relay.federation import metrics
from rmb_relay.federation.inbound import InboundFederation
from rmb_relay.federation.outbound import (
    DEFAULT_MAX_BACKOFF,
    DEFAULT_MAX_TTL,
    DEFAULT_WORKERS,
    OutboundFederation,
)
from rmb_relay.federation.priors import load_priors
from rmb_relay.federation.queue import (
    DEFAULT_CLAIM_IDLE,
    DEFAULT_MAX_HELD,
    MemoryQueue,
    OutboundQueue,
    RedisQueue,
)
from rmb_relay.federation.ranker import DEFAULT_RANKER_PERIOD, Ranker
from rmb_relay.federation.sender import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIMEOUT,
    DEFAULT_URL_TEMPLATE,
    Sender,
)

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient
    from rmb_relay.switch import Switch
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.twins import Twin, TwinDirectory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("RMB federation (relay to relay: POST /)")
    group.add_argument(
        "-p",
        "--ranker-period",
        type=float,
        default=DEFAULT_RANKER_PERIOD,
        metavar="SECONDS",
        help="window in which a relay's failures count against it when choosing among a "
        "twin's relays",
    )
    group.add_argument(
        "--ranker-priors",
        metavar="FILE",
        help="per-domain prior failure rates (JSON {domain: rate}, or Parquet with columns "
        "domain, failure_rate) that order relays with equal recent failures",
    )
    group.add_argument(
        "--federation-url-template",
        default=DEFAULT_URL_TEMPLATE,
        metavar="TEMPLATE",
        help="URL a remote relay's domain is posted to; {domain} is replaced",
    )
    group.add_argument(
        "--federation-ca",
        metavar="PEM",
        help="CA bundle to verify remote relays' TLS certificates with (default: the system's)",
    )
    group.add_argument(
        "--federation-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="longest wait for one remote relay's answer",
    )
    group.add_argument(
        "--federation-concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help="requests in flight (and pooled keep-alive connections) per remote relay; "
        "batches to another rmb-relay: at most 4 of them in flight",
    )
    group.add_argument(
        "--federation-workers",
        type=int,
        default=DEFAULT_WORKERS,
        metavar="N",
        help="posting tasks of this process, over all remote relays; each takes every "
        "envelope ready (up to 1024) and posts them as batches or one POST each",
    )
    group.add_argument(
        "--federation-queue-max",
        type=int,
        default=DEFAULT_MAX_HELD,
        metavar="N",
        help="without --redis: envelopes held for other relays before senders get an error",
    )
    group.add_argument(
        "--federation-claim-idle",
        type=float,
        default=DEFAULT_CLAIM_IDLE,
        metavar="SECONDS",
        help="with --redis: an instance takes over queued envelopes another instance has not "
        "touched for this long (it crashed or hangs)",
    )
    group.add_argument(
        "--federation-max-backoff",
        type=float,
        default=DEFAULT_MAX_BACKOFF,
        metavar="SECONDS",
        help="longest pause between rounds over a twin's relays when all of them fail",
    )
    group.add_argument(
        "--federation-max-ttl",
        type=int,
        default=DEFAULT_MAX_TTL,
        metavar="SECONDS",
        help="longest an envelope for another relay is retried after it was queued, whatever "
        "its own expiration says; then its sender hears it expired",
    )
    group.add_argument(
        "--verify-federated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="accept a POSTed envelope only if it is signed by its source twin's account key "
        "(checked in Rust, ~0.13 ms per envelope; --no-verify-federated trusts whoever posts)",
    )


def build(
    args: argparse.Namespace,
    *,
    redis: RedisClient | None,
    switch: Switch,
    registry: Registry,
    directory: TwinDirectory,
    is_ours: Callable[[Twin], bool],
) -> tuple[OutboundFederation, InboundFederation]:
    """Both directions, registered in the process's metrics (`registry`); the outbound queue
    is in Redis when there is one. Raises ConfigError."""
    if args.federation_workers < 1:
        raise ConfigError("--federation-workers must be at least 1")
    if not args.federation_max_backoff > 0:
        raise ConfigError("--federation-max-backoff must be positive")
    if args.federation_queue_max < 1:
        raise ConfigError("--federation-queue-max must be at least 1")
    if args.federation_max_ttl < 1:
        raise ConfigError("--federation-max-ttl must be at least 1 second")
    if not args.federation_claim_idle > 0:
        raise ConfigError("--federation-claim-idle must be positive")
    priors = load_priors(args.ranker_priors) if args.ranker_priors else {}
    ranker = Ranker(args.ranker_period, priors=priors)
    sender = Sender(
        args.federation_url_template,
        timeout=args.federation_timeout,
        concurrency=args.federation_concurrency,
        cafile=args.federation_ca,
        # the first --domain names this relay in the receiver's route records
        origin=args.domain[0] if getattr(args, "domain", None) else None,
    )
    queue: OutboundQueue
    if redis is None:
        queue = MemoryQueue(args.federation_queue_max)
    else:
        queue = RedisQueue(redis, claim_idle=args.federation_claim_idle)
    outbound = OutboundFederation(
        queue,
        sender,
        ranker,
        directory,
        switch,
        workers=args.federation_workers,
        max_backoff=args.federation_max_backoff,
        max_ttl=args.federation_max_ttl,
    )
    inbound = InboundFederation(directory, switch, is_ours, verify=args.verify_federated)
    metrics.register(registry, outbound, inbound)
    return outbound, inbound
