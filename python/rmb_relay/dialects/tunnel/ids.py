"""Request ids: random (version 4) UUIDs in their canonical text form, as RelayServer's Guids.

Why not `str(uuid.uuid4())`: it costs one `os.urandom` system call and a `UUID` object per
tunnelled request, about 7 µs (the largest single item of the relay's handler in its
profile). Here the randomness is read from the OS 256 ids at a time and formatted straight
to text (~1 µs): the ids are exactly as unpredictable (the same source, the same 122 random
bits), only fetched in bulk.
"""

from __future__ import annotations

import os

__all__ = ["request_id"]

#: ids whose randomness one `os.urandom` call provides
_BATCH = 256
#: RFC 9562 §4.1: the variant bits 10xx make the 17th hex digit 8, 9, a or b (its two low bits
#: stay random, as uuid4 keeps them)
_VARIANT = "89ab"

_pool = b""
_offset = 0


def request_id() -> str:
    """A fresh version-4 UUID, lower-case with dashes (`str(uuid.UUID(...))` form)."""
    global _pool, _offset
    if _offset >= len(_pool):
        _pool = os.urandom(16 * _BATCH)
        _offset = 0
    raw = _pool[_offset : _offset + 16]
    _offset += 16
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[(raw[8] >> 4) & 3]}{h[17:20]}-{h[20:]}"
