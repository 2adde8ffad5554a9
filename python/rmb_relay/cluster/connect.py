"""One Redis client type for a single server and for Redis Cluster.

redis-py's `RedisCluster` speaks the same commands as `Redis` and routes each to the node that
owns its key's slot; the keys in `keys.py` carry hash tags so that everything one command or
transaction touches is in one slot. `--redis URL` names a server; with `--redis-cluster` it
names any node of a cluster (the client discovers the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from rmb_relay.errors import ConfigError

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

RedisClient: TypeAlias = "Redis | RedisCluster"


async def connect_redis(url: str, *, cluster: bool = False, timeout: float = 5.0) -> RedisClient:
    """A client that answered PING; raises ConfigError naming the URL when it cannot. Every
    socket operation is bounded by `timeout`: without it a Redis that stops answering (stopped,
    not dead) would hold each caller forever."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import RedisError

    client: RedisClient
    try:
        bounds = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        client = RedisCluster.from_url(url, **bounds) if cluster else Redis.from_url(url, **bounds)
    except ValueError as err:
        raise ConfigError(f"bad redis URL {url!r}: {err}") from None
    try:
        await client.ping()
    except (RedisError, OSError) as err:
        await client.aclose()
        kind = "redis cluster" if cluster else "redis"
        raise ConfigError(f"cannot reach {kind} at {url}: {err}") from None
    return client
