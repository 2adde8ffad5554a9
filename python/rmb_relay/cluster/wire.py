"""The records instances hand each other through their bus streams, and their bytes.

One stream entry carries many records (field `m`), so a busy sender pays one XADD per batch
and not per message. A record is a fixed 16-byte header then the name and the frame:

| bytes | field | meaning |
|---|---|---|
| 1 | kind | `MESSAGE`, `DISPLACED` or `MAIL` (below) |
| 1 | hops | how many instances passed it on already (bounded by `MAX_HOPS`) |
| 8 | deadline | unix seconds it is worth delivering until; 0 = never store it in a mailbox |
| 2 | name length | |
| 4 | frame length | |
| n | name | UTF-8 address name (`keys.py`) |
| n | frame | the bytes to write to the receiver, as the sender's dialect made them |

Kinds: `MESSAGE` (deliver `frame` to `name`), `DISPLACED` (a newer connection on another
instance holds `name`: close ours if `frame`, a presence claim in UTF-8, is still our claim of
it), `MAIL` (`name`'s mailbox got a message: drain it).
Big-endian, as network formats are. Anything else in an entry is a `BusFormatError`: the
reader logs it, counts it and acknowledges the entry (a poisoned entry must not block the bus).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rmb_relay.errors import RelayError

MESSAGE = 0
DISPLACED = 1
MAIL = 2
KINDS = frozenset((MESSAGE, DISPLACED, MAIL))

#: a message passed on this many times is stored (or dropped) instead: presence that moves
#: faster than messages must not make them circle
MAX_HOPS = 3

_HEADER = struct.Struct("!BBQHI")
HEADER_BYTES = _HEADER.size


class BusFormatError(RelayError, ValueError):
    """A bus entry that is not a sequence of well-formed records (a bug or a foreign writer)."""


@dataclass(frozen=True, slots=True)
class Record:
    kind: int
    name: str
    frame: bytes = b""
    deadline: int = 0
    hops: int = 0


def encode(record: Record) -> bytes:
    name = record.name.encode()
    if len(name) > 0xFFFF:
        raise BusFormatError(f"address name of {len(name)} bytes is over 65535")
    head = _HEADER.pack(record.kind, record.hops, record.deadline, len(name), len(record.frame))
    return head + name + record.frame


def encode_message(name: str, frame: bytes, deadline: int) -> bytes:
    """`encode(Record(MESSAGE, name, frame, deadline))` without the Record (the sender's hot
    path)."""
    raw = name.encode()
    if len(raw) > 0xFFFF:
        raise BusFormatError(f"address name of {len(raw)} bytes is over 65535")
    return _HEADER.pack(MESSAGE, 0, deadline, len(raw), len(frame)) + raw + frame


def decode(data: bytes) -> list[Record]:
    """Every record of one entry; raises BusFormatError on anything malformed."""
    return decode_from(data, 0)


def decode_from(data: bytes, offset: int) -> list[Record]:
    """The records of one entry from byte `offset` on (where one starts); raises
    BusFormatError on anything malformed."""
    records = []
    view = memoryview(data)
    end = len(data)
    while offset < end:
        if end - offset < HEADER_BYTES:
            raise BusFormatError(f"truncated record header at byte {offset}")
        kind, hops, deadline, name_len, frame_len = _HEADER.unpack_from(view, offset)
        if kind not in KINDS:
            raise BusFormatError(f"unknown record kind {kind} at byte {offset}")
        offset += HEADER_BYTES
        if end - offset < name_len + frame_len:
            raise BusFormatError(f"record at byte {offset - HEADER_BYTES} runs past the entry")
        try:
            name = bytes(view[offset : offset + name_len]).decode()
        except UnicodeDecodeError:
            raise BusFormatError("address name is not UTF-8") from None
        offset += name_len
        frame = bytes(view[offset : offset + frame_len])
        offset += frame_len
        records.append(Record(kind, name, frame, deadline, hops))
    return records
