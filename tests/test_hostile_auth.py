"""Hostile clients against the login paths of a real relay process (issue 33): a flood of
wrong secrets is refused with 429 and Retry-After before any hashing, honest logins from
another address in parallel all pass, the relay's memory stays bounded and it logs no
traceback."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import WAIT
from tests.relay_process import RelayProcess
from tests.scrape import scrape
from tests.tunnel_processes import add_tenant

SECRET = "the-right-secret"
#: relay RSS growth allowed over a flood: the auth pool's two scrypt runs hold ~16 MiB each
RSS_GROWTH_MIB = 64
#: an honest address: loopback answers for all of 127/8
HONEST = "127.0.0.2"


@pytest.fixture
def tunnel_relay(tmp_path: Path) -> Iterator[RelayProcess]:
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    asyncio.run(add_tenant(db, env, "acme", SECRET))
    relay = RelayProcess(
        "--twins", db, "--no-sbd", "--auth-failures", "5", "--auth-failure-window", "600"
    )
    try:
        yield relay
    finally:
        relay.close()


def _form(secret: str) -> dict[str, str]:
    return {
        "grant_type": "client_credentials",
        "client_id": "acme",
        "client_secret": secret,
        "scope": "connector",
    }


async def test_wrong_secret_flood_gets_429_and_honest_logins_pass(
    tunnel_relay: RelayProcess,
) -> None:
    base = f"http://127.0.0.1:{tunnel_relay.port}"
    rss_before = tunnel_relay.rss_mib()
    honest_transport = httpx.AsyncHTTPTransport(local_address=HONEST)
    async with (
        httpx.AsyncClient(base_url=base, timeout=WAIT) as attacker,
        httpx.AsyncClient(base_url=base, timeout=WAIT, transport=honest_transport) as honest,
    ):

        async def attack() -> list[httpx.Response]:
            answers: list[httpx.Response] = []
            for _ in range(10):
                wave = [attacker.post("/tunnel/token", data=_form("wrong")) for _ in range(6)]
                answers += await asyncio.gather(*wave)
            return answers

        async def log_in() -> list[int]:
            statuses = []
            for _ in range(5):
                answer = await honest.post("/tunnel/token", data=_form(SECRET))
                statuses.append(answer.status_code)
                if answer.status_code == 200:
                    assert answer.json()["token_type"] == "Bearer"
            return statuses

        flood, logins = await asyncio.gather(attack(), log_in())
        tally = Counter(answer.status_code for answer in flood)
        assert tally == {401: 5, 429: 55}, tally
        for answer in flood:
            if answer.status_code == 429:
                assert int(answer.headers["retry-after"]) >= 1
                assert answer.json()["error"] == "temporarily_unavailable"
        assert logins == [200] * 5
    page = await scrape(*tunnel_relay.address)
    assert page.value("rmb_relay_auth_throttled_total", dialect="tunnel", reason="ip") == 55
    assert tunnel_relay.rss_mib() - rss_before < RSS_GROWTH_MIB
    assert tunnel_relay.stop() == 0
    assert not tunnel_relay.problems, tunnel_relay.problems
