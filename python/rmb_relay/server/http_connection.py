"""An HTTP/1.1 connection of the listener: it moves bytes and nothing else.

Theory of operation
-------------------
A connection starts here: every `data_received` goes to the Rust `HttpStreamParser` in one
call, which returns events. A request head starts a task that asks the router for a response;
the body's events feed an `IncomingBody` that the route reads whole or as it arrives (reading
pauses while too much of it waits unread, and, for a body the route charges to an upload rate
(`RequestBody.throttle`, the tunnel's), for as long as the rate asks after each read: a loop
timer resumes it, so TCP slows the sender instead of the relay refusing it). Bytes that arrive
after the request's end (pipelined) wait in the parser, and reading pauses until the response
is written (a client that waits for its answer is never paused). The next request is not parsed
either while the connection's own output is over its write high-water mark: a client that
pipelines requests and never reads the answers stops being read, instead of having the relay
queue answers for it without end; it resumes once the client has read (`resume_writing`), and
is closed if it reads nothing for the idle timeout.

Timers: the idle timer runs only while the connection waits for a request head (from the
connection or the previous response on); a head that never completes is answered with 408.
Once a head is complete, the request deadline bounds how long the handler takes to answer (503
when it expires); time the handler spends waiting for the client's body does not count, each
such wait is bounded by the idle timeout instead, and so is each wait for the client to read a
streamed response.

A websocket upgrade asks the matching dialect to `accept`, handing it the
`WebSocketConnection` that will carry the connection (ws_connection.py); on success the 101 is
written and that connection takes the transport over (connection_base.py), fed whatever the
client sent after its head.

A dialect's fast path (`HttpFastPath`, the tunnel's hub) may serve a whole request from the
read in the Rust core, without a task; its answer comes back through the connection's outbox
(`write_taken`), or through `fast_answer` / `adopt_fast` when Python must answer after all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

from rmb_relay._core import (
    HttpData,
    HttpEnd,
    HttpParseError,
    HttpRequest,
    HttpStreamParser,
    HttpViolation,
    encode_chunk,
    encode_last_chunk,
    encode_response,
    encode_response_head,
    encode_switching_protocols,
    validate_websocket_upgrade,
)
from rmb_relay.contract import HttpResponse, reject_response
from rmb_relay.errors import HttpReject
from rmb_relay.server.connection_base import ConnectionBase, ConnectionHost, State
from rmb_relay.server.http import BODY_BUFFER_LIMIT, IncomingBody
from rmb_relay.server.limits import OPS_PATHS
from rmb_relay.server.ws_connection import WebSocketConnection

if TYPE_CHECKING:
    from rmb_relay.dialects.base import HttpEvent, HttpFastPath

log = logging.getLogger("rmb_relay.server")

#: how early the idle timer may fire and still close (timers fire to the millisecond): a
#: timer found earlier than its deadline by more waits again
IDLE_SLACK = 0.005
#: the interim answer to `Expect: 100-continue` (RFC 9110 §15.2.1)
CONTINUE = encode_response_head(100, [])


class HttpConnection(ConnectionBase):
    """A TCP connection of the listener in its HTTP life; see the module docstring."""

    __slots__ = (
        "_body",
        "_client_done",
        "_continue_sent",
        "_fast",
        "_fast_pending",
        "_http_paused",
        "_http_timer",
        "_idle_deadline",
        "_next_on_drain",
        "_parser",
        "_request",
        "_response_started",
        "_task",
        "_throttle_timer",
        "_upgrading",
    )

    def __init__(self, server: ConnectionHost, *, ops: bool = False) -> None:
        super().__init__(server)
        self.ops_listener = ops
        self._parser: HttpStreamParser | None = HttpStreamParser(
            max_head=server.config.max_http_head
        )
        # the request being served: its head, its body, how far the answer got
        self._request: HttpRequest | None = None
        self._body: IncomingBody | None = None
        self._response_started = False
        self._continue_sent = False
        self._http_paused = False
        #: serves a whole request in the Rust core from the read (`HttpFastPath`), if any
        self._fast: HttpFastPath | None = server.http_fast_path
        #: a request `_fast` took is being served: its answer comes through `write_taken`
        #: (or `fast_answer`, `adopt_fast`), and nothing more is parsed until then
        self._fast_pending = False
        #: the websocket a dialect is accepting this connection as (state UPGRADING)
        self._upgrading: WebSocketConnection | None = None
        self._http_timer: asyncio.TimerHandle | None = None
        #: reading is held for the body's upload rate until this timer fires (`_throttle`)
        self._throttle_timer: asyncio.TimerHandle | None = None
        #: loop time the idle timer closes the connection at; None while a request is served
        #: (the timer, once armed, stays: `_http_idle` re-arms it for the rest of the wait)
        self._idle_deadline: float | None = None
        self._task: asyncio.Task[None] | None = None
        #: the client half-closed: answer the request being served, then close
        self._client_done = False
        #: the last answer left the output over its high-water mark: the next request is read
        #: when it drains (`resume_writing`)
        self._next_on_drain = False

    # ---- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer_host, self.peer_port = str(peer[0]), int(peer[1])
        self.transport.set_write_buffer_limits(high=self.server.config.write_high_water)
        self.server.connection_opened(self)
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        if self.state is not State.HTTP:
            # UPGRADING: the parser kept earlier bytes; a well-behaved client sends nothing
            # until the 101, and reading is paused meanwhile. CLOSING/CLOSED, or handed over to
            # a websocket: nothing more is read here.
            return
        self.bytes_in += len(data)
        self.last_active = self._activity.now
        fast = self._fast
        if fast is None or self._request is not None or self.ops_only:
            self._on_http_bytes(data)
        elif self._fast_pending:
            # pipelined bytes wait in the parser (it is done) until the answer is out
            self._on_http_bytes(data)
            self._pause_http()
        else:
            assert self._parser is not None
            http_events = fast.feed(self, self._parser, data)
            if http_events is None:
                self.messages_in += 1
                self._fast_pending = True
                self._idle_deadline = None  # the fast path's answer deadline takes over
            else:
                self._on_http_events(http_events)

    def eof_received(self) -> bool | None:
        """The client will send nothing more. A request being served still gets its answer
        (a client may half-close after sending, as `nc -N` does); then the connection
        closes. Anything else closes at once."""
        if self._fast_pending and self._fast is not None:
            self._client_done = True
            self._fast.client_done(self)
            return True
        if self.state is State.HTTP and self._request is not None:
            body = self._body
            if body is not None and not body.finished:
                self._refuse(400, "connection half-closed before the request body ended")
                return None
            self._client_done = True
            return True  # keep the transport open for the answer
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        if self._http_timer is not None:
            self._http_timer.cancel()
        if self._throttle_timer is not None:
            self._throttle_timer.cancel()
            self._throttle_timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        fast = self._fast
        if fast is not None:
            fast.closed(self, self._fast_pending)
            self._fast_pending = False
        outboxes = self._outboxes
        if outboxes is not None:
            outboxes.remove(self.conn_id)
        upgrading, self._upgrading = self._upgrading, None
        if upgrading is not None:
            upgrading.connection_lost(exc)  # the client left while the dialect accepted it
        self._lost()

    # ---- answers to requests the fast path took --------------------------------------------

    def write_taken(self, data: bytes | memoryview) -> None:
        """Write bytes taken from this connection's outbox (`Outboxes.drain`). For a client
        whose request the fast path took, they are its whole answer, kept alive (the fast
        path leaves every other answer to Python): the next request is read."""
        self._write(data)
        if self._fast_pending:
            self.messages_out += 1
            self._fast_pending = False
            if self.state is State.HTTP:
                self._next_request()

    def fast_answer(self, response: HttpResponse, method: str) -> None:
        """Python's answer to a request the fast path took (503 when its connector left,
        504 at its deadline): written whole, and the connection closes, as after any error."""
        if not self._fast_pending:
            return
        self._fast_pending = False
        if self.state is not State.HTTP:
            return
        self.server.metrics.http_requests.inc(1, method or "other", str(response.status))
        self._respond(response, close=True)

    def adopt_fast(self, request: HttpRequest, response: HttpResponse) -> None:
        """A request the fast path took is answered by Python after all (an answer the fast
        path does not write: a stored body, an error status, a half-closed client): it
        becomes this connection's request being served, its body read whole, and `response`
        is sent as any handler's is. Nothing when the client is gone."""
        if not self._fast_pending:
            return
        self._fast_pending = False
        if self.state is not State.HTTP:
            return
        config = self.server.config
        body = IncomingBody(
            0,
            limit=config.max_message,
            idle_timeout=config.http_idle_timeout,
            on_read=self._on_body_read,
        )
        if not body.finished:
            body.finish([])
        self._request = request
        self._body = body
        self._response_started = False
        if response.stream is not None or request.method == "HEAD":
            self._task = asyncio.get_running_loop().create_task(
                self._serve(request, body, response)
            )
            return
        keep = request.keep_alive and response.status < 400 and not self._client_done
        try:
            self._send_whole(request, body, response, keep)
        except Exception:
            # an answer that cannot be encoded (a status or a field HTTP/1.1 cannot carry,
            # from the connector): 500, as `_serve` answers; this runs inside the connector's
            # read, which must not end for it
            log.exception("internal error answering %s %s", request.method, request.path)
            self._respond(HttpResponse(500, b"internal server error"), close=True)

    # ---- requests ------------------------------------------------------------------------

    def _on_http_bytes(self, data: bytes) -> None:
        parser = self._parser
        assert parser is not None
        self._on_http_events(parser.feed(data))

    def _on_http_events(self, events: list[HttpEvent]) -> None:
        parser = self._parser
        assert parser is not None
        for event in events:
            if self.state is not State.HTTP:
                return  # refused: the rest of the request is not read
            kind = type(event)
            if kind is HttpData:
                body = self._body
                assert body is not None
                body.feed(event.data)  # type: ignore[union-attr]
                if body.buffered > BODY_BUFFER_LIMIT:
                    self._pause_http()  # until the handler catches up (_on_body_read)
            elif kind is HttpRequest:
                self._start_request(event)  # type: ignore[arg-type]
            elif kind is HttpEnd:
                body = self._body
                assert body is not None
                body.finish(event.trailers)  # type: ignore[union-attr]
            else:
                violation: HttpViolation = event  # type: ignore[assignment]
                self._refuse(violation.status, violation.reason)
                return
        body = self._body
        if body is not None and body.charge is not None and body.received > body.charged:
            self._charge_upload(body)
        if parser.buffered and self._request is not None:
            body = self._body
            if body is not None and body.finished:
                # bytes past the request's end (pipelined) wait in the parser until it is
                # answered, and reading stops meanwhile. Paused only then, not at every
                # request's end: a client that waits for its answer costs no pause and
                # resume (two epoll_ctl calls per request)
                self._pause_http()

    def _start_request(self, request: HttpRequest) -> None:
        self.messages_in += 1
        self._idle_deadline = None  # the request deadline takes over from the idle timer
        if request.is_websocket_upgrade and request.has_body:
            self._refuse(400, "websocket upgrade with a body")
            return
        if self.ops_only and request.path not in OPS_PATHS:
            self._refuse(503, "connection limit reached: only /health and /metrics are served")
            return
        hosts = request.header_count("host")
        if hosts > 1 or (hosts == 0 and request.version >= 1):
            # RFC 9112 section 3.2: exactly one Host on HTTP/1.1, at most one on 1.0
            self._refuse(400, "missing Host header" if hosts == 0 else "duplicate Host header")
            return
        config = self.server.config
        self._request = request
        self._response_started = False
        self._continue_sent = False
        self._body = IncomingBody(
            request.content_length,
            limit=config.max_message,
            idle_timeout=config.http_idle_timeout,
            on_read=self._on_body_read,
        )
        self._start_task()

    def _start_task(self) -> None:
        request, body = self._request, self._body
        assert request is not None
        assert body is not None
        self._task = asyncio.get_running_loop().create_task(self._serve(request, body))

    def refuse_at_once(self, status: int, reason: str) -> None:
        """Answer a connection the caps do not admit, without reading its request, and close."""
        log.debug("refusing connection from %s: %s", self.peer_host, reason)
        self._respond(HttpResponse(status, reason.encode()), close=True)

    def _refuse(self, status: int, reason: str) -> None:
        """The client broke HTTP/1.1 (or a limit): answer with `status` if no answer has
        started yet, and close."""
        log.info("bad HTTP request from %s: %s (%d)", self.peer_host, reason, status)
        self.server.metrics.http_errors.inc(1, str(status))
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the request is broken: its handler's answer is moot
        if self._response_started:
            self._abort_http()
        else:
            self._respond(HttpResponse(status, reason.encode()), close=True)

    def _charge_upload(self, body: IncomingBody) -> None:
        """Charge what this read added to the body to its upload rate (`RequestBody.throttle`)
        and stop reading for as long as the rate asks: TCP then slows the sender down."""
        charge = body.charge
        assert charge is not None
        size = body.received - body.charged
        body.charged = body.received
        wait = charge(size)
        if wait <= 0 or body.finished or self.state is not State.HTTP:
            return
        if self._throttle_timer is not None:
            self._throttle_timer.cancel()
        body.paused = True
        body.pauses += 1
        self._pause_http()
        self._throttle_timer = self.closed.get_loop().call_later(wait, self._unthrottle, body)

    def _unthrottle(self, body: IncomingBody) -> None:
        """The upload rate's pause is over: read again, unless the handler is behind."""
        self._throttle_timer = None
        body.paused = False
        if (
            body is self._body
            and self.state is State.HTTP
            and (body.buffered <= BODY_BUFFER_LIMIT // 2)
        ):
            self._resume_http()

    def _on_body_read(self, body: IncomingBody) -> None:
        """The handler took body bytes or waits for some."""
        request = self._request
        if body is not self._body or request is None or self.state is not State.HTTP:
            return  # (a body of an earlier request, still being read after its answer)
        if (
            request.expect_continue
            and not self._continue_sent
            and not self._response_started
            and body.received == 0
            and not body.finished
        ):
            self._continue_sent = True  # RFC 9110 §10.1.1: only once, only before the answer
            self._write(CONTINUE)
        if not body.finished and body.buffered <= BODY_BUFFER_LIMIT // 2:
            self._resume_http()

    async def _serve(
        self, request: HttpRequest, body: IncomingBody, response: HttpResponse | None = None
    ) -> None:
        """Answer and send (`response` given: the fast path's, to send)."""
        try:
            if response is None:
                response = await self._answer(request, body)
            if response is not None:
                await self._send(request, body, response)
        except asyncio.CancelledError:
            raise
        except ConnectionError as err:
            log.info("HTTP client %s went away: %s", self.peer_host, err)
            self._abort_http()
        except Exception:
            log.exception("internal error serving %s %s", request.method, request.path)
            if self._response_started:
                self._abort_http()  # a half-sent response: the client sees it cut
            else:
                self._respond(HttpResponse(500, b"internal server error"), close=True)
        finally:
            # let the finished task go: after an upgrade the connection lives on for hours,
            # and a done task keeps its coroutine and context (~580 bytes per websocket)
            if self._task is asyncio.current_task():
                self._task = None

    async def _answer(self, request: HttpRequest, body: IncomingBody) -> HttpResponse | None:
        """The handler's response, within the request deadline (None once upgraded)."""
        limit = self.server.config.http_request_timeout
        try:
            async with asyncio.timeout(limit) as deadline:
                body.deadline = deadline
                try:
                    if request.is_websocket_upgrade:
                        await self._upgrade(request)
                        return None
                    return await self.server.dispatch(request, body, self)
                finally:
                    body.deadline = None
        except HttpReject as reject:
            return reject_response(reject)
        except TimeoutError:
            if not deadline.expired():
                raise
            log.warning(
                "%s %s from %s not answered within %g s",
                request.method,
                request.path,
                self.peer_host,
                limit,
            )
            if self.state is State.UPGRADING:
                self.state = State.HTTP  # the dialect's accept ran out of time
            return HttpResponse(503, f"request not answered within {limit:g} s".encode())

    async def _send(self, request: HttpRequest, body: IncomingBody, response: HttpResponse) -> None:
        """Write the response (head only for HEAD), then serve the next request or close."""
        if self.state is not State.HTTP:
            return
        # The connection persists if the client wants it, the answer is no refusal and the
        # request was read to its end; a response sent before the body was read closes it
        # (RFC 9110 §10.1.1), unless it streams (a tunnel may still be reading the body).
        keep = request.keep_alive and response.status < 400 and not self._client_done
        if response.stream is None and request.method != "HEAD":
            self._send_whole(request, body, response, keep)
            return
        if response.stream is None and not body.finished:
            keep = False
        self.server.metrics.http_requests.inc(1, request.method, str(response.status))
        if response.stream is not None:
            if response.length is None and request.version == 0:
                keep = False  # its body ends with the connection
            await self._send_stream(request, response, close=not keep)
        else:  # HEAD
            bodyless = response.status < 200 or response.status in (204, 304)
            self._response_started = True
            self.messages_out += 1
            self._write(
                encode_response_head(
                    response.status,
                    response.header_list(),
                    content_length=None if bodyless else len(response.body),
                    close=not keep,
                )
            )
        if keep and body.finished and self.state is State.HTTP:
            self._next_request()
        else:
            self._close_http()

    def _send_whole(
        self, request: HttpRequest, body: IncomingBody, response: HttpResponse, keep: bool
    ) -> None:
        """A response with its body in memory, in one write; then the next request."""
        if response.stream is None and not body.finished:
            keep = False
        self.server.metrics.http_requests.inc(1, request.method, str(response.status))
        self._response_started = True
        self.messages_out += 1
        self._write(
            encode_response(response.status, response.header_list(), response.body, close=not keep)
        )
        if keep and body.finished and self.state is State.HTTP:
            self._next_request()
        else:
            self._close_http()

    async def _send_stream(
        self, request: HttpRequest, response: HttpResponse, *, close: bool
    ) -> None:
        """Head, then the stream as it comes: raw bytes when its length is known, else chunks."""
        stream = response.stream
        assert stream is not None
        length = response.length
        # HTTP/1.0 cannot read chunked: a body of unknown length ends with the connection
        chunked = length is None and request.version >= 1
        try:
            head = encode_response_head(
                response.status,
                response.header_list(),
                content_length=length,
                chunked=chunked,
                close=close or (length is None and not chunked),
            )
            self._response_started = True
            self.messages_out += 1
            self._write(head)
            if request.method == "HEAD":
                return
            sent = 0
            async for piece in stream:
                if not piece:
                    continue
                sent += len(piece)
                if length is not None and sent > length:
                    raise RuntimeError(f"response stream longer than its length {length}")
                self._write(encode_chunk(piece) if chunked else piece)
                await self._drain()
            if chunked:
                self._write(encode_last_chunk())
            elif sent != length:
                raise RuntimeError(f"response stream ended at {sent} of its length {length}")
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _drain(self) -> None:
        """Wait while the client is slow to read our response (bounded by the idle timeout)."""
        if self.congested:
            timeout = self.server.config.http_idle_timeout
            try:
                await asyncio.wait_for(self.writable(), timeout)
            except TimeoutError:
                raise ConnectionError(f"response not read for {timeout:g} s") from None
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionError("connection lost while sending the response")

    def _next_request(self) -> None:
        """Keep-alive: wait for the next request (idle timer), or parse a pipelined one."""
        parser = self._parser
        assert parser is not None
        parser.start_next_cycle()
        self._request = None
        self._body = None
        self._response_started = False
        self._arm_idle_timer()
        if self.congested:
            # the client has not read what we answered: read nothing more until it does
            self._next_on_drain = True
            self.server.metrics.reply_pauses.inc(1, self.dialect_name)
            self._pause_http()
            return
        self._read_next()

    def _read_next(self) -> None:
        parser = self._parser
        assert parser is not None
        self._resume_http()
        if parser.buffered:  # (nothing buffered, nothing to parse: no call per answer)
            self._on_http_bytes(b"")

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._next_on_drain:
            self._next_on_drain = False
            if self.state is State.HTTP and self._request is None and not self._fast_pending:
                self._read_next()

    def _arm_idle_timer(self) -> None:
        """Start the idle wait. A timer still armed from an earlier wait is kept and finds the
        new deadline when it fires: one timer per keep-alive connection rather than a
        call_later and a cancel per request (3.5 us of a tunnelled request's ~40 in the relay
        went to its two timers)."""
        # (the loop from a future of ours: get_running_loop costs a getpid syscall)
        loop = self.closed.get_loop()
        timeout = self.server.config.http_idle_timeout
        self._idle_deadline = loop.time() + timeout
        if self._http_timer is not None:
            return
        self._http_timer = loop.call_at(self._idle_deadline, self._http_idle)

    def _pause_http(self) -> None:
        transport = self.transport
        if not self._http_paused and transport is not None and not transport.is_closing():
            self._http_paused = True
            transport.pause_reading()

    def _resume_http(self) -> None:
        """Read again (not before the upload rate's pause is over: `_unthrottle` resumes)."""
        transport = self.transport
        if self._throttle_timer is not None:
            return
        if self._http_paused and transport is not None and not transport.is_closing():
            self._http_paused = False
            transport.resume_reading()

    async def _upgrade(self, request: HttpRequest) -> None:
        dialect = None if self.ops_listener else self.server.dialect_for(request.path)
        if dialect is None:
            self._respond(HttpResponse(404, b"no relay dialect serves this path"), close=True)
            return
        try:
            accept = validate_websocket_upgrade(request)
        except HttpParseError as err:
            reason, status = err.args
            # RFC 6455 section 4.4: a 426 names the versions we speak
            headers = (("Sec-WebSocket-Version", "13"),) if int(status) == 426 else ()
            self._respond(
                HttpResponse(int(status), str(reason).encode(), headers=headers), close=True
            )
            return
        self.state = State.UPGRADING
        # the dialect's Peer from the start: `accept` may keep it
        ws = self._upgrading = WebSocketConnection(self.server, dialect)
        ws.take_over(self)
        try:
            handler = await dialect.accept(request, ws)
        except HttpReject as reject:
            log.info(
                "%s upgrade from %s refused: %d %s",
                dialect.name,
                self.peer_host,
                reject.status,
                reject.reason,
            )
            self._upgrading = None
            self.state = State.HTTP
            self._respond(reject_response(reject), close=True)
            return
        transport = self.transport
        if ws.state is not State.UPGRADING or transport is None:
            handler.on_close(None)  # the client left (or the dialect closed) meanwhile
            return
        self._write(encode_switching_protocols(accept))
        parser = self._parser
        assert parser is not None
        rest = parser.take_rest()
        self._parser = None
        self._request = None
        self._body = None
        timer = self._http_timer  # the keep-alive idle timer (`_arm_idle_timer`) is HTTP's
        if timer is not None:
            self._http_timer = None
            timer.cancel()
        # hand the transport over: every later read goes to the websocket
        self._upgrading = None
        self.state = State.WEBSOCKET
        ws.congested = self.congested
        ws.start(handler)
        transport.set_protocol(ws)
        self.server.websocket_opened(ws)
        with ws.batch():
            handler.on_open()
        if self._http_paused:  # (first: reading what came with the head may pause it again)
            self._http_paused = False
            transport.resume_reading()
        if rest:
            ws.data_received(rest)

    def _respond(self, response: HttpResponse, *, close: bool) -> None:
        """A whole response written at once (refusals and errors)."""
        self._response_started = True
        self.messages_out += 1
        self._write(
            encode_response(response.status, response.header_list(), response.body, close=close)
        )
        if close:
            self._close_http()

    def _close_http(self) -> None:
        if self.state is not State.CLOSED:
            self.state = State.CLOSING
        self._close_after_output()

    def _abort_http(self) -> None:
        if self.state is not State.CLOSED:
            self.state = State.CLOSING
        if self.transport is not None:
            self.transport.abort()

    def _http_idle(self) -> None:
        """No request head (or only part of one) within the idle timeout."""
        self._http_timer = None
        deadline = self._idle_deadline
        if (
            self.state is not State.HTTP
            or self.transport is None
            or self._request is not None
            or deadline is None
        ):
            return
        loop = self.closed.get_loop()
        if loop.time() < deadline - IDLE_SLACK:  # a later idle wait than the one that armed it
            self._http_timer = loop.call_at(deadline, self._http_idle)
            return
        parser = self._parser
        if self._next_on_drain:
            log.info("HTTP client %s did not read its answers in time", self.peer_host)
            self._abort_http()
        elif parser is not None and parser.buffered:
            log.info("request head from %s not complete in time", self.peer_host)
            self._respond(HttpResponse(408, b"request head not received in time"), close=True)
        else:
            log.debug("closing idle HTTP connection from %s", self.peer_host)
            self._close_http()
