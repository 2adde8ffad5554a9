"""The gateway's codecs: golden ETF bytes both ways, the restricted term set, msgpack and json
errors as clear DecodeErrors."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmb_relay.dialects.singyeong import etf
from rmb_relay.dialects.singyeong.codec import DecodeError, Encoding, decode, encode, json_text
from rmb_relay.dialects.singyeong.dialect import SingyeongDialect
from rmb_relay.dialects.singyeong.frames import dispatch, hello
from rmb_relay.dialects.singyeong.settings import SgSettings
from rmb_relay.telemetry.metrics import Registry

#: (value, bytes) as `:erlang.term_to_binary` writes them (binaries for strings, atoms for
#: nil/true/false)
GOLDEN: list[tuple[Any, bytes]] = [
    (1, bytes([131, 97, 1])),
    (-1, bytes([131, 98, 255, 255, 255, 255])),
    (300, bytes([131, 98, 0, 0, 1, 44])),
    (2**40, bytes([131, 110, 6, 0, 0, 0, 0, 0, 0, 1])),
    (-(2**40), bytes([131, 110, 6, 1, 0, 0, 0, 0, 0, 1])),
    (1.5, bytes([131, 70, 63, 248, 0, 0, 0, 0, 0, 0])),
    ("hi", bytes([131, 109, 0, 0, 0, 2]) + b"hi"),
    (None, bytes([131, 119, 3]) + b"nil"),
    (True, bytes([131, 119, 4]) + b"true"),
    ([], bytes([131, 106])),
    ([1, 2], bytes([131, 108, 0, 0, 0, 2, 97, 1, 97, 2, 106])),
    ({"a": 1}, bytes([131, 116, 0, 0, 0, 1, 109, 0, 0, 0, 1]) + b"a" + bytes([97, 1])),
]


@pytest.mark.parametrize(("value", "raw"), GOLDEN)
def test_etf_golden_bytes_both_ways(value: Any, raw: bytes) -> None:
    assert etf.encode(value) == raw
    assert etf.decode(raw) == value


def test_etf_decodes_what_elixir_clients_send() -> None:
    # %{op: 1, d: %{client_id: "c"}} with atom keys (OTP 26 writes SMALL_ATOM_UTF8_EXT),
    # and the older ATOM_EXT (100) and charlists (107)
    raw = (
        bytes([131, 116, 0, 0, 0, 2, 119, 2])
        + b"op"
        + bytes([97, 1, 100, 0, 1])
        + b"d"
        + bytes([116, 0, 0, 0, 1, 119, 9])
        + b"client_id"
        + bytes([107, 0, 2])
        + b"ab"
    )
    assert etf.decode(raw) == {"op": 1, "d": {"client_id": [97, 98]}}


def test_etf_struct_keys_go_out_as_atoms() -> None:
    raw = etf.encode(etf.Struct(op=0, d={"k": 1}))
    assert raw.startswith(bytes([131, 116, 0, 0, 0, 2, 119, 2]) + b"op")
    assert bytes([109, 0, 0, 0, 1]) + b"k" in raw  # a user map keeps binary keys


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "missing version byte"),
        (bytes([130, 97, 1]), "missing version byte"),
        (bytes([131, 104, 1, 97, 1]), "small tuple"),
        (bytes([131, 80, 0, 0, 0, 1]), "compressed term"),
        (bytes([131, 88]), "pid"),
        (bytes([131, 117]), "fun"),
        (bytes([131, 108, 0, 0, 0, 1, 97, 1, 97, 2]), "improper lists"),
        (bytes([131, 109, 0, 0, 0, 9, 1]), "truncated"),
        (bytes([131, 109, 0, 0, 0, 1, 255]), "binary is not UTF-8"),
        (bytes([131, 97, 1, 0]), "trailing bytes"),
        (bytes([131, 116, 0, 0, 0, 1, 97, 1, 97, 1]), "map keys must be"),
        (bytes([131, 108, 255, 255, 255, 255]), "list longer than the frame"),
        (bytes([131, 110, 200, 0]) + bytes(200), "integer longer than"),
        (bytes([131]) + bytes([108, 0, 0, 0, 1]) * 100 + bytes([106]) * 101, "nested deeper"),
    ],
)
def test_etf_refuses_terms_outside_the_set(raw: bytes, reason: str) -> None:
    with pytest.raises(etf.EtfError, match=reason):
        etf.decode(raw)


def test_atoms_never_become_anything_but_text() -> None:
    raw = bytes([131, 119, 5]) + b"hello"
    assert etf.decode(raw) == "hello"


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(deadline=None)  # pure CPU; a loaded CI host must not fail it on time
@given(json_values)
def test_etf_round_trips_every_json_value(value: Any) -> None:
    assert etf.decode(etf.encode(value)) == value


@settings(deadline=None)
@given(st.binary(max_size=64))
def test_etf_decoder_accepts_or_refuses_cleanly(raw: bytes) -> None:
    with contextlib.suppress(etf.EtfError):
        etf.decode(bytes([131]) + raw)


@pytest.mark.parametrize("encoding", list(Encoding))
def test_frames_round_trip_in_every_encoding(encoding: Encoding) -> None:
    for frame in (hello(45000, 1), dispatch("SEND", {"x": [1, 2.5, None]}, 7, "n")):
        assert decode(encoding, encode(encoding, frame)) == frame


@pytest.mark.parametrize(
    ("encoding", "raw", "reason"),
    [
        (Encoding.JSON, b"\xff", "payload is not UTF-8"),
        (Encoding.JSON, b"[1,", "invalid json"),
        (Encoding.JSON, b"[" * 100_000, "nested too deeply"),
        (Encoding.MSGPACK, b"\x92\x01", "invalid msgpack"),
        (Encoding.MSGPACK, b"\xd4\x01\x00", "extension type 1"),
        (Encoding.MSGPACK, msgpack.packb({1: 2}), "invalid msgpack"),
        (Encoding.ETF, b"\x83\x68\x00", "invalid etf"),
    ],
)
def test_decode_errors_say_what_is_wrong(encoding: Encoding, raw: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        decode(encoding, raw)


def test_unknown_encoding_names_the_choices() -> None:
    assert Encoding.parse(None) is Encoding.JSON
    with pytest.raises(ValueError, match="use json, msgpack or etf"):
        Encoding.parse("bson")


@settings(max_examples=200, deadline=None)
@given(name=st.text(min_size=1), nonce=json_values, payload=json_values, attempt=st.integers(0))
def test_hot_queue_frames_are_the_generic_json(
    name: str, nonce: Any, payload: Any, attempt: int
) -> None:
    """The JSON QUEUE_CONFIRM built from pieces (the core's DISPATCH layout) is byte for byte
    what the generic path encodes, and a kept CONFIRM is the same text as a fresh one. (The
    QUEUE dispatch's: test_singyeong_queues.py, over a socket.)"""
    ts = 1_700_000_000_123
    confirm = encode(
        Encoding.JSON, dispatch("QUEUE_CONFIRM", {"queue": name}, ts, nonce, queue=name)
    )
    gateway = SingyeongDialect(SgSettings(), Registry())
    assert gateway._confirm_json(name, nonce, ts) == confirm
    assert gateway._confirm_json(name, nonce, ts) == confirm


def test_json_text_is_the_standard_encoder() -> None:
    value = {"a": [1, 1.5, float("nan"), -0.0, "é\n\u2028"], "b": None, 1: True}
    assert json_text(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert json_text('x"y') == json.dumps('x"y', ensure_ascii=False)
    with pytest.raises(TypeError):
        json_text(object())
