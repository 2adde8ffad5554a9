"""Signatures checked against independent implementations: `cryptography` for ed25519 and
`py-sr25519-bindings` (substrate's own schnorrkel wrapper) for sr25519."""

from __future__ import annotations

import hashlib

import pytest
import sr25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import given
from hypothesis import strategies as st

from rmb_relay._core import (
    SignatureError,
    SigningKey,
    verify_ed25519,
    verify_prefixed,
    verify_sr25519,
)

SEED = hashlib.sha256(b"crypto test").digest()


def test_ed25519_public_key_and_signature_match_cryptography() -> None:
    ours = SigningKey.ed25519(SEED)
    theirs = Ed25519PrivateKey.from_private_bytes(SEED)
    assert ours.public_key == theirs.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert ours.sign(b"message") == theirs.sign(b"message")  # ed25519 is deterministic


def test_cryptography_signature_verifies_with_ours() -> None:
    theirs = Ed25519PrivateKey.from_private_bytes(SEED)
    pk = theirs.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert verify_ed25519(pk, b"abc", theirs.sign(b"abc"))
    assert not verify_ed25519(pk, b"abd", theirs.sign(b"abc"))


def test_sr25519_public_key_matches_substrate_expansion() -> None:
    public, _secret = sr25519.pair_from_seed(SEED)
    assert SigningKey.sr25519(SEED).public_key == public


def test_sr25519_signatures_cross_verify() -> None:
    key = SigningKey.sr25519(SEED)
    pair = sr25519.pair_from_seed(SEED)
    assert sr25519.verify(key.sign(b"ours"), b"ours", key.public_key)
    assert verify_sr25519(key.public_key, b"theirs", sr25519.sign(pair, b"theirs"))
    assert not verify_sr25519(key.public_key, b"other", sr25519.sign(pair, b"theirs"))


@given(st.binary(max_size=256))
def test_prefixed_signatures_round_trip_for_both_schemes(message: bytes) -> None:
    for key in (SigningKey.ed25519(SEED), SigningKey.sr25519(SEED)):
        signature = key.sign_prefixed(message)
        assert len(signature) == 65
        assert signature[:1] == (b"e" if key.key_type == "ed25519" else b"s")
        assert verify_prefixed(key.public_key, message, signature)
        assert not verify_prefixed(key.public_key, message + b"!", signature)


@pytest.mark.parametrize(
    ("public_key", "signature"),
    [
        (b"\x00" * 31, b"e" + b"\x00" * 64),
        (b"\x00" * 32, b"e" + b"\x00" * 63),
        (b"\x00" * 32, b"x" + b"\x00" * 64),
    ],
)
def test_wrong_shapes_raise_signature_error(public_key: bytes, signature: bytes) -> None:
    with pytest.raises(SignatureError):
        verify_prefixed(public_key, b"m", signature)


def test_seed_of_wrong_length_is_refused() -> None:
    with pytest.raises(SignatureError):
        SigningKey.sr25519(b"short")
