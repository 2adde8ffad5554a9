"""`POST /`: envelopes other relays forward to twins of this relay (decision 4).

rmb-rs takes anything posted here and pushes it to the destination's stream, which makes every
relay an open forwarder to its twins for anyone on the internet (spec §8.1). Here the request
passes, in order, each check answering with the status the origin relay understands (a 4xx is
permanent there, anything else is retried):

| check | refusal |
|---|---|
| body at most `--max-message` (the router, before reading it) | 413 |
| the body parses as an Envelope with a destination | 400 `bad request: ...` |
| the destination twin is served by this relay (a shared domain) | 403 |
| `--verify-federated`: signed by the source twin's account key | 403 |
| `fail-fast` tag and the destination is not connected | 404 `destination offline` |
| the directory or the mailbox is down | 500 (the origin retries) |

Accepted: delivered to the destination's connection or stored in its mailbox, then 202 with an
empty body, as rmb-rs. Every answer carries `RMB-Batch-Max`: other rmb-relays then post batches
of envelopes (`batch.py`), each envelope answered as if it had been posted alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rmb_relay._core import Envelope, SignatureError, scan_envelope, verify_prefixed
from rmb_relay.errors import EnvelopeError, MailboxUnavailable, TwinLookupError
from rmb_relay.federation.batch import (
    BATCH_HEADER,
    BATCH_TYPE,
    STATUS_TYPE,
    decode_batch,
    encode_statuses,
)
from rmb_relay.protocols.base import HttpResponse
from rmb_relay.switch import Outcome

if TYPE_CHECKING:
    from rmb_relay._core import EnvelopeRouting, HttpRequest
    from rmb_relay.mailbox import SessionKey
    from rmb_relay.protocols.base import HttpClient
    from rmb_relay.switch import Switch
    from rmb_relay.twins import Twin, TwinDirectory

log = logging.getLogger("rmb_relay.federation")

#: (status, reason) of one envelope
Answer = tuple[int, bytes]
ACCEPTED: Answer = (202, b"")


class _Route:
    """An envelope that passed the checks, and its destination session."""

    __slots__ = ("env", "key")

    def __init__(self, env: EnvelopeRouting) -> None:
        self.env = env
        self.key: SessionKey = (env.dest_twin, env.dest_connection)


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
        verify: bool = False,
        max_body: int = 1 << 20,
    ) -> None:
        self.directory = directory
        self.switch = switch
        self.is_ours = is_ours
        self.verify = verify
        self.stats = InboundStats()
        self._headers = ((BATCH_HEADER, str(max_body)),)

    async def handle(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        content_type = request.header("content-type")
        if content_type is not None and content_type.split(b";")[0].strip() == BATCH_TYPE.encode():
            return await self._handle_batch(request.body, client)
        status, reason = await self._handle(request.body)
        self._count(status, reason, client)
        return HttpResponse(status, reason, headers=self._headers)

    async def _handle_batch(self, body: bytes, client: HttpClient) -> HttpResponse:
        """Every envelope is checked first; those for a connected, uncongested session are then
        written in one pass (one socket write per receiving connection, not one per
        envelope); the rest (offline: mailbox; congested: wait) go the single POST's way, in
        order per destination."""
        try:
            envelopes = decode_batch(body)
        except EnvelopeError as err:
            reason = f"bad request: {err}".encode()
            self._count(400, reason, client)
            return HttpResponse(400, reason, headers=self._headers)
        answers: list[Answer] = [ACCEPTED] * len(envelopes)
        routes: list[tuple[int, bytes, _Route]] = []
        ours: set[int] = set()  # destination twins checked in this batch
        for index, envelope in enumerate(envelopes):
            if not self.verify:  # the usual case: a twin already checked, nothing to await
                try:
                    env = scan_envelope(envelope)
                except EnvelopeError:
                    pass  # _check says why
                else:
                    if env.dest_twin in ours:
                        routes.append((index, envelope, _Route(env)))
                        continue
            checked = await self._check(envelope)
            if isinstance(checked, _Route):
                ours.add(checked.env.dest_twin)
                routes.append((index, envelope, checked))
            else:
                answers[index] = checked
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
                            continue
                        waiting.add(key)
                    later.append(item)
        for index, envelope, route in later:
            answers[index] = await self._deliver(envelope, route)
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

    async def _handle(self, body: bytes) -> Answer:
        checked = await self._check(body)
        if isinstance(checked, _Route):
            return await self._deliver(body, checked)
        return checked

    async def _check(self, body: bytes) -> Answer | _Route:
        """The refusal, or where the envelope goes."""
        try:
            env = scan_envelope(body)
        except EnvelopeError as err:
            return _refuse(400, f"bad request: {err}")
        if env.dest_twin == 0:
            return _refuse(400, "bad request: message with missing destination")
        try:
            twin = await self.directory.get(env.dest_twin)
        except TwinLookupError as err:
            return _refuse(500, f"failed to get twin: {err}")
        if twin is None or not self.is_ours(twin):
            return _refuse(403, f"twin {env.dest_twin} is not served by this relay")
        if self.verify:
            refusal = await self._check_signature(env, body)
            if refusal is not None:
                return refusal
        return _Route(env)

    async def _deliver(self, body: bytes, route: _Route) -> Answer:
        env = route.env
        if env.fail_fast:
            # only a connected destination will do (never the mailbox)
            if await self.switch.deliver(route.key, body) is Outcome.DELIVERED:
                return ACCEPTED
            return _refuse(404, "destination offline")
        deadline = self.switch.mailbox.deadline(env.timestamp, env.expiration)
        try:
            await self.switch.deliver(route.key, body, deadline=deadline)
        except MailboxUnavailable as err:
            return _refuse(500, f"switch error: {err}")
        return ACCEPTED

    async def _check_signature(self, env: EnvelopeRouting, body: bytes) -> Answer | None:
        """`--verify-federated`: the envelope must be signed by its source twin's account."""
        if env.source_twin == 0:
            return _refuse(403, "unsigned envelope (no source twin)")
        try:
            source = await self.directory.get(env.source_twin)
        except TwinLookupError as err:
            return _refuse(500, f"failed to get twin: {err}")
        if source is None:
            return _refuse(403, f"unknown source twin {env.source_twin}")
        decoded = Envelope.decode(body)
        if decoded.signature is None:
            return _refuse(403, "envelope is not signed")
        try:
            ok = verify_prefixed(source.account, decoded.challenge(), decoded.signature)
        except SignatureError as err:
            return _refuse(403, f"invalid envelope signature: {err}")
        if not ok:
            return _refuse(403, "invalid envelope signature")
        return None


def _refuse(status: int, reason: str) -> Answer:
    return status, reason.encode()
