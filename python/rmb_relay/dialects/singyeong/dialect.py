"""The 신경 gateway on the shared listener: `GET /gateway/websocket?encoding=json|msgpack|etf`.

Theory of operation (spec/singyeong.md, the decisions at its top)
-----------------------------------------------------------------
A connection gets op 0 hello at once; its `SgSession` (session.py) decodes frames and
identifies the client, which then lives in the `ClientIndex` (clients.py) until the socket
closes. Dispatches are routed here:

- SEND / BROADCAST: the Rust core parses the target and resolves it against its index
  (query.py, clients.py): match, then the selector, `key` (rendezvous hashing) or one at
  random (SEND); each receiver's frame is encoded once per encoding and written to its
  connection. No receiver: op 3 `no_route` unless the query is droppable. A JSON client's
  SEND/BROADCAST whose answer the core can write itself never reaches Python: its scanner
  (`bind`, rust/dialects/singyeong/mod.rs) resolves the same query on the same index inside
  the read and writes the receivers' frames into their outboxes (the switch's, shared with
  RMB and SBD: one output path per connection, so frame order holds).
- QUEUE*: queues.py; the confirmation goes out only once the message is stored; a message
  over the in-memory queues' byte budget is refused with op 3 `queue_full`, never dropped.
  With Redis (redis_queues.py) a store that failed is withdrawn before it is refused: op 3
  `queue unavailable` says it is not stored, `queue unknown` that the gateway cannot tell.
- UPDATE_METADATA: validated at once, applied at up to `--sg-metadata-rate` per client per
  second (session.py), the rest merged and applied when the rate allows.

Time: `clock` (monotonic ns) drives heartbeat timeouts, ack timeouts and the metadata rate;
`wall_clock` only stamps `ts` and `last_heartbeat_time`. A periodic `sweep(now)` closes
silent clients and retries expired deliveries; tests call it with a fake clock.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Final

from rmb_relay._core import Outboxes, SgIndex, SgScanner, WsDecoder
from rmb_relay.budget import ByteBudget
from rmb_relay.clock import Clock, monotonic_clock, wall_clock
from rmb_relay.dialects.base import Dialect, Peer, Routes, WebSocketHandler
from rmb_relay.dialects.singyeong import frames
from rmb_relay.dialects.singyeong.clients import Client, ClientIndex
from rmb_relay.dialects.singyeong.cluster import SgCluster
from rmb_relay.dialects.singyeong.codec import (
    Encoding,
    dispatch_json,
    encode,
    json_text_of_str,
    json_value,
)
from rmb_relay.dialects.singyeong.metrics import SgMetrics
from rmb_relay.dialects.singyeong.proxy import Proxy
from rmb_relay.dialects.singyeong.query import Query, QueryError, parse
from rmb_relay.dialects.singyeong.queues import (
    MAX_QUEUE_NAME,
    MESSAGE_OVERHEAD,
    Message,
    NotStored,
    Queues,
    StoreUnknown,
    TooManyQueues,
    TooManyRequests,
)
from rmb_relay.dialects.singyeong.session import SgSession
from rmb_relay.dialects.singyeong.settings import SgSettings
from rmb_relay.errors import BudgetExceeded, HttpReject

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay._core import _SgQueueFrame as SgQueueFrame
    from rmb_relay.cluster.connect import RedisClient as Redis  # a server or a Cluster
    from rmb_relay.cluster.node import Cluster
    from rmb_relay.dialects.singyeong.redis_queues import RedisQueues
    from rmb_relay.telemetry.metrics import Registry

log = logging.getLogger("rmb_relay.singyeong")

#: the longest pause between sweeps (heartbeat and ack-timeout checks), seconds
MAX_SWEEP_INTERVAL = 0.25
#: `HotCounters.add` keys of the queue frames' usual outcomes
_QUEUE_STORED = ("QUEUE", "stored")
_REQUEST_OK = ("QUEUE_REQUEST", "ok")
_ACK_OK = ("QUEUE_ACK", "ok")
_ACK_UNKNOWN = ("QUEUE_ACK", "unknown")
#: parsed QUEUE targets kept by their text (`_queue_target`); the table starts over when full
#: (at this many entries or at --sg-target-cache-bytes)
QUEUE_TARGET_CACHE = 4096
#: queue names a client's `queues` keeps (what it asked for; pumped when its metadata
#: changes): beyond, names of queues that are gone are forgotten first
CLIENT_QUEUE_NAMES = 1000
#: the kinds of queue frame an SgScanner reads (`SgQueueFrame`'s first item)
QUEUE_REQUEST: Final = 1
QUEUE_ACK: Final = 2
#: what a cached target costs besides its key's length three times (the key, the decoded
#: value and the compiled query each hold about that much): the entry, tuple and Query
TARGET_ENTRY_BYTES = 1024
#: a target whose key is over this share of the cache's budget is parsed each time, never
#: cached (one producer's huge target must not empty the cache for everyone)
TARGET_CACHE_SHARE = 16


def _query_param(query: str | None, name: str) -> str | None:
    if not query:
        return None
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


class SingyeongDialect(Dialect):
    name = "singyeong"
    paths = ("/gateway/websocket",)

    def __init__(
        self,
        settings: SgSettings,
        registry: Registry,
        clock: Clock = monotonic_clock,
        wall: Clock = wall_clock,
        *,
        rng: random.Random | None = None,
        redis: Redis | None = None,
        cluster: Cluster | None = None,
        outboxes: Outboxes | None = None,
    ) -> None:
        """With `redis`, queues live there (shared by every instance on it, surviving
        restarts); with `cluster`, the instances in it form one gateway (cluster.py), and
        the node's name is the cluster's instance id. Either must be called on the running
        loop. `outboxes`: the switch's, which every session writes through and the fast path
        writes into (a gateway of its own without it). `rng` seeds the core's SEND picks."""
        self.settings = settings
        #: this instance's name in QUERY_NODES and delivery tokens
        self.node = cluster.me if cluster is not None else settings.node
        self.clock = clock
        self.wall = wall
        self.rng = rng if rng is not None else random.Random()
        limits = settings.query_limits
        self.index = ClientIndex(
            SgIndex(self.rng.getrandbits(64), limits.max_depth, limits.max_ops, limits.max_list)
        )
        self.outboxes = outboxes if outboxes is not None else Outboxes()
        # the scanner stamps `ts` from the reading the listener passes it
        self.scan_clock = wall
        #: open sessions in the order of their last heartbeat (`heard_from`), oldest first
        self.sessions: dict[int, SgSession] = {}
        #: non-restricted clients that asked for CLIENT_CONNECTED/DISCONNECTED
        self.update_listeners: set[SgSession] = set()
        self.queues: Queues | RedisQueues
        if redis is None:
            self.queues = Queues(
                ack_timeout_ns=int(settings.ack_timeout * 1e9),
                max_attempts=settings.max_attempts,
                clock=clock,
                wall_ms=self.now_ms,
                budget=ByteBudget(
                    key_bytes=settings.queue_bytes, total_bytes=settings.queue_total_bytes
                ),
                dead_letter_bytes=settings.dead_letter_bytes,
                queues_per_app=settings.queues_per_app,
                queues_total=settings.queues_total,
                requests_per_client=settings.requests_per_client,
                requests_total=settings.requests_total,
            )
        else:
            # redis-py (and the cryptography it loads) only for a gateway started with --redis
            from rmb_relay.dialects.singyeong.redis_queues import RedisQueues

            self.queues = RedisQueues(
                redis,
                node=self.node,
                ack_timeout_ns=int(settings.ack_timeout * 1e9),
                max_attempts=settings.max_attempts,
                wall_ms=self.now_ms,
                queue_bytes=settings.queue_bytes,
                queue_total_bytes=settings.queue_total_bytes,
                queues_per_app=settings.queues_per_app,
                queues_total=settings.queues_total,
                requests_per_client=settings.requests_per_client,
                requests_total=settings.requests_total,
                verdict_timeout=settings.verdict_timeout,
                held_bytes=settings.held_bytes,
                # (a store is held, unwritten, while the cluster knows Redis is down)
                redis_up=(lambda: True) if cluster is None else (lambda: cluster.redis_up),
                redis_back=None if cluster is None else cluster.redis_back,
            )
            self.queues.start()
        self.cluster: SgCluster | None = None
        if cluster is not None:
            self.cluster = SgCluster(
                cluster,
                self.index,
                self.deliver_local,
                self.displace_local,
                settings,
                lambda limit: self.metrics.refused.inc(1, limit),
            )
            self.cluster.start()
        self.metrics = SgMetrics(
            registry,
            lambda: self.index,
            lambda: self.queues,
            self.fast_counts,
            lambda: (
                self.metadata_bytes,
                self.target_cache_bytes,
                0 if self.cluster is None else self.cluster.replica_bytes,
            ),
        )
        self._sweeper: asyncio.TimerHandle | None = None
        self._metadata_due: dict[SgSession, int] = {}
        self._metadata_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: QUEUE target key -> (value, parsed query), for both paths (`_cached_target`)
        self._queue_targets: dict[str, tuple[Any, Query]] = {}
        #: the last nonce-less QUEUE_CONFIRM (queue, ts, text): a burst is confirmed with one
        self._confirm: tuple[str, int, bytes] = ("", -1, b"")
        #: what `_queue_targets` costs (`_target_cost` of each entry), within
        #: --sg-target-cache-bytes
        self.target_cache_bytes = 0
        #: bytes of every local client's metadata (session.py `charge_metadata`)
        self.metadata_bytes = 0
        self._closed = False
        self.proxy = Proxy(self)

    def now_ms(self) -> int:
        return self.wall() // 1_000_000

    def fast_counts(self) -> tuple[int, int, int, int]:
        """(frames_in, sends, broadcasts, frames_out) the fast path answered: each SEND or
        BROADCAST is one frame in, its DISPATCH frames are the outboxes' count."""
        sends, broadcasts = self.index.core.counts
        return sends + broadcasts, sends, broadcasts, self.outboxes.forwarded("singyeong")[0]

    def bind(self, session: SgSession, decoder: WsDecoder) -> SgScanner | None:
        """The session's output goes through the outboxes (the listener reads
        `handler.outboxes`); a JSON session's decoder gets a scanner, ready once it
        identifies unrestricted."""
        session.outboxes = self.outboxes
        if not session.encoding.text_frames:
            return None
        scanner = SgScanner(self.index.core, self.outboxes, session.peer.id)
        decoder.set_scanner(scanner)
        return scanner

    # ---- upgrade ---------------------------------------------------------------------------

    async def accept(self, request: HttpRequest, peer: Peer) -> WebSocketHandler:
        try:
            encoding = Encoding.parse(_query_param(request.query, "encoding"))
        except ValueError as err:
            raise HttpReject(400, str(err)) from None
        return SgSession(peer, self, encoding, self.client_address(request, peer))

    def client_address(self, request: HttpRequest, peer: Peer) -> str:
        """The address the gateway saw for a client: its socket's, or under
        `--trusted-ip-header` that header of the upgrade (of a list, the last address: the one
        the operator's front proxy appended). A header that is absent or not an address falls
        back to the socket's."""
        name = self.settings.client_ip_header
        if name is None:
            return peer.peer_host
        raw = request.header(name)
        if raw is None:
            return peer.peer_host
        last = raw.decode("latin-1").rsplit(",", 1)[-1].strip()
        try:
            return str(ipaddress.ip_address(last))
        except ValueError:
            return peer.peer_host

    def open_surfaces(self) -> list[str]:
        if self.settings.auth is not None:
            return []
        return ["gateway and HTTP API without a password (no --sg-auth)"]

    def add_routes(self, router: Routes) -> None:
        from rmb_relay.dialects.singyeong.api import SgApi

        SgApi(self).add_routes(router)

    # ---- client lifecycle ------------------------------------------------------------------

    def client_ready(self, session: SgSession, client: Client) -> None:
        self.index.add(client)
        if session.scanner is not None and not client.restricted:
            session.scanner.ready = True
        if self.cluster is not None:
            self.cluster.joined(client)
        if client.receive_updates:
            self.update_listeners.add(session)
        self._client_update("CLIENT_CONNECTED", client)

    def session_closed(self, session: SgSession) -> None:
        self.sessions.pop(session.peer.id, None)
        self._metadata_due.pop(session, None)
        self.update_listeners.discard(session)
        if session.scanner is not None:
            session.scanner.ready = False
        client = session.client
        if client is None:
            return
        if self.index.get(client.app_id, client.client_id) is client:
            self.index.remove(client)
            if self.cluster is not None:
                self.cluster.left(client)
            self.queues.consumer_gone(session)
            self._client_update("CLIENT_DISCONNECTED", client)

    def displace_local(self, client: Client, by: str) -> None:
        """Another instance's authenticated client wants the id of `client` (cluster.py): if
        it is still a restricted client connected here, it is told and closed."""
        session = client.session
        if (
            session is None
            or session.closing
            or client.node is not None
            or not client.restricted
            or self.index.get(client.app_id, client.client_id) is not client
        ):
            return
        self.metrics.refused.inc(1, "restricted_displaced")
        log.info(
            "singyeong: %s/%s: restricted client from %s displaced by an authenticated one "
            "on another instance (from %s)",
            client.app_id,
            client.client_id,
            session.address,
            by,
        )
        session.displaced(by)

    def _client_update(self, event: str, client: Client) -> None:
        if not self.update_listeners:
            return
        frame = frames.dispatch(event, {"app": client.app_id}, self.now_ms())
        self._send_all(list(self.update_listeners), frame)

    # ---- time ------------------------------------------------------------------------------

    def ensure_sweeper(self) -> None:
        if self._sweeper is None:
            interval = min(
                MAX_SWEEP_INTERVAL, self.settings.heartbeat_ms / 4000, self.settings.ack_timeout / 4
            )
            self._sweeper = asyncio.get_running_loop().call_later(interval, self._tick)

    def _tick(self) -> None:
        self._sweeper = None
        try:
            self.sweep(self.clock())
        finally:
            if self.sessions or self.queues.busy:
                self.ensure_sweeper()

    def sweep(self, now: int) -> None:
        """Close clients silent for 1.5 heartbeat intervals (decision 7); retry deliveries whose
        ack timed out (decision 11). The silent clients are a prefix of `sessions` (heartbeat
        order), so a sweep reads those and one more, not every client four times a second."""
        limit = self.settings.heartbeat_timeout_ns
        silent = []
        for session in self.sessions.values():
            if now - session.last_heartbeat <= limit:
                break
            if not session.closing:
                silent.append(session)
        for session in silent:
            self.metrics.heartbeat_closed.inc()
            session.fatal("heartbeat took too long")
        self.queues.sweep(now)

    def heard_from(self, session: SgSession) -> None:
        """A heartbeat (or the identify) of `session`: its time is now, and it moves to the end
        of `sessions`, which stays in heartbeat order (a monotonic clock)."""
        session.last_heartbeat = self.clock()
        sessions = self.sessions
        key = session.peer.id
        if sessions.pop(key, None) is not None:
            sessions[key] = session

    def metadata_waiting(self, session: SgSession, due: int) -> None:
        self._metadata_due[session] = due
        self._arm_metadata_timer()

    def _arm_metadata_timer(self) -> None:
        if self._metadata_timer is not None or not self._metadata_due:
            return
        delay = max(0, min(self._metadata_due.values()) - self.clock()) / 1e9
        self._metadata_timer = asyncio.get_running_loop().call_later(delay, self._metadata_tick)

    def _metadata_tick(self) -> None:
        self._metadata_timer = None
        try:
            self.flush_metadata(self.clock())
        finally:  # the other clients' updates must not stall behind one that failed
            self._arm_metadata_timer()

    def flush_metadata(self, now: int) -> None:
        """Apply every pending metadata update whose time has come. A session whose update
        raises (a bug) is closed and its update dropped; the others are still applied."""
        for session, due in list(self._metadata_due.items()):
            if due > now:
                continue
            try:
                later = session.flush_metadata(now)
            except Exception:
                log.exception("singyeong: metadata of %s failed", session.peer.peer_host)
                del self._metadata_due[session]
                session.fatal("internal server error")
                continue
            if later is None:
                del self._metadata_due[session]
            else:
                self._metadata_due[session] = later

    def metadata_applied(self, client: Client) -> None:
        """The other instances' replicas of this client follow, and queues it waits on
        look again (it may match messages it did not before)."""
        if self.cluster is not None:
            self.cluster.changed(client)
        for name in client.queues:
            self.queues.pump(name)

    # ---- dispatches ------------------------------------------------------------------------

    def dispatch(self, session: SgSession, client: Client, t: Any, d: Any) -> None:
        hot = self.metrics.hot
        if not isinstance(t, str):
            hot.dispatch("other", "invalid")
            session.invalid("a dispatch needs a string t")
            return
        if client.restricted and t != "UPDATE_METADATA":
            hot.dispatch(t, "refused")
            session.invalid(f"invalid dispatch type {t} (are you restricted?)")
            return
        handler = self._handlers.get(t)
        if handler is None:
            hot.dispatch(t, "invalid")
            session.invalid("invalid dispatch payload", {"t": t})
            return
        handler(self, session, client, t, d)

    def _update_metadata(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        self.metrics.hot.dispatch(t, session.update_metadata(d))

    def _parse_target(self, session: SgSession, t: str, target: Any) -> Query | None:
        try:
            return parse(target, self.settings.query_limits)
        except QueryError as err:
            self.metrics.hot.dispatch(t, "invalid")
            if err.limit is not None:
                self.metrics.queries_refused.inc(1, err.limit)
            session.invalid("invalid query", str(err))
            return None

    def _send(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        if not isinstance(d, dict) or "target" not in d or "payload" not in d:
            self.metrics.hot.dispatch(t, "invalid")
            session.invalid(f"{t} needs target and payload", d)
            return
        query = self._parse_target(session, t, d["target"])
        if query is None:
            return
        receivers = self.resolve(query, broadcast=t == "BROADCAST")
        if not receivers:
            if query.droppable:
                self.metrics.hot.dispatch(t, "dropped")
                return
            self.metrics.hot.dispatch(t, "no_route")
            original = {"op": frames.Op.DISPATCH, "d": d, "t": t, "ts": self.now_ms()}
            session.invalid("no_route", original)
            return
        self.metrics.hot.dispatch(t, "delivered")
        local = [r for r in receivers if r.node is None]
        if len(local) != len(receivers):
            assert self.cluster is not None
            remote = [r for r in receivers if r.node is not None]
            nonce = d.get("nonce")

            def failed(reason: str) -> None:
                self.metrics.hot.dispatch(t, "unavailable")
                if not session.closing:
                    session.invalid(reason, {"t": t, "nonce": nonce})

            self.cluster.forward(remote, t, d["payload"], nonce, failed)
        if local:
            self.deliver_local(local, t, d["payload"], d.get("nonce"))

    def deliver_local(self, receivers: list[Client], t: str, payload: Any, nonce: Any) -> None:
        """A dispatch to clients connected here (from a local sender or another instance)."""
        frame = frames.dispatch(t, payload, self.now_ms(), nonce)
        self._send_all([r.session for r in receivers], frame)

    def resolve(self, query: Query, *, broadcast: bool) -> list[Client]:
        """The receivers of a SEND (one) or BROADCAST (all), decided by the core (decisions
        5 and 6: match, `optional`, selector, `key`, else one at random)."""
        return self.index.resolve(query, broadcast=broadcast)

    def _send_all(self, sessions: list[Any], frame: Any) -> None:
        """One encode per encoding, whatever the number of receivers."""
        encoded: dict[Encoding, bytes] = {}
        sent = 0
        for session in sessions:
            if session is None or session.closing:
                continue
            data = encoded.get(session.encoding)
            if data is None:
                data = encoded[session.encoding] = encode(session.encoding, frame)
            session.send_encoded(data)
            sent += 1
        self.metrics.hot.frames_out += sent

    def _query_nodes(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        query = self._parse_target(session, t, d)
        if query is None:
            return
        nonce = d.get("nonce") if isinstance(d, dict) else None
        matches = self.index.match(query)
        too_many = self.too_many_results(len(matches))
        if too_many is not None:
            self.metrics.hot.dispatch(t, "refused")
            session.invalid("too_many_results", {"nonce": nonce, "reason": too_many})
            return
        self.metrics.hot.dispatch(t, "ok")
        nodes: dict[str, list[dict[str, Any]]] = {}
        for found in matches:
            nodes.setdefault(found.node or self.node, []).append(found.describe())
        session.send(frames.dispatch(t, {"nodes": nodes}, self.now_ms(), nonce, nodes=nodes))

    def too_many_results(self, matched: int) -> str | None:
        """Why an answer listing `matched` clients is refused (QUERY_NODES, /api/v1/query:
        each client may carry up to --sg-metadata-bytes), or None."""
        limit = self.settings.query_max_results
        if matched <= limit:
            return None
        self.metrics.refused.inc(1, "query_results")
        return f"the query matches {matched} clients, {limit} allowed (--sg-query-max-results)"

    # ---- queues ----------------------------------------------------------------------------

    def _queue_name(self, session: SgSession, t: str, d: Any) -> str | None:
        name = d.get("queue") if isinstance(d, dict) else None
        if not isinstance(name, str) or not name or len(name) > MAX_QUEUE_NAME:
            self.metrics.hot.dispatch(t, "invalid")
            session.invalid(f"{t} needs a queue name of 1 to {MAX_QUEUE_NAME} characters", d)
            return None
        return name

    def _queue(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        name = self._queue_name(session, t, d)
        if name is None:
            return
        if "target" not in d or "payload" not in d:
            self.metrics.hot.dispatch(t, "invalid")
            session.invalid("QUEUE needs queue, target and payload", d)
            return
        query = self._queue_target(session, t, d["target"])
        if query is None:
            return
        self.queue_message(
            session,
            name,
            d.get("nonce"),
            d["target"],
            query,
            session.frame_bytes,
            None,
            d["payload"],
        )

    def _queue_target(self, session: SgSession, t: str, target: Any) -> Query | None:
        """A QUEUE's target, parsed once per distinct value (`_cached_target`). The key is
        `repr` of the decoded value, which tells apart every JSON and msgpack value (`1`,
        `1.0` and `True` included) at a tenth of the parse. ETF values (atoms, tuples) are
        parsed each time."""
        if session.encoding is Encoding.ETF:
            return self._parse_target(session, t, target)
        try:
            key = repr(target)
        except RecursionError:  # nested past any query's depth: parse says why
            return self._parse_target(session, t, target)
        cached = self._cached_target(session, t, key, target)
        return None if cached is None else cached[1]

    def _cached_target(
        self, session: SgSession, t: str, key: str, target: Any, *, text: bool = False
    ) -> tuple[Any, Query] | None:
        """(target value, parsed query) for `key`: producers address the same consumers
        message after message, and parsing (compiling the predicates) cost more than the rest
        of storing the message; a query is immutable, so messages share it. `text`: `target`
        is the JSON text `key` itself (from the scanner), decoded only on a miss.

        One cache for both readings: decoded frames' keys are `repr`s, the scanner's JSON
        texts, and a JSON text that is also the `repr` of a value denotes that same value
        (`1`, `1.0`, `"it's"`, `[1, 2]`; `repr` writes `True`, `None` and single quotes,
        which JSON does not)."""
        cache = self._queue_targets
        cached = cache.get(key)
        if cached is None:
            value = json_value(target) if text else target
            query = self._parse_target(session, t, value)
            if query is None:
                return None
            cached = (value, query)
            budget = self.settings.target_cache_bytes
            cost = 3 * len(key) + TARGET_ENTRY_BYTES
            if cost > budget // TARGET_CACHE_SHARE:
                return cached  # parsed for this message only
            if len(cache) >= QUEUE_TARGET_CACHE or self.target_cache_bytes + cost > budget:
                cache.clear()
                self.target_cache_bytes = 0
            cache[key] = cached
            self.target_cache_bytes += cost
        return cached

    def queue_batch(self, session: SgSession, batch: list[SgQueueFrame]) -> None:
        """Queue frames the scanner read (`bind`), in order: the same handling as
        `_queue`, `_queue_request` and `_queue_ack` (through the same `queue_message`,
        `request_queue` and `ack_queue`) without decoding whole frames or walking `handle`
        and `dispatch` per frame (three frames per queued message). The scanner reads only
        frames these accept (names within the limits): the others reach `handle` whole."""
        client = session.client
        assert client is not None
        hot = self.metrics.hot
        for item in batch:
            if session.closing:  # as `on_message`: nothing more is read from a closing client
                return
            hot.frames_in += 1
            if item[0] == QUEUE_ACK:
                self.ack_queue(item[1], item[2])
            elif item[0] == QUEUE_REQUEST:
                self.request_queue(session, client, "QUEUE_REQUEST", item[1])
            else:
                _, name, nonce_text, target_text, payload_text, size, canonical = item
                cached = self._cached_target(session, "QUEUE", target_text, target_text, text=True)
                if cached is None:
                    continue
                nonce = None if nonce_text is None else json_value(nonce_text)
                payload = json_value(payload_text)
                self.queue_message(
                    session,
                    name,
                    nonce,
                    *cached,
                    size,
                    payload_text if canonical else None,
                    payload,
                )

    def queue_message(
        self,
        session: SgSession,
        name: str,
        nonce: Any,
        target: Any,
        query: Query,
        frame_size: int,
        payload_json: str | None,
        payload: Any,
    ) -> None:
        """Store a QUEUE's message (both paths). `payload_json`: the payload's JSON text, kept
        for JSON consumers (read by the scanner) and charged to the budget with the frame."""
        extra = 0 if payload_json is None else len(payload_json)
        message = Message(
            Queues.new_id(),
            name,
            nonce,
            target,
            payload,
            query=query,
            size=frame_size + MESSAGE_OVERHEAD + extra,
            payload_json=payload_json,
        )
        self.store_message(session, message)

    def store_message(self, session: SgSession, message: Message) -> None:
        """Confirm once stored: memory at once (confirm, then deliver) when the budget has
        room, else op 3 `queue_full` and nothing kept; Redis after its write."""
        queues = self.queues
        app = session.client.app_id if session.client is not None else ""
        if isinstance(queues, Queues):
            try:
                queues.admit(message, app)
            except TooManyQueues as err:
                self.too_many_queues(session, "QUEUE", err, message.nonce)
                return
            except BudgetExceeded as err:
                self.metrics.hot.dispatch("QUEUE", "full")
                session.invalid(
                    "queue_full",
                    {
                        "queue": message.queue,
                        "nonce": message.nonce,
                        "limit": err.limit,
                        "reason": f"the message was not stored: {err}",
                    },
                )
                return
            self.metrics.hot.add(_QUEUE_STORED)
            self.confirm(session, message)
            queues.stored(message)
            return
        self.metrics.hot.dispatch("QUEUE", "stored")
        task = asyncio.get_running_loop().create_task(self._store_durably(session, message, app))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store_durably(self, session: SgSession, message: Message, app: str) -> None:
        try:
            await self.queues.store(message, app)
        except TooManyQueues as err:
            if not session.closing:
                self.too_many_queues(session, "QUEUE", err, message.nonce)
            return
        except BudgetExceeded as err:
            self.metrics.hot.dispatch("QUEUE", "full")
            if not session.closing:
                session.invalid(
                    "queue_full",
                    {
                        "queue": message.queue,
                        "nonce": message.nonce,
                        "limit": err.limit,
                        "reason": f"the message was not stored: {err}",
                    },
                )
            return
        except StoreUnknown as err:
            log.warning("singyeong: queue %s: stored or not, unknown: %s", message.queue, err)
            self.metrics.hot.dispatch("QUEUE", "unknown")
            _refuse_queued(session, message, "queue unknown: cannot tell whether it was stored")
            return
        except Exception as err:  # NotStored, or failed before writing: certainly not stored
            # (NotStored at debug: its cause is logged once per batch or outage by the store,
            # and an outage refuses every QUEUE of it; the dispatch counter counts them)
            level = logging.DEBUG if isinstance(err, NotStored) else logging.WARNING
            log.log(level, "singyeong: queue %s: could not store: %s", message.queue, err)
            self.metrics.hot.dispatch("QUEUE", "unavailable")
            _refuse_queued(session, message, "queue unavailable: the message was not stored")
            return
        if not session.closing:
            self.confirm(session, message)
        self.queues.stored(message)

    def confirm(self, session: SgSession, message: Message) -> None:
        name = message.queue
        if session.encoding is Encoding.JSON:
            session.peer.send_text(self._confirm_json(name, message.nonce, self.now_ms()))
            return
        session.send(
            frames.dispatch(
                "QUEUE_CONFIRM", {"queue": name}, self.now_ms(), message.nonce, queue=name
            )
        )

    def _confirm_json(self, name: str, nonce: Any, ts: int) -> bytes:
        """QUEUE_CONFIRM as JSON; one without a nonce (the usual) is kept while its `ts` lasts."""
        last = self._confirm
        if nonce is None and last[0] == name and last[1] == ts:
            return last[2]
        quoted = json_text_of_str(name)
        data = dispatch_json(
            "QUEUE_CONFIRM", f'{{"queue":{quoted}}}', ts, nonce, f',"queue":{quoted}'
        )
        if nonce is None:
            self._confirm = (name, ts, data)
        return data

    def _queue_request(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        name = self._queue_name(session, t, d)
        if name is not None:
            self.request_queue(session, client, t, name)

    def request_queue(self, session: SgSession, client: Client, t: str, name: str) -> None:
        """A QUEUE_REQUEST with a valid name (both paths)."""
        try:
            self.queues.request(name, session, client.app_id)
        except TooManyQueues as err:
            self.too_many_queues(session, t, err, None)
            return
        except TooManyRequests as err:
            self.metrics.hot.dispatch(t, "refused")
            self.metrics.refused.inc(1, f"requests_{err.limit}")
            session.invalid(
                "too many outstanding QUEUE_REQUESTs",
                {"queue": name, "limit": err.limit, "reason": str(err)},
            )
            return
        names = client.queues
        if name not in names and len(names) >= CLIENT_QUEUE_NAMES:
            # the names a client asked for outlive its requests (metadata changes pump
            # them): forget those whose queue has gone before keeping another
            names.intersection_update(self.queues.names())
        if len(names) < CLIENT_QUEUE_NAMES:
            names.add(name)
        self.metrics.hot.add(_REQUEST_OK)

    def too_many_queues(self, session: SgSession, t: str, err: TooManyQueues, nonce: Any) -> None:
        """Op 3 `too_many_queues`: a QUEUE or QUEUE_REQUEST naming a queue that does not exist
        while its application's (or the gateway's) queues are at their bound."""
        self.metrics.hot.dispatch(t, "refused")
        self.metrics.refused.inc(1, f"queues_{err.limit}")
        session.invalid(
            "too_many_queues",
            {"queue": err.name, "nonce": nonce, "limit": err.limit, "reason": str(err)},
        )

    def _queue_cancel(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        name = self._queue_name(session, t, d)
        if name is None:
            return
        client.queues.discard(name)
        self.queues.cancel(name, session)
        self.metrics.hot.dispatch(t, "ok")

    def _queue_ack(self, session: SgSession, client: Client, t: str, d: Any) -> None:
        name = self._queue_name(session, t, d)
        if name is None:
            return
        message_id = d.get("id")
        if not isinstance(message_id, str):
            self.metrics.hot.dispatch(t, "invalid")
            session.invalid("QUEUE_ACK needs queue and id", d)
            return
        self.ack_queue(name, message_id)

    def ack_queue(self, name: str, message_id: str) -> None:
        """A QUEUE_ACK with a valid name and id (both paths)."""
        acked = self.queues.ack(name, message_id)
        self.metrics.hot.add(_ACK_OK if acked else _ACK_UNKNOWN)

    _handlers: ClassVar[
        dict[str, Callable[[SingyeongDialect, SgSession, Client, str, Any], None]]
    ] = {
        "UPDATE_METADATA": _update_metadata,
        "SEND": _send,
        "BROADCAST": _send,
        "QUERY_NODES": _query_nodes,
        "QUEUE": _queue,
        "QUEUE_REQUEST": _queue_request,
        "QUEUE_REQUEST_CANCEL": _queue_cancel,
        "QUEUE_ACK": _queue_ack,
    }

    # ---- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Once (the listener and a test may both call it): a second close must not reopen
        Redis connections the owner has already closed."""
        if self._closed:
            return
        self._closed = True
        for handle in (self._sweeper, self._metadata_timer):
            if handle is not None:
                handle.cancel()
        self._sweeper = self._metadata_timer = None
        for task in list(self._tasks):
            task.cancel()
        await self.queues.close()
        await self.proxy.close()
        if self.cluster is not None:
            await self.cluster.close()


def _refuse_queued(session: SgSession, message: Message, error: str) -> None:
    """Op 3 for a QUEUE the store did not confirm, naming the message (as queue_full does): a
    producer with several in flight must know which one to send again."""
    if not session.closing:
        session.invalid(error, {"queue": message.queue, "nonce": message.nonce})
