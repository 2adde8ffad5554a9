"""Tunnel tenants and credentials: the tenant store and `rmb-relay tenants`, embedded tokens
and their expiry, OIDC tokens checked against a real JWKS server, the management API."""

from __future__ import annotations

import json
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from rmb_relay.clock import NS
from rmb_relay.dialects.tunnel.tenants import Tenant, TenantStore, hash_secret, verify_secret
from rmb_relay.dialects.tunnel.tenants_cli import main as tenants_main
from rmb_relay.dialects.tunnel.tokens import (
    JWKS_LIFESPAN,
    LEEWAY,
    OidcVerifier,
    TokenAuthority,
)
from rmb_relay.errors import AuthError, ConfigError
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.helpers import serve_app
from tests.tunnel_fixtures import StartTunnel
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)
KEY = "management-key-0123456789"


def test_tenants_share_the_twin_directory_file(tmp_path: Path) -> None:
    path = tmp_path / "relay.sqlite3"
    with SqliteTwinDirectory(path) as twins:
        twins.add(Twin(7, b"\x01" * 32, None, None))
    with TenantStore(path) as store:
        store.add(Tenant("Acme", secret_hash=hash_secret("s")))
        assert store.get("ACME") == store.get("acme")
        assert store.get("acme").name == "Acme"  # type: ignore[union-attr]
        with pytest.raises(ConfigError, match="exists already"):
            store.add(Tenant("ACME"))
        with pytest.raises(ConfigError, match="URL path segment"):
            store.add(Tenant("a/b"))
        key = store.signing_key()
        assert store.signing_key() == key
    with SqliteTwinDirectory(path) as twins:
        assert [t.id for t in twins.list()] == [7]
    with TenantStore(path) as store:
        assert store.signing_key() == key  # kept in the file: every relay on it agrees


def test_secrets_are_stored_hashed() -> None:
    stored = hash_secret("hunter2")
    assert "hunter2" not in stored
    assert verify_secret("hunter2", stored)
    assert not verify_secret("hunter3", stored)
    assert not verify_secret("hunter2", None)
    assert not verify_secret("hunter2", "garbage")
    with pytest.raises(ConfigError):
        hash_secret("")


