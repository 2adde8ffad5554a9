"""SBD framing in the Rust core: golden bytes of spec/sbd.md §1.3."""

from __future__ import annotations

import base64

import pytest

from rmb_relay._core import (
    SBD_COMMAND,
    SBD_FORWARD,
    SbdError,
    encode_binary,
    sbd_classify,
    sbd_decode_pubkey_path,
    sbd_encode_command,
    sbd_forward_frame,
    sbd_rewrite_forward,
)

Z = bytes(28)


@pytest.mark.parametrize(
    ("tag", "payload", "golden"),
    [
        (b"lbrt", (8000).to_bytes(4, "big"), Z + bytes.fromhex("6c627274 00001f40")),
        (b"lbrt", (16000).to_bytes(4, "big"), Z + bytes.fromhex("6c627274 00003e80")),
        (b"lidl", (10000).to_bytes(4, "big"), Z + bytes.fromhex("6c69646c 00002710")),
        (b"srdy", b"", Z + bytes.fromhex("73726479")),
        (b"keep", b"", Z + bytes.fromhex("6b656570")),
    ],
)
def test_command_golden_bytes(tag: bytes, payload: bytes, golden: bytes) -> None:
    assert sbd_encode_command(tag, payload) == golden
    message = sbd_classify(golden)
    assert (message.kind, message.tag, message.payload) == (SBD_COMMAND, tag, payload)


def test_forward_is_rewritten_to_the_sender() -> None:
    dest, sender = bytes([1]) * 32, bytes([2]) * 32
    message = dest + b"data"
    classified = sbd_classify(message)
    assert (classified.kind, classified.peer, classified.payload) == (SBD_FORWARD, dest, b"data")
    assert sbd_rewrite_forward(message, sender) == sender + b"data"
    assert sbd_forward_frame(message, sender) == encode_binary(sender + b"data")
    big = dest + bytes(19968)
    assert sbd_forward_frame(big, sender) == encode_binary(sender + bytes(19968))


def test_short_message_is_an_sbd_error() -> None:
    with pytest.raises(SbdError):
        sbd_classify(bytes(31))


def test_pubkey_path_must_be_strict_base64url() -> None:
    key = bytes(range(1, 33))
    text = base64.urlsafe_b64encode(key).rstrip(b"=").decode()
    assert sbd_decode_pubkey_path(text) == key
    for bad in [
        text + "=",
        "bad-pubkey-path",
        text[:-1] + "B",
        base64.urlsafe_b64encode(bytes(32)).rstrip(b"=").decode(),
    ]:
        with pytest.raises(SbdError):
            sbd_decode_pubkey_path(bad)
