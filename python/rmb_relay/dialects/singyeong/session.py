"""One gateway connection: hello, identify, then heartbeats and dispatches (spec §3-§6).

State machine
-------------
```text
open ──hello──▶ HELLO_SENT ──identify ok──▶ READY ──(socket closes)──▶ gone
                    │  any other op: op 8 "...without identifying first", close
                    │  identify refused: op 8 (or op 3 + close for a duplicate id)
READY: heartbeat -> op 6; dispatch -> by `t`; identify again -> op 3; other ops -> op 8, close
```
Every frame is decoded here (codec.py) and answered in the socket's encoding; anything that
escapes a handler becomes op 8 `internal server error` and a close, never a dead process.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any, Protocol

from rmb_relay._core import SgScanner, WsDecoder, WsMessage
from rmb_relay.dialects.base import CloseCode, Peer, WebSocketHandler
from rmb_relay.dialects.singyeong import frames
from rmb_relay.dialects.singyeong.clients import Client
from rmb_relay.dialects.singyeong.codec import (
    DecodeError,
    Encoding,
    decode,
    dispatch_json,
    encode,
    json_text,
    json_text_of_str,
)
from rmb_relay.dialects.singyeong.etf import Struct
from rmb_relay.dialects.singyeong.frames import Op
from rmb_relay.dialects.singyeong.metadata import (
    MAX_KEY_LENGTH,
    MetadataAccount,
    MetadataError,
    MetadataLimit,
    Update,
    entry_bytes,
    validate,
)

if TYPE_CHECKING:
    from rmb_relay._core import _SgQueueFrame as SgQueueFrame
    from rmb_relay.clock import Clock
    from rmb_relay.dialects.singyeong.clients import ClientIndex
    from rmb_relay.dialects.singyeong.cluster import SgCluster
    from rmb_relay.dialects.singyeong.metrics import SgMetrics
    from rmb_relay.dialects.singyeong.query import Query
    from rmb_relay.dialects.singyeong.queues import Message
    from rmb_relay.dialects.singyeong.settings import SgSettings

log = logging.getLogger("rmb_relay.singyeong")

_OP_VALUES = frozenset(int(op) for op in Op)
#: the longest client_id or application_id (characters)
MAX_ID_LENGTH = MAX_KEY_LENGTH
# plain ints: comparing with an IntEnum member costs an attribute lookup on the enum class
_DISPATCH, _HEARTBEAT, _IDENTIFY = int(Op.DISPATCH), int(Op.HEARTBEAT), int(Op.IDENTIFY)


class SessionHost(Protocol):
    """What a session needs of its gateway (dialect.py's `SingyeongDialect`, which imports
    this module: a protocol, so that nothing here imports it back)."""

    #: bytes of every local client's metadata (`charge_metadata` keeps it)
    metadata_bytes: int

    @property
    def settings(self) -> SgSettings: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def index(self) -> ClientIndex: ...

    @property
    def metrics(self) -> SgMetrics: ...

    @property
    def cluster(self) -> SgCluster | None: ...

    @property
    def sessions(self) -> dict[int, SgSession]: ...

    def now_ms(self) -> int: ...

    def bind(self, session: SgSession, decoder: WsDecoder) -> SgScanner | None: ...

    def ensure_sweeper(self) -> None: ...

    def heard_from(self, session: SgSession) -> None: ...

    def client_ready(self, session: SgSession, client: Client) -> None: ...

    def session_closed(self, session: SgSession) -> None: ...

    def displace_local(self, client: Client, by: str) -> None: ...

    def dispatch(self, session: SgSession, client: Client, t: Any, d: Any) -> None: ...

    def queue_batch(self, session: SgSession, batch: list[SgQueueFrame]) -> None: ...

    def metadata_waiting(self, session: SgSession, due: int) -> None: ...

    def metadata_applied(self, client: Client) -> None: ...


class SgSession(WebSocketHandler):
    """See the module docstring."""

    def __init__(
        self,
        peer: Peer,
        dialect: SessionHost,
        encoding: Encoding,
        address: str | None = None,
    ) -> None:
        """`address`: the client's address as the gateway saw it (the socket's, or the
        trusted header's under `--trusted-ip-header`)."""
        super().__init__(peer)
        self.dialect = dialect
        self.encoding = encoding
        self.address = address if address is not None else peer.peer_host
        self.client: Client | None = None
        self.closing = False
        self.last_heartbeat = dialect.clock()
        #: metadata rate limit (GCRA): the theoretical arrival time of the next update (ns)
        self.metadata_tat = 0
        #: updates waiting for the rate limit, merged (later wins per key)
        self.metadata_pending: dict[str, Any] = {}
        self.metadata_pending_types: dict[str, str] = {}
        #: what the client's metadata holds once the pending updates are applied (bounds)
        self.metadata_account = MetadataAccount()
        #: the size of the frame being handled (what a QUEUE costs the queues' memory budget)
        self.frame_bytes = 0
        #: this JSON connection's scanner (the fast path: SingyeongDialect.bind), if any
        self.scanner: SgScanner | None = None
        # looked up once, not per frame
        self._text_frames = encoding.text_frames
        self._hot = dialect.metrics.hot

    # ---- sending ---------------------------------------------------------------------------

    def send(self, value: Any) -> None:
        self.send_encoded(encode(self.encoding, value))

    def send_encoded(self, data: bytes) -> None:
        if self.encoding is Encoding.JSON:
            self.peer.send_text(data)
        else:
            self.peer.send(data)

    def fatal(self, error: str, extra_info: Any = None) -> None:
        """Op 8 then close: the public server's answer to every unrecoverable state."""
        if self.closing:
            return
        self.send(frames.error(error, self.dialect.now_ms(), extra_info))
        self.closing = True
        self.peer.close(CloseCode.NORMAL, error[:120])

    def invalid(self, error: str, extra_info: Any = None) -> None:
        self.send(frames.invalid(error, self.dialect.now_ms(), extra_info))

    # ---- as a queue consumer (queues.Consumer) -----------------------------------------------

    def matches(self, query: Query) -> bool:
        client = self.client
        return client is not None and not self.closing and self.dialect.index.matches(query, client)

    def deliver_queued(self, message: Message) -> None:
        self.dialect.metrics.hot.frames_out += 1
        if self.encoding is Encoding.JSON:
            payload = message.payload_json
            text = (
                f'{{"queue":{json_text_of_str(message.queue)},"payload":'
                f"{json_text(message.payload) if payload is None else payload},"
                f'"id":{json_text_of_str(message.id)},"attempt":{message.attempts}}}'
            )
            self.peer.send_text(dispatch_json("QUEUE", text, self.dialect.now_ms(), message.nonce))
            return
        body = Struct(
            queue=message.queue, payload=message.payload, id=message.id, attempt=message.attempts
        )
        self.send(frames.dispatch("QUEUE", body, self.dialect.now_ms(), message.nonce))

    # ---- lifecycle -------------------------------------------------------------------------

    def bind_decoder(self, decoder: WsDecoder) -> None:
        self.scanner = self.dialect.bind(self, decoder)

    def on_open(self) -> None:
        dialect = self.dialect
        self.last_heartbeat = dialect.clock()  # `sessions` is in heartbeat order
        dialect.sessions[self.peer.id] = self
        dialect.ensure_sweeper()
        self.send(frames.hello(dialect.settings.heartbeat_ms, dialect.now_ms()))

    def on_close(self, code: int | None) -> None:
        self.closing = True
        self.dialect.session_closed(self)
        self.dialect.metadata_bytes -= self.metadata_account.held
        self.metadata_account.held = 0

    def displaced(self, by: str) -> None:
        """An authenticated client identified as this (restricted) one's (app, client id):
        it wins; this one is told why (op 3), then closed, and leaves the index now."""
        self.invalid("displaced", {"reason": f"an authenticated client took this id ({by})"})
        self.closing = True
        self.peer.close(CloseCode.POLICY, "displaced by an authenticated client")
        self.dialect.session_closed(self)

    # ---- receiving -------------------------------------------------------------------------

    def on_message(self, message: WsMessage) -> None:
        if self.closing:
            return
        dialect = self.dialect
        batch = message.routing
        if batch is not None:  # queue frames the scanner read (SingyeongDialect.bind)
            try:
                dialect.queue_batch(self, batch)  # type: ignore[arg-type]
            except Exception:
                log.exception("singyeong: handling frames from %s failed", self.peer.peer_host)
                self.fatal("internal server error")
            return
        self._hot.frames_in += 1
        if message.is_text != self._text_frames:
            self.fatal("decode: payload: invalid websocket opcode/encoding combo")
            return
        try:
            payload = decode(self.encoding, message.data)
        except DecodeError as err:
            dialect.metrics.decode_errors.inc(1, self.encoding.value)
            self.fatal(f"decode: {err}")
            return
        self.frame_bytes = len(message.data)
        try:
            self.handle(payload)
        except Exception:
            log.exception("singyeong: handling a frame from %s failed", self.peer.peer_host)
            self.fatal("internal server error")

    def handle(self, payload: Any) -> None:
        op = payload.get("op") if isinstance(payload, dict) else None
        if not isinstance(op, int) or isinstance(op, bool):
            self.fatal("decode: payload: a frame is an object with an integer op")
            return
        if self.client is None:
            if op != Op.IDENTIFY:
                self.fatal("sent payload with non-identify opcode without identifying first")
                return
            self.identify(payload.get("d"))
            return
        if op == _DISPATCH:
            self.dialect.dispatch(self, self.client, payload.get("t"), payload.get("d"))
        elif op == _HEARTBEAT:
            self.heartbeat()
        elif op == _IDENTIFY:
            self.invalid("already identified")
        else:
            known = op in _OP_VALUES
            self.fatal(f"invalid client op {Op(op).name.lower() if known else op}")

    def heartbeat(self) -> None:
        dialect = self.dialect
        dialect.heard_from(self)
        client = self.client
        assert client is not None
        dialect.index.set_values(client, {"last_heartbeat_time": dialect.now_ms()}, {})
        self.send(frames.heartbeat_ack(client.client_id, dialect.now_ms()))

    # ---- identify (spec §4, decisions 9 and 10) --------------------------------------------

    def identify(self, d: Any) -> None:
        dialect = self.dialect
        if not isinstance(d, dict):
            self.fatal("payload has no data")
            return
        client_id = d.get("client_id")
        app_id = d.get("application_id")
        if not isinstance(client_id, str) or not client_id:
            self.fatal("identify: client_id must be a non-empty string")
            return
        if not isinstance(app_id, str) or not app_id:
            self.fatal("identify: application_id must be a non-empty string")
            return
        if len(client_id) > MAX_ID_LENGTH or len(app_id) > MAX_ID_LENGTH:
            # ids key the index and every query answer: bounded as metadata keys are
            dialect.metrics.refused.inc(1, "id_length")
            self.fatal(f"identify: client_id and application_id are at most {MAX_ID_LENGTH} long")
            return
        password = dialect.settings.auth
        auth = d.get("auth")
        restricted = password is not None and not (
            isinstance(auth, str) and hmac.compare_digest(auth.encode(), password.encode())
        )
        if restricted and self.encoding is Encoding.ETF:
            self.fatal("restricted clients may not use ETF")
            return
        initial = d.get("metadata")
        try:
            update = validate(initial if initial is not None else {})
        except MetadataError as err:
            self.fatal("initial metadata: invalid", err.errors)
            return
        declared = d.get("ip")
        ip = declared if isinstance(declared, str) else self.address
        namespace = d.get("namespace")
        if not isinstance(namespace, str):
            namespace = None
        # the client's own strings among the base keys count against its metadata too
        given = {"ip": ip, "namespace": namespace or ""}
        try:
            self.charge_metadata(Update({}, {}, {k: entry_bytes(k, v) for k, v in given.items()}))
            self.charge_metadata(update)
        except MetadataLimit as err:
            self.fatal("initial metadata: metadata_full", err.info())
            return
        holder = dialect.index.get(app_id, client_id)
        if holder is not None:
            # under --sg-auth an authenticated client takes an id a restricted one holds here
            # (issue 33: a stranger cannot squat a service's name); else the first one keeps it
            squatter = holder.session if holder.restricted and not restricted else None
            cluster = dialect.cluster
            elsewhere = holder.node is not None and cluster is not None
            if elsewhere and holder.restricted and not restricted:
                # held on another instance: it is asked to close its restricted client; this
                # one is told to identify again once the id is free (the table says so)
                assert cluster is not None
                cluster.displace(holder, self.address)
                self.invalid(
                    f"{client_id}: held by a restricted client on another instance, which is "
                    "being closed: identify again"
                )
                self.closing = True
                self.peer.close(CloseCode.NORMAL, "id held elsewhere: identify again")
                return
            if squatter is None:
                self.invalid(f"{client_id}: already registered for app {app_id}")
                self.closing = True
                self.peer.close(CloseCode.NORMAL, "duplicate client id")
                return
            if squatter.closing:  # already told and closing: it only leaves the index sooner
                dialect.session_closed(squatter)
            else:
                dialect.displace_local(holder, self.address)
        client = Client(
            app_id,
            client_id,
            restricted=restricted,
            encoding=self.encoding.value,
            socket_ip=self.address,
            session=self,
        )
        client.receive_updates = d.get("receive_client_updates") is True and not restricted
        base = {
            "last_heartbeat_time": dialect.now_ms(),
            "restricted": restricted,
            "encoding": self.encoding.value,
            "ip": None if restricted else ip,
            "namespace": namespace,
            "receive_client_updates": client.receive_updates,
        }
        base_types = {
            "last_heartbeat_time": "integer",
            "restricted": "boolean",
            "encoding": "string",
            "ip": "string",
            "namespace": "string",
            "receive_client_updates": "boolean",
        }
        client.types.update(update.types)
        client.types.update(base_types)
        client.metadata.update(update.values)
        client.metadata.update(base)  # the gateway's own keys win (spec §4)
        self.client = client
        dialect.heard_from(self)
        self.send(frames.ready(client_id, restricted, dialect.now_ms()))
        dialect.client_ready(self, client)

    # ---- metadata (decision 8) -------------------------------------------------------------

    def charge_metadata(self, update: Update) -> None:
        """Count `update` against this client's metadata bounds; raises MetadataLimit (and
        counts the refusal) if it does not fit, nothing charged."""
        dialect = self.dialect
        settings = dialect.settings
        try:
            delta = self.metadata_account.charge(
                update,
                settings.metadata_keys,
                settings.metadata_bytes,
                (dialect.metadata_bytes, settings.metadata_total_bytes),
            )
        except MetadataLimit as err:
            self.dialect.metrics.refused.inc(1, f"metadata_{err.limit}")
            raise
        self.dialect.metadata_bytes += delta

    def update_metadata(self, d: Any) -> str:
        """Validate, bound and apply (or hold for the rate) an update; the outcome for
        `rmb_relay_sg_dispatches_total`: "ok", "invalid" or "refused" (metadata_full)."""
        try:
            update = validate(d)
        except MetadataError as err:
            self.invalid("invalid metadata", err.errors)
            return "invalid"
        try:
            self.charge_metadata(update)
        except MetadataLimit as err:
            self.invalid("metadata_full", err.info())
            return "refused"
        dialect = self.dialect
        now = dialect.clock()
        interval = 1_000_000_000 // dialect.settings.metadata_rate
        # GCRA with a burst of one second's worth: allowed while tat - now <= 1 s - interval
        tolerance = 1_000_000_000 - interval
        if not self.metadata_pending and self.metadata_tat - now <= tolerance:
            self.metadata_tat = max(self.metadata_tat, now) + interval
            self.apply_metadata(update.values, update.types)
            return "ok"
        self.metadata_pending.update(update.values)
        self.metadata_pending_types.update(update.types)
        dialect.metadata_waiting(self, self.metadata_tat - tolerance)
        return "ok"

    def flush_metadata(self, now: int) -> int | None:
        """Apply the merged pending updates if the rate allows; else the time it will (ns)."""
        if not self.metadata_pending:
            return None
        interval = 1_000_000_000 // self.dialect.settings.metadata_rate
        tolerance = 1_000_000_000 - interval
        due = self.metadata_tat - tolerance
        if now < due:
            return due
        self.metadata_tat = max(self.metadata_tat, now) + interval
        values, types = self.metadata_pending, self.metadata_pending_types
        self.metadata_pending, self.metadata_pending_types = {}, {}
        self.apply_metadata(values, types)
        return None

    def apply_metadata(self, values: dict[str, Any], types: dict[str, str]) -> None:
        client = self.client
        if client is None or self.closing:
            return
        self.dialect.index.set_values(client, values, types)
        self.dialect.metadata_applied(client)