def test_tenants_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:{tmp_path / 'db.sqlite3'}"
    assert tenants_main(["--twins", url, "add", "acme", "--generate-secret"]) == 0
    secret = capsys.readouterr().out.split("secret: ")[1].strip()
    assert (
        tenants_main(
            [
                "--twins",
                url,
                "set",
                "acme",
                "--max-concurrent",
                "4",
                "--ack-mode",
                "manual",
                "--require-auth",
                "yes",
            ]
        )
        == 0
    )
    assert tenants_main(["--twins", url, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert listed[0]["maximumConcurrentConnectorRequests"] == 4
    assert listed[0]["acknowledgeMode"] == 3
    assert listed[0]["requireAuthentication"] is True
    with TenantStore(tmp_path / "db.sqlite3") as store:
        assert verify_secret(secret, store.get("acme").secret_hash)  # type: ignore[union-attr]
    assert tenants_main(["--twins", url, "add", "ACME"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert tenants_main(["--twins", url, "rm", "acme"]) == 0
    assert tenants_main(["--twins", url, "rm", "acme"]) == 2
    assert tenants_main(["--twins", url, "set", "x", "--max-concurrent", "-1"]) == 2
    assert tenants_main(["--twins", "redis://x", "list"]) == 2


class WallClock:
    def __init__(self) -> None:
        self.now = int(time.time()) * NS

    def __call__(self) -> int:
        return self.now


async def test_embedded_tokens_expire() -> None:
    clock = WallClock()
    tokens = TokenAuthority(b"k" * 32, ttl=60, clock=clock)
    token = tokens.issue("acme")
    assert await tokens.verify(token) == "acme"
    clock.now += (60 + LEEWAY + 1) * NS
    with pytest.raises(AuthError, match="expired"):
        await tokens.verify(token)
    other = TokenAuthority(b"x" * 32, clock=clock).issue("acme")
    with pytest.raises(AuthError, match="refused"):
        await tokens.verify(other)  # signed with another key


async def test_expired_token_is_refused_at_the_connector_socket(start_tunnel: StartTunnel) -> None:
    tunnel = await start_tunnel()
    clock = WallClock()
    clock.now -= 3600 * NS
    old = TokenAuthority(tunnel.store.signing_key(), ttl=60, clock=clock).issue("acme")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(
                tunnel.base + "/tunnel/connector", headers={"Authorization": f"Bearer {old}"}
            )
    assert refused.value.status == 401


async def _jwks_server(stack: AsyncExitStack, public: dict[str, Any]) -> str:
    app = web.Application()
    base: list[str] = []

    async def discovery(request: web.Request) -> web.Response:
        return web.json_response({"issuer": base[0], "jwks_uri": base[0] + "/jwks"})

    async def jwks(request: web.Request) -> web.Response:
        return web.json_response({"keys": [public]})

    app.router.add_get("/.well-known/openid-configuration", discovery)
    app.router.add_get("/jwks", jwks)
    port = await serve_app(stack, app)
    base.append(f"http://127.0.0.1:{port}")
    return base[0]


async def test_oidc_tokens_from_a_jwks_server(start_tunnel: StartTunnel) -> None:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    public.update(kid="k1", use="sig", alg="RS256")
    async with AsyncExitStack() as stack:
        issuer = await _jwks_server(stack, public)
        tunnel = await start_tunnel(oidc_issuer=issuer, oidc_audience="relayserver")
        now = int(time.time())

        def token(**claims: Any) -> str:
            body = {
                "iss": issuer,
                "aud": "relayserver",
                "client_id": "acme",
                "scope": "connector",
                "exp": now + 300,
                **claims,
            }
            return jwt.encode(body, private, algorithm="RS256", headers={"kid": "k1"})

        tokens = tunnel.dialect.tokens
        assert await tokens.verify(token()) == "acme"
        # a long-lived token's verdict is kept no longer than one JWKS lifespan
        long = token(exp=now + 3600)
        assert await tokens.verify(long) == "acme"
        assert tokens.cache is not None
        assert tokens.cache.known_token(long, int(time.time())) == ("acme", 1)  # connector
        assert tokens.cache.known_token(long, int(time.time()) + JWKS_LIFESPAN + 1) is None
        for bad, why in [
            (token(aud="other"), "(?i)audience"),
            (token(scope="profile"), "scope"),
            (token(exp=now - 3600), "expired"),
            (
                jwt.encode(
                    {
                        "iss": issuer,
                        "aud": "relayserver",
                        "client_id": "acme",
                        "scope": "connector",
                        "exp": now + 300,
                    },
                    "s" * 32,
                    algorithm="HS256",
                    headers={"kid": "k1"},
                ),
                "refused",
            ),
        ]:
            with pytest.raises(AuthError, match=why):
                await tokens.verify(bad)
        # a connector holding the provider's token is served
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                tunnel.base + "/tunnel/connector",
                headers={"Authorization": f"Bearer {token()}"},
            ) as ws,
        ):
            assert json.loads(await ws.receive_str(timeout=10))["target"] == "Configure"
    with pytest.raises(ConfigError):
        OidcVerifier("ftp://x", "a")


async def test_management_api(start_tunnel: StartTunnel) -> None:
    off = await start_tunnel()
    async with off.client() as client:
        assert (await client.get("/management/tenants")).status_code == 404
    tunnel = await start_tunnel(management_key=KEY)
    auth = {"Api-Key": KEY}
    async with tunnel.client() as client:
        assert (await client.get("/management/tenants")).status_code == 401
        assert (
            await client.get("/management/tenants", headers={"Api-Key": "wrong" * 5})
        ).status_code == 401
        created = await client.post(
            "/management/tenants",
            headers=auth,
            json={"name": "Beta", "secret": "pw", "maximumConcurrentConnectorRequests": 2},
        )
        assert created.status_code == 201
        assert created.json()["hasSecret"] is True
        again = await client.post("/management/tenants", headers=auth, json={"name": "beta"})
        assert again.status_code == 409
        page = (await client.get("/management/tenants?skip=0&take=10", headers=auth)).json()
        assert page["totalCount"] == 2
        assert [t["name"] for t in page["results"]] == ["acme", "Beta"]
        put = await client.put(
            "/management/tenants/beta", headers=auth, json={"requireAuthentication": True}
        )
        assert put.status_code == 204
        one = (await client.get("/management/tenants/BETA", headers=auth)).json()
        assert one["requireAuthentication"] is True
        # the change applies at once to clients of this relay
        assert (await client.get("/relay/beta/x/y")).status_code == 401
        for body in (b"{", b"[]", b'{"name": 5}', b'{"name": "x", "requireAuthentication": 1}'):
            bad = await client.post("/management/tenants", headers=auth, content=body)
            assert bad.status_code == 400, body
        assert (await client.delete("/management/tenants/beta", headers=auth)).status_code == 204
        assert (await client.delete("/management/tenants/beta", headers=auth)).status_code == 404
        assert (await client.get("/relay/beta/x/y")).status_code == 404
