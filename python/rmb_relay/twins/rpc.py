"""One websocket JSON-RPC 2.0 connection to one substrate node: requests matched to answers
by id, and subscriptions (new heads, extrinsic status) as async streams.

Why our own: the public Python substrate client is synchronous (a thread per connection
would be the only way to use it from asyncio), and we need few methods. The websocket is the
project's client (`sdk/websocket.py`), so a read is one call into the Rust codec.

Anything a node sends that is not JSON-RPC (not JSON, not an object, an answer to no request)
breaks this connection: every pending request fails with a `NodeError` saying what came, and
the owner (`substrate.SubstrateClient`) fails over to the next node. A JSON-RPC error answer
fails only its request, as an `RpcError` carrying the node's code and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections import deque
from typing import Any

from rmb_relay._core import WsMessage
from rmb_relay.errors import ConnectionClosed, HandshakeError, NodeError
from rmb_relay.sdk.websocket import WebSocketClient

__all__ = ["RpcConnection", "RpcError", "Subscription"]

log = logging.getLogger("rmb_relay.twins.rpc")

#: largest JSON-RPC message accepted: tfchain's metadata (the largest answer) is about 170 KB hex
MAX_MESSAGE = 16 << 20
#: notifications kept for a subscription nobody has claimed yet (they can overtake the
#: subscribe answer's consumer), and queued for a slow consumer; more means it is not reading
MAX_QUEUED = 1024


class RpcError(NodeError):
    """The node answered a request with a JSON-RPC error object."""

    def __init__(self, method: str, code: object, message: object, data: object = None) -> None:
        # substrate puts the reason in `data` ("Invalid Transaction" / "bad signature")
        detail = f"{message}: {data}" if data is not None else str(message)
        super().__init__(f"{method}: node error {code}: {detail}")
        self.code = code if isinstance(code, int) else None
        self.message = detail


_END = object()


class Subscription:
    """Notifications of one subscription, in order; `next()` raises NodeError once the
    connection is gone (so a consumer notices a dead node without its own timer)."""

    def __init__(self, connection: RpcConnection, sub_id: str, unsubscribe: str | None) -> None:
        self.connection = connection
        self.id = sub_id
        self._unsubscribe = unsubscribe
        self._queue: deque[object] = deque()
        self._ready = asyncio.Event()

    def _push(self, item: object) -> None:
        if item is not _END and len(self._queue) >= MAX_QUEUED:
            self.connection.fail(f"subscription {self.id} fell {MAX_QUEUED} notifications behind")
            return
        self._queue.append(item)
        self._ready.set()

    async def next(self) -> Any:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        item = self._queue.popleft()
        if item is _END:
            self._queue.appendleft(_END)
            raise NodeError(f"{self.connection.url}: {self.connection.error or 'closed'}")
        return item

    async def close(self, timeout: float) -> None:
        """Unsubscribe (best effort: a node that is gone has forgotten it anyway)."""
        self.connection._subscriptions.pop(self.id, None)
        if self._unsubscribe and self.connection.is_open:
            with contextlib.suppress(NodeError):
                await self.connection.request(self._unsubscribe, [self.id], timeout)


class RpcConnection:
    """See the module docstring. Create with `connect`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._ws: WebSocketClient | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._subscriptions: dict[str, Subscription] = {}
        #: notifications for subscription ids not claimed yet (the answer is still in flight)
        self._early: dict[str, list[object]] = {}
        #: why the connection broke, once it has
        self.error: str | None = None

    @classmethod
    async def connect(cls, url: str, timeout: float) -> RpcConnection:
        """Open the websocket; NodeError when the node cannot be reached in `timeout`."""
        connection = cls(url)
        try:
            connection._ws = await WebSocketClient.connect(
                url, max_message=MAX_MESSAGE, on_message=connection._on_message, timeout=timeout
            )
        except TimeoutError:
            raise NodeError(f"{url}: no websocket within {timeout:g} s") from None
        except (OSError, HandshakeError, ConnectionClosed, ValueError) as err:
            raise NodeError(f"{url}: cannot connect: {err}") from None
        connection._ws.closed.add_done_callback(lambda _: connection.fail("connection closed"))
        return connection

    @property
    def is_open(self) -> bool:
        return self.error is None and self._ws is not None and self._ws.is_open

    async def request(self, method: str, params: list[Any], timeout: float) -> Any:
        """The `result` of one call; NodeError when the node fails or does not answer in time,
        RpcError when it answers with an error."""
        if self.error is not None or self._ws is None:
            raise NodeError(f"{self.url}: {self.error or 'not connected'}")
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (method, future)
        message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        try:
            self._ws.send_text(json.dumps(message, separators=(",", ":")))
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise NodeError(f"{self.url}: no answer to {method} within {timeout:g} s") from None
        except ConnectionClosed:
            raise NodeError(f"{self.url}: connection closed") from None
        finally:
            self._pending.pop(request_id, None)

    async def subscribe(
        self, method: str, params: list[Any], unsubscribe: str | None, timeout: float
    ) -> Subscription:
        sub_id = await self.request(method, params, timeout)
        if not isinstance(sub_id, str | int) or isinstance(sub_id, bool):
            self.fail(f"{method} answered {type(sub_id).__name__}, not a subscription id")
            raise NodeError(f"{self.url}: {self.error}")
        subscription = Subscription(self, str(sub_id), unsubscribe)
        self._subscriptions[subscription.id] = subscription
        for item in self._early.pop(subscription.id, []):
            subscription._push(item)
        if self.error is not None:
            subscription._push(_END)
        return subscription

    def _on_message(self, message: WsMessage) -> None:
        try:
            data = json.loads(message.data)
        except (ValueError, UnicodeDecodeError):
            self.fail(f"sent something that is not JSON: {bytes(message.data[:60])!r}")
            return
        if not isinstance(data, dict):
            self.fail(f"sent JSON that is not a JSON-RPC object: {type(data).__name__}")
            return
        if "id" in data and data["id"] is not None:
            self._on_answer(data)
        elif data.get("method") and isinstance(data.get("params"), dict):
            params = data["params"]
            sub_id = str(params.get("subscription"))
            subscription = self._subscriptions.get(sub_id)
            if subscription is not None:
                subscription._push(params.get("result"))
            elif sub_id in self._early or len(self._early) < MAX_QUEUED:
                early = self._early.setdefault(sub_id, [])
                if len(early) < MAX_QUEUED:
                    early.append(params.get("result"))
            else:
                self.fail(f"sent notifications for over {MAX_QUEUED} unknown subscriptions")
        else:
            self.fail("sent a JSON object that is neither an answer nor a notification")

    def _on_answer(self, data: dict[str, Any]) -> None:
        entry = self._pending.get(data["id"]) if isinstance(data["id"], int) else None
        if entry is None:
            # an answer to a request that timed out is normal; one with an id we never used
            # is not, but is harmless: ignore both
            return
        method, future = entry
        if future.done():
            return
        error = data.get("error")
        if error is not None:
            if isinstance(error, dict):
                future.set_exception(
                    RpcError(method, error.get("code"), error.get("message"), error.get("data"))
                )
            else:
                future.set_exception(RpcError(method, None, error))
        elif "result" in data:
            future.set_result(data["result"])
        else:
            self.fail(f"answered {method} with neither result nor error")

    def fail(self, reason: str) -> None:
        """Break the connection: pending requests and subscriptions get NodeError(reason)."""
        if self.error is not None:
            return
        self.error = reason
        log.warning("substrate node %s: %s", self.url, reason)
        for method, future in self._pending.values():
            if not future.done():
                future.set_exception(NodeError(f"{self.url}: {reason} (during {method})"))
        for subscription in self._subscriptions.values():
            subscription._push(_END)
        if self._ws is not None:
            self._ws.abort()

    async def close(self) -> None:
        if self.error is None:
            self.error = "closed by us"
            for _, future in self._pending.values():
                if not future.done():
                    future.set_exception(NodeError(f"{self.url}: closed"))
            for subscription in self._subscriptions.values():
                subscription._push(_END)
        if self._ws is not None:
            await self._ws.close(timeout=1.0)
