"""rmb-peer's parts on their own: envelope signing rules, msgbus JSON, end-to-end crypto, and
the lean Redis client against a real redis-server."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given

from rmb_relay._core import Envelope as RustEnvelope
from rmb_relay.errors import BadMessage, ConfigError, E2eError, RedisUnavailable
from rmb_relay.identity import secret_from_phrase, signing_key
from rmb_relay.peer.e2e import E2eKey
from rmb_relay.sdk.envelope import (
    Envelope,
    address_text,
    challenge,
    parse_address,
    sign,
    signature_ok,
    stamp,
    ttl,
)
from rmb_relay.sdk.msgbus import (
    error_response,
    incoming_request,
    incoming_response,
    parse_incoming_response,
    parse_request,
    parse_response,
)
from rmb_relay.sdk.resp import RespClient, encode_command, parse_redis_url
from tests.conftest import RedisServer, free_port
from tests.test_envelope import envelopes

# ---- envelope: challenge, signature, stamp ----------------------------------------------------


@given(envelopes())
def test_challenge_matches_the_rust_core(reference: object) -> None:
    """Two implementations of spec §2.1 (this one for twins, Rust's for the relay) agree on
    every envelope, including absent vs empty optional fields and deprecated ones."""
    env = Envelope.FromString(reference.SerializeToString())  # type: ignore[attr-defined]
    assert challenge(env) == RustEnvelope.decode(env.SerializeToString()).challenge()


def test_challenge_golden_stream() -> None:
    env = Envelope(uid="u", timestamp=10, expiration=300, tags="t", schema="s", plain=b"P")
    env.source.twin = 7
    env.source.connection = "c"
    env.destination.twin = 9
    env.error.code = 5
    env.error.message = "m"
    env.relays.extend(["r1", "r2"])
    assert challenge(env) == hashlib.md5(b"ut103007c95msPr1r2").digest()


@pytest.mark.parametrize("key_type", ["sr25519", "ed25519"])
def test_signature_checks_account_and_content(key_type: str) -> None:
    key = signing_key(os.urandom(32), key_type)  # type: ignore[arg-type]
    env = Envelope(uid="u", timestamp=1, expiration=2, plain=b"x")
    env.request.command = "c"
    sign(env, key)
    assert env.signature[:1] == (b"s" if key_type == "sr25519" else b"e")
    assert signature_ok(env, key.public_key) is None
    assert signature_ok(env, signing_key(os.urandom(32)).public_key) is not None
    env.plain = b"y"
    assert "does not match" in (signature_ok(env, key.public_key) or "")
    env.ClearField("signature")
    assert signature_ok(env, key.public_key) == "envelope is not signed"
    env.signature = b"x" * 10
    assert signature_ok(env, key.public_key)


def test_stamp_and_ttl_follow_the_spec_examples() -> None:
    assert stamp(10, 1, 20) == (10, 11)
    assert stamp(21, 1, 20) == (21, 0)
    assert stamp(10, 0, 20) == (10, 20)  # no timestamp: now
    assert stamp(10, 50, 20) == (10, 20)  # from the future: now
    assert ttl(10, 1, 20) == 11
    assert ttl(21, 1, 20) is None  # at the deadline: expired
    assert ttl(22, 1, 20) is None


def test_address_text_round_trips() -> None:
    env = Envelope()
    env.source.twin = 5
    assert address_text(env.source) == "5"
    env.source.connection = ""
    assert address_text(env.source) == "5:"  # present but empty is another session
    assert parse_address("5") == (5, None)
    assert parse_address("5:s") == (5, "s")
    for bad in ("", "x", "-1", "4294967296", " 5"):
        with pytest.raises(ValueError, match="twin"):
            parse_address(bad)


# ---- msgbus JSON -----------------------------------------------------------------------------


def request_json(**overrides: object) -> bytes:
    message: dict[str, object] = {
        "ver": 1,
        "ref": "r1",
        "cmd": "zos.test",
        "exp": 300,
        "dat": base64.b64encode(b"payload").decode(),
        "tag": None,
        "dst": [2, 3],
        "ret": "reply-queue",
        "shm": "application/json",
        "now": 1_700_000_000,
    }
    message.update(overrides)
    return json.dumps({k: v for k, v in message.items() if v is not ...}).encode()


def test_request_parses_with_extra_keys_and_missing_options() -> None:
    request = parse_request(request_json(ref=..., tag=..., shm=..., extra={"x": 1}))
    assert request.ref is None
    assert request.tags is None
    assert request.schema is None
    assert request.destinations == (2, 3)
    assert request.data == b"payload"
    assert request.ret == "reply-queue"


def test_request_without_padding_still_decodes() -> None:
    assert parse_request(request_json(dat="YWI")).data == b"ab"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"ver": ...}, "'ver'"),
        ({"ver": "1"}, "'ver'"),
        ({"cmd": 5}, "'cmd'"),
        ({"exp": -1}, "'exp'"),
        ({"exp": 1.5}, "'exp'"),
        ({"now": True}, "'now'"),
        ({"dat": "not base64!"}, "'dat'"),
        ({"dst": 2}, "'dst'"),
        ({"dst": []}, "names no twin"),
        ({"dst": [0]}, "twin ids"),
        ({"dst": [2**32]}, "twin ids"),
        ({"tag": 5}, "'tag'"),
    ],
)
def test_bad_request_is_a_clear_error_that_knows_where_to_answer(
    overrides: dict[str, object], reason: str
) -> None:
    with pytest.raises(BadMessage, match=reason) as caught:
        parse_request(request_json(**overrides))
    assert caught.value.ret == "reply-queue"
    assert caught.value.ref == "r1"
    assert caught.value.code == 101


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"ret": 5}', b"\xff"])
def test_unreadable_request_has_no_return_queue(raw: bytes) -> None:
    with pytest.raises(BadMessage) as caught:
        parse_request(raw)
    assert caught.value.ret is None


def test_service_reply_without_err_and_with_request_keys() -> None:
    """What real services send (spec §6): no `err`, the request's keys copied in."""
    raw = json.dumps(
        {
            "ver": 1,
            "ref": "uid-1",
            "dat": base64.b64encode(b"answer").decode(),
            "dst": "7",
            "now": 1,
            "cmd": "zos.test",
            "exp": 300,
            "ret": "msgbus.system.reply",
            "shm": None,
        }
    ).encode()
    reply = parse_response(raw)
    assert (reply.ref, reply.data, reply.destination, reply.error) == (
        "uid-1",
        b"answer",
        "7",
        None,
    )


def test_service_error_reply_and_numeric_destination() -> None:
    raw = b'{"ver":1,"ref":"u","dat":"","dst":7,"now":0,"err":{"code":7,"message":"no"}}'
    reply = parse_response(raw)
    assert reply.error == (7, "no")
    assert reply.destination == "7"
    with pytest.raises(BadMessage, match="'err'"):
        parse_response(b'{"ver":1,"dat":"","dst":"7","now":0,"err":"boom"}')
    with pytest.raises(BadMessage, match="'dst'"):
        parse_response(b'{"ver":1,"dat":"","dst":null,"now":0}')


def test_output_json_is_compact_and_in_struct_order() -> None:
    assert incoming_request("u", "1:s", "c", 300, b"x", None, "j", 9) == (
        b'{"ver":1,"ref":"u","src":"1:s","cmd":"c","exp":300,"dat":"eA==","tag":null,'
        b'"ret":"msgbus.system.reply","shm":"j","now":9}'
    )
    assert incoming_response("r", b"", "0", None, 3, (0, "offline")) == (
        b'{"ver":1,"ref":"r","dat":"","src":"0","shm":null,"now":3,'
        b'"err":{"code":0,"message":"offline"}}'
    )
    assert error_response(None, 103, "unknown twin id '9'") == (
        b'{"ver":1,"ref":null,"dat":"","src":"","shm":null,"now":0,'
        b'"err":{"code":103,"message":"unknown twin id \'9\'"}}'
    )
    ref, reply = parse_incoming_response(incoming_response("r", b"x", "2", None, 3, None))
    assert ref == "r"
    assert (reply.twin, reply.data, reply.error) == (2, b"x", None)


# ---- end-to-end encryption -------------------------------------------------------------------


def test_shared_key_is_sha256_of_the_x_coordinate() -> None:
    """Checked against `cryptography`'s ECDH, whose output is exactly the x-coordinate."""
    ours, theirs = os.urandom(32), os.urandom(32)
    key, other = E2eKey(ours), E2eKey(theirs)
    private = ec.derive_private_key(int.from_bytes(ours, "big"), ec.SECP256K1())
    public = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256K1(), other.public_key)
    x = private.exchange(ec.ECDH(), public)
    assert key.shared_key(other.public_key) == hashlib.sha256(x).digest()
    assert key.shared_key(other.public_key) == other.shared_key(key.public_key)


