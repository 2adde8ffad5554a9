"""The three encodings of the gateway socket (decision 1): frames as Python values both ways.

| encoding | frames | library |
|---|---|---|
| json | text | the standard library (`ensure_ascii=False`, compact separators) |
| msgpack | binary | `msgpack` (str keys only, no ext types) |
| etf | binary | `etf.py` (restricted term set; refused for restricted clients) |

Decoding returns any value (the frame checks in `frames.py` say what a frame must look like);
every failure is a `DecodeError` whose text becomes the `decode: ...` of an op 8 error.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import msgpack

from rmb_relay._core import sg_dispatch_text
from rmb_relay.dialects.singyeong import etf

#: msgpack containers larger than this are refused before allocation (a 1 MiB frame cannot
#: hold more elements than bytes anyway; the bound keeps a hostile header from reserving more)
_MSGPACK_LIMIT = 1 << 20


class DecodeError(ValueError):
    """A frame that could not be decoded in the socket's encoding."""


class Encoding(enum.Enum):
    JSON = "json"
    MSGPACK = "msgpack"
    ETF = "etf"

    @property
    def text_frames(self) -> bool:
        return self is Encoding.JSON

    @classmethod
    def parse(cls, text: str | None) -> Encoding:
        """`?encoding=` of the upgrade URL (absent: json); ValueError names the choices."""
        if text is None or text == "":
            return cls.JSON
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unsupported encoding {text!r}: use json, msgpack or etf") from None


def _json_default(value: Any) -> Any:
    # msgpack bin and ETF never produce other types; bytes reach JSON only from a msgpack bin
    if isinstance(value, bytes | bytearray):
        return value.decode(errors="replace")
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


#: the C encoder made once: `JSONEncoder.encode` builds one per call (with a floatstr closure
#: and a markers dict), a third of a small frame's encode time. Without the circular-reference
#: markers: frames are built here from decoded values, which cannot hold cycles.
_c_encode = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, _json_default, json.encoder.encode_basestring, None, ":", ",", False, False, True
)
_encode_str = json.encoder.encode_basestring


def json_text(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))`, the same text; raises
    TypeError for values JSON cannot carry."""
    if isinstance(value, str):
        return _encode_str(value)
    return "".join(_c_encode(value, 0))


#: a string as a JSON string literal (`json_text` when the value is known to be a str): the C
#: function itself, no Python frame around it
json_text_of_str = _encode_str


_json_decode = json.JSONDecoder().decode
#: the C scanner under `JSONDecoder.decode`, called directly: the two Python frames and two
#: whitespace regex matches around it were half of a small frame's decode
_scan_once = json.scanner.c_make_scanner(json.JSONDecoder())  # type: ignore[attr-defined]


def _json_value(text: str) -> Any:
    """`json.loads(text)`: the scanner alone when the text is one value and nothing else (every
    client's frame), else the full decoder, which accepts surrounding whitespace and words
    every error the same way as before."""
    try:
        value, end = _scan_once(text, 0)
    except (StopIteration, ValueError):
        return _json_decode(text)
    if end != len(text):
        return _json_decode(text)
    return value


#: one JSON value's text -> the value (`json.loads`): the scanner hands queue frames'
#: target, payload and nonce over as text, each decoded alone
json_value = _json_value


def dispatch_json(
    event: str, payload_text: str, ts: int, nonce: Any = None, extra: str = ""
) -> bytes:
    """`encode(JSON, frames.dispatch(event, payload, ts, nonce, **extra))` from the payload's
    JSON text (`extra`: the extra members' text, `,"key":value`...), written by the core's one
    DISPATCH layout, the fast path's (rust/dialects/singyeong/mod.rs `dispatch_text`)."""
    nonce_text = "null" if nonce is None else json_text(nonce)
    return sg_dispatch_text(event, nonce_text, payload_text, extra, ts)


_packb = msgpack.Packer(use_bin_type=True, datetime=False).pack


def _refuse_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack extension type {code} is not supported")


def encode(encoding: Encoding, value: Any) -> bytes:
    """`value` in `encoding` (UTF-8 for json). Raises TypeError for values it cannot carry."""
    if encoding is Encoding.JSON:
        return json_text(value).encode()
    if encoding is Encoding.MSGPACK:
        try:
            return bytes(_packb(value))
        except (TypeError, ValueError, OverflowError) as err:
            raise TypeError(f"cannot encode as msgpack: {err}") from None
    return etf.encode(value)


def decode(encoding: Encoding, data: bytes) -> Any:
    """One frame's value; raises DecodeError with a message fit for the client."""
    if encoding is Encoding.JSON:
        try:
            return _json_value(data.decode())
        except UnicodeDecodeError:
            raise DecodeError("payload is not UTF-8") from None
        except ValueError as err:
            raise DecodeError(f"invalid json: {err}") from None
        except RecursionError:
            raise DecodeError("invalid json: nested too deeply") from None
    if encoding is Encoding.MSGPACK:
        try:
            return msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                ext_hook=_refuse_ext,
                max_bin_len=_MSGPACK_LIMIT,
                max_str_len=_MSGPACK_LIMIT,
                max_array_len=_MSGPACK_LIMIT,
                max_map_len=_MSGPACK_LIMIT,
            )
        except DecodeError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as err:
            raise DecodeError(f"invalid msgpack: {err or type(err).__name__}") from None
    try:
        return etf.decode(data)
    except etf.EtfError as err:
        raise DecodeError(f"invalid etf: {err}") from None
