"""The HTTP tunnel dialect on the shared listener: connector websockets at `GET
/tunnel/connector`, and the plain routes of `client.py`, `endpoints.py` and `management.py`.

A connector authenticates with a bearer token (header, or `access_token` in the query as
SignalR clients send it) whose tenant exists; `?protocol=msgpack` switches its messages to
msgpack. Everything else about requests lives in `hub.py`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Hashable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from rmb_relay.budget import ByteBudget
from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.dialects.base import Dialect, HttpResponse, Peer, Routes, WebSocketHandler
from rmb_relay.dialects.tunnel import client, endpoints, express, management
from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
from rmb_relay.dialects.tunnel.hub import ConnectorSession, Hub, Job
from rmb_relay.dialects.tunnel.metrics import TunnelMetrics
from rmb_relay.dialects.tunnel.native import NativeExpress
from rmb_relay.dialects.tunnel.scaleout import RedisBridge
from rmb_relay.dialects.tunnel.settings import CONNECTOR_MAX_MESSAGE, TunnelSettings
from rmb_relay.dialects.tunnel.tenants import Tenant, TenantStore, normalize
from rmb_relay.dialects.tunnel.tokens import OidcVerifier, TokenAuthority, bearer
from rmb_relay.dialects.tunnel.wire import TenantConfig
from rmb_relay.errors import AuthError, ClusterUnavailable, HttpReject

if TYPE_CHECKING:
    from collections.abc import Callable

    from rmb_relay._core import HttpRequest, Outboxes
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.base import ExpressClient, HttpClient, RequestBody
    from rmb_relay.telemetry.metrics import Registry
    from rmb_relay.telemetry.records import Channel

log = logging.getLogger("rmb_relay.tunnel")

#: how often the body store is swept for orphans (seconds)
SWEEP_INTERVAL = 30.0
#: every method a client may tunnel (HEAD is registered on its own so it is relayed as HEAD)
METHODS = ("HEAD", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


class TenantCache:
    """Tenant lookups cached for `ttl` (misses too, as RelayServer), so the per-request cost is
    a dict lookup; the management API forgets an entry when it changes it."""

    def __init__(self, store: TenantStore, ttl: float, clock: Clock = monotonic_clock) -> None:
        self.store = store
        self.ttl = nanos(ttl)
        self.clock = clock
        self._entries: dict[str, tuple[int, Tenant | None]] = {}

    def get(self, name: str, *, fresh: bool = False) -> Tenant | None:
        key = normalize(name)
        now = self.clock()
        entry = self._entries.get(key)
        if entry is not None and not fresh and now - entry[0] < self.ttl:
            return entry[1]
        tenant = self.store.get(name)
        self._entries[key] = (now, tenant)
        return tenant

    def forget(self, name: str) -> None:
        self._entries.pop(normalize(name), None)


class TunnelDialect(Dialect):
    name = "tunnel"
    paths = ("/tunnel/connector",)
    max_message = CONNECTOR_MAX_MESSAGE

    def __init__(
        self,
        settings: TunnelSettings,
        tenants: TenantStore,
        registry: Registry,
        *,
        tokens: TokenAuthority | None = None,
        cluster: Cluster | None = None,
        clock: Clock = monotonic_clock,
        outboxes: Outboxes | None = None,
    ) -> None:
        """`cluster`: share requests with the other relays in it (scaleout.py); None (no
        `--redis`, or `--no-cluster`): this relay serves its own connectors only."""
        self.settings = settings
        self.registry = registry
        self.store_of_tenants = tenants
        self.tenants = TenantCache(tenants, settings.tenant_cache_ttl, clock)
        if tokens is None:
            oidc = None
            if settings.oidc_issuer is not None and settings.oidc_audience is not None:
                oidc = OidcVerifier(settings.oidc_issuer, settings.oidc_audience)
            tokens = TokenAuthority(tenants.signing_key(), ttl=settings.token_ttl, oidc=oidc)
        self.tokens = tokens
        self.ack_mode = settings.ack_mode
        max_age = settings.request_ttl + settings.response_timeout + 60.0
        self.store = FileBodyStore(settings.body_store, max_age=max_age, clock=clock)
        self.store.sweep_leftovers(time.time(), max_age)
        self.metrics = TunnelMetrics(
            registry,
            inflight=lambda: [((t,), self.hub.inflight(t)) for t in self.hub.connectors],
            queued=lambda: [((t,), len(q)) for t, q in self.hub.pending.items()],
            connectors=lambda: [((t,), len(g)) for t, g in self.hub.connectors.items()],
            body_bytes=lambda: [((), self.store.bytes)],
            held_bytes=lambda: [((str(t),), self._held_by(t)) for t in self.hub.budget.holders()],
            refused=lambda: [
                (({"key": "tenant"}.get(k, k),), n)
                for k, n in self.hub.budget.refused.items()
                if k != "count"
            ],
        )
        self.hub = Hub(
            origin_id=str(uuid.uuid4()),
            store=self.store,
            metrics=self.metrics,
            request_ttl=settings.request_ttl,
            balance=settings.balance,
            default_limit=settings.max_concurrent,
            config=TenantConfig(
                keep_alive_interval=settings.keep_alive,
                reconnect_minimum_delay=settings.reconnect_min,
                reconnect_maximum_delay=settings.reconnect_max,
            ),
            clock=clock,
            budget=ByteBudget(key_bytes=settings.tenant_bytes, total_bytes=settings.total_bytes),
        )
        #: the connectors' reads carry the hub's clock into the native table's scanner (the
        #: times of its route records, `--records`)
        self.scan_clock = clock
        self._sweeper: asyncio.Task[None] | None = None
        #: the response deadlines of requests on the express path (express.py)
        self.express_deadlines = express.Deadlines(settings.request_ttl + settings.response_timeout)
        self._closed = False
        #: route records (--records; set by `build`), or None
        self.records: Channel | None = None
        self.bridge: RedisBridge | None = None
        if cluster is not None:
            self.bridge = RedisBridge(
                cluster, self.hub, self.store, request_ttl=settings.request_ttl
            )
            self.hub.on_tenant_joined = self.bridge.tenant_joined
            self.hub.on_tenant_left = self.bridge.tenant_left
        #: the native express table (native.py): with the express path in the Rust core
        #: (`--tunnel-no-native` turns both off) and the switch's outboxes to write into
        self.native: NativeExpress | None = None
        if settings.express and settings.native and outboxes is not None:
            self.native = NativeExpress(self, outboxes)
            self.native_http = self.native
            self.hub.native = self.native
            self.tokens.on_verified = self.native.token_verified

    # ---- where a request goes (scale-out hooks in here) -------------------------------------

    def ack_mode_of(self, tenant: Tenant) -> int:
        """The acknowledge mode the tenant's requests are sent with: its own, else the
        relay's (`--tunnel-ack-mode`)."""
        return tenant.ack_mode if tenant.ack_mode is not None else self.ack_mode

    def serves_locally(self) -> bool:
        """A request with a connector of its tenant here goes straight to it: no Redis, or
        the local shortcut on (the bridge is set after the dialect is built, so this is
        asked, not kept)."""
        return self.bridge is None or self.settings.shortcut

    def _held_by(self, tenant: Hashable) -> int:
        """In-memory bytes of the tenant's requests held here (`rmb_relay_tunnel_held_bytes`):
        the budget's count without the part of the native table's lease no job uses (the
        budget's keys are the hub's tenant keys, strs)."""
        held = self.hub.budget.held_by(tenant)
        native = self.native
        if native is None or not isinstance(tenant, str):
            return held
        return held - native.unused_lease(tenant)

    async def reachable(self, tenant: str) -> bool:
        """A connector of the tenant is connected here or, with Redis, to another relay."""
        if self.hub.has_connector(tenant):
            return True
        if self.bridge is None:
            return False
        try:
            return await self.bridge.reachable(tenant)
        except ClusterUnavailable as err:  # the client gets 503, as for no connector
            log.warning("tunnel: cannot ask the other relays about %s: %s", tenant, err)
            return False

    async def submit(self, job: Job) -> str:
        """Serve the job here when a connector of its tenant is (or no other relay can),
        else hand it to the relays on Redis; returns the route taken (`local`, `cluster`, as
        route records name them). Raises ClusterUnavailable, or BudgetExceeded when this relay
        would keep it and its memory budget is full (nothing is kept then)."""
        self.start_sweeper()
        local = self.hub.has_connector(job.tenant) and self.settings.shortcut
        if self.bridge is None or local:
            self.hub.admit(job)
            self.hub.submit(job)
            return "local"
        await self.bridge.publish(job)
        return "cluster"

    # ---- connectors ------------------------------------------------------------------------

    async def accept(self, request: HttpRequest, peer: Peer) -> WebSocketHandler:
        query = parse_qs(request.query or "")
        token = bearer(request.header("authorization"))
        if token is None and "access_token" in query:
            token = query["access_token"][0]
        if token is None:
            self.metrics.auth_failures.inc(1, "token")
            raise HttpReject(401, "a bearer token is required", (("WWW-Authenticate", "Bearer"),))
        try:
            tenant_name = await self.tokens.verify(token)
        except AuthError as err:
            self.metrics.auth_failures.inc(1, "token")
            raise HttpReject(401, str(err), (("WWW-Authenticate", "Bearer"),)) from None
        tenant = self.tenants.get(tenant_name)
        if tenant is None:
            raise HttpReject(403, f"tenant {tenant_name} does not exist on this relay")
        protocol = query.get("protocol", ["json"])[0].lower()
        if protocol not in ("json", "msgpack"):
            raise HttpReject(400, "protocol must be json or msgpack")
        self.start_sweeper()
        session = ConnectorSession(
            peer, self.hub, tenant.normalized, tenant.name, binary=protocol == "msgpack"
        )
        if self.settings.express and self.settings.native:
            session.native = functools.partial(express.deliver_native, self.hub)
        if self.native is not None:
            session.outboxes = self.native.outboxes
        return session

    # ---- routes ----------------------------------------------------------------------------

    def add_routes(self, router: Routes) -> None:
        for mode in client.MODES:
            for method in METHODS:
                router.add_streaming(
                    method,
                    f"/{mode}/*",
                    self._client,
                    # relay mode's common case skips the task path (express.py)
                    express=self._express if mode == "relay" and self.settings.express else None,
                )
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
        return await client.handle(self, request, body, client_)

    def _express(
        self, request: HttpRequest, body: bytes, client_: ExpressClient
    ) -> Callable[[], None] | None:
        return express.offer(self, request, body, client_, self.settings.native)

    async def _discovery(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await endpoints.discovery(self, request)

    async def _token(self, request: HttpRequest, client_: HttpClient) -> HttpResponse:
        return await endpoints.token(self, request)

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
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            self.sweep()

    def sweep(self, now: int | None = None) -> int:
        """Remove orphaned body files (those of live jobs are kept)."""
        live = {job.body_name for job in self.hub.jobs.values() if job.body_name}
        removed = self.store.sweep(now, keep=live)
        if removed:
            self.metrics.swept.inc(removed)
        return removed

    async def close(self) -> None:
        """Once (the listener and a test may both call it)."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.bridge is not None:
            await self.bridge.close()
        if self.native is not None:
            self.native.close()
        self.hub.close()
        self.express_deadlines.close()
        self.store_of_tenants.close()
