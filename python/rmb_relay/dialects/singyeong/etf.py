"""A small Erlang External Term Format codec, restricted to the terms 신경 frames use.

Why our own: the ETF packages on PyPI either decode every tag (tuples, pids, funs, compressed
terms) or are unmaintained, and a gateway decoding untrusted bytes wants the opposite: a
closed set of term types, bounded depth and sizes, and a clear error for everything else.

Decoded (ETF -> Python)
-----------------------
| tag | term | Python |
|---|---|---|
| 97 / 98 / 110 / 111 | small, 32-bit, big integers | int (bigs up to 64 bytes) |
| 70 | new float | float |
| 100 / 115 / 118 / 119 | atoms | `nil` -> None, `true`/`false` -> bool, others -> str |
| 106 | [] | [] |
| 107 | charlist | list of int |
| 108 | proper list | list |
| 109 | binary (UTF-8) | str |
| 116 | map with string/atom keys | dict |

Atoms from untrusted input never reach an atom table: Python has none, and an atom other than
the three specials decodes to a plain (bounded) string, exactly like a binary. Tuples, pids,
references, funs, ports, improper lists, compressed terms and non-UTF-8 binaries are refused.

Encoded (Python -> ETF)
-----------------------
None/True/False -> atoms, int -> small/32-bit/big integer, float -> new float, str -> binary,
list/tuple -> list, dict -> map. A dict of the `Struct` class encodes its keys as atoms, the way
the public server's structs reach an Elixir client (`op`, `d`, `t`, `ts`, `nonce`, ...).
"""

from __future__ import annotations

import struct
from typing import Any

#: every ETF term starts with this version byte
VERSION = 131
#: nesting deeper than this is refused (no stack exhaustion from a hostile frame)
MAX_DEPTH = 64
#: big integers longer than this many bytes are refused (no quadratic int parsing)
MAX_BIG_BYTES = 64

_SMALL_INTEGER = 97
_INTEGER = 98
_NEW_FLOAT = 70
_ATOM = 100
_SMALL_ATOM = 115
_ATOM_UTF8 = 118
_SMALL_ATOM_UTF8 = 119
_NIL = 106
_STRING = 107
_LIST = 108
_BINARY = 109
_SMALL_BIG = 110
_LARGE_BIG = 111
_MAP = 116

_NAMES = {
    80: "compressed term",
    99: "old float",
    104: "small tuple",
    105: "large tuple",
    88: "pid",
    103: "pid",
    90: "reference",
    114: "reference",
    117: "fun",
    112: "fun",
    113: "export",
    102: "port",
    89: "port",
    77: "bit binary",
}

_SPECIAL_ATOMS: dict[str, Any] = {"nil": None, "true": True, "false": False}

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_F64 = struct.Struct(">d")


class EtfError(ValueError):
    """Bytes that are not a term of the restricted set (the message says which rule broke)."""


class Struct(dict[str, Any]):
    """A server-built map whose keys go out as atoms over ETF (plain dict everywhere else)."""

    __slots__ = ()


def decode(data: bytes) -> Any:
    """One term; raises EtfError for anything outside the restricted set or trailing bytes."""
    if not data or data[0] != VERSION:
        raise EtfError("not an ETF term (missing version byte 131)")
    decoder = _Decoder(data)
    value = decoder.term(1)
    if decoder.pos != len(data):
        raise EtfError(f"{len(data) - decoder.pos} trailing bytes after the term")
    return value


