"""`POST /`: envelopes other relays forward to twins of this relay (decision 4).

rmb-rs takes anything posted here and pushes it to the destination's stream, which makes every
relay an open forwarder to its twins for anyone on the internet (spec §8.1). Here the request
passes, in order, each check answering with the status the origin relay understands (a 4xx is
permanent there, anything else is retried):

| check | refusal |
|---|---|
| body at most `--max-message` (the router, before reading it) | 413 |
| the body parses as an Envelope with a destination | 400 `bad request: ...` |
| it has a source twin (twin 0 is a relay's own error, made locally, never posted) | 400 |
| the destination twin is served here (a shared domain; standalone: it names no relay) | 403 |
| signed by the source twin's account key (on by default; `--no-verify-federated`) | 403 |
| `fail-fast` tag and the destination is not connected | 404 `destination offline` |
| the directory or the mailbox is down | 500 (the origin retries) |

Accepted: delivered to the destination's connection or stored in its mailbox, then 202 with an
empty body, as rmb-rs. Every answer carries `RMB-Batch-Max`: other rmb-relays then post batches
of envelopes (`batch.py`), each envelope answered as if it had been posted alone.

Route records (`--records`): one record per envelope, once its answer is decided, through the
RMB channel: the route it took here (`local`, `cluster` for a session held by another instance,
`mailbox` stored, `delivered` or `queued`) or `none`/`rejected` with the refusal's label as
reason (`bad request`, `not served here`, `bad signature`, `destination offline`, `twin lookup
failed`, `mailbox full`, `mailbox down`, `redis down`). `remote` is the relay that posted it,
as its `RMB-Relay-Domain` header says (rmb-relays send it; rmb-rs does not: null), and
`relay_us` runs from the request's arrival. A 413 is answered by the router before this
handler sees the body: no record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmb_relay._core import Envelope, SignatureError, scan_envelope, verify_prefixed
from rmb_relay.contract import HttpResponse
from rmb_relay.errors import (
    ClusterUnavailable,
    EnvelopeError,
    MailboxFull,
    MailboxUnavailable,
    TwinLookupError,
)
from rmb_relay.federation.batch import (
    BATCH_HEADER,
    BATCH_TYPE,
    ORIGIN_HEADER,
    STATUS_TYPE,
    decode_batch,
    encode_statuses,
)
from rmb_relay.switch import Outcome
from rmb_relay.throttle import ip_key

if TYPE_CHECKING:
    from rmb_relay._core import EnvelopeRouting, HttpRequest
    from rmb_relay.contract import HttpClient
    from rmb_relay.mailbox import SessionKey
    from rmb_relay.switch import Switch
    from rmb_relay.telemetry.records import Channel
    from rmb_relay.twins import Twin, TwinDirectory

log = logging.getLogger("rmb_relay.federation")

#: (status, reason) of one envelope
Answer = tuple[int, bytes]
ACCEPTED: Answer = (202, b"")
#: longest domain name (RFC 1035); a longer header is not recorded
MAX_DOMAIN = 253
#: route record (route, outcome) of an accepted envelope, by what the switch did with it
_ROUTED = {
    Outcome.DELIVERED: ("local", "delivered"),
    Outcome.FORWARDED: ("cluster", "delivered"),
    Outcome.QUEUED: ("mailbox", "queued"),
}

#: route-record label of an envelope the switch could not take, as the RMB dialect labels it
_UNAVAILABLE: dict[type[MailboxUnavailable], str] = {
    MailboxFull: "mailbox full",
    ClusterUnavailable: "redis down",
}


class _Route:
    """An envelope that passed the checks, and its destination session."""

    __slots__ = ("env", "key")

    def __init__(self, env: EnvelopeRouting) -> None:
        self.env = env
        self.key: SessionKey = (env.dest_twin, env.dest_connection)


class _Refusal:
    """An envelope's refusal: the answer, its route-record label and what was parsed of it."""

    __slots__ = ("answer", "env", "label")

    def __init__(self, status: int, reason: str, label: str, env: EnvelopeRouting | None) -> None:
        self.answer: Answer = (status, reason.encode())
        self.label = label
        self.env = env


class _Request:
    """What one `POST /` says about the envelopes it carries, for their route records: when it
    arrived (the records' clock) and the relay that sent it."""

    __slots__ = ("received", "remote")

    def __init__(self, received: int | None, remote: str | None) -> None:
        self.received = received
        self.remote = remote


