"""The exceptions of rmb-relay, in one hierarchy.

```text
Exception
 ├─ CoreError                      raised by the Rust core (`rmb_relay._core`)
 │   ├─ HttpParseError             malformed/over-limit HTTP request; args = (message, status)
 │   ├─ WebSocketProtocolError     frame the peer had no right to send; args = (message, close_code)
 │   ├─ EnvelopeError              bytes that are not a valid RMB Envelope
 │   ├─ SbdError                   an SBD message breaking SBD framing
 │   └─ SignatureError             key/signature of the wrong shape (a wrong signature is False)
 └─ RelayError                     raised by the Python layers
     ├─ ConfigError                a flag, env var or file the operator must fix
     ├─ AuthError                  a login the relay refuses; carries the HTTP status and reason
     ├─ TwinLookupError            the twin directory backend failed (not: "no such twin")
     └─ ClientError                the SDK client could not do what was asked
         └─ RequestTimeout         no response arrived before the deadline
```

Whose fault: `CoreError` subclasses and `AuthError` are the peer's; `ConfigError` is the
operator's; `ClientError` is reported to the application using the SDK.
"""

from __future__ import annotations

from rmb_relay._core import (
    CoreError,
    EnvelopeError,
    HttpParseError,
    SbdError,
    SignatureError,
    WebSocketProtocolError,
)

__all__ = [
    "AuthError",
    "ClientError",
    "ConfigError",
    "CoreError",
    "EnvelopeError",
    "HttpParseError",
    "RelayError",
    "RequestTimeout",
    "SbdError",
    "SignatureError",
    "TwinLookupError",
    "WebSocketProtocolError",
]


class RelayError(Exception):
    """Base of the errors raised by rmb-relay's Python layers."""


class ConfigError(RelayError):
    """Configuration the operator must fix (bad flag value, unreadable file, ...)."""


class AuthError(RelayError):
    """A login the relay refuses. `status` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class TwinLookupError(RelayError):
    """The twin directory could not answer (database or chain failure), as opposed to
    answering that a twin does not exist. The relay answers 500 `failed to get twin: ...`."""


class ClientError(RelayError):
    """The SDK client could not complete an operation."""


class RequestTimeout(ClientError):
    """No response arrived for a request before its deadline."""