class _Decoder:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 1

    def take(self, count: int) -> bytes:
        end = self.pos + count
        if end > len(self.data):
            raise EtfError("term truncated")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, shape: struct.Struct) -> Any:
        return shape.unpack(self.take(shape.size))[0]

    def text(self, count: int, what: str) -> str:
        try:
            return self.take(count).decode()
        except UnicodeDecodeError:
            raise EtfError(f"{what} is not UTF-8") from None

    def term(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise EtfError(f"term nested deeper than {MAX_DEPTH}")
        tag = self.unpack(_U8)
        if tag == _BINARY:
            return self.text(self.unpack(_U32), "binary")
        if tag == _SMALL_INTEGER:
            return self.unpack(_U8)
        if tag == _INTEGER:
            return self.unpack(_I32)
        if tag == _MAP:
            return self.map(depth)
        if tag == _LIST:
            count = self.unpack(_U32)
            if count > len(self.data) - self.pos:  # every element takes at least one byte
                raise EtfError("list longer than the frame")
            items = [self.term(depth + 1) for _ in range(count)]
            if self.unpack(_U8) != _NIL:
                raise EtfError("improper lists are not supported")
            return items
        if tag == _NIL:
            return []
        if tag in (_SMALL_ATOM_UTF8, _SMALL_ATOM):
            return self.atom(self.unpack(_U8))
        if tag in (_ATOM_UTF8, _ATOM):
            return self.atom(self.unpack(_U16))
        if tag == _NEW_FLOAT:
            return self.unpack(_F64)
        if tag == _STRING:
            return list(self.take(self.unpack(_U16)))
        if tag in (_SMALL_BIG, _LARGE_BIG):
            count = self.unpack(_U8) if tag == _SMALL_BIG else self.unpack(_U32)
            if count > MAX_BIG_BYTES:
                raise EtfError(f"integer longer than {MAX_BIG_BYTES} bytes")
            sign = self.unpack(_U8)
            magnitude = int.from_bytes(self.take(count), "little")
            return -magnitude if sign else magnitude
        raise EtfError(f"unsupported term: {_NAMES.get(tag, f'tag {tag}')}")

    def atom(self, length: int) -> Any:
        name = self.text(length, "atom")
        if name in _SPECIAL_ATOMS:
            return _SPECIAL_ATOMS[name]
        return name  # never an atom on our side: just the text (see the module docstring)

    def map(self, depth: int) -> dict[str, Any]:
        count = self.unpack(_U32)
        if count > len(self.data) - self.pos:
            raise EtfError("map longer than the frame")
        out: dict[str, Any] = {}
        for _ in range(count):
            key = self.term(depth + 1)
            if not isinstance(key, str):
                raise EtfError("map keys must be binaries or atoms")
            out[key] = self.term(depth + 1)
        return out


def encode(value: Any) -> bytes:
    """`value` (see the module docstring for the mapping) as an ETF term; TypeError otherwise."""
    out = bytearray((VERSION,))
    _encode(value, out, 0)
    return bytes(out)


def _atom(name: str, out: bytearray) -> None:
    raw = name.encode()
    if len(raw) < 256:
        out += bytes((_SMALL_ATOM_UTF8, len(raw)))
    else:
        out.append(_ATOM_UTF8)
        out += _U16.pack(len(raw))
    out += raw


def _encode(value: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"value nested deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        raw = value.encode()
        out.append(_BINARY)
        out += _U32.pack(len(raw))
        out += raw
    elif value is None:
        _atom("nil", out)
    elif value is True:
        _atom("true", out)
    elif value is False:
        _atom("false", out)
    elif isinstance(value, int):
        if 0 <= value < 256:
            out += bytes((_SMALL_INTEGER, value))
        elif -(2**31) <= value < 2**31:
            out.append(_INTEGER)
            out += _I32.pack(value)
        else:
            magnitude = abs(value)
            raw = magnitude.to_bytes((magnitude.bit_length() + 7) // 8, "little")
            if len(raw) < 256:
                out += bytes((_SMALL_BIG, len(raw)))
            else:
                out.append(_LARGE_BIG)
                out += _U32.pack(len(raw))
            out.append(1 if value < 0 else 0)
            out += raw
    elif isinstance(value, float):
        out.append(_NEW_FLOAT)
        out += _F64.pack(value)
    elif isinstance(value, dict):
        out.append(_MAP)
        out += _U32.pack(len(value))
        atoms = isinstance(value, Struct)
        for key, item in value.items():
            if atoms:
                _atom(key, out)
            else:
                _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
    elif isinstance(value, list | tuple):
        if not value:
            out.append(_NIL)
            return
        out.append(_LIST)
        out += _U32.pack(len(value))
        for item in value:
            _encode(item, out, depth + 1)
        out.append(_NIL)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as ETF")