class InboundStats:
    """Requests by answer, read at scrape."""

    def __init__(self) -> None:
        self.by_status: dict[str, int] = {}

    def count(self, label: str, n: int = 1) -> None:
        self.by_status[label] = self.by_status.get(label, 0) + n


class InboundFederation:
    """The `POST /` handler; see the module docstring."""

    def __init__(
        self,
        directory: TwinDirectory,
        switch: Switch,
        is_ours: Callable[[Twin], bool],
        *,
        verify: bool = True,
        max_body: int = 1 << 20,
    ) -> None:
        self.directory = directory
        self.switch = switch
        self.is_ours = is_ours
        self.verify = verify
        self.stats = InboundStats()
        self._headers = ((BATCH_HEADER, str(max_body)),)
        #: route records (--records), or None
        self.records: Channel | None = switch.record_channel("rmb")

    async def handle(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        records = self.records
        origin = None
        if records is not None:
            origin = _Request(records.clock(), _origin(request.header(ORIGIN_HEADER)))
        content_type = request.header("content-type")
        if content_type is not None and content_type.split(b";")[0].strip() == BATCH_TYPE.encode():
            return await self._handle_batch(request.body, client, origin)
        status, reason = await self._handle(request.body, origin, self._sender(client))
        self._count(status, reason, client)
        return HttpResponse(status, reason, headers=self._headers)

    async def _handle_batch(
        self, body: bytes, client: HttpClient, origin: _Request | None
    ) -> HttpResponse:
        """Every envelope is checked first; those for a connected, uncongested session are then
        written in one pass (one socket write per receiving connection, not one per
        envelope); the rest (offline: mailbox; congested: wait) go the single POST's way, in
        order per destination."""
        try:
            envelopes = decode_batch(body)
        except EnvelopeError as err:
            reason = f"bad request: {err}".encode()
            self._count(400, reason, client)
            if origin is not None:  # one record: its envelopes cannot be told apart
                self._record(None, len(body), "none", "rejected", "bad request", origin)
            return HttpResponse(400, reason, headers=self._headers)
        answers: list[Answer] = [ACCEPTED] * len(envelopes)
        routes: list[tuple[int, bytes, _Route]] = []
        ours: set[int] = set()  # destination twins checked in this batch
        for index, envelope in enumerate(envelopes):
            try:
                env = scan_envelope(envelope)
            except EnvelopeError as err:
                answers[index] = self._refused(_malformed(err), len(envelope), origin)
                continue
            if not self.verify and env.dest_twin in ours:
                # the usual case: a twin already checked, nothing to await
                routes.append((index, envelope, _Route(env)))
                continue
            checked = await self._check_scanned(env, envelope)
            if isinstance(checked, _Route):
                ours.add(checked.env.dest_twin)
                routes.append((index, envelope, checked))
            else:
                answers[index] = self._refused(checked, len(envelope), origin)
        later = []
        if routes:
            waiting: set[SessionKey] = set()  # keys that go the slow way from here on
            lookup = self.switch.lookup
            with client.batch():
                for item in routes:
                    key = item[2].key
                    if key not in waiting:
                        endpoint = lookup(key)
                        if endpoint is not None and not endpoint.peer.congested:
                            endpoint.deliver(item[1])
                            if origin is not None:
                                env = item[2].env
                                self._record(env, len(item[1]), "local", "delivered", None, origin)
                            continue
                        waiting.add(key)
                    later.append(item)
        sender = self._sender(client)
        for index, envelope, route in later:
            answers[index] = await self._deliver(envelope, route, origin, sender)
        accepted = 0
        for status, reason in answers:
            if status == 202:
                accepted += 1
            else:
                self._count(status, reason, client)
        if accepted:
            self.stats.count("accepted", accepted)
        return HttpResponse(
            200, encode_statuses(answers), content_type=STATUS_TYPE, headers=self._headers
        )

    def _count(self, status: int, reason: bytes, client: HttpClient) -> None:
        self.stats.count("accepted" if status == 202 else str(status))
        if status != 202:
            log.debug(
                "refused federated envelope from %s: %d %s",
                client.peer_host,
                status,
                reason.decode(errors="replace"),
            )

    @staticmethod
    def _sender(client: HttpClient) -> str:
        """Who posted, for its share of the mailbox: the address (the domain header is what
        the poster claims), IPv6 by its /64."""
        return ip_key(client.peer_host)

    async def _handle(self, body: bytes, origin: _Request | None, sender: str) -> Answer:
        checked = await self._check(body)
        if isinstance(checked, _Route):
            return await self._deliver(body, checked, origin, sender)
        return self._refused(checked, len(body), origin)

    async def _check(self, body: bytes) -> _Refusal | _Route:
        """The refusal, or where the envelope goes."""
        try:
            env = scan_envelope(body)
        except EnvelopeError as err:
            return _malformed(err)
        return await self._check_scanned(env, body)

    async def _check_scanned(self, env: EnvelopeRouting, body: bytes) -> _Refusal | _Route:
        """`_check` for an envelope already scanned (a batch scans each envelope once)."""
        if env.dest_twin == 0:
            reason = "bad request: message with missing destination"
            return _Refusal(400, reason, "bad request", env)
        if env.source_twin == 0:
            # only a relay makes those (errors), for its own twins: never one that is posted
            reason = "bad request: message without a source twin"
            return _Refusal(400, reason, "bad request", env)
        try:
            twin = await self.directory.get(env.dest_twin)
        except TwinLookupError as err:
            return _Refusal(500, f"failed to get twin: {err}", "twin lookup failed", env)
        if twin is None or not self.is_ours(twin):
            reason = f"twin {env.dest_twin} is not served by this relay"
            return _Refusal(403, reason, "not served here", env)
        if self.verify:
            refusal = await self._check_signature(env, body)
            if refusal is not None:
                return refusal
        return _Route(env)

    async def _deliver(
        self, body: bytes, route: _Route, origin: _Request | None, sender: str
    ) -> Answer:
        env = route.env
        if env.fail_fast:
            # only a connected destination will do (never the mailbox)
            outcome = await self.switch.deliver(route.key, body)
            if outcome is not Outcome.DELIVERED:
                refusal = _Refusal(404, "destination offline", "destination offline", env)
                return self._refused(refusal, len(body), origin)
        else:
            deadline = self.switch.mailbox.deadline(env.timestamp, env.expiration)
            try:
                outcome = await self.switch.deliver(
                    route.key, body, deadline=deadline, sender=sender
                )
            except MailboxUnavailable as err:
                label = _UNAVAILABLE.get(type(err), "mailbox down")
                refusal = _Refusal(500, f"switch error: {err}", label, env)
                return self._refused(refusal, len(body), origin)
        if origin is not None:
            where, what = _ROUTED.get(outcome, ("none", "rejected"))
            self._record(env, len(body), where, what, None, origin)
        return ACCEPTED

    def _refused(self, refusal: _Refusal, size: int, origin: _Request | None) -> Answer:
        """The answer of a refused envelope, after its route record."""
        if origin is not None:
            self._record(refusal.env, size, "none", "rejected", refusal.label, origin)
        return refusal.answer

    def _record(
        self,
        env: EnvelopeRouting | None,
        size: int,
        route: str,
        outcome: str,
        reason: str | None,
        origin: _Request,
    ) -> None:
        assert self.records is not None
        src = dst = None
        if env is not None:
            src, dst = env.source_twin or None, env.dest_twin or None
        self.records.add(
            src, dst, size, route, outcome, reason, received=origin.received, remote=origin.remote
        )

    async def _check_signature(self, env: EnvelopeRouting, body: bytes) -> _Refusal | None:
        """`--verify-federated` (the default): the envelope must be signed by its source twin's
        account (the decode, digest and signature check are the Rust core's)."""
        try:
            source = await self.directory.get(env.source_twin)
        except TwinLookupError as err:
            return _Refusal(500, f"failed to get twin: {err}", "twin lookup failed", env)
        if source is None:
            reason = f"unknown source twin {env.source_twin}"
            return _Refusal(403, reason, "bad signature", env)
        decoded = Envelope.decode(body)
        if decoded.signature is None:
            return _Refusal(403, "envelope is not signed", "bad signature", env)
        try:
            ok = verify_prefixed(source.account, decoded.challenge(), decoded.signature)
        except SignatureError as err:
            reason = f"invalid envelope signature: {err}"
            return _Refusal(403, reason, "bad signature", env)
        if not ok:
            return _Refusal(403, "invalid envelope signature", "bad signature", env)
        return None


def _malformed(err: EnvelopeError) -> _Refusal:
    return _Refusal(400, f"bad request: {err}", "bad request", None)


def _origin(header: bytes | None) -> str | None:
    """The posting relay's domain from its header, if it is a plausible one (it is what the
    sender claims: a label for analytics, never used to decide anything)."""
    if header is None or not 0 < len(header) <= MAX_DOMAIN:
        return None
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if not text or not all(c.isalnum() or c in ".-:_[]" for c in text):
        return None
    return text
