"""Who a connection is, in each dialect's own terms: an RMB twin and session id, an SBD public
key, a 신경 application and client, a tunnel connector's tenant and connection id.

Read from the connection's handler when asked (nothing is kept per connection for it), and
shaped two ways: fields for the JSON listing and one short text (`who`) to filter by and to
show in `rmb-relay top`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rmb_relay.dialects.rmb.session import RmbSession
from rmb_relay.dialects.sbd.session import SbdSession
from rmb_relay.dialects.singyeong.session import SgSession
from rmb_relay.dialects.tunnel.hub import ConnectorSession
from rmb_relay.server.ws_connection import WebSocketConnection

if TYPE_CHECKING:
    from rmb_relay.server.http_connection import HttpConnection

Identity = dict[str, str | int | None]


def identity_of(conn: HttpConnection | WebSocketConnection) -> Identity:
    """The identity fields of a connection ({} before its dialect knows who it is)."""
    if not isinstance(conn, WebSocketConnection):
        return {}
    handler = conn.handler
    if isinstance(handler, RmbSession):
        return {"twin": handler.twin, "sid": handler.sid}
    if isinstance(handler, SbdSession):
        return {"key": handler.key_text}
    if isinstance(handler, SgSession):
        client = handler.client
        if client is None:
            return {}
        return {"app": client.app_id, "client": client.client_id}
    if isinstance(handler, ConnectorSession):
        return {"tenant": handler.tenant_name, "connector": handler.connection_id}
    return {}


def who(identity: Identity) -> str:
    """One short text of an identity: `twin 7:sid`, `key AbC...`, `app/client`,
    `tenant/connector`, or "" when unknown."""
    if "twin" in identity:
        sid = identity.get("sid")
        return f"twin {identity['twin']}" + (f":{sid}" if sid else "")
    if "key" in identity:
        return f"key {identity['key']}"
    if "app" in identity:
        return f"{identity['app']}/{identity['client']}"
    if "tenant" in identity:
        return f"{identity['tenant']}/{identity['connector']}"
    return ""
