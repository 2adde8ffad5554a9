"""tfchain's storage keys, SCALE types and extrinsics, driven by the runtime metadata shipped in
this package (`data/tfchain-metadata.scale`, metadata V14).

Why the shipped metadata rather than the node's: the types we read (`pallet_tfgrid::types::Twin`,
`TfgridModule` events, `update_twin`) have been stable across tfchain releases, and decoding a
twin must not wait for a 80 KB `state_getMetadata` on every reconnect. The devchain serves the
same file, so both ends agree by construction.

Why scalecodec: it turns the metadata's portable type registry into codecs for every type the
chain uses, so no SCALE layout is written by hand here (spec/rmb.md §4.1-§4.2). Its values are
loosely typed (`dict`, `str` hex); this module is the one place that turns them into our types
and rejects anything else with a `ChainDataError`.

Storage keys (§4.2): twox128(pallet) ++ twox128(storage) ++ blake2_128(scale(key)) ++ scale(key)
for the `Blake2_128Concat` maps `Twins` (u32) and `TwinIdByAccountID` (AccountId32).

Loading the metadata takes about a second of CPU: `ChainCodec.load()` is synchronous; async
callers run it in a worker thread once (`load_async`).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

import xxhash
from scalecodec.base import RuntimeConfigurationObject, ScaleBytes
from scalecodec.exceptions import RemainingScaleBytesNotEmptyException
from scalecodec.type_registry import load_type_registry_preset

from rmb_relay._core import SigningKey, verify_ed25519, verify_sr25519
from rmb_relay.errors import ConfigError, CoreError, NodeError
from rmb_relay.twins import ACCOUNT_LEN, PK_LEN, Twin, format_relays, parse_relays

__all__ = [
    "PALLET",
    "ChainCodec",
    "ChainDataError",
    "SignedExtrinsic",
    "StorageKey",
    "TwinEvent",
    "blake2_128",
    "twox128",
]

PALLET = "TfgridModule"
#: an immortal era (the one byte 0x00): the extrinsic is valid until the nonce is used
IMMORTAL_ERA = "00"
#: substrate signs blake2_256(payload) instead of the payload when it is longer than this
_MAX_RAW_PAYLOAD = 256
#: MultiSignature variant index by scheme, and back
_SCHEMES = {"Ed25519": "ed25519", "Sr25519": "sr25519"}


class ChainDataError(NodeError):
    """Bytes or JSON values from a node that are not what tfchain stores there (a node that
    answers nonsense is failed over like one that is down)."""


def twox128(data: bytes) -> bytes:
    """Substrate's Twox128: xxh64 with seeds 0 and 1, each little-endian, concatenated."""
    return xxhash.xxh64_digest(data, seed=0)[::-1] + xxhash.xxh64_digest(data, seed=1)[::-1]


