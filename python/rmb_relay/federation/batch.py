"""Batched federation between rmb-relays: many envelopes in one `POST /`.

rmb-rs posts one envelope per request, and so does this relay to any remote that has not said
it takes batches: at a few thousand requests per second an HTTP client spends more time on
request framing than on the envelopes. A relay that takes batches says so on every answer to
`POST /` with the header below (its body limit in bytes); a sender that has seen it posts
batches to that remote from then on. rmb-rs ignores the header, so nothing changes for it.

Wire format (all integers big-endian):

```text
request   Content-Type: application/x-rmb-envelope-batch
          body = { u32 length, envelope bytes }*
response  200, Content-Type: application/x-rmb-batch-status
          body = { u16 status, u16 reason length, reason (UTF-8) }*   one per envelope, in order
```

Each envelope gets exactly the answer a single `POST /` of it would have got (202, 4xx, 5xx),
so the sender treats each one as rmb-rs semantics say. A batch that cannot be split into
envelopes is refused as a whole with 400.
"""

from __future__ import annotations

import struct

from rmb_relay.errors import EnvelopeError

#: announces batch support and the remote's body limit (bytes) on answers to POST /
BATCH_HEADER = "RMB-Batch-Max"
#: the posting relay's domain on every POST / from an rmb-relay (single or batch): the
#: receiver's route records name it as `remote` (rmb-rs neither sends nor reads it)
ORIGIN_HEADER = "RMB-Relay-Domain"
BATCH_TYPE = "application/x-rmb-envelope-batch"
STATUS_TYPE = "application/x-rmb-batch-status"
#: envelopes per batch at most, whatever the byte limit allows
MAX_BATCH_ITEMS = 1024

_LEN = struct.Struct(">I")
_STATUS = struct.Struct(">HH")
#: bytes of framing per envelope in a batch
FRAME = _LEN.size
#: one envelope's answer when it was accepted (a batch of them is this, repeated)
ALL_ACCEPTED = _STATUS.pack(202, 0)


def encode_batch(envelopes: list[bytes]) -> bytes:
    parts: list[bytes] = [b""] * (2 * len(envelopes))
    parts[0::2] = map(_LEN.pack, map(len, envelopes))  # C-level loops, no per-envelope Python
    parts[1::2] = envelopes
    return b"".join(parts)


def decode_batch(body: bytes) -> list[bytes]:
    """The envelopes of a batch body; EnvelopeError when the framing is broken."""
    envelopes = []
    offset, end = 0, len(body)
    unpack = _LEN.unpack_from
    while offset < end:
        if end - offset < _LEN.size:
            raise EnvelopeError("batch truncated in a length prefix")
        (length,) = unpack(body, offset)
        offset += _LEN.size
        if length > end - offset:
            raise EnvelopeError("batch truncated in an envelope")
        envelopes.append(body[offset : offset + length])
        offset += length
        if len(envelopes) > MAX_BATCH_ITEMS:
            raise EnvelopeError(f"batch of more than {MAX_BATCH_ITEMS} envelopes")
    return envelopes


def encode_statuses(statuses: list[tuple[int, bytes]]) -> bytes:
    pack = _STATUS.pack
    return b"".join(pack(status, len(reason)) + reason for status, reason in statuses)


def decode_statuses(body: bytes, count: int) -> list[tuple[int, str]]:
    """`count` (status, reason) pairs; EnvelopeError when the body does not hold them."""
    out = []
    offset = 0
    for _ in range(count):
        if len(body) - offset < _STATUS.size:
            raise EnvelopeError("batch status truncated")
        status, length = _STATUS.unpack_from(body, offset)
        offset += _STATUS.size
        out.append((status, body[offset : offset + length].decode("utf-8", "replace")))
        offset += length
    if offset != len(body):
        raise EnvelopeError("batch status has trailing bytes")
    return out
