"""`POST /api/v1/proxy` (spec §11, issue #12 point 7): an HTTP request to a client chosen by a
query, sent to the address the client gave (`ip` at identify, else its socket's address).

The public server lets any caller make the gateway request any URL a client names; here the
target must resolve to the client's own socket address or to a network the operator allowed
(`--sg-proxy-allow`), the request is abandoned after `--sg-proxy-timeout`, and redirects are
never followed (the 3xx goes back to the caller as it is). Errors are 400
`{"errors": [...]}` (the public server's shape), 502 when the client cannot be reached and 504
on timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.singyeong.query import QueryError, parse

if TYPE_CHECKING:
    from rmb_relay.dialects.singyeong.clients import Client
    from rmb_relay.dialects.singyeong.dialect import SingyeongDialect

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


class Proxy:
    def __init__(self, dialect: SingyeongDialect) -> None:
        self.dialect = dialect
        self._session: Any = None

    def target_url(self, client: Client, route: str) -> str:
        base = client.metadata.get("ip") or client.socket_ip
        if not isinstance(base, str):
            base = client.socket_ip
        if not base.startswith(("http://", "https://")):
            host = base if ":" not in base or base.startswith("[") else f"[{base}]"
            base = f"http://{host}"
        return base.rstrip("/") + "/" + route.lstrip("/")

    async def allowed(self, client: Client, url: str) -> str | None:
        """None if every address the URL's host resolves to is the client's own or allowed;
        else why not."""
        parts = urlsplit(url)
        host = parts.hostname
        if parts.scheme not in ("http", "https") or not host:
            return f"not an http(s) URL: {url}"
        own = _ip(client.socket_ip)
        addresses = [_ip(host)]
        if addresses[0] is None:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 80)
            except OSError as err:
                return f"cannot resolve {host}: {err}"
            addresses = [_ip(str(info[4][0])) for info in infos]
        networks = self.dialect.settings.proxy_allow
        for address in addresses:
            if address is None:
                return f"cannot resolve {host}"
            if address == own or any(address in network for network in networks):
                continue
            return f"{address} is neither the client's address nor in --sg-proxy-allow"
        return None

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
            query = parse(target)
        except QueryError as err:
            return _error(400, str(err))
        receivers = self.dialect.resolve(query, broadcast=False)
        if not receivers:
            return _error(400, "no matches")
        client = receivers[0]
        url = self.target_url(client, route)
        refused = await self.allowed(client, url)
        if refused is not None:
            return _error(403, refused)
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
        return await self.forward(method, url, send_headers, data)

    async def forward(
        self, method: str, url: str, headers: dict[str, str], data: bytes | None
    ) -> HttpResponse:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        timeout = aiohttp.ClientTimeout(total=self.dialect.settings.proxy_timeout)
        try:
            async with self._session.request(
                method, url, headers=headers, data=data, allow_redirects=False, timeout=timeout
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
