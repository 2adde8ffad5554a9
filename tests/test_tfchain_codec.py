"""tfchain's storage keys, Twin and event decoding and extrinsic signing (twins/chain.py),
against golden bytes written out from the chain's SCALE layout (spec/rmb.md §4.1):
`Twin { id: u32, account_id: [u8; 32], relay: Option<BoundedVec<u8>>, entities: Vec<_>,
pk: Option<BoundedVec<u8>> }`."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmb_relay.identity import signing_key
from rmb_relay.twins import Twin
from rmb_relay.twins.chain import ChainCodec, ChainDataError, StorageKey, TwinEvent

#: the codec fixture is module-scoped and read-only, so sharing it across examples is safe
FIXTURE = [HealthCheck.function_scoped_fixture]
ACCOUNT = bytes(range(32))
PK = bytes([3]) + bytes(range(100, 132))


@pytest.fixture(scope="module")
def codec() -> ChainCodec:
    return ChainCodec.load()


def twin_bytes(
    twin_id: int, relay: bytes | None, pk: bytes | None, entities: bytes = b"\0"
) -> bytes:
    """A Twin written out by hand: u32 LE, 32 bytes, Option<Vec<u8>> (0 | 1 + compact length +
    bytes), Vec<EntityProof>, Option<Vec<u8>>."""

    def option(data: bytes | None) -> bytes:
        return b"\0" if data is None else b"\1" + bytes([len(data) << 2]) + data

    return twin_id.to_bytes(4, "little") + ACCOUNT + option(relay) + entities + option(pk)


def test_storage_keys_are_substrates() -> None:
    # twox128("System") ++ twox128("Events"): the key every substrate chain has
    assert ChainCodec.events_key().hex() == (
        "26aa394eea5630e07c48ae0c9558cef780d41e5e16056765bc8461851072c9d7"
    )
    # twox128("TfgridModule") ++ twox128("Twins") ++ blake2_128(1u32) ++ 1u32
    assert ChainCodec.twin_key(1).hex() == (
        "19a2526838feefd7695a3b5715b415b1311378229266fc86f673a3f4cf398e69"
        "d82c12285b5d4551f88e8f6e7eb52b8101000000"
    )
    account_key = ChainCodec.account_key(ACCOUNT)
    assert account_key.startswith(bytes.fromhex("19a2526838feefd7695a3b5715b415b1"))
    assert account_key.endswith(ACCOUNT)


def test_storage_keys_parse_back() -> None:
    assert ChainCodec.parse_key(ChainCodec.twin_key(77)) == StorageKey("twin", 77)
    assert ChainCodec.parse_key(ChainCodec.account_key(ACCOUNT)) == StorageKey(
        "twin_by_account", ACCOUNT
    )
    assert ChainCodec.parse_key(ChainCodec.events_key()) == StorageKey("events", None)
    tampered = bytearray(ChainCodec.twin_key(77))
    tampered[40] ^= 1  # the hash no longer matches the key
    assert ChainCodec.parse_key(bytes(tampered)) is None
    assert ChainCodec.parse_key(b"\0" * 52) is None


def test_decodes_a_twin_with_relays_and_pk(codec: ChainCodec) -> None:
    data = twin_bytes(42, b"r1.grid.tf_r2.grid.tf", PK)
    assert codec.decode_twin(data) == Twin(42, ACCOUNT, frozenset({"r1.grid.tf", "r2.grid.tf"}), PK)


def test_decodes_a_twin_without_relay_or_pk(codec: ChainCodec) -> None:
    assert codec.decode_twin(twin_bytes(7, None, None)) == Twin(7, ACCOUNT, None, None)


def test_decodes_a_twin_with_entity_proofs(codec: ChainCodec) -> None:
    # one EntityProof { entity_id: 5u32, signature: Vec<u8> [0xaa, 0xbb] }
    entities = b"\x04" + (5).to_bytes(4, "little") + b"\x08\xaa\xbb"
    twin = codec.decode_twin(twin_bytes(9, b"relay.example", None, entities))
    assert twin == Twin(9, ACCOUNT, frozenset({"relay.example"}), None)


def test_encodes_exactly_the_bytes_it_decodes(codec: ChainCodec) -> None:
    data = twin_bytes(42, b"a.example_b.example", PK)
    assert codec.encode_twin(codec.decode_twin(data)) == data


def test_empty_relay_parts_are_skipped(codec: ChainCodec) -> None:
    twin = codec.decode_twin(twin_bytes(3, b"_a.example__", None))
    assert twin.relays == frozenset({"a.example"})


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x01\x00", "truncated"),
        (twin_bytes(1, None, None) + b"\x00", "bytes left after"),
        (twin_bytes(1, b"bad relay!", None), "invalid relay domain"),
        (twin_bytes(0, None, None), "twin id must be"),
    ],
)
def test_bad_twin_bytes_are_a_clear_error(codec: ChainCodec, data: bytes, reason: str) -> None:
    with pytest.raises(ChainDataError, match=reason):
        codec.decode_twin(data)


@pytest.mark.parametrize("pk", [b"\x02\x01", b"\x04" + bytes(32), b"0x02" + b"ab" * 20])
def test_a_pk_that_is_no_compressed_key_reads_as_none(codec: ChainCodec, pk: bytes) -> None:
    """Older clients published other key formats: the twin is usable, without e2e."""
    assert codec.decode_twin(twin_bytes(1, None, pk)) == Twin(1, ACCOUNT, None, None)


def test_twin_id_by_account(codec: ChainCodec) -> None:
    assert codec.decode_twin_id((4242).to_bytes(4, "little")) == 4242
    assert codec.encode_twin_id(4242) == (4242).to_bytes(4, "little")
    with pytest.raises(ChainDataError):
        codec.decode_twin_id(b"\x01")


def test_twin_events_among_other_events(codec: ChainCodec) -> None:
    stored = Twin(5, ACCOUNT, frozenset({"x.example"}), PK)
    updated = Twin(6, ACCOUNT, None, None)
    data = codec.encode_events(
        [
            (0, "System", "ExtrinsicSuccess", {"dispatch_info": _DISPATCH}),
            (1, "TfgridModule", "TwinStored", codec.twin_value(stored)),
            (1, "TfgridModule", "TwinDeleted", 77),
            (2, "TfgridModule", "TwinUpdated", codec.twin_value(updated)),
        ]
    )
    assert codec.decode_twin_events(data) == [
        TwinEvent("TwinStored", stored),
        TwinEvent("TwinUpdated", updated),
    ]
    with pytest.raises(ChainDataError):
        codec.decode_twin_events(data[:-3])


_DISPATCH = {"weight": {"ref_time": 0, "proof_size": 0}, "class": "Normal", "pays_fee": "Yes"}


@pytest.mark.parametrize("key_type", ["sr25519", "ed25519"])
def test_signed_update_twin_verifies_and_tampering_does_not(
    codec: ChainCodec, key_type: str
) -> None:
    key = signing_key("0x" + "07" * 32, key_type)  # type: ignore[arg-type]
    genesis = bytes(range(32))
    args = {"relay": "localhost", "pk": "0x" + PK.hex()}
    data = codec.signed_extrinsic(key, "update_twin", args, 4, genesis)
    extrinsic = codec.decode_extrinsic(data)
    assert (extrinsic.account, extrinsic.scheme, extrinsic.nonce) == (key.public_key, key_type, 4)
    assert (extrinsic.function, extrinsic.args) == ("update_twin", args)
    assert extrinsic.call[:2] == bytes([25, 18])  # pallet 25, call_index 18 (spec §4.2)
    assert codec.verify(extrinsic, genesis)
    assert not codec.verify(extrinsic, bytes(32))  # signed for another chain
    other = codec.decode_extrinsic(codec.signed_extrinsic(key, "update_twin", args, 5, genesis))
    forged = type(extrinsic)(**{**_fields(extrinsic), "signature": other.signature})
    assert not codec.verify(forged, genesis)


def _fields(extrinsic: object) -> dict[str, object]:
    return {name: getattr(extrinsic, name) for name in extrinsic.__slots__}  # type: ignore[attr-defined]


def test_undecodable_extrinsic_is_a_clear_error(codec: ChainCodec) -> None:
    with pytest.raises(ChainDataError, match="cannot decode the extrinsic"):
        codec.decode_extrinsic(b"\x10\x84\x00")


def test_runtime_version_comes_from_the_metadata(codec: ChainCodec) -> None:
    assert codec.runtime_version["specName"] == "substrate-threefold"
    assert codec.spec_version > 0
    assert codec.transaction_version > 0


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=200))
def test_any_bytes_decode_or_raise_chain_data_error(codec: ChainCodec, data: bytes) -> None:
    """Whatever a node sends, the codec answers with a value or ChainDataError (which fails
    over), never another exception."""
    for decode in (
        codec.decode_twin,
        codec.decode_twin_id,
        codec.decode_twin_events,
        codec.decode_extrinsic,
    ):
        with contextlib.suppress(ChainDataError):
            decode(data)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    twin_id=st.integers(1, 2**32 - 1),
    relay=st.none() | st.binary(max_size=60),
    pk=st.none() | st.binary(max_size=60),
)
def test_any_twin_shaped_bytes_decode_or_raise_chain_data_error(
    codec: ChainCodec, twin_id: int, relay: bytes | None, pk: bytes | None
) -> None:
    try:
        twin = codec.decode_twin(twin_bytes(twin_id, relay, pk))
    except ChainDataError:
        return
    assert twin.id == twin_id


def test_a_relay_that_looks_like_hex_stays_text(codec: ChainCodec) -> None:
    """scalecodec reads text starting with "0x" as hex; byte fields must go in as bytes."""
    twin = Twin(8, ACCOUNT, frozenset({"0x1234"}), PK)
    data = codec.encode_twin(twin)
    assert data == twin_bytes(8, b"0x1234", PK)
    assert codec.decode_twin(data) == twin
    key = signing_key("0x" + "07" * 32)
    genesis = bytes(32)
    signed = codec.signed_extrinsic(
        key, "update_twin", {"relay": b"0x1234", "pk": None}, 0, genesis
    )
    extrinsic = codec.decode_extrinsic(signed)
    assert extrinsic.call == bytes([25, 18, 1, 6 << 2]) + b"0x1234" + b"\0"
    assert codec.verify(extrinsic, genesis)
