"""The tunnel's plain HTTP endpoints besides the client side (spec §6, decisions 3, 5, 6):

| route | auth | what |
|---|---|---|
| `GET /.well-known/relayserver-configuration` | none | endpoints, timings |
| `POST /tunnel/token` | client credentials (form) | a JWT for `scope` connector, client |
| `GET /tunnel/body/request/{id}[?delete=true]` | tenant token | an outsourced request body |
| `POST /tunnel/body/response/{id}` | tenant token | stores a response body; its length |
| `POST /tunnel/acknowledge/{origin}/{id}/{token}` | URL token | manual acknowledgement, 204 |

Token errors follow RFC 6749 §5.2 (`invalid_request`, `invalid_client`, ...) as JSON.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from rmb_relay import __version__
from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.tunnel.tenants import verify_secret
from rmb_relay.dialects.tunnel.tokens import CLIENT_SCOPE, CONNECTOR_SCOPE, ROLES, bearer
from rmb_relay.errors import AuthError, BodyTooLarge, HttpReject

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.base import HttpClient, RequestBody
    from rmb_relay.dialects.tunnel.host import TunnelHost

log = logging.getLogger("rmb_relay.tunnel")

#: a token request is a short form
TOKEN_BODY_MAX = 4096
JSON = "application/json"


def _json(status: int, value: object) -> HttpResponse:
    return HttpResponse(status, json.dumps(value).encode(), content_type=JSON)


def _token_error(status: int, error: str, description: str) -> HttpResponse:
    return _json(status, {"error": error, "error_description": description})


def _throttled(reject: HttpReject) -> HttpResponse:
    """A throttle's 429/503 as a token error (RFC 6749 §5.2 shape), with its Retry-After."""
    body = {"error": "temporarily_unavailable", "error_description": reject.reason}
    return HttpResponse(
        reject.status, json.dumps(body).encode(), content_type=JSON, headers=reject.headers
    )


async def discovery(dialect: TunnelHost, request: HttpRequest) -> HttpResponse:
    base = ""
    host = request.header("host")
    if host is not None:
        base = f"http://{host.decode('latin-1')}"
    s = dialect.settings
    return _json(
        200,
        {
            "serverVersion": __version__,
            "authorizationServer": s.oidc_issuer or f"{base}/tunnel",
            "authorizationTokenEndpoint": f"{base}/tunnel/token",
            "connectorEndpoint": f"{base}/tunnel/connector",
            "acknowledgeEndpoint": f"{base}/tunnel/acknowledge",
            "requestEndpoint": f"{base}/tunnel/body/request",
            "responseEndpoint": f"{base}/tunnel/body/response",
            "endpointTimeout": s.response_timeout,
            "requestTtl": s.request_ttl,
            "binarySizeThreshold": s.inline_limit,
            "keepAliveInterval": s.keep_alive,
            "reconnectMinimumDelay": s.reconnect_min,
            "reconnectMaximumDelay": s.reconnect_max,
        },
    )


