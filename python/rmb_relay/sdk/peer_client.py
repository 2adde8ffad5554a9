"""`RmbPeerClient`: requests and services through a local rmb-peer, over its Redis msgbus
JSON (spec §5.4-§5.8), for programs that hold no keys themselves.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.errors import (
    BadMessage,
    ClientError,
    RedisUnavailable,
    RequestTimeout,
)
from rmb_relay.sdk.client import DEFAULT_EXPIRATION
from rmb_relay.sdk.msgbus import (
    BLOCK_SECONDS,
    LOCAL_QUEUE,
    REPLY_QUEUE,
    PeerReply,
    PeerRequest,
    command_queue,
    outgoing_response,
    parse_incoming_request,
    parse_incoming_response,
)
from rmb_relay.sdk.resp import RespClient

log = logging.getLogger("rmb_relay.sdk")

#: items taken from a queue at once once the blocking pop has returned
POP_BATCH = 256


#: pause before popping again after Redis failed
POP_RETRY = 0.5


async def _pop(redis: RespClient, queue: bytes) -> list[bytes]:
    """What waits on a queue (oldest first), or [] after BLOCK_SECONDS of nothing: a blocking
    pop pipelined with a non-blocking one, which Redis runs as soon as the first returns, so
    one round trip takes everything queued. A Redis failure is logged and retried: a restart
    of Redis does not end a client or service."""
    try:
        popped, more = await redis.pipeline(
            [(b"BRPOP", queue, BLOCK_SECONDS), (b"RPOP", queue, POP_BATCH)]
        )
        if popped is None:
            return []
    except RedisUnavailable as err:
        log.warning("cannot pop %s: %s", queue.decode(errors="replace"), err)
        await asyncio.sleep(POP_RETRY)
        return []
    return [popped[1], *(more or ())]


PeerHandler = Callable[[PeerRequest], bytes | Awaitable[bytes]]


class RmbPeerClient:
    """Requests and services through a local rmb-peer, over its Redis msgbus.

        async with await RmbPeerClient.connect("redis://localhost:6379") as bus:
            replies = await bus.request([9], "calc.add", b"[1, 2]")

    Every client has its own reply queue (`ret`), read by one task; requests are matched to
    replies by the `ref` the client chose. A request to several twins resolves with one reply
    per destination (or fewer when the timeout ends it). Services: `serve(command, handler)`
    pops `msgbus.<command>` and answers on `msgbus.system.reply`.
    """

    def __init__(self, redis: RespClient, *, clock: Clock = wall_clock) -> None:
        self.redis = redis
        self.clock = clock
        self.queue = f"rmb-client.{uuid.uuid4()}"
        self._pending: dict[str, tuple[int, list[PeerReply], asyncio.Future[list[PeerReply]]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._services: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(
        cls, url: str = "redis://localhost:6379", *, clock: Clock = wall_clock
    ) -> RmbPeerClient:
        """A client on the peer's Redis; raises RedisUnavailable if it cannot be reached."""
        redis = RespClient(url)
        await redis.execute((b"PING",))
        return cls(redis, clock=clock)

    async def __aenter__(self) -> RmbPeerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def request(
        self,
        destinations: Sequence[int],
        command: str,
        data: bytes = b"",
        *,
        expiration: int = DEFAULT_EXPIRATION,
        schema: str | None = None,
        tags: str | None = None,
        timeout: float = 30.0,
    ) -> list[PeerReply]:
        """Send one request to every twin in `destinations`; the replies, one per twin, in
        arrival order. Raises RequestTimeout when none came in time."""
        ref = str(uuid.uuid4())
        message = {
            "ver": 1,
            "ref": ref,
            "cmd": command,
            "exp": expiration,
            "dat": base64.b64encode(data).decode(),
            "tag": tags,
            "dst": list(destinations),
            "ret": self.queue,
            "shm": schema,
            "now": seconds(self.clock()),
        }
        future: asyncio.Future[list[PeerReply]] = asyncio.get_running_loop().create_future()
        replies: list[PeerReply] = []
        self._pending[ref] = (len(destinations), replies, future)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        try:
            await self.redis.execute((b"LPUSH", LOCAL_QUEUE, json.dumps(message).encode()))
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            if replies:
                return replies
            raise RequestTimeout(
                f"no reply to {command!r} through rmb-peer in {timeout}s"
            ) from None
        finally:
            self._pending.pop(ref, None)

    async def _read_replies(self) -> None:
        blocking = self.redis.blocking()
        queue = self.queue.encode()
        try:
            while True:
                for raw in await _pop(blocking, queue):
                    try:
                        ref, reply = parse_incoming_response(raw)
                    except BadMessage as err:
                        log.warning("unreadable reply on %s: %s", self.queue, err)
                        continue
                    entry = self._pending.get(ref or "")
                    if entry is None:
                        continue
                    expected, replies, future = entry
                    replies.append(reply)
                    if len(replies) >= expected and not future.done():
                        future.set_result(replies)
        finally:
            await blocking.close()

    def serve(self, command: str, handler: PeerHandler) -> None:
        """Answer requests for `command` (popped from `msgbus.<command>`) with
        `handler(request) -> bytes`; an exception becomes an error reply with code 500."""
        task = asyncio.get_running_loop().create_task(self._serve(command, handler))
        self._services.append(task)

    async def _serve(self, command: str, handler: PeerHandler) -> None:
        blocking = self.redis.blocking()
        queue = command_queue(command)
        try:
            while True:
                answers = [self._answer(queue, raw, handler) for raw in await _pop(blocking, queue)]
                replies = [reply for reply in await asyncio.gather(*answers) if reply]
                try:
                    await self.redis.pipeline([(b"LPUSH", REPLY_QUEUE, r) for r in replies])
                except RedisUnavailable as err:
                    log.warning("lost %d replies to %s: %s", len(replies), command, err)
        finally:
            await blocking.close()

    async def _answer(self, queue: bytes, raw: bytes, handler: PeerHandler) -> bytes | None:
        try:
            request = parse_incoming_request(raw)
        except BadMessage as err:
            log.warning("unreadable request on %s: %s", queue.decode(), err)
            return None
        error: tuple[int, str] | None = None
        data = b""
        try:
            result = handler(request)
            data = await result if inspect.isawaitable(result) else result
        except Exception as err:
            error = (500, str(err))
        return outgoing_response(request, data, error, seconds(self.clock()))

    async def close(self) -> None:
        tasks = [*self._services, *([self._reader] if self._reader else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, _, future in self._pending.values():
            if not future.done():
                future.set_exception(ClientError("client closed"))
        await self.redis.close()
