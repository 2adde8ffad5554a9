"""Hostile RMB logins over real sockets (issue 9, items 5 and 6): a JWT header nested two
thousand deep, an oversized token and a token that never expires are all a clear 401 counted as
a login failure, never a 500 with a traceback; a failing directory answers 500 without a path.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import pytest

from rmb_relay.identity import JWT_HEADER_B64, b64url, make_jwt
from tests.conftest import StartRelay
from tests.helpers import http_exchange
from tests.rmb_fixtures import RmbRelay, key_for, start_rmb_relay
from tests.scrape import scrape


@pytest.fixture
async def relay(start_relay: StartRelay, tmp_path: Path) -> RmbRelay:
    return await start_rmb_relay(start_relay, tmp_path)


async def login(relay: RmbRelay, token: str) -> tuple[int, bytes]:
    host, port = relay.server.addresses[0]
    raw = (
        f"GET /?{token} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    answer = await http_exchange(host, port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def failures(relay: RmbRelay, reason: str) -> float:
    host, port = relay.server.addresses[0]
    page = await scrape(host, port)
    try:
        return page.value("rmb_relay_auth_failures_total", dialect="rmb", reason=reason)
    except KeyError:
        return 0.0


def claims(now: int, exp: int) -> str:
    return b64url(f'{{"sub":1,"sid":null,"iat":{now},"exp":{exp}}}'.encode())


async def test_deeply_nested_jwt_header_is_a_401_login_failure_without_traceback(
    relay: RmbRelay, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: RecursionError in the JSON decoder, a 500 and a logged traceback, no count."""
    now = int(time.time())
    token = f"{b64url(b'[' * 2000)}.{claims(now, now + 60)}.{b64url(bytes(65))}"
    assert 2000 < len(token) < 4096
    with caplog.at_level(logging.INFO):
        status, body = await login(relay, token)
    assert (status, body) == (401, b"invalid jwt: malformed base64url or JSON")
    assert await failures(relay, "invalid jwt") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_oversized_token_is_refused_before_decoding(relay: RmbRelay) -> None:
    token = "A" * 5000 + "." + "B" * 10 + "." + "C" * 10
    status, body = await login(relay, token)
    assert status == 401
    assert body == b"invalid jwt: token over 4096 characters"


@pytest.mark.parametrize("exp", [2**64 - 1, 10**30])
async def test_token_that_never_expires_is_refused(relay: RmbRelay, exp: int) -> None:
    now = int(time.time())
    signed = f"{JWT_HEADER_B64}.{claims(now, exp)}"
    token = f"{signed}.{b64url(key_for(1).sign_prefixed(signed.encode()))}"
    status, body = await login(relay, token)
    assert (status, body) == (401, b"invalid jwt: jwt lifetime over 3600 s")
    # an ordinary token of the same twin still logs in
    client = await relay.client(1)
    assert (await client.ping()).data == b"hello world"
    await relay.close_clients()


async def test_directory_failure_is_a_500_without_the_file_path(
    relay: RmbRelay, caplog: pytest.LogCaptureFixture
) -> None:
    path = relay.directory.path
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO twins (id, account) VALUES (5, x'0102')")
    db.close()
    token = make_jwt(key_for(5), 5, None, int(time.time()))
    with caplog.at_level(logging.INFO):
        status, body = await login(relay, token)
    assert status == 500
    assert body.startswith(b"failed to get twin: directory unavailable (request ")
    assert str(path).encode() not in body
    assert b"sqlite" not in body
    request_id = body.split(b"request ")[1].rstrip(b")").decode()
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert logged  # the operator finds the cause under the id
    assert str(path) in logged[0]
