"""The exceptions of rmb-relay, in one hierarchy.

```text
Exception
 ├─ CoreError                      raised by the Rust core (`rmb_relay._core`)
 │   ├─ HttpParseError             malformed/over-limit HTTP request; args = (message, status)
 │   ├─ HttpResponseError          a target's response that breaks HTTP/1.1 (the connector's client)
 │   ├─ WebSocketProtocolError     frame the peer had no right to send; args = (message, close_code)
 │   ├─ EnvelopeError              bytes that are not a valid RMB Envelope
 │   ├─ SbdError                   an SBD message breaking SBD framing
 │   ├─ SignatureError             key/signature of the wrong shape (a wrong signature is False)
 │   └─ TunnelWireError            a malformed tunnel message (wire.py raises it as WireError)
 └─ RelayError                     raised by the Python layers
     ├─ ConfigError                a flag, env var or file the operator must fix
     ├─ HttpReject                 a request refused with an HTTP status (before any upgrade)
     ├─ AuthError                  a login the relay refuses; carries the HTTP status and reason
     ├─ TwinLookupError            the twin directory backend failed (not: "no such twin")
     │   └─ ChainError             tfchain could not answer: every node failed (twins/substrate.py)
     │       ├─ NodeError          one node failed or answered nonsense; the client fails over
     │       └─ ExtrinsicRejected  the chain refused or failed an extrinsic (e.g. update_twin)
     ├─ BudgetExceeded             a byte budget of an in-memory store (budget.py) refused a message
     ├─ MailboxUnavailable         the mailbox backend (Redis) could not store or read
     │   ├─ ClusterUnavailable     Redis failed while handing a message to another instance
     │   └─ MailboxFull            a mailbox memory budget (bytes, sessions) is reached
     ├─ FederationError            an envelope could not be handed to another relay
     └─ ClientError                the SDK client could not do what was asked
         ├─ RequestTimeout         no response arrived before the deadline
         ├─ RemoteError            the remote service (or a relay) answered with an error
         ├─ HandshakeError         the server refused the websocket upgrade (also ConnectionError)
         └─ ConnectionClosed       the websocket closed under the client (also ConnectionError)
     └─ PeerError                  rmb-peer (`peer/`) could not do what a message asked
         ├─ BadMessage             msgbus JSON that does not have the public shape (code 101)
         ├─ EnvelopeRejected       an incoming envelope failed a check; code 102-106 (spec §5.9)
         │   └─ E2eError           could not encrypt or decrypt a payload (code 106)
         └─ RedisUnavailable       the msgbus Redis could not be reached or dropped the connection
```

Whose fault: `CoreError` subclasses, `HttpReject` and `AuthError` are the peer's;
`ConfigError` is the operator's; `TwinLookupError`, `MailboxUnavailable`, `FederationError`
and `RedisUnavailable` are a dependency's (chain, Redis, another relay); `ClientError` is
reported to the application using the SDK; `BadMessage` is the local msgbus client's (it gets
an error reply when its return queue can be read), `EnvelopeRejected` the remote twin's (it
gets an error envelope when it sent a request). `BudgetExceeded` is the sender's load, not a
fault: the message is refused with a clear reason and nothing already stored is displaced.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rmb_relay._core import (
    CoreError,
    EnvelopeError,
    HttpParseError,
    HttpResponseError,
    SbdError,
    SignatureError,
    TunnelWireError,
    WebSocketProtocolError,
)

__all__ = [
    "AuthError",
    "BadMessage",
    "BodyTooLarge",
    "BudgetExceeded",
    "ChainError",
    "ClientError",
    "ClusterUnavailable",
    "ConfigError",
    "ConnectionClosed",
    "CoreError",
    "E2eError",
    "EnvelopeError",
    "EnvelopeRejected",
    "ExtrinsicRejected",
    "FederationError",
    "HandshakeError",
    "HttpParseError",
    "HttpReject",
    "HttpResponseError",
    "MailboxFull",
    "MailboxUnavailable",
    "NodeError",
    "PeerError",
    "RedisUnavailable",
    "RelayError",
    "RemoteError",
    "RequestTimeout",
    "SbdError",
    "SignatureError",
    "TunnelWireError",
    "TwinLookupError",
    "WebSocketProtocolError",
]


class RelayError(Exception):
    """Base of the errors raised by rmb-relay's Python layers."""


class ConfigError(RelayError):
    """Configuration the operator must fix (bad flag value, unreadable file, ...)."""


