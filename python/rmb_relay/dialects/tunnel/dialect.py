"""The HTTP tunnel dialect on the shared listener: connector websockets at `GET
/tunnel/connector`, the client routes of `client.py` (and the hub's fast path, which takes
most client requests from the read before any route runs), and the plain routes of
`endpoints.py` and `management.py`.

A connector authenticates with a bearer token (header, or `access_token` in the query as
SignalR clients send it) whose tenant exists; `?protocol=msgpack` switches its messages to
msgpack. Everything about requests is the hub's (hub.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from rmb_relay.clock import Clock, monotonic_clock, wall_clock
from rmb_relay.contract import CloseCode
from rmb_relay.dialects.base import Dialect, HttpResponse, Peer, Routes, WebSocketHandler
from rmb_relay.dialects.tunnel import client, endpoints, management
from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
from rmb_relay.dialects.tunnel.hub import ConnectorSession, Hub
from rmb_relay.dialects.tunnel.scaleout import RedisBridge
from rmb_relay.dialects.tunnel.settings import CONNECTOR_MAX_MESSAGE, TunnelSettings
from rmb_relay.dialects.tunnel.tenants import TenantStore, normalize
from rmb_relay.dialects.tunnel.tokens import (
    CONNECTOR_SCOPE,
    OidcVerifier,
    TokenAuthority,
    bearer,
    fingerprint,
)
from rmb_relay.errors import AuthError, ClusterUnavailable, HttpReject
from rmb_relay.throttle import Throttles, UploadRate

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest, Outboxes
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.base import HttpClient, RequestBody
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.telemetry.records import Channel

log = logging.getLogger("rmb_relay.tunnel")

#: every method a client may tunnel (HEAD is registered on its own so it is relayed as HEAD)
METHODS = ("HEAD", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


class TunnelDialect(Dialect):
    name = "tunnel"
    paths = ("/tunnel/connector",)
    max_message = CONNECTOR_MAX_MESSAGE

    def __init__(
        self,
        settings: TunnelSettings,
        tenants: TenantStore,
        registry: Registry,
        outboxes: Outboxes,
        *,
        cluster: Cluster | None = None,
        clock: Clock = monotonic_clock,
        wall: Clock = wall_clock,
        throttles: Throttles | None = None,
    ) -> None:
        """`cluster`: share requests with the other relays in it (scaleout.py); None (no
        `--redis`, or `--no-cluster`): this relay serves its own connectors only.
        `throttles`: the process's auth pool and failed-login limiter (throttle.py)."""
        self.throttles = throttles if throttles is not None else Throttles(registry, clock=clock)
        self.settings = settings
        self.registry = registry
        self.store_of_tenants = tenants
        self.clock = clock
        max_age = settings.body_max_age
        self.store = FileBodyStore(
            settings.body_store,
            max_age=max_age,
            clock=clock,
            max_body=settings.max_body,
            tenant_bytes=settings.tenant_disk,
            total_bytes=settings.total_disk,
        )
        self.store.sweep_leftovers(wall() / 1e9, max_age)  # (file times are wall-clock)
        self.upload_rate = UploadRate(
            registry,
            settings.upload_rate_per_ip,
            settings.upload_rate_per_tenant,
            ipv6_prefix=self.throttles.settings.ipv6_prefix,
            clock=clock,
        )
        self.hub = hub = Hub(
            settings,
            self.store,
            registry,
            outboxes,
            instance=cluster.me if cluster is not None else "",
            clustered=cluster is not None,
            clock=clock,
            wall=wall,
        )
        #: the hub serves whole client requests from the read (the listener asks for this)
        self.http_fast_path = hub
        #: the connectors' reads carry the hub's clock into its scanner
        self.scan_clock = clock
        oidc = None
        if settings.oidc_issuer is not None and settings.oidc_audience is not None:
            oidc = OidcVerifier(settings.oidc_issuer, settings.oidc_audience)
        self.tokens = TokenAuthority(
            tenants.signing_key(),
            ttl=settings.token_ttl,
            clock=wall,
            oidc=oidc,
            cache=hub.core,
            secret_of=self.secret_of,
        )
        self.bridge: RedisBridge | None = None
        if cluster is not None:
            self.bridge = RedisBridge(
                cluster,
                self,
                request_ttl=settings.request_ttl,
                response_timeout=settings.response_timeout,
                answers_held_bytes=settings.answers_held_bytes,
            )
        self._sweeper: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False

    def open_surfaces(self) -> list[str]:
        """Tenants a client reaches without a token, and the management API (harden)."""
        surfaces = []
        open_tenants = [
            t.name for t in self.store_of_tenants.list() if not t.require_authentication
        ]
        if open_tenants:
            shown = ", ".join(open_tenants[:10]) + (" ..." if len(open_tenants) > 10 else "")
            surfaces.append(f"{len(open_tenants)} tenant(s) without required auth ({shown})")
        if self.settings.management_key is not None:
            surfaces.append("management API /management/tenants (Api-Key)")
        return surfaces

    def record_into(self, channel: Channel) -> None:
        """Route records (`--records`)."""
        self.hub.record_into(channel)

    # ---- tenants: the directory fills the hub's cache ---------------------------------------

    def load_tenant(self, name: str) -> None:
        """The directory's answer for `name`, into the hub (what it asked for)."""
        tenant = self.store_of_tenants.get(name)
        settings = None
        if tenant is not None:
            settings = (
                tenant.name,
                tenant.require_authentication,
                tenant.max_concurrent,
                tenant.ack_mode,
                tenant.forward_authorization,
            )
        self.hub.core.set_tenant(normalize(name), settings, self.clock())

    def secret_of(self, name: str) -> str | None:
        """What an embedded token of tenant `name` carries of its secret (`fingerprint`); None
        when there is no such tenant or it has no secret."""
        tenant = self.store_of_tenants.get(name)
        return fingerprint(tenant.secret_hash) if tenant is not None else None

    def tenant_name(self, name: str, *, load: bool = False) -> str | None:
        """The stored name of tenant `name`, or None when there is none (`load`: ask the
        directory when the hub has no fresh answer; else None then too)."""
        core = self.hub.core
        cached = core.cached(normalize(name), self.clock())
        if cached is None and load:
            self.load_tenant(name)
            cached = core.cached(normalize(name), self.clock())
        return cached if cached is not None else None

    def forget_tenant(self, name: str) -> None:
        """The tenant changed (management API): the hub asks the directory again, its tokens'
        verdicts go, and its connectors are checked against what it is now."""
        key = normalize(name)
        self.hub.core.forget_tenant(key)
        self.hub.core.forget_tokens(key)
        self.revisit_connectors({key})

    def revisit_connectors(self, keys: set[str] | None = None) -> int:
        """Close the connectors (of the tenants `keys`, or all) whose tenant was removed or
        re-keyed since they attached: a connector stays only as long as the credentials it
        came with. Returns how many were closed. Runs when this relay changes a tenant, and
        every tenant cache lifetime (10 s) for changes made elsewhere (another relay on the
        same file, `rmb-relay tenants`)."""
        closed = 0
        now: dict[str, tuple[bool, str | None]] = {}
        for session in list(self.hub.sessions.values()):
            if session.revoked or (keys is not None and session.tenant not in keys):
                continue
            if session.tenant not in now:
                tenant = self.store_of_tenants.get(session.tenant_name)
                secret = fingerprint(tenant.secret_hash) if tenant is not None else None
                now[session.tenant] = (tenant is not None, secret)
            exists, secret = now[session.tenant]
            if exists and secret == session.secret:
                continue
            why = "tenant removed" if not exists else "tenant secret changed"
            log.info(
                "connector %s of %s closed: %s", session.connection_id, session.tenant_name, why
            )
            self.hub.core.forget_tokens(session.tenant)
            session.revoked = True
            session.peer.close(CloseCode.POLICY, why)
            closed += 1
        if closed:
            self.hub.revoked.inc(closed)
        return closed

    # ---- several relays ---------------------------------------------------------------------

    async def reachable(self, key: str) -> bool:
        """A connector of the tenant is connected here or, with Redis, to another relay."""
        if self.hub.core.has_connector(key):
            return True
        if self.bridge is None:
            return False
        try:
            return await self.bridge.reachable(key)
        except ClusterUnavailable as err:  # the client gets 503, as for no connector
            log.warning("tunnel: cannot ask the other relays about %s: %s", key, err)
            return False

    async def publish(
        self, request_id: str, message: bytes, pickup: int, body: bytes | tuple[str, int] | None
    ) -> None:
        """Hand a request to whichever relay holds a connector of its tenant. Raises
        ClusterUnavailable (not accepted) or WriteUncertain (it may still land)."""
        if self.bridge is None:
            raise ClusterUnavailable("this relay has no cluster")
        stored = body[0] if isinstance(body, tuple) else None
        await self.bridge.publish(request_id, message, pickup, stored)

    def verdict(self, request_id: str) -> asyncio.Future[bool | None]:
        """The verdict on withdrawing a request whose publish failed (scaleout.py)."""
        assert self.bridge is not None, "only a published request is withdrawn"
        return self.bridge.verdict(request_id)

    # ---- connectors ------------------------------------------------------------------------

    async def accept(self, request: HttpRequest, peer: Peer) -> WebSocketHandler:
        query = parse_qs(request.query or "")
        token = bearer(request.header("authorization"))
        if token is None and "access_token" in query:
            token = query["access_token"][0]
        if token is None:
            self.hub.auth_failures.inc(1, "token")
            raise HttpReject(401, "a bearer token is required", (("WWW-Authenticate", "Bearer"),))
        try:
            claim = await self.tokens.verify(token, CONNECTOR_SCOPE)
        except AuthError as err:
            self.hub.auth_failures.inc(1, "token")
            raise HttpReject(401, str(err), (("WWW-Authenticate", "Bearer"),)) from None
        name = self.tenant_name(claim, load=True)
        if name is None:
            raise HttpReject(403, f"tenant {claim} does not exist on this relay")
        protocol = query.get("protocol", ["json"])[0].lower()
        if protocol not in ("json", "msgpack"):
            raise HttpReject(400, "protocol must be json or msgpack")
        self.start_sweeper()
        binary = protocol == "msgpack"
        session = ConnectorSession(peer, self.hub, normalize(name), name, binary)
        session.secret = self.secret_of(name)
        if self.bridge is not None:
            session.on_joined = self.bridge.connector_joined
            session.on_left = self.bridge.connector_left
        return session

    # ---- routes ----------------------------------------------------------------------------

    def add_routes(self, router: Routes) -> None:
        for mode in client.MODES:
            for method in METHODS:
                router.add_streaming(method, f"/{mode}/*", self._client)
        router.add("GET", "/.well-known/relayserver-configuration", self._discovery)
        router.add("POST", "/tunnel/token", self._token)
        router.add("GET", "/tunnel/body/request/*", self._request_body)
        router.add_streaming("POST", "/tunnel/body/response/*", self._response_body)
        router.add("POST", "/tunnel/acknowledge/*", self._acknowledge)
        for method in ("GET", "POST", "PUT", "DELETE"):
            router.add(method, "/management/tenants", self._management)
            router.add(method, "/management/tenants/*", self._management)

    async def _client(
        self, request: HttpRequest, body: RequestBody, client_: HttpClient
    ) -> HttpResponse:
        self.start_sweeper()
        return await client.handle(self, request, body, client_)

    async def _discovery(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await endpoints.discovery(self, request)

    async def _token(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await endpoints.token(self, request, client_)

    async def _request_body(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await endpoints.request_body(self, request)

    async def _response_body(
        self, request: HttpRequest, body: RequestBody, client_: HttpClient
    ) -> HttpResponse:
        return await endpoints.response_body(self, request, body, client_)

    async def _acknowledge(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await endpoints.acknowledge(self, request)

    async def _management(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await management.handle(self, request)

    # ---- housekeeping ----------------------------------------------------------------------

    def start_sweeper(self) -> None:
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep_forever())
            self._watcher = loop.create_task(self._watch_tenants())

    async def _watch_tenants(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tenant_cache_ttl)
            self.revisit_connectors()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.body_sweep)
            self.sweep()

    def sweep(self, now: int | None = None) -> int:
        """Remove orphaned body files (those of live jobs are kept)."""
        removed = self.store.sweep(now, keep=set(self.hub.core.stored_bodies()))
        if removed:
            self.hub.swept.inc(removed)
        return removed

    async def close(self) -> None:
        """Once (the listener and a test may both call it)."""
        if self._closed:
            return
        self._closed = True
        for task in (self._sweeper, self._watcher):
            if task is not None:
                task.cancel()
        if self.bridge is not None:
            await self.bridge.close()
        self.hub.close()
        self.store_of_tenants.close()
