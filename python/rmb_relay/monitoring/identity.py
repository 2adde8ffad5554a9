"""Who a connection is, in each dialect's own terms: an RMB twin and session id, an SBD public
key, a 신경 application and client, a tunnel connector's tenant and connection id.

Read from the connection's handler when asked (nothing is kept per connection for it), and
shaped two ways: fields for the JSON listing and one short text (`who`) to filter by and to
show in `rmb-relay top`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rmb_relay.dialects.rmb.session import RmbSession
from rmb_relay.dialects.sbd.session import SbdSession
from rmb_relay.dialects.singyeong.session import SgSession
from rmb_relay.dialects.tunnel.hub import ConnectorSession
from rmb_relay.server.ws_connection import WebSocketConnection

if TYPE_CHECKING:
    from rmb_relay.server.http_connection import HttpConnection

Identity = dict[str, str | int | None]


def _rmb(handler: RmbSession) -> Identity:
    return {"twin": handler.twin, "sid": handler.sid}


def _sbd(handler: SbdSession) -> Identity:
    return {"key": handler.key_text}


def _sg(handler: SgSession) -> Identity:
    client = handler.client
    return {} if client is None else {"app": client.app_id, "client": client.client_id}


def _connector(handler: ConnectorSession) -> Identity:
    return {"tenant": handler.tenant_name, "connector": handler.connection_id}


#: by the handler's exact class: a dict lookup, where an isinstance chain over these (abstract)
#: classes cost ~8 us a connection (a listing computes it for every one to sort by `who`)
_READERS: dict[type, Callable[[Any], Identity]] = {
    RmbSession: _rmb,
    SbdSession: _sbd,
    SgSession: _sg,
    ConnectorSession: _connector,
}


def identity_of(conn: HttpConnection | WebSocketConnection) -> Identity:
    """The identity fields of a connection ({} before its dialect knows who it is)."""
    if not isinstance(conn, WebSocketConnection):
        return {}
    handler = conn.handler
    read = _READERS.get(type(handler))
    if read is None:
        # a subclass (or no handler yet): looked up the slow way
        read = next((r for k, r in _READERS.items() if isinstance(handler, k)), None)
        if read is None:
            return {}
    return read(handler)


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
