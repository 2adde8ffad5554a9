"""The spec-auth hook client: `PUT /authenticate` bodies go to the operator's hook for a token.

On aiohttp, the maintained asyncio HTTP client (federation and the tunnel use it too), so
framing (Content-Length, chunked, keep-alive), TLS and connection reuse are its concern, not
ours. What stays ours is the contract the dialect answers by:

| outcome | raised | the dialect answers |
|---|---|---|
| 200 with `{"authToken": "<non-empty string>"}` | (returns the token) | 200 with it |
| 401 | PermissionError | 401 |
| any other status, bad JSON, no or empty token, a broken or oversized answer | ValueError | 502 |
| connection refused or reset, DNS failure | OSError | 502 |
| no complete answer within the timeout | TimeoutError | 502 |

Limits: the whole exchange, body included, runs under one timeout (a hook that answers
slowly is as bad as one that does not answer); the answer body is capped at
`AUTH_HOOK_MAX_RESPONSE` bytes, counted as read, and it is not decompressed (none is asked for)
so the cap is what is held in memory. Redirects are not followed: the operator configured the
hook's URL.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rmb_relay.dialects.sbd.settings import AUTH_HOOK_MAX_RESPONSE, AUTH_HOOK_TIMEOUT
from rmb_relay.lazy_errors import aiohttp_client_error

if TYPE_CHECKING:
    # imported when a session is made (`new_session`), not with the SBD dialect: aiohttp costs
    # ~11 MB of RSS a relay without --sbd-auth-hook does not pay (bench/README.md "Idle
    # connections")
    import aiohttp

#: the answer is read in pieces of this size, so the cap is checked before much is buffered
_READ_CHUNK = 4096


def new_session() -> aiohttp.ClientSession:
    """A session configured for hook calls; must be created and closed inside a running loop.

    No session-wide timeout (each call sets its own) and no `Accept-Encoding`, with automatic
    decompression off, so a compressed answer cannot expand past the size cap."""
    import aiohttp

    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding",),
    )


async def call_auth_hook(
    url: str,
    body: bytes,
    timeout: float = AUTH_HOOK_TIMEOUT,
    *,
    session: aiohttp.ClientSession | None = None,
) -> str:
    """PUT the auth bytes to the operator's hook (spec-auth); returns its `authToken`.

    `session` is the caller's long-lived one (connections to the hook are reused); without it
    a session is made for this one call. Raises as the module docstring's table says."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"auth hook must be an http(s) URL, got {url!r}")
    if session is None:
        async with new_session() as own:
            return await call_auth_hook(url, body, timeout, session=own)
    try:
        async with asyncio.timeout(timeout):
            status, answer = await _put(session, url, body)
    except (TimeoutError, OSError):
        raise  # aiohttp's connection errors are OSErrors: unreachable, refused, reset
    except aiohttp_client_error() as err:  # disconnected mid-answer, malformed, truncated
        raise ValueError(f"auth hook answer unusable: {err!r}") from None
    if status == 401:
        raise PermissionError("auth hook refused")
    if status != 200:
        raise ValueError(f"auth hook answered {status}")
    try:
        token = json.loads(answer)["authToken"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("auth hook answer has no authToken") from None
    if not isinstance(token, str) or not token:
        raise ValueError("auth hook authToken is not a non-empty string")
    return token


async def _put(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
    """(status, body) of one PUT; the body is read only for a 200 (nothing else uses it)."""
    async with session.put(
        url,
        data=body,
        headers={"Content-Type": "application/octet-stream"},
        allow_redirects=False,
    ) as response:
        if response.status != 200:
            return response.status, b""
        length = response.content_length
        if length is not None and length > AUTH_HOOK_MAX_RESPONSE:
            raise ValueError("auth hook response too large")
        answer = bytearray()
        async for chunk in response.content.iter_chunked(_READ_CHUNK):
            answer += chunk
            if len(answer) > AUTH_HOOK_MAX_RESPONSE:
                raise ValueError("auth hook response too large")
        return response.status, bytes(answer)


class AuthHookClient:
    """The dialect's hook client: one aiohttp session for every call, created on first use
    (a session belongs to the running loop) and closed with the dialect."""

    def __init__(self, timeout: float = AUTH_HOOK_TIMEOUT) -> None:
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def call(self, url: str, body: bytes) -> str:
        if self._session is None or self._session.closed:
            self._session = new_session()
        return await call_auth_hook(url, body, self.timeout, session=self._session)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
