"""Exception classes of libraries a relay imports only when a feature needs them.

aiohttp (federation, the SBD auth hook) and redis-py (`--redis`) cost ~11 MB and ~7.5 MB of RSS
that a relay on defaults does not pay (bench/README.md "Idle connections"), so no module
imports them for its `except` clauses. An `except` evaluates its expression only when an
exception reaches it, so `except (aiohttp_client_error(), OSError)` imports nothing on the path
where nothing failed, and by the time something did the library is loaded anyway.
"""

from __future__ import annotations


def redis_error() -> type[Exception]:
    """redis-py's base error class."""
    from redis.exceptions import RedisError

    return RedisError


def aiohttp_client_error() -> type[Exception]:
    """aiohttp's base client error class (its connection errors are also OSErrors)."""
    from aiohttp import ClientError

    return ClientError