def blake2_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def blake2_256(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _prefix(pallet: str, storage: str) -> bytes:
    return twox128(pallet.encode()) + twox128(storage.encode())


_TWINS = _prefix(PALLET, "Twins")
_TWIN_BY_ACCOUNT = _prefix(PALLET, "TwinIdByAccountID")
_EVENTS = _prefix("System", "Events")


@dataclass(frozen=True, slots=True)
class StorageKey:
    """A storage key the devchain understands, parsed back from its bytes."""

    kind: Literal["twin", "twin_by_account", "events"]
    #: twin id (for "twin"), account (for "twin_by_account"), None for "events"
    key: int | bytes | None


@dataclass(frozen=True, slots=True)
class TwinEvent:
    """`TfgridModule.TwinStored` or `TwinUpdated`, with the twin as stored after the change."""

    name: Literal["TwinStored", "TwinUpdated"]
    twin: Twin


@dataclass(frozen=True, slots=True)
class SignedExtrinsic:
    """The parts of a signed extrinsic the devchain checks and applies."""

    account: bytes
    scheme: str
    signature: bytes
    nonce: int
    era: str
    tip: int
    module: str
    function: str
    args: dict[str, Any]
    call: bytes
    #: blake2_256 of the encoded extrinsic: how substrate names it
    hash: bytes


def _hex(value: object, what: str) -> bytes:
    if not isinstance(value, str) or not value.startswith("0x"):
        raise ChainDataError(f"{what}: expected 0x-prefixed hex, got {type(value).__name__}")
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise ChainDataError(f"{what}: not hex") from None


def _usable_pk(pk: bytes | None) -> bytes | None:
    """The chain stores any bytes as `pk` (older clients published other formats): only a
    33-byte compressed secp256k1 point is a key rmb can encrypt to; anything else means "no
    usable e2e key" (messages to the twin go in plaintext), not a failed lookup."""
    if pk is None or len(pk) != PK_LEN or pk[0] not in (2, 3):
        return None
    return pk


def _vec_u8(value: object) -> bytes:
    """A `Vec<u8>` value as scalecodec decodes it: text when the bytes are UTF-8, else 0x-hex.
    (A compressed key starts with 0x02 or 0x03, so its text form never starts with "0x".)"""
    if not isinstance(value, str):
        raise ChainDataError(f"expected bytes, got {type(value).__name__}")
    return _hex(value, "bytes") if value.startswith("0x") else value.encode()


class ChainCodec:
    """Encoders and decoders for the tfchain types rmb-relay uses. Immutable after `load`;
    one instance serves every connection and the devchain."""

    def __init__(self, metadata_bytes: bytes) -> None:
        if not metadata_bytes.startswith(b"meta"):
            raise ConfigError("runtime metadata must start with the magic 'meta'")
        config = RuntimeConfigurationObject()
        config.update_type_registry(load_type_registry_preset("core"))
        config.update_type_registry(load_type_registry_preset("legacy"))
        metadata = config.create_scale_object("MetadataVersioned", data=ScaleBytes(metadata_bytes))
        metadata.decode()
        config.add_portable_registry(metadata)
        self.metadata_bytes = metadata_bytes
        self._config = config
        self._metadata = metadata
        pallet = metadata.get_metadata_pallet(PALLET)
        self._twin_type: str = pallet.get_storage_function("Twins").get_value_type_string()
        self._twin_id_type: str = pallet.get_storage_function(
            "TwinIdByAccountID"
        ).get_value_type_string()
        self._events_type: str = (
            metadata.get_metadata_pallet("System")
            .get_storage_function("Events")
            .get_value_type_string()
        )
        extensions = metadata.get_signed_extensions()
        # the signed payload as substrate-interface builds it for these extensions: the extra
        # (era, nonce, tip) then the additional signed data (spec, tx version, genesis, era block)
        self._payload_mapping = [
            ["call", "CallBytes"],
            ["era", extensions["CheckMortality"]["extrinsic"]],
            ["nonce", extensions["CheckNonce"]["extrinsic"]],
            ["tip", extensions["ChargeTransactionPayment"]["extrinsic"]],
            ["spec_version", extensions["CheckSpecVersion"]["additional_signed"]],
            ["transaction_version", extensions["CheckTxVersion"]["additional_signed"]],
            ["genesis_hash", extensions["CheckGenesis"]["additional_signed"]],
            ["block_hash", extensions["CheckMortality"]["additional_signed"]],
        ]
        self.runtime_version: dict[str, Any] = self._runtime_version()

    @classmethod
    def load(cls) -> ChainCodec:
        """The codec for the metadata shipped in this package (about a second of CPU)."""
        data = resources.files("rmb_relay.twins").joinpath("data/tfchain-metadata.scale")
        return cls(data.read_bytes())

    @classmethod
    async def load_async(cls) -> ChainCodec:
        """`load` in a worker thread, so the event loop keeps serving meanwhile."""
        return await asyncio.to_thread(cls.load)

    def _runtime_version(self) -> dict[str, Any]:
        """`System.Version` from the metadata's constants, in `state_getRuntimeVersion` form."""
        for constant in self._metadata.get_metadata_pallet("System").constants:
            if constant.name == "Version":
                obj = self._config.create_scale_object(
                    constant.type, data=ScaleBytes(constant.constant_value)
                )
                value = obj.decode()
                return {
                    "specName": value["spec_name"],
                    "implName": value["impl_name"],
                    "authoringVersion": value["authoring_version"],
                    "specVersion": value["spec_version"],
                    "implVersion": value["impl_version"],
                    "apis": [[api, version] for api, version in value["apis"]],
                    "transactionVersion": value["transaction_version"],
                    "stateVersion": value["state_version"],
                }
        raise ConfigError("runtime metadata has no System.Version constant")

    @property
    def spec_version(self) -> int:
        return int(self.runtime_version["specVersion"])

    @property
    def transaction_version(self) -> int:
        return int(self.runtime_version["transactionVersion"])

    # ---- storage keys ----------------------------------------------------------------------

    @staticmethod
    def twin_key(twin_id: int) -> bytes:
        encoded = twin_id.to_bytes(4, "little")
        return _TWINS + blake2_128(encoded) + encoded

    @staticmethod
    def account_key(account: bytes) -> bytes:
        if len(account) != ACCOUNT_LEN:
            raise ConfigError(f"account must be {ACCOUNT_LEN} bytes, got {len(account)}")
        return _TWIN_BY_ACCOUNT + blake2_128(account) + account

    @staticmethod
    def events_key() -> bytes:
        """`System.Events`: every event of the block it is read at."""
        return _EVENTS

    @staticmethod
    def parse_key(key: bytes) -> StorageKey | None:
        """The devchain's side of `twin_key`/`account_key`/`events_key`; None for any other."""
        if key == _EVENTS:
            return StorageKey("events", None)
        for prefix, size in ((_TWINS, 4), (_TWIN_BY_ACCOUNT, ACCOUNT_LEN)):
            if key.startswith(prefix) and len(key) == 32 + 16 + size:
                raw = key[48:]
                if blake2_128(raw) != key[32:48]:
                    return None
                if size == 4:
                    return StorageKey("twin", int.from_bytes(raw, "little"))
                return StorageKey("twin_by_account", raw)
        return None

    # ---- values ----------------------------------------------------------------------------

    def _decode(self, type_string: str, data: bytes, what: str) -> Any:
        try:
            obj = self._config.create_scale_object(type_string, data=ScaleBytes(bytearray(data)))
            value = obj.decode(check_remaining=True)
        except RemainingScaleBytesNotEmptyException as err:
            # scalecodec raises this both for too few bytes and for bytes left over
            detail = "truncated" if "No more bytes" in str(err) else "bytes left after the value"
            raise ChainDataError(f"cannot decode {what} ({len(data)} bytes): {detail}") from None
        except Exception as err:  # scalecodec raises many kinds for truncated or bad input
            raise ChainDataError(f"cannot decode {what} ({len(data)} bytes): {err}") from None
        return value

    def _encode(self, type_string: str, value: Any) -> bytes:
        obj = self._config.create_scale_object(type_string)
        return bytes(obj.encode(value).data)

    def decode_twin(self, data: bytes) -> Twin:
        """A stored `Twin<AccountId>` as rmb's Twin (relay split on '_', optional pk)."""
        return self._twin_from_value(self._decode(self._twin_type, data, "a Twin"))

    def _twin_from_value(self, value: Any) -> Twin:
        if not isinstance(value, dict):
            raise ChainDataError("a Twin must decode to a struct")
        relay = value.get("relay")
        pk = value.get("pk")
        try:
            return Twin(
                int(value["id"]),
                _hex(value["account_id"], "Twin.account_id"),
                # scalecodec gives a BoundedVec<u8> as text when it is UTF-8 (tfchain only
                # accepts [A-Za-z0-9-_.] there), as 0x-hex otherwise
                None if relay is None else parse_relays(str(relay)),
                _usable_pk(None if pk is None else _vec_u8(pk)),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise ChainDataError(f"the chain's Twin is not usable: {err}") from None

    def encode_twin(self, twin: Twin) -> bytes:
        return self._encode(self._twin_type, self.twin_value(twin))

    def decode_twin_id(self, data: bytes) -> int:
        value = self._decode(self._twin_id_type, data, "a twin id")
        if not isinstance(value, int):
            raise ChainDataError("a twin id must decode to an integer")
        return value

    def encode_twin_id(self, twin_id: int) -> bytes:
        return self._encode(self._twin_id_type, twin_id)

    def decode_twin_events(self, data: bytes) -> list[TwinEvent]:
        """The `TwinStored`/`TwinUpdated` events among a block's `System.Events`."""
        records = self._decode(self._events_type, data, "System.Events")
        if not isinstance(records, list):
            raise ChainDataError("System.Events must decode to a list")
        found = []
        for record in records:
            if not isinstance(record, dict):
                raise ChainDataError("an event record must decode to a struct")
            name = record.get("event_id")
            if record.get("module_id") == PALLET and name in ("TwinStored", "TwinUpdated"):
                found.append(TwinEvent(name, self._twin_from_value(record.get("attributes"))))
        return found

    def encode_events(self, events: list[tuple[int, str, str, Any]]) -> bytes:
        """`System.Events` for a block: (extrinsic index, pallet, event, attributes) each."""
        return self._encode(
            self._events_type,
            [
                {
                    "phase": {"ApplyExtrinsic": index},
                    "event": {pallet: {name: attributes}},
                    "topics": [],
                }
                for index, pallet, name, attributes in events
            ],
        )

    def twin_value(self, twin: Twin) -> dict[str, Any]:
        """A Twin as scalecodec encodes it (storage, an event's attributes). Byte fields go in
        as bytes: scalecodec would read text starting with "0x" as hex (a relay named
        `0x1234` would be stored as two bytes)."""
        relay = format_relays(twin.relays)
        return {
            "id": twin.id,
            "account_id": "0x" + twin.account.hex(),
            "relay": None if relay is None else relay.encode(),
            "entities": [],
            "pk": twin.pk,
        }

    # ---- extrinsics ------------------------------------------------------------------------

    def encode_call(self, function: str, args: dict[str, Any]) -> bytes:
        call = self._config.create_scale_object("Call", metadata=self._metadata)
        return bytes(
            call.encode({"call_module": PALLET, "call_function": function, "call_args": args}).data
        )

    def signing_payload(
        self, call: bytes, nonce: int, genesis: bytes, *, era: str = IMMORTAL_ERA, tip: int = 0
    ) -> bytes:
        """What the account signs: call, extra and additional data; hashed when over 256 bytes.
        Only immortal extrinsics are built and accepted (their era block is the genesis)."""
        if era != IMMORTAL_ERA:
            raise ChainDataError("only immortal extrinsics (era 00) are supported")
        payload = self._config.create_scale_object("ExtrinsicPayloadValue")
        payload.type_mapping = self._payload_mapping
        genesis_hex = "0x" + genesis.hex()
        data = bytes(
            payload.encode(
                {
                    "call": "0x" + call.hex(),
                    "era": era,
                    "nonce": nonce,
                    "tip": tip,
                    "spec_version": self.spec_version,
                    "transaction_version": self.transaction_version,
                    "genesis_hash": genesis_hex,
                    "block_hash": genesis_hex,
                }
            ).data
        )
        return blake2_256(data) if len(data) > _MAX_RAW_PAYLOAD else data

    def signed_extrinsic(
        self, key: SigningKey, function: str, args: dict[str, Any], nonce: int, genesis: bytes
    ) -> bytes:
        """A signed, immortal, tip-free extrinsic calling `TfgridModule.<function>(args)`."""
        call = self.encode_call(function, args)
        signature = key.sign(self.signing_payload(call, nonce, genesis))
        extrinsic = self._config.create_scale_object("Extrinsic", metadata=self._metadata)
        value = {
            "account_id": "0x" + key.public_key.hex(),
            "signature_version": 1 if key.key_type == "sr25519" else 0,
            "signature": "0x" + signature.hex(),
            "call_module": PALLET,
            "call_function": function,
            "call_args": args,
            "nonce": nonce,
            "era": IMMORTAL_ERA,
            "tip": 0,
        }
        return bytes(extrinsic.encode(value).data)

    def decode_extrinsic(self, data: bytes) -> SignedExtrinsic:
        """A signed extrinsic's parts; ChainDataError for unsigned or undecodable ones."""
        try:
            obj = self._config.create_scale_object(
                "Extrinsic", data=ScaleBytes(bytearray(data)), metadata=self._metadata
            )
            value = obj.decode(check_remaining=True)
        except Exception as err:  # scalecodec raises many kinds for bad input
            raise ChainDataError(f"cannot decode the extrinsic: {err}") from None
        signature = value.get("signature")
        if not isinstance(signature, dict) or len(signature) != 1:
            raise ChainDataError("the extrinsic is not signed")
        ((variant, sig_hex),) = signature.items()
        scheme = _SCHEMES.get(variant)
        if scheme is None:
            raise ChainDataError(f"unsupported signature scheme {variant}")
        call = value["call"]
        if call["call_module"] != PALLET:
            raise ChainDataError(f"the devchain only runs {PALLET} calls")
        args = {arg["name"]: arg["value"] for arg in call["call_args"]}
        return SignedExtrinsic(
            account=_hex(value["address"], "address"),
            scheme=scheme,
            signature=_hex(sig_hex, "signature"),
            nonce=int(value["nonce"]),
            era=str(value["era"]),
            tip=int(value["tip"]),
            module=call["call_module"],
            function=call["call_function"],
            args=args,
            # the call's own bytes: re-encoding the decoded args could differ (scalecodec shows
            # Vec<u8> as text, and reads text starting with "0x" as hex)
            call=bytes(obj.value_object["call"].get_used_bytes()),
            hash=blake2_256(data),
        )

    def verify(self, extrinsic: SignedExtrinsic, genesis: bytes) -> bool:
        """Whether the extrinsic's signature is its account's over the signing payload."""
        payload = self.signing_payload(
            extrinsic.call, extrinsic.nonce, genesis, era=extrinsic.era, tip=extrinsic.tip
        )
        check = verify_sr25519 if extrinsic.scheme == "sr25519" else verify_ed25519
        try:
            return check(extrinsic.account, payload, extrinsic.signature)
        except CoreError:  # a key or signature of the wrong length
            return False
