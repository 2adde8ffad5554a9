"""What the tunnel's request paths (client.py, endpoints.py, management.py, scaleout.py) use
of the dialect: a Protocol that dialect.py's `TunnelDialect` satisfies, so that those modules
name the dialect without importing it (dialect.py imports them: no cycle, tests/test_layers.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio

    from rmb_relay.dialects.tunnel.bodystore import FileBodyStore
    from rmb_relay.dialects.tunnel.hub import Hub
    from rmb_relay.dialects.tunnel.settings import TunnelSettings
    from rmb_relay.dialects.tunnel.tenants import TenantStore
    from rmb_relay.dialects.tunnel.tokens import TokenAuthority
    from rmb_relay.throttle import Throttles, UploadRate


class TunnelHost(Protocol):
    """The relay's tunnel: its hub, body store, tenant directory, token authority and
    throttles, and the operations that reach beyond this relay."""

    settings: TunnelSettings
    hub: Hub
    store: FileBodyStore
    store_of_tenants: TenantStore
    tokens: TokenAuthority
    throttles: Throttles
    upload_rate: UploadRate

    def load_tenant(self, name: str) -> None: ...

    def tenant_name(self, name: str, *, load: bool = False) -> str | None: ...

    def forget_tenant(self, name: str) -> None: ...

    async def reachable(self, key: str) -> bool: ...

    async def publish(
        self, request_id: str, message: bytes, pickup: int, body: bytes | tuple[str, int] | None
    ) -> None: ...

    def verdict(self, request_id: str) -> asyncio.Future[bool | None]: ...
