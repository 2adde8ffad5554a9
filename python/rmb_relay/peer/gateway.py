"""rmb-peer's gateway: one twin's identity between its local msgbus (Redis) and its relays.

Theory of operation (spec/rmb.md §5)
------------------------------------
The relay side is an `RmbClient` (client.py) on every `--relay` at once, reconnecting forever:
it signs, fails over between relays, matches replies to requests and re-sends what a lost relay
may have swallowed. This module adds what makes it a peer:

Outgoing (Redis -> relay). One task pops `msgbus.system.local` (client requests) and
`msgbus.system.reply` (service replies): a blocking `BRPOP` pipelined with `RPOP key COUNT`
of both, so one round trip takes the first item and everything queued behind it. A request
becomes one envelope per destination, all with one new uid: stamped (§2.2), encrypted when the
destination publishes a `pk` (§5.10), signed; its `Backlog` (return queue and the client's
`ref`) is written to `msgbus.backlog.<uid>` with the request's TTL and kept in memory as a
`PendingRequest`. A service reply becomes a response (or error) envelope to the `dst` it
names, uid = its `ref`.

Incoming (relay -> Redis). Every envelope is checked in arrival order before anything else
(§5.7): expired (102), unknown sender (103), bad signature (104), cipher without a sender key
(105), undecryptable (106); a request that fails gets an error envelope back. Relay errors
(unsigned, source twin 0) are accepted. A request is pushed to `msgbus.<cmd>` (except
`rmb.version`, which the peer answers itself); a reply goes to its client's `ret` with the
client's `ref`, from memory or, after a restart of the peer, from the Redis backlog.

Every Redis write goes through one `RedisWriter`: commands are pipelined in the order given,
one pipeline per event-loop turn, and a batch that fails (Redis restarting) is written again
with everything after it, so what the peer holds is not lost.

Errors reach the client's `ret` as rmb-peer's JSON (`src` "") with its codes: a bad request
(101), expired before sending (102, or 500 when it expired waiting for a relay), an unknown
destination (103), an encryption failure (106); relay errors arrive with `src` "0".
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import hiredis
from google.protobuf.message import DecodeError

from rmb_relay import __version__
from rmb_relay._proto.peer_pb2 import Backlog
from rmb_relay.clock import Clock, monotonic_clock, seconds, wall_clock
from rmb_relay.errors import (
    BadMessage,
    ClientError,
    E2eError,
    EnvelopeRejected,
    RedisUnavailable,
    TwinLookupError,
)
from rmb_relay.sdk import RmbClient, Waiter
from rmb_relay.sdk.envelope import (
    DEFAULT_TTL,
    MAX_TTL,
    Envelope,
    address_text,
    parse_address,
    signature_ok,
    stamp,
    ttl,
)
from rmb_relay.sdk.envelope import (
    kind as envelope_kind,
)
from rmb_relay.sdk.link import FLUSH_AT, RETRY_DELAY
from rmb_relay.sdk.msgbus import (
    LOCAL_QUEUE,
    MAX_COMMANDS,
    REPLY_QUEUE,
    Codes,
    backlog_key,
    command_queue,
    error_response,
    incoming_request,
    incoming_response,
    parse_request,
    parse_response,
)
from rmb_relay.sdk.resp import Command, RespClient
from rmb_relay.twins.cache import CachedTwinDirectory

if TYPE_CHECKING:
    from rmb_relay._core import SigningKey
    from rmb_relay.peer.e2e import E2eKey
    from rmb_relay.twins import Twin, TwinDirectory

__all__ = ["VERSION", "Gateway", "PendingRequest", "RedisWriter"]

log = logging.getLogger("rmb_relay.peer")

#: what `rmb.version` answers (a JSON string, as rmb-peer's `"v1.5.1"`)
VERSION = f"v{__version__}"
#: items taken from each queue per pop
INTAKE_BATCH = 512
#: how long one blocking pop waits before it is issued again
BLOCK_SECONDS = 5
#: commands per pipeline
WRITE_BATCH = 2048
#: command groups held while Redis is unreachable; past this the oldest are dropped (logged)
MAX_HELD_WRITES = 200_000
#: pause after a Redis failure before the next try, doubling up to the maximum
RETRY_MIN = 0.05
RETRY_MAX = 2.0
#: requests answered by every destination, remembered so a late duplicate reply (after a
#: re-send) is dropped without asking Redis; duplicates come seconds after the original
MAX_ANSWERED = 100_000
#: relay replies carry this TTL (rmb-peer's plugin and error replies)
REPLY_TTL = 300
EXPIRED_BEFORE_SENDING = "other: response has expired before sending!"


class RedisWriter:
    """Every Redis write of the peer, in order, pipelined; see the module docstring.

    A group (`push(*commands)`) is kept together. The groups pushed during one event-loop turn
    leave at its end as one pipeline, without waiting for the replies to earlier pipelines:
    Redis applies the commands of one connection in order, and a round trip per batch would
    only add latency. A pipeline that fails (Redis restarting) is held, with every later one,
    and the lot is written again in order after a pause until Redis answers: a group may then
    be applied twice (at-least-once, like the rest of RMB), never lost or reordered.
    """

    def __init__(self, redis: RespClient) -> None:
        self.redis = redis
        self._queue: deque[tuple[Command, ...]] = deque()
        #: batches sent and not yet acknowledged, by sequence number (= send order)
        self._inflight: dict[int, list[tuple[Command, ...]]] = {}
        self._seq = 0
        self._scheduled = False
        self._retrying: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.dropped = 0
        self.written = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def push(self, *commands: Command) -> None:
        queue = self._queue
        if len(queue) >= MAX_HELD_WRITES:
            queue.popleft()
            self.dropped += 1
            if self.dropped % 10_000 == 1:
                log.error("redis unreachable for long: dropped %d queued writes", self.dropped)
        queue.append(commands)
        self._idle.clear()
        if self._retrying is not None:
            return
        if len(queue) >= FLUSH_AT:  # a long batch: do not hold the first writes to its end
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _batches(self) -> list[list[tuple[Command, ...]]]:
        """The queue cut into batches of at most WRITE_BATCH commands (a group is not cut)."""
        batches: list[list[tuple[Command, ...]]] = []
        batch: list[tuple[Command, ...]] = []
        size = 0
        queue = self._queue
        while queue:
            group = queue.popleft()
            if batch and size + len(group) > WRITE_BATCH:
                batches.append(batch)
                batch, size = [], 0
            batch.append(group)
            size += len(group)
        if batch:
            batches.append(batch)
        return batches

    def _flush(self) -> None:
        self._scheduled = False
        if self._retrying is not None:
            return
        loop = asyncio.get_running_loop()
        for batch in self._batches():
            self._seq += 1
            seq = self._seq
            self._inflight[seq] = batch
            commands = [command for group in batch for command in group]
            sent = self.redis.send_now(commands)
            if sent is not None:  # connected: no task, a callback with the replies
                sent.add_done_callback(functools.partial(self._sent, seq=seq, commands=commands))
                continue
            task = loop.create_task(self._send(seq, commands))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, seq: int, commands: list[Command]) -> None:
        """A batch sent while (re)connecting."""
        try:
            replies = await self.redis.pipeline(commands)
        except RedisUnavailable as err:
            self._failed(err)
            return
        self._done(seq, commands, replies)

    def _sent(
        self, future: asyncio.Future[list[Any]], *, seq: int, commands: list[Command]
    ) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self._done(seq, commands, future.result())
        elif isinstance(error, RedisUnavailable):
            self._failed(error)
        else:
            log.error("redis write failed unexpectedly: %r", error)

    def _failed(self, error: RedisUnavailable) -> None:
        if self._retrying is None:
            log.warning("redis write failed (%s): holding writes and retrying", error)
            self._retrying = asyncio.get_running_loop().create_task(self._retry())

    def _done(self, seq: int, commands: list[Command], replies: list[Any]) -> None:
        self._inflight.pop(seq, None)
        self.written += len(commands)
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, hiredis.ReplyError):
                log.warning("redis refused %r: %s", command[0], reply)
        if not self._inflight and not self._queue:
            self._idle.set()

    async def _retry(self) -> None:
        """Write everything unacknowledged again, oldest first, one batch at a time, until
        Redis takes it; then go back to sending without waiting."""
        delay = RETRY_MIN
        try:
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                held = [group for seq in sorted(self._inflight) for group in self._inflight[seq]]
                self._inflight.clear()
                self._queue.extendleft(reversed(held))
                try:
                    for batch in self._batches():
                        self._seq += 1
                        self._inflight[self._seq] = batch
                        commands = [command for group in batch for command in group]
                        self._done(self._seq, commands, await self.redis.pipeline(commands))
                except RedisUnavailable:
                    continue
                log.info("redis is back: held writes written")
                return
        finally:
            self._retrying = None
            if self._queue:
                self._flush()

    async def flushed(self) -> None:
        """Wait until everything pushed so far is written (tests, shutdown)."""
        await self._idle.wait()

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._retrying] if self._retrying else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PendingRequest(Waiter):
    """A client's request to one or more twins, until every destination has answered or the
    request expired. One reply per destination reaches the client: a re-sent request (after a
    relay was lost) may be answered twice, and the second answer is dropped here."""

    __slots__ = ("gateway", "ref", "ret", "uid", "waiting", "wire_by_twin")

    def __init__(
        self, gateway: Gateway, uid: str, ret: str, ref: str | None, deadline: int
    ) -> None:
        super().__init__(deadline)
        self.gateway = gateway
        self.uid = uid
        self.ret = ret
        self.ref = ref
        self.wire_by_twin: dict[int, bytes] = {}
        self.waiting: set[int] = set()

    def add(self, twin: int, wire: bytes) -> None:
        self.wire_by_twin[twin] = wire
        self.waiting.add(twin)

    def on_reply(self, env: Envelope) -> bool:
        source = env.source.twin
        if source == 0:  # a relay error names no twin: it answers for one of those waiting
            if self.waiting:
                self.waiting.pop()
        elif source in self.waiting:
            self.waiting.discard(source)
        else:
            log.debug("dropping a second reply from twin %d to %s", source, self.uid)
            return not self.waiting
        self.gateway.reply_to_client(self.ret, self.ref, env)
        if self.waiting:
            return False
        self.gateway.answered(self.uid)
        return True

    def wires(self) -> list[bytes]:
        return [wire for twin, wire in self.wire_by_twin.items() if twin in self.waiting]

    def expire(self) -> None:
        if not self.sent:  # never left: no relay was up before the deadline
            self.gateway.tell(
                self.ret, error_response(self.ref, Codes.OTHER, EXPIRED_BEFORE_SENDING)
            )
        # sent and unanswered: the backlog expires in Redis; rmb-peer tells the client nothing

    def fail(self, error: ClientError) -> None:
        # only when the peer shuts down: its backlog stays in Redis, so a restarted peer
        # still routes the replies; telling the client now would be premature
        log.debug("request %s left waiting: %s", self.uid, error)


class Gateway:
    """One twin's rmb-peer: see the module docstring. `start()`, then `close()`."""

    def __init__(
        self,
        twin: int,
        key: SigningKey,
        e2e: E2eKey,
        directory: TwinDirectory,
        *,
        redis_url: str,
        relays: Sequence[str],
        encrypt: bool = True,
        clock: Clock = wall_clock,
        monotonic: Clock = monotonic_clock,
        retry_delay: float = RETRY_DELAY,
    ) -> None:
        """`encrypt` False: send everything plain. For a twin whose published `pk` is not
        ours (`--no-update`): whatever we encrypt, its receiver could not decrypt (105)."""
        self.twin = twin
        self.e2e = e2e
        self.encrypt = encrypt
        self.directory = directory
        self.relays = list(relays)
        self.clock = clock
        self.client = RmbClient(
            twin,
            key,
            clock=clock,
            monotonic=monotonic,
            reconnect=True,
            retry_delay=retry_delay,
            accept=self._accept,
            on_request=self._on_request,
            on_unmatched=self._on_unmatched,
        )
        #: a cached directory answers repeat senders without an await
        self._peek = directory.peek if isinstance(directory, CachedTwinDirectory) else _never_cached
        self.redis = RespClient(redis_url)
        self.writer = RedisWriter(self.redis)
        self._popper = self.redis.blocking()
        self._intake_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: uids of requests every destination has answered, oldest first
        self._answered: dict[str, None] = {}

    async def start(self) -> None:
        """Start the relay links (in the background, reconnecting) and the msgbus intake."""
        await self.client.open(self.relays)
        self._intake_task = asyncio.get_running_loop().create_task(self._intake())

    async def close(self) -> None:
        if self._intake_task is not None:
            self._intake_task.cancel()
            await asyncio.gather(self._intake_task, return_exceptions=True)
        await self.client.close()
        for task in list(self._tasks):
            task.cancel()
        try:
            async with asyncio.timeout(2.0):
                await self.writer.flushed()
        except TimeoutError:
            log.warning("closing with writes to redis still pending")
        await self.writer.close()
        await self._popper.close()
        await self.redis.close()

    # ---- Redis -> relay --------------------------------------------------------------------

    async def _intake(self) -> None:
        popper = self._popper
        delay = RETRY_MIN
        failing = False
        # one round trip per wake-up: Redis runs the RPOPs as soon as the BRPOP returns, so
        # they take whatever queued behind the first item (oldest first, as the BRPOP)
        take: list[Command] = [
            (b"BRPOP", LOCAL_QUEUE, REPLY_QUEUE, BLOCK_SECONDS),
            (b"RPOP", LOCAL_QUEUE, INTAKE_BATCH),
            (b"RPOP", REPLY_QUEUE, INTAKE_BATCH),
        ]
        while True:
            try:
                popped, requests, replies = await popper.pipeline(take)
                if popped is None:
                    continue
                if popped[0] == LOCAL_QUEUE:
                    requests = [popped[1], *(requests or ())]
                else:
                    replies = [popped[1], *(replies or ())]
            except RedisUnavailable as err:
                if not failing:
                    log.warning("cannot read the msgbus (%s): retrying", err)
                    failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            if failing:
                log.info("msgbus redis is back")
                failing = False
            delay = RETRY_MIN
            for queue, items, handle in (
                (REPLY_QUEUE, replies, self._send_response),
                (LOCAL_QUEUE, requests, self._send_request),
            ):
                for raw in items or ():
                    try:
                        await handle(raw)
                    except Exception:  # a bug with one message must not stop the msgbus
                        log.exception("failed to handle %r from %s", raw[:200], queue.decode())
            await self.client.writable()

    def tell(self, ret: str, message: bytes) -> None:
        """LPUSH to a client's return queue, capped as rmb-peer caps it."""
        queue = ret.encode()
        self.writer.push((b"LPUSH", queue, message), (b"LTRIM", queue, 0, MAX_COMMANDS - 1))

    async def _twin(self, twin_id: int) -> Twin | None:
        try:
            return await self.directory.get(twin_id)
        except TwinLookupError as err:
            raise EnvelopeRejected(Codes.OTHER, f"other: failed to get twin: {err}") from None

    def _set_payload(self, env: Envelope, twin: Twin, data: bytes) -> None:
        """Encrypt for a twin that publishes a key, else send plain (spec §5.10)."""
        if twin.pk is None or not self.encrypt:
            env.plain = data
        else:
            env.cipher = self.e2e.encrypt(twin.pk, data)

    async def _send_request(self, raw: bytes) -> None:
        try:
            request = parse_request(raw)
        except BadMessage as err:
            log.warning("bad request on %s: %s", LOCAL_QUEUE.decode(), err)
            if err.ret is not None:
                message = f"invalid message payload data: {err}"
                self.tell(err.ret, error_response(err.ref, Codes.INVALID_PAYLOAD_DATA, message))
            return
        now = seconds(self.clock())
        timestamp, expiration = stamp(now, request.now, request.expiration or DEFAULT_TTL)
        expiration = min(expiration, MAX_TTL)
        left = ttl(now, timestamp, expiration)
        if left is None:
            self.tell(
                request.ret,
                error_response(
                    request.ref, Codes.EXPIRED, "envelope validation error: message has expired"
                ),
            )
            return
        uid = str(uuid.uuid4())
        pending = PendingRequest(self, uid, request.ret, request.ref, timestamp + expiration)
        for dest in dict.fromkeys(request.destinations):
            try:
                twin = await self._twin(dest)
                if twin is None:
                    raise EnvelopeRejected(Codes.UNKNOWN_TWIN, f"unknown twin id '{dest}'")
                env = Envelope(uid=uid, timestamp=timestamp, expiration=expiration)
                env.source.twin = self.twin
                env.destination.twin = dest
                env.request.command = request.command
                if request.tags is not None:
                    env.tags = request.tags
                if request.schema is not None:
                    env.schema = request.schema
                self._set_payload(env, twin, request.data)
            except EnvelopeRejected as err:
                self.tell(request.ret, error_response(request.ref, err.code, str(err)))
                continue
            pending.add(dest, self.client.seal(env))
        if not pending.waiting:
            return
        backlog = Backlog(uid=uid, reply_to=request.ret, module="", ttl=left)
        if request.ref is not None:
            backlog.reference = request.ref
        self.writer.push((b"SETEX", backlog_key(uid), left, backlog.SerializeToString()))
        self.client.send_expecting(uid, pending)

    async def _send_response(self, raw: bytes) -> None:
        try:
            response = parse_response(raw)
            dest, sid = parse_address(response.destination)
            twin = await self._twin(dest) if dest else None
            if twin is None:
                raise EnvelopeRejected(Codes.UNKNOWN_TWIN, f"unknown twin id '{dest}'")
        except (BadMessage, ValueError, EnvelopeRejected) as err:
            log.warning("dropping a reply on %s: %s", REPLY_QUEUE.decode(), err)
            return
        env = self._reply_envelope(twin, sid, response.ref or "", response.now, MAX_TTL)
        if env is None:
            return
        if response.error is not None:
            env.error.code, env.error.message = response.error
        else:
            env.response.SetInParent()
            try:
                self._set_payload(env, twin, response.data)
            except E2eError as err:
                log.warning("cannot encrypt a reply to twin %d: %s", dest, err)
                return
        if response.schema is not None:
            env.schema = response.schema
        self._send(env)

    def _reply_envelope(
        self, twin: Twin, sid: str | None, uid: str, timestamp: int, expiration: int
    ) -> Envelope | None:
        """A reply's envelope to (twin, sid), stamped; None (logged) when already expired."""
        now = seconds(self.clock())
        timestamp, expiration = stamp(now, timestamp, expiration)
        if ttl(now, timestamp, expiration) is None:
            log.warning("reply %s to twin %d: %s", uid, twin.id, EXPIRED_BEFORE_SENDING)
            return None
        env = Envelope(uid=uid, timestamp=timestamp, expiration=expiration)
        env.source.twin = self.twin
        env.destination.twin = twin.id
        if sid is not None:
            env.destination.connection = sid
        return env

    def _send(self, env: Envelope) -> None:
        uid, dest = env.uid, env.destination.twin

        def expired() -> None:
            log.warning("reply %s to twin %d: %s", uid, dest, EXPIRED_BEFORE_SENDING)

        self.client.send(
            self.client.seal(env), deadline=env.timestamp + env.expiration, on_expired=expired
        )

    # ---- relay -> Redis --------------------------------------------------------------------

    def _accept(self, env: Envelope) -> bool | Awaitable[bool]:
        """Check an incoming envelope (spec §5.7) and decrypt its payload; False when it was
        rejected (a request gets an error back) or handled here (`rmb.*`). Answered without an
        await when the sender's twin is in the cache, as it is for every message after the
        first."""
        source = env.source.twin
        if source == 0:
            return self._check(env, None)
        hit, twin = self._peek(source)
        if hit:
            return self._check(env, twin)
        return self._accept_after_lookup(env)

    async def _accept_after_lookup(self, env: Envelope) -> bool:
        try:
            twin = await self._twin(env.source.twin)
        except EnvelopeRejected as err:
            return self._reject(env, err)
        return self._check(env, twin)

    def _check(self, env: Envelope, twin: Twin | None) -> bool:
        request = env.HasField("request")
        source = env.source.twin
        try:
            if ttl(seconds(self.clock()), env.timestamp, env.expiration) is None:
                raise EnvelopeRejected(
                    Codes.EXPIRED, "envelope validation error: message has expired"
                )
            if source == 0:
                # a relay's error: unsigned by design (spec §2.4), so only an error is taken
                # unsigned, never a request or a response, and it reaches a client only as
                # the answer to a request this peer sent (`on_reply`, or its backlog after a
                # restart; anything else is dropped there)
                if not env.HasField("error"):
                    log.warning(
                        "dropping an unsigned %s %s from twin 0", envelope_kind(env), env.uid
                    )
                    return False
                return True
            if twin is None:
                raise EnvelopeRejected(Codes.UNKNOWN_TWIN, f"unknown twin id '{source}'")
            problem = signature_ok(env, twin.account)
            if problem is not None:
                raise EnvelopeRejected(
                    Codes.INVALID_SIGNATURE, f"invalid envelope signature: {problem}"
                )
            if env.WhichOneof("payload") == "cipher":
                if twin.pk is None:
                    raise EnvelopeRejected(Codes.NO_PUBLIC_KEY, "sender twin has no public key")
                env.plain = self.e2e.decrypt(twin.pk, env.cipher)
        except EnvelopeRejected as err:
            return self._reject(env, err)
        if request and env.request.command.startswith("rmb."):
            self._rmb_command(env, twin)
            return False
        return True

    def _reject(self, env: Envelope, err: EnvelopeRejected) -> bool:
        source = env.source.twin
        log.info("rejected envelope %s from twin %d: %s", env.uid, source, err)
        if env.HasField("request") and source != 0:
            self._send_error(env, err.code, str(err))
        return False

    def _send_error(self, env: Envelope, code: int, message: str) -> None:
        """rmb-peer's answer to a request it cannot take: same uid, the request's TTL."""
        reply = Envelope(uid=env.uid, timestamp=seconds(self.clock()), expiration=env.expiration)
        reply.source.twin = self.twin
        reply.destination.CopyFrom(env.source)
        reply.error.code = code
        reply.error.message = message
        self._send(reply)

    def _rmb_command(self, env: Envelope, twin: Twin) -> None:
        """The peer's own commands (rmb-peer's `rmb` plugin): `rmb.version`; others logged."""
        command = env.request.command
        if command != "rmb.version":
            log.info("no handler for %s from twin %d", command, twin.id)
            return
        sid = env.source.connection if env.source.HasField("connection") else None
        reply = self._reply_envelope(twin, sid, env.uid, 0, REPLY_TTL)
        if reply is None:
            return
        reply.response.SetInParent()
        reply.schema = "application/json"
        try:
            self._set_payload(reply, twin, json.dumps(VERSION).encode())
        except E2eError as err:
            log.warning("cannot encrypt rmb.version reply to twin %d: %s", twin.id, err)
            return
        self._send(reply)

    def _on_request(self, env: Envelope) -> None:
        """A checked request from a remote twin, to the service popping `msgbus.<cmd>`."""
        command = env.request.command
        queue = command_queue(command)
        message = incoming_request(
            env.uid,
            address_text(env.source),
            command,
            env.expiration,
            env.plain,
            env.tags if env.HasField("tags") else None,
            env.schema if env.HasField("schema") else None,
            env.timestamp,
        )
        self.writer.push((b"LPUSH", queue, message), (b"LTRIM", queue, 0, MAX_COMMANDS - 1))

    def reply_to_client(self, ret: str, ref: str | None, env: Envelope) -> None:
        """A checked reply (or error) to the client that asked, on its return queue."""
        error = (env.error.code, env.error.message) if env.HasField("error") else None
        self.tell(
            ret,
            incoming_response(
                ref,
                env.plain,
                address_text(env.source),
                env.schema if env.HasField("schema") else None,
                env.timestamp,
                error,
            ),
        )

    def answered(self, uid: str) -> None:
        """Every destination of a request answered: forget its backlog, remember the uid."""
        self.writer.push((b"DEL", backlog_key(uid)))
        answered = self._answered
        answered[uid] = None
        if len(answered) > MAX_ANSWERED:
            del answered[next(iter(answered))]

    def _on_unmatched(self, env: Envelope) -> None:
        """A reply no request in memory waits for: a duplicate of one already delivered, or
        the peer restarted since it sent the request (its backlog is in Redis), or the
        request expired."""
        if env.uid in self._answered:
            log.debug("dropping a duplicate reply to %s from %d", env.uid, env.source.twin)
            return
        task = asyncio.get_running_loop().create_task(self._reply_from_backlog(env))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply_from_backlog(self, env: Envelope) -> None:
        try:
            stored: Any = await self.redis.execute((b"GET", backlog_key(env.uid)))
        except RedisUnavailable as err:
            log.warning("cannot read the backlog of %s: %s", env.uid, err)
            return
        if stored is None:
            log.info("received reply of an expired message %s from %s", env.uid, env.source.twin)
            return
        try:
            backlog = Backlog.FromString(stored)
        except DecodeError:
            log.warning("unreadable backlog for %s: dropping its reply", env.uid)
            return
        ref = backlog.reference if backlog.HasField("reference") else None
        self.reply_to_client(backlog.reply_to, ref, env)


def _never_cached(twin_id: int) -> tuple[bool, Twin | None]:
    return False, None
