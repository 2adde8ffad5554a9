"""The gateway's native SEND/BROADCAST path (rust/singyeong.rs), kept in step from Python.

Why: a SEND cost ~20 us of gateway CPU through Python (decode, query parse, index match,
encode, the listener's send path), so one core routed ~48k/s where issue #12 asks 100k. The
Rust core now answers the common case inside the decoder's `feed`: a SEND or BROADCAST whose
target is an application plus top-level `$eq`s on scalars, with a payload and nonce whose
JSON text Python would re-encode to the same bytes. It writes the receivers' DISPATCH frames
into their outboxes (the switch's, shared with RMB and SBD: one output path per connection,
so frame order holds) and Python never sees the frame. Everything else reaches the dialect
as before, in order (scan.rs stops answering natively for the rest of a read once one frame
goes to Python).

What Python owes the index (`SgIndex`), on rare events only:
- `joined` / `changed`: a non-restricted client identified, or its metadata was applied:
  its application, whether it speaks JSON, and its top-level scalars as canonical bytes
  (`index_values`). Heartbeats change `last_heartbeat_time` only, which is never indexed.
- `left`: the socket closed.
Restricted clients are never in the index: the default query excludes them, and a query
asking for them (`restricted: true`) goes to Python.

The native path is off in cluster mode (receivers may be on other instances and the replicas
live in Python) and with `SgSettings.native = False`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from rmb_relay._core import (
    SG_MAX_INT_DIGITS,
    SG_VOLATILE_KEY,
    Outboxes,
    SgIndex,
    SgScanner,
    WsDecoder,
)
from rmb_relay.dialects.singyeong.clients import index_key

if TYPE_CHECKING:
    from rmb_relay._core import _SgQueueFrame as SgQueueFrame
    from rmb_relay.dialects.singyeong.clients import Client
    from rmb_relay.dialects.singyeong.session import SgSession

#: the kinds of queue frame an SgScanner reads (`SgQueueFrame`'s first item; rust's QueueKind)
QUEUE: Final = 0
QUEUE_REQUEST: Final = 1
QUEUE_ACK: Final = 2

__all__ = [
    "QUEUE",
    "QUEUE_ACK",
    "QUEUE_REQUEST",
    "VOLATILE_KEY",
    "NativePath",
    "SgQueueFrame",
    "encodes",
    "index_value",
    "index_values",
]

#: the gateway key that changes on every heartbeat: not indexed (defined in rust/singyeong.rs)
VOLATILE_KEY = SG_VOLATILE_KEY
#: integers of more digits are tainted (rust's MAX_INT_DIGITS)
_INT_LIMIT = 10**SG_MAX_INT_DIGITS


def index_value(value: Any, kind: str | None) -> bytes | bool | None:
    """The canonical bytes of a metadata value for the index: Python's bucket (`index_key`)
    as Rust spells it. None: tainted (a `$eq` on it must be answered by Python: floats equal
    integers, versions compare by semver, long integers, strings Rust cannot hold); False: no
    scalar `$eq` can match it (lists, maps, null, NaN), so it is left out."""
    if kind == "version":
        return None
    bucket = index_key(value, kind)
    if bucket is None:
        return False
    tag, v = bucket
    if tag == "b":
        return b"b1" if v else b"b0"
    if tag == "n":
        return b"n%d" % v if isinstance(v, int) and -_INT_LIMIT < v < _INT_LIMIT else None
    return b"s" + v.encode() if encodes(v) else None


def encodes(text: str) -> bool:
    """Whether `text` is valid Unicode (no lone surrogate, which JSON's "\\ud800" can carry
    and metadata accepts): only those can cross into Rust, and only those can be named by
    a query the native path reads (its frames are UTF-8)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def index_values(client: Client) -> list[tuple[str, bytes | None]]:
    """Every top-level metadata entry of `client` a scalar `$eq` could match (see
    `index_value`). Keys that are not valid Unicode are left out: no native query names
    them (Python answers the ones that do)."""
    types = client.types
    out: list[tuple[str, bytes | None]] = []
    for key, value in client.metadata.items():
        if key == VOLATILE_KEY or not encodes(key):
            continue
        canonical = index_value(value, types.get(key))
        if canonical is not False:
            out.append((key, canonical))  # type: ignore[arg-type]
    return out


class NativePath:
    """The index and outboxes one gateway's JSON connections are answered from."""

    __slots__ = ("index", "outboxes")

    def __init__(self, outboxes: Outboxes, *, seed: int) -> None:
        """`seed`: the index's SEND receiver picks (from the dialect's rng: the core reads no
        clock or entropy of its own)."""
        self.outboxes = outboxes
        self.index = SgIndex(seed)

    def bind(self, session: SgSession, decoder: WsDecoder) -> SgScanner | None:
        """The session's output goes through the outboxes (the listener reads
        `handler.outboxes`); a JSON session's decoder gets a scanner, ready once it
        identifies."""
        session.outboxes = self.outboxes
        if not session.encoding.text_frames:
            return None
        scanner = SgScanner(self.index, self.outboxes, session.peer.id)
        decoder.set_scanner(scanner)
        return scanner

    def joined(self, session: SgSession, client: Client) -> None:
        if client.restricted:
            return
        self.changed(session, client)
        if session.scanner is not None:
            session.scanner.ready = True

    def changed(self, session: SgSession, client: Client) -> None:
        if client.restricted or session.closing:
            return
        if not encodes(client.app_id):
            # no native query can name this application: Python answers those that do
            self.index.remove(session.peer.id)
            return
        self.index.set(
            session.peer.id, client.app_id, session.encoding.text_frames, index_values(client)
        )

    def left(self, session: SgSession) -> None:
        if session.scanner is not None:
            session.scanner.ready = False
        self.index.remove(session.peer.id)

    def counts(self) -> tuple[int, int, int, int]:
        """(frames_in, sends, broadcasts, frames_out) answered natively: each SEND or
        BROADCAST is one frame in, its DISPATCH frames are the outboxes' count."""
        sends, broadcasts = self.index.counts
        return sends + broadcasts, sends, broadcasts, self.outboxes.forwarded("singyeong")[0]