def test_cipher_is_nonce_ciphertext_tag_and_round_trips() -> None:
    alice, bob = E2eKey(os.urandom(32)), E2eKey(os.urandom(32))
    data = alice.encrypt(bob.public_key, b"secret")
    assert len(data) == 12 + len(b"secret") + 16
    shared = AESGCM(alice.shared_key(bob.public_key))
    assert shared.decrypt(data[:12], data[12:], None) == b"secret"
    assert bob.decrypt(alice.public_key, data) == b"secret"
    assert data != alice.encrypt(bob.public_key, b"secret")  # a fresh nonce each time


def test_e2e_key_is_the_signing_secret_and_pk_is_compressed() -> None:
    secret = secret_from_phrase(
        "bottom drive obey lake curtain smoke basket hold race lonely fit walk"
    )
    key = E2eKey(secret)
    assert key.public_key[0] in (2, 3)
    assert len(key.public_key) == 33


def test_decrypt_failures_are_e2e_errors() -> None:
    alice, bob, eve = (E2eKey(os.urandom(32)) for _ in range(3))
    data = alice.encrypt(bob.public_key, b"secret")
    with pytest.raises(E2eError, match="e2e error"):
        eve.decrypt(alice.public_key, data)
    with pytest.raises(E2eError, match="shorter"):
        bob.decrypt(alice.public_key, b"short")
    with pytest.raises(E2eError, match="invalid public key"):
        bob.decrypt(b"\x02" + bytes(32), data)
    with pytest.raises(ConfigError, match="secp256k1"):
        E2eKey(bytes(32))


