"""End-to-end encryption between rmb-peers (spec/rmb.md §5.10, §1.4).

Each twin publishes a secp256k1 public key (`pk`, 33-byte compressed) in the twin directory;
its secret key is the same 32 bytes as its signing key's seed (§1.4). Two twins share
`SHA-256(X)`, where X is the 32-byte big-endian x-coordinate of the ECDH point `sk * PK`. That is
not libsecp256k1's default ECDH hash (SHA-256 of the compressed point, which coincurve's
`ecdh()` returns), so the point is multiplied here and its x-coordinate hashed.

A payload is AES-256-GCM with a random 12-byte nonce and no associated data, sent as
`nonce || ciphertext || tag`. The relay sees only that.

The ECDH multiplication costs about 40 us, so the AES key per remote `pk` is kept (bounded, and
keyed by the pk itself, so a twin that publishes a new key simply gets a new entry).
"""

from __future__ import annotations

import hashlib
import os

import coincurve
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from rmb_relay.errors import ConfigError, E2eError

__all__ = ["NONCE_LEN", "E2eKey"]

NONCE_LEN = 12
#: remote keys whose AES key is kept; past this the cache starts over (a twin talks to few)
MAX_PEERS = 10_000


class E2eKey:
    """Our secp256k1 key and the AES keys shared with the twins we talk to."""

    def __init__(self, secret: bytes) -> None:
        try:
            self._secret = coincurve.PrivateKey(secret)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"the secret is not a valid secp256k1 key: {err}") from None
        #: what the twin publishes as its `pk`: the 33-byte compressed public key
        self.public_key: bytes = self._secret.public_key.format(compressed=True)
        self._ciphers: dict[bytes, AESGCM] = {}

    def shared_key(self, pk: bytes) -> bytes:
        """SHA-256 of the x-coordinate of our secret times their public key."""
        try:
            point = coincurve.PublicKey(pk).multiply(self._secret.secret)
        except (ValueError, TypeError) as err:
            raise E2eError(f"invalid public key: {err}") from None
        return hashlib.sha256(point.format(compressed=True)[1:]).digest()

    def _cipher(self, pk: bytes) -> AESGCM:
        cipher = self._ciphers.get(pk)
        if cipher is None:
            if len(self._ciphers) >= MAX_PEERS:
                self._ciphers.clear()
            cipher = self._ciphers[pk] = AESGCM(self.shared_key(pk))
        return cipher

    def encrypt(self, pk: bytes, plain: bytes) -> bytes:
        nonce = os.urandom(NONCE_LEN)
        return nonce + self._cipher(pk).encrypt(nonce, plain, None)

    def decrypt(self, pk: bytes, data: bytes) -> bytes:
        if len(data) < NONCE_LEN:
            raise E2eError("cipher text is shorter than its nonce")
        try:
            return self._cipher(pk).decrypt(data[:NONCE_LEN], data[NONCE_LEN:], None)
        except InvalidTag:
            raise E2eError("cannot decrypt: wrong key or altered cipher text") from None
