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


#: a command that fails on a broken connection is tried this many more times, on a new
#: connection, after a short backoff: after a Redis restart every pooled connection is dead
#: and the first command on each would fail otherwise. (A write whose reply was lost may then
#: be applied twice; the bus is at-least-once anyway.)
CONNECTION_RETRIES = 2


async def connect_redis(url: str, *, cluster: bool = False, timeout: float = 5.0) -> RedisClient:
    """A client that answered PING; raises ConfigError naming the URL when it cannot. Every
    socket operation is bounded by `timeout`: without it a Redis that stops answering (stopped,
    not dead) would hold each caller forever."""
    from redis.asyncio import ConnectionPool, Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, RedisError, TimeoutError

    client: RedisClient
    try:
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), CONNECTION_RETRIES)
        options = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": retry,
            "retry_on_error": [ConnectionError, TimeoutError],
        }
        if cluster:
            client = RedisCluster.from_url(url, **options)
        else:
            # the retry must reach the pool's connections (Redis.from_url keeps it to itself)
            pool = ConnectionPool.from_url(url, **options)
            client = Redis.from_pool(pool)  # closes the pool with the client
    except ValueError as err:
        raise ConfigError(f"bad redis URL {url!r}: {err}") from None
    try:
        await client.ping()
    except (RedisError, OSError) as err:
        await client.aclose()
        kind = "redis cluster" if cluster else "redis"
        raise ConfigError(f"cannot reach {kind} at {url}: {err}") from None
    return client
