"""`/management/tenants`: tenant CRUD over HTTP (decision 10), RelayServer's endpoint shapes
(spec §12), behind `--management-key` sent as header `Api-Key` (RelayServer's demo scheme).

| request | answer |
|---|---|
| `GET /management/tenants?skip=0&take=10` | 200 `{results, totalCount, offset, pageSize}` |
| `GET /management/tenants/{name}` | 200 tenant, 404 |
| `POST /management/tenants` (tenant JSON, optional `secret`) | 201, 409 when it exists |
| `PUT /management/tenants/{name}` | 204, 404 |
| `DELETE /management/tenants/{name}` | 204, 404 |

Without `--management-key` the routes are not served (404): the API must be switched on.
A wrong or missing key is 401; malformed JSON or fields 400 with the reason.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.tunnel.tenants import Tenant, hash_secret
from rmb_relay.errors import ConfigError

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.tunnel.host import TunnelHost

PREFIX = "/management/tenants"
_FIELDS = {
    "displayName": ("display_name", str),
    "description": ("description", str),
    "requireAuthentication": ("require_authentication", bool),
    "maximumConcurrentConnectorRequests": ("max_concurrent", int),
    "acknowledgeMode": ("ack_mode", int),
    "forwardAuthorization": ("forward_authorization", bool),
}


def _json(status: int, value: object) -> HttpResponse:
    return HttpResponse(status, json.dumps(value).encode(), content_type="application/json")


def _error(status: int, message: str) -> HttpResponse:
    return _json(status, {"error": message})


def _apply(tenant: Tenant, body: dict[str, Any]) -> Tenant:
    changes: dict[str, Any] = {}
    for key, (attr, kind) in _FIELDS.items():
        if key in body:
            value = body[key]
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not ok and not (attr == "ack_mode" and value is None):
                raise ConfigError(f"{key} must be {kind.__name__}")
            changes[attr] = value
    if "secret" in body:
        secret = body["secret"]
        if not isinstance(secret, str) or not secret:
            raise ConfigError("secret must be a non-empty string")
        changes["secret_hash"] = hash_secret(secret)
    return replace(tenant, **changes)


async def handle(dialect: TunnelHost, request: HttpRequest) -> HttpResponse:
    key = dialect.settings.management_key
    if key is None:
        return HttpResponse(404, b"page not found")
    given = request.header("api-key") or b""
    if not hmac.compare_digest(given, key.encode()):
        dialect.hub.auth_failures.inc(1, "management")
        return _error(401, "a valid Api-Key header is required")
    store = dialect.store_of_tenants
    path = request.path
    name = unquote(path[len(PREFIX) + 1 :]) if path.startswith(PREFIX + "/") else ""
    if path not in (PREFIX, PREFIX + "/") and not name:
        return _error(404, "not found")
    method = request.method
    try:
        body: Any = json.loads(request.body) if request.body else {}
        if method in ("POST", "PUT") and not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if not name:
            if method in ("GET", "HEAD"):
                query = parse_qs(request.query or "")
                skip = int(query.get("skip", ["0"])[0])
                take = int(query.get("take", ["10"])[0])
                if skip < 0 or not 0 < take <= 1000:
                    raise ValueError("skip must be >= 0 and take 1..1000")
                results = [t.as_json() for t in store.list(skip, take)]
                return _json(
                    200,
                    {
                        "results": results,
                        "totalCount": store.count(),
                        "offset": skip,
                        "pageSize": take,
                    },
                )
            if method == "POST":
                new_name = body.get("name")
                if not isinstance(new_name, str):
                    raise ValueError("name is required")
                if store.get(new_name) is not None:
                    return _error(409, f"tenant {new_name} exists already")
                tenant = store.add(_apply(Tenant(new_name), body))
                dialect.forget_tenant(tenant.name)
                return _json(201, tenant.as_json())
            return HttpResponse(405, b"method not allowed", headers=(("Allow", "GET, POST"),))
        existing = store.get(name)
        if existing is None:
            return _error(404, f"no tenant {name}")
        if method in ("GET", "HEAD"):
            return _json(200, existing.as_json())
        if method == "PUT":
            store.update(_apply(existing, body))
            dialect.forget_tenant(name)
            return HttpResponse(204)
        if method == "DELETE":
            store.remove(name)
            dialect.forget_tenant(name)
            return HttpResponse(204)
        return HttpResponse(405, b"method not allowed", headers=(("Allow", "GET, PUT, DELETE"),))
    except (ValueError, ConfigError) as err:
        return _error(400, str(err))