# ---- the lean Redis client -------------------------------------------------------------------


def test_resp_encoding_and_urls() -> None:
    assert encode_command((b"SET", "k", 5)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n"
    assert parse_redis_url("redis://u:p%40ss@h:7/3") == ("h", 7, 3, "u", "p@ss")
    assert parse_redis_url("redis://localhost") == ("localhost", 6379, 0, None, None)
    for bad in ("http://h", "redis://h/x", "redis://h:port"):
        with pytest.raises(ConfigError):
            parse_redis_url(bad)


async def test_resp_pipelines_and_reports_errors(redis_server: RedisServer) -> None:
    client = RespClient(redis_server.url.rsplit("/", 1)[0] + "/2")
    replies = await client.pipeline(
        [(b"LPUSH", b"q", b"a"), (b"LPUSH", b"q", b"b"), (b"RPOP", b"q", 5), (b"INCR", b"q")]
    )
    assert replies[:3] == [1, 2, [b"a", b"b"]]
    assert "WRONGTYPE" not in str(replies[3])  # q is gone after the pop: INCR works
    await client.execute((b"SET", b"s", b"x"))
    with pytest.raises(RedisUnavailable, match="not an integer"):
        await client.execute((b"INCR", b"s"))
    # concurrent callers in one turn share a write and get their own replies
    results = await asyncio.gather(*(client.execute((b"INCR", b"n")) for _ in range(50)))
    assert sorted(results) == list(range(1, 51))
    await client.close()


async def test_resp_reconnects_after_redis_restarts(tmp_path: object) -> None:
    from tests.conftest import start_redis

    port = free_port()
    server = start_redis(str(tmp_path), port)
    client = RespClient(f"redis://127.0.0.1:{port}")
    await client.execute((b"SET", b"k", b"v"))
    server.stop()
    with pytest.raises(RedisUnavailable):
        await client.execute((b"GET", b"k"))
    server = start_redis(str(tmp_path), port)
    try:
        assert await client.execute((b"GET", b"k")) == b"v"  # the append-only file kept it
    finally:
        await client.close()
        server.stop()
    with pytest.raises(RedisUnavailable, match="closed"):
        await client.execute((b"GET", b"k"))