class HttpReject(RelayError):
    """Raised by a dialect's `accept` (or a route) to refuse with an HTTP status before upgrade.

    The reason is sent as the body and logged, so an operator and the client see the same text.
    Never put paths or internals in it: it goes to whoever asked."""

    def __init__(self, status: int, reason: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers


class AuthError(RelayError):
    """A login the relay refuses. `status` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class TwinLookupError(RelayError):
    """The twin directory could not answer (database or chain failure), as opposed to
    answering that a twin does not exist. The relay answers 500 `failed to get twin:
    directory unavailable (request ID)`; the cause (it names files and hosts) goes only to the
    log, under that id."""


class ChainError(TwinLookupError):
    """tfchain could not answer: every node tried failed, or what they said cannot be used."""


class NodeError(ChainError):
    """One chain node failed (refused, timed out, dropped the connection) or answered
    something that is not substrate JSON-RPC (garbage, wrong types, undecodable SCALE). The
    client drops that connection and tries the next node; it only escapes wrapped in a
    ChainError once every attempt failed."""


class ExtrinsicRejected(ChainError):
    """The chain refused an extrinsic (bad signature, stale nonce) or it failed on chain."""


class BudgetExceeded(RelayError):
    """Keeping a message would take an in-memory store over a limit of its `ByteBudget`
    (budget.py). `limit` says which: "count" (items per key), "key" (bytes per key) or
    "total" (bytes in all); `allowed` is that limit, `held` what was held against it, `size`
    what was asked for (items for "count", else bytes). Each store turns it into its own
    protocol's refusal."""

    def __init__(self, limit: str, *, key: object, size: int, held: int, allowed: int) -> None:
        unit = "items" if limit == "count" else "bytes"
        whose = "in all" if limit == "total" else f"for {key!r}"
        super().__init__(
            f"{limit} budget: {held} {unit} held {whose}, {size} more asked, {allowed} allowed"
        )
        self.limit = limit
        self.key = key
        self.size = size
        self.held = held
        self.allowed = allowed


class BodyTooLarge(RelayError):
    """A tunnel body would take the body store over a bound: `limit` is "body" (one body,
    `--tunnel-max-body`), "tenant" (one tenant's files, `--tunnel-tenant-disk`) or "total"
    (all files, `--tunnel-total-disk`); `allowed` is that bound in bytes. Answered 413 with
    the message, which names the bound and never a path."""

    FLAGS: ClassVar[dict[str, str]] = {
        "body": "--tunnel-max-body",
        "tenant": "--tunnel-tenant-disk",
        "total": "--tunnel-total-disk",
    }

    def __init__(self, limit: str, allowed: int) -> None:
        what = {"body": "a body", "tenant": "this tenant's stored bodies"}.get(
            limit, "the relay's stored bodies"
        )
        super().__init__(f"{what} may take at most {allowed} bytes ({self.FLAGS[limit]})")
        self.limit = limit
        self.allowed = allowed


class MailboxUnavailable(RelayError):
    """The mailbox backend failed (Redis down or stalled): the message could not be stored or
    read. The sender of a request gets an error envelope; nothing is silently dropped."""


class ClusterUnavailable(MailboxUnavailable):
    """Redis failed while looking up where an address is or handing a message to the instance
    holding it: the message was not accepted (the sender of a request gets an error envelope).
    A `MailboxUnavailable`, so every caller that handles a failed mailbox handles this too."""


class WriteUncertain(RelayError):
    """A write to Redis failed after it may have left: its reply is what was lost (a cut link
    delivers the bytes it held when it heals). Deliberately not a `ClusterUnavailable`: the
    caller must find out what happened (scaleout.py withdraws a request) before it tells
    anyone the write failed."""


class MailboxFull(MailboxUnavailable):
    """Storing the envelope would take a mailbox over one of its memory budgets (bytes per
    twin, bytes in all, sessions per twin): refused, so the sender hears of it, rather than
    displacing mail that is already waiting."""


class FederationError(RelayError):
    """The envelope could not be handed to the destination's relay; the text goes to the sender."""


class ClientError(RelayError):
    """The SDK client could not complete an operation."""


class RequestTimeout(ClientError):
    """No response arrived for a request before its deadline."""


class RemoteError(ClientError):
    """The remote service (or the relay) answered a request with an error. `reply` is the
    SDK's `Reply` (`rmb_relay.sdk`)."""

    def __init__(self, reply: Any) -> None:
        code, message = reply.error
        super().__init__(f"{'relay' if reply.from_relay else reply.source} error {code}: {message}")
        self.reply = reply


class HandshakeError(ClientError, ConnectionError):
    """The server refused the upgrade; `status` and `body` say why."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upgrade refused with HTTP {status}: {body.decode(errors='replace')}")
        self.status = status
        self.body = body


class ConnectionClosed(ClientError, ConnectionError):
    """The websocket closed; `code` is the close code (None without one)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"websocket closed ({code}): {reason}")
        self.code = code
        self.reason = reason


class PeerError(RelayError):
    """rmb-peer could not do what a message (local JSON or a remote envelope) asked."""


class BadMessage(PeerError):
    """A msgbus JSON message without the public shape (spec/rmb.md §5.5). `ret` and `ref` are
    the return queue and reference when they could still be read, so the sender can be told."""

    code = 101

    def __init__(self, reason: str, ret: str | None = None, ref: str | None = None) -> None:
        super().__init__(reason)
        self.ret = ret
        self.ref = ref


class EnvelopeRejected(PeerError):
    """An incoming envelope failed a check; `code` is rmb-peer's ProtocolError code (§5.9) and
    str() its message, both sent back to the source when the envelope was a request."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class E2eError(EnvelopeRejected):
    """A payload could not be encrypted or decrypted (code 106, `e2e error: ...`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(106, f"e2e error: {reason}")


class RedisUnavailable(PeerError):
    """The msgbus Redis refused the connection, dropped it, or answered with an error."""
