"""`POST /api/v1/proxy` (spec §11, issues #12 point 7 and 33): an HTTP request to a client
chosen by a query, sent to the address the gateway itself saw for that client.

The public server lets any caller make the gateway request any URL a client names. Here:
- the connection goes to the client's address as the gateway saw it (its socket's, or the
  `--trusted-ip-header` of its upgrade), never to one it declared: the `ip` a client gives
  at identify only chooses the scheme, the port and the Host name. A declared host that is an
  address must be that address; a name is resolved once and must include it (else 403);
- the request is made to that address (a literal in the URL, the name in `Host` and, for
  https, in SNI and the certificate check), so a second resolution cannot send it elsewhere
  (DNS rebinding);
- with `--sg-proxy-allow`, the address must be in one of those networks (403 otherwise);
  without it, any address but loopback, link-local, unspecified and multicast ones (this
  host's own services: a client behind a front proxy on this host looks like 127.0.0.1);
- the request is abandoned after `--sg-proxy-timeout`, and redirects are never followed (the
  3xx goes back to the caller as it is);
- at most `--sg-proxy-concurrency` requests are in flight (each may hold an answer of up to
  `MAX_RESPONSE`); more get 503 at once.
Errors are 400 `{"errors": [...]}` (the public server's shape), 403 for a target refused as
above, 502 when the client cannot be reached, 503 over the concurrency and 504 on timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.singyeong.query import QueryError, parse

if TYPE_CHECKING:
    from rmb_relay.dialects.singyeong.clients import Client
    from rmb_relay.dialects.singyeong.metrics import SgMetrics
    from rmb_relay.dialects.singyeong.query import Query
    from rmb_relay.dialects.singyeong.settings import SgSettings

METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"))
WITHOUT_BODY = frozenset(("GET", "HEAD"))
#: not passed on either way (RFC 9110 7.6.1 hop-by-hop, plus what aiohttp sets itself)
HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
    )
)
#: largest upstream body passed back (the caller's answer is held in memory)
MAX_RESPONSE = 16 << 20


def _error(status: int, *errors: str) -> HttpResponse:
    return HttpResponse(status, json.dumps({"errors": list(errors)}).encode(), "application/json")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True, slots=True)
class Target:
    """A checked destination: `url` names the address itself (no name to resolve again);
    `host` is the Host header when the client gave a name; `server_hostname` the name for
    TLS (https)."""

    url: str
    host: str | None
    server_hostname: str | None


class ProxyHost(Protocol):
    """What the proxy needs of the gateway (dialect.py's `SingyeongDialect`; a protocol here
    so that this module does not import the dialect that imports it)."""

    @property
    def settings(self) -> SgSettings: ...

    @property
    def metrics(self) -> SgMetrics: ...

    def resolve(self, query: Query, *, broadcast: bool) -> list[Client]: ...


class Proxy:
    def __init__(self, dialect: ProxyHost) -> None:
        self.dialect = dialect
        self._session: Any = None
        #: requests being forwarded now (`--sg-proxy-concurrency`)
        self.in_flight = 0

    async def target(self, client: Client, route: str) -> Target | str:
        """Where the request for `client` goes, or why it may not go (module docstring)."""
        seen = _ip(client.socket_ip)
        if seen is None:
            return f"the client's address {client.socket_ip!r} is not an IP address"
        declared = client.metadata.get("ip")
        if not isinstance(declared, str) or not declared:
            declared = client.socket_ip
        if "://" not in declared:
            bare = ":" in declared and not declared.startswith("[") and _ip(declared) is not None
            declared = f"http://[{declared}]" if bare else f"http://{declared}"
        try:
            parts = urlsplit(declared)
            host = parts.hostname
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:  # a bad port, an unclosed "[": the client's own text
            return f"not a valid address: {declared[:200]}"
        if parts.scheme not in ("http", "https") or not host:
            return f"not an http(s) URL: {declared[:200]}"
        literal = _ip(host)
        if literal is not None:
            if literal != seen:
                return (
                    f"{literal} is not the address the gateway saw for the client ({seen}); "
                    "the proxy connects only to that"
                )
            name = None
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port)
            except OSError as err:
                return f"cannot resolve {host[:200]}: {err}"
            if seen not in {_ip(str(info[4][0])) for info in infos}:
                return (
                    f"{host[:200]} does not resolve to the address the gateway saw for the "
                    f"client ({seen}); the proxy connects only to that"
                )
            name = host
        networks = self.dialect.settings.proxy_allow
        if networks:
            if not any(seen in network for network in networks):
                return f"{seen} is not in --sg-proxy-allow"
        elif seen.is_loopback or seen.is_link_local or seen.is_unspecified or seen.is_multicast:
            # this host's own services (a client behind a front proxy on this host looks
            # like 127.0.0.1): only when the operator names them
            return (
                f"{seen} is this host or its link: the proxy reaches such addresses only if "
                "--sg-proxy-allow names them (behind a proxy on this host, set "
                "--trusted-ip-header)"
            )
        shown = f"[{seen}]" if seen.version == 6 else str(seen)
        url = f"{parts.scheme}://{shown}:{port}/{route.lstrip('/')}"
        host_header = None
        if name is not None:
            default = port == (443 if parts.scheme == "https" else 80)
            host_header = name if default else f"{name}:{port}"
        return Target(url, host_header, name if parts.scheme == "https" else None)

    async def handle(self, raw: bytes) -> HttpResponse:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, "body must be an object")
        method, route, target = body.get("method"), body.get("route"), body.get("query")
        for name, value in (("method", method), ("route", route), ("query", target)):
            if value is None:
                return HttpResponse(
                    400, json.dumps({name: [f"no {name} provided"]}).encode(), "application/json"
                )
        if not isinstance(method, str) or method.upper() not in METHODS:
            return _error(400, f"method must be one of {', '.join(sorted(METHODS))}")
        method = method.upper()
        if not isinstance(route, str):
            return _error(400, "route must be a string")
        has_body = "body" in body
        if method in WITHOUT_BODY and has_body:
            return _error(400, f"{method} requests must not have a body")
        if method not in WITHOUT_BODY and not has_body:
            return _error(400, f'{method} requests need a body (send "" for none)')
        try:
            query = parse(target, self.dialect.settings.query_limits)
        except QueryError as err:
            return _error(400, str(err))
        receivers = self.dialect.resolve(query, broadcast=False)
        if not receivers:
            return _error(400, "no matches")
        client = receivers[0]
        target = await self.target(client, route)
        if isinstance(target, str):
            self.dialect.metrics.refused.inc(1, "proxy_target")
            return _error(403, target)
        payload = body.get("body")
        data = (
            payload.encode()
            if isinstance(payload, str)
            else json.dumps(payload).encode()
            if payload is not None
            else None
        )
        headers = body.get("headers") or {}
        if not isinstance(headers, dict):
            return _error(400, "headers must be an object")
        send_headers = {
            str(k): str(v) for k, v in headers.items() if str(k).lower() not in HOP_BY_HOP
        }
        if target.host is not None:
            send_headers["Host"] = target.host
        limit = self.dialect.settings.proxy_concurrency
        if self.in_flight >= limit:
            self.dialect.metrics.refused.inc(1, "proxy_concurrency")
            return _error(
                503, f"{limit} proxied requests are in flight (--sg-proxy-concurrency); retry later"
            )
        self.in_flight += 1
        try:
            return await self.forward(method, target, send_headers, data)
        finally:
            self.in_flight -= 1

    async def forward(
        self, method: str, target: Target, headers: dict[str, str], data: bytes | None
    ) -> HttpResponse:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        timeout = aiohttp.ClientTimeout(total=self.dialect.settings.proxy_timeout)
        try:
            async with self._session.request(
                method,
                target.url,
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=timeout,
                server_hostname=target.server_hostname,
            ) as response:
                content = await response.content.read(MAX_RESPONSE + 1)
                if len(content) > MAX_RESPONSE:
                    return _error(502, f"upstream answer over {MAX_RESPONSE} bytes")
                passed = tuple(
                    (k.lower(), v)
                    for k, v in response.headers.items()
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-type"
                )
                return HttpResponse(
                    response.status,
                    content,
                    response.headers.get("content-type", "application/octet-stream"),
                    headers=passed,
                )
        except TimeoutError:
            return _error(504, "the client did not answer in time")
        except aiohttp.ClientError as err:
            return _error(502, f"cannot reach the client: {err}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