async def token(dialect: TunnelHost, request: HttpRequest, client: HttpClient) -> HttpResponse:
    """Client credentials grant (RFC 6749 §4.4), form-encoded as RelayServer's connector sends.

    The secret's scrypt runs in the process's bounded auth pool, not on the loop (503 with
    Retry-After when it is full), and failed attempts are limited per client address and per
    tenant (429 with Retry-After, before any hashing): throttle.py."""
    content_type = (request.header("content-type") or b"").decode("latin-1").lower()
    if not content_type.startswith("application/x-www-form-urlencoded"):
        return _token_error(
            400, "invalid_request", "send an application/x-www-form-urlencoded form"
        )
    if len(request.body) > TOKEN_BODY_MAX:
        return _token_error(400, "invalid_request", "form too large")
    try:
        form = {k: v[0] for k, v in parse_qs(request.body.decode(), strict_parsing=True).items()}
    except (ValueError, UnicodeDecodeError):
        return _token_error(400, "invalid_request", "malformed form")
    if form.get("grant_type") != "client_credentials":
        return _token_error(400, "unsupported_grant_type", "only client_credentials is supported")
    # a connector's and a client's tokens are distinct: each asks for its scope (a connector
    # that names none is asking for its own, as RelayServer's connector does)
    scopes = form.get("scope", CONNECTOR_SCOPE).split()
    if not scopes or any(scope not in ROLES for scope in scopes):
        return _token_error(
            400, "invalid_scope", f"the scope must be {CONNECTOR_SCOPE!r} and/or {CLIENT_SCOPE!r}"
        )
    scope = " ".join(dict.fromkeys(scopes))
    client_id, secret = form.get("client_id", ""), form.get("client_secret", "")
    throttles = dialect.throttles
    try:
        charged = throttles.check("tunnel", client.peer_host, "tenant:" + client_id.upper())
    except HttpReject as err:
        return _throttled(err)
    tenant = dialect.store_of_tenants.get(client_id) if client_id else None
    if tenant is None or not tenant.secret_hash:
        dialect.hub.auth_failures.inc(1, "credentials")
        return _token_error(401, "invalid_client", "unknown tenant or wrong secret")
    try:
        verified = await throttles.run("tunnel", verify_secret, secret, tenant.secret_hash)
    except HttpReject as err:  # the pool is full: this attempt was not made
        throttles.refund(charged)
        return _throttled(err)
    if not verified:
        dialect.hub.auth_failures.inc(1, "credentials")
        return _token_error(401, "invalid_client", "unknown tenant or wrong secret")
    throttles.refund(charged)
    issued = dialect.tokens.issue(tenant.name, scope)
    return _json(
        200,
        {
            "access_token": issued,
            "token_type": "Bearer",
            "expires_in": dialect.tokens.ttl,
            "scope": scope,
        },
    )


async def _named(dialect: TunnelHost, request: HttpRequest, prefix: str) -> tuple[str, str]:
    """(the request id the path names, the tenant key of the caller's connector token)."""
    token = bearer(request.header("authorization"))
    if token is None:
        raise HttpReject(401, "a connector bearer token is required")
    try:
        tenant = (await dialect.tokens.verify(token, CONNECTOR_SCOPE)).upper()
    except AuthError as err:
        dialect.hub.auth_failures.inc(1, "token")
        raise HttpReject(401, str(err)) from None
    request_id = request.path[len(prefix) :]
    try:
        uuid.UUID(request_id)
    except ValueError:
        raise HttpReject(400, f"not a request id: {request_id!r}") from None
    return str(uuid.UUID(request_id)), tenant


async def request_body(dialect: TunnelHost, request: HttpRequest) -> HttpResponse:
    request_id, tenant = await _named(dialect, request, "/tunnel/body/request/")
    found = dialect.hub.core.request_body(request_id, tenant)
    if found is None:
        raise HttpReject(404, "unknown request id, or it has no stored body")
    name, acked = found
    if not dialect.store.exists(name):
        raise HttpReject(404, "this request has no stored body")
    query = parse_qs(request.query or "")
    remove = query.get("delete", ["false"])[0].lower() == "true" and acked
    if remove:
        dialect.hub.core.body_fetched(request_id)
    return HttpResponse(
        200,
        content_type="application/octet-stream",
        stream=dialect.store.read(name, remove=remove),
        length=dialect.store.size(name),
    )


async def response_body(
    dialect: TunnelHost, request: HttpRequest, body: RequestBody, client: HttpClient
) -> HttpResponse:
    request_id, tenant = await _named(dialect, request, "/tunnel/body/response/")
    if dialect.hub.core.tenant_of(request_id) != tenant:
        raise HttpReject(404, "unknown request id")
    store = dialect.store
    if request.content_length is not None:
        try:
            store.refuse_size(request.content_length)
        except BodyTooLarge as err:
            raise HttpReject(413, str(err)) from None
    name = store.name("res", request_id)
    try:
        size = await store.write(name, body, owner=tenant)
    except BodyTooLarge as err:
        raise HttpReject(413, str(err)) from None
    return HttpResponse(200, str(size).encode())


async def acknowledge(dialect: TunnelHost, request: HttpRequest) -> HttpResponse:
    parts = request.path.split("/")
    # ['', 'tunnel', 'acknowledge', origin, request id, token]
    if len(parts) != 6 or parts[3] != dialect.hub.origin_id:
        return HttpResponse(404, b"unknown acknowledgement\n")
    if not dialect.hub.manual_acknowledge(parts[4], parts[5]):
        return HttpResponse(404, b"unknown acknowledgement\n")
    return HttpResponse(204)
