"""The cluster's flags of `rmb-relay serve`, and the `Cluster` they describe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rmb_relay.cluster.node import DEFAULT_CACHE_TTL, DEFAULT_TTL, HELD_BYTES, Cluster
from rmb_relay.errors import ConfigError

if TYPE_CHECKING:
    from rmb_relay.cluster.connect import RedisClient
    from rmb_relay.switch import Switch
    from rmb_relay.telemetry.metrics import Registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster (instances sharing --redis see each other's sessions; docs/cluster.md)"
    )
    group.add_argument(
        "--redis-cluster",
        action="store_true",
        help="--redis names a node of a Redis Cluster (the others are discovered)",
    )
    group.add_argument(
        "--no-cluster",
        action="store_true",
        help="with --redis, do not join the other instances (mailboxes only)",
    )
    group.add_argument(
        "--instance-id",
        metavar="ID",
        help="this process's name among the instances (default: host-pid-random); must be unique",
    )
    group.add_argument(
        "--cluster-ttl",
        type=float,
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help="presence and liveness last this long without renewal: how soon the sessions of "
        "an instance that died are given up",
    )
    group.add_argument(
        "--cluster-held-bytes",
        type=int,
        default=HELD_BYTES,
        metavar="BYTES",
        help="messages reaped from an instance given up (SBD forwards, 신경 frames: no mailbox) "
        "are kept this much in all, for up to 300 s, and sent to it if it comes back (it may "
        "only have been cut off from Redis); past it they are dropped and counted "
        "(rmb_relay_cluster_held_bytes)",
    )


async def start_cluster(
    args: argparse.Namespace, redis: RedisClient, switch: Switch, registry: Registry
) -> Cluster | None:
    """The cluster the flags ask for, started and attached to `switch` (None with
    --no-cluster). Raises ConfigError."""
    from redis.exceptions import RedisError

    if args.no_cluster:
        return None
    if not args.cluster_ttl > 0:
        raise ConfigError("--cluster-ttl must be a positive number of seconds")
    if args.cluster_held_bytes < 0:
        raise ConfigError("--cluster-held-bytes must be >= 0 (0: keep nothing)")
    if args.instance_id is not None and not args.instance_id.strip():
        raise ConfigError("--instance-id must not be empty")
    cluster = Cluster(
        redis,
        switch,
        instance_id=args.instance_id,
        ttl=args.cluster_ttl,
        cache_ttl=min(DEFAULT_CACHE_TTL, args.cluster_ttl / 3),
        registry=registry,
        held_bytes=args.cluster_held_bytes,
    )
    try:
        await cluster.start()
    except (RedisError, OSError) as err:
        raise ConfigError(f"cannot join the cluster through redis: {err}") from None
    switch.cluster = cluster
    return cluster
