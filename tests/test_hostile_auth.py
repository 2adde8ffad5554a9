"""Hostile clients against the login paths of a real relay process (issue 33): a flood of
wrong secrets is refused with 429 and Retry-After before any hashing, honest logins from
another address in parallel all pass, the relay's memory stays bounded and it logs no
traceback."""

from __future__ import annotations

import asyncio
import os
import stat
import time
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
        # at most --auth-failures wrong guesses are tried; one may be refused "for this
        # tenant" instead while an honest login holds the tenant's attempt (refunded at its
        # success), so the attacker can get one 401 fewer, never more
        assert set(tally) == {401, 429}, tally
        assert 4 <= tally[401] <= 5, tally
        assert tally[401] + tally[429] == 60
        for answer in flood:
            if answer.status_code == 429:
                assert int(answer.headers["retry-after"]) >= 1
                assert answer.json()["error"] == "temporarily_unavailable"
        assert logins == [200] * 5
    page = await scrape(*tunnel_relay.address)
    throttled = {
        reason: page.samples.get(
            ("rmb_relay_auth_throttled_total", (("dialect", "tunnel"), ("reason", reason))), 0.0
        )
        for reason in ("ip", "key")
    }
    assert throttled["ip"] + throttled["key"] == tally[429], throttled
    assert tunnel_relay.rss_mib() - rss_before < RSS_GROWTH_MIB
    assert tunnel_relay.stop() == 0
    assert not tunnel_relay.problems, tunnel_relay.problems


def test_twin_directory_file_and_directory_are_private(tmp_path: Path) -> None:
    """The SQLite file holds tenant secret hashes and the token-signing key: 0600 in a 0700
    directory when the relay creates them, and an existing readable one is narrowed."""
    from rmb_relay.twins.local import SqliteTwinDirectory

    path = tmp_path / "state" / "twins.sqlite3"
    old_umask = os.umask(0o022)
    try:
        with SqliteTwinDirectory(path):
            pass
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert path.stat().st_mode & 0o777 == 0o600
        for sidecar in path.parent.iterdir():  # -wal, -shm
            assert sidecar.stat().st_mode & 0o077 == 0, sidecar
        path.chmod(0o644)
        with SqliteTwinDirectory(path):
            pass
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)


def _not_private(root: Path) -> list[str]:
    """What below `root` another local user could read (mode, path): a file or the directory
    holding one, or a body store (empty or not)."""
    paths = sorted(root.rglob("*"))
    exposed = {p for p in paths if p.is_file()}
    exposed |= {p.parent for p in exposed if p.parent != root}
    exposed |= {p for p in paths if p.is_dir() and "bodies" in p.name}
    return [
        f"{stat.S_IMODE(p.stat().st_mode):o} {p.relative_to(root)}"
        for p in sorted(exposed)
        if p.stat().st_mode & 0o077
    ]


def _usual_umask() -> None:
    os.umask(0o022)


def test_a_relay_process_keeps_secrets_and_bodies_private(tmp_path: Path) -> None:
    """The relay as users start it, under umask 022 with new data, state and temp directories:
    what it creates there (the SQLite file of tenant secret hashes and the token-signing key,
    its -wal and -shm, the tunnel's body store) is its user's alone; a body store directory
    others may write is refused at startup."""
    homes = {name: tmp_path / name for name in ("data", "state", "tmp")}
    for home in homes.values():
        home.mkdir(mode=0o755)
    env = {
        **os.environ,
        "XDG_DATA_HOME": str(homes["data"]),
        "XDG_STATE_HOME": str(homes["state"]),
        "TMPDIR": str(homes["tmp"]),
    }
    relay = RelayProcess(env=env, preexec_fn=_usual_umask)
    try:
        assert list(homes["data"].rglob("*.sqlite3")), "no SQLite file made"
        exposed = [bad for home in homes.values() for bad in _not_private(home)]
        assert not exposed, exposed
    finally:
        relay.close()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="written by others"):
        RelayProcess("--tunnel-body-store", str(shared), env=env).close()


async def _upgrade_status(
    port: int, path: str, local: str = "127.0.0.1"
) -> tuple[int, dict[str, str]]:
    """The status and headers a websocket upgrade to `path` is answered with."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    writer.close()
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}


async def test_failed_rmb_logins_from_one_address_get_429(tmp_path: Path) -> None:
    from rmb_relay.identity import make_jwt
    from rmb_relay.twins import Twin
    from rmb_relay.twins.local import SqliteTwinDirectory
    from tests.rmb_fixtures import key_for

    db = tmp_path / "twins.sqlite3"
    with SqliteTwinDirectory(db) as twins:
        twins.add(Twin(5, key_for(5).public_key, None))
    relay = RelayProcess("--twins", f"sqlite:{db}", "--no-tunnel", "--auth-failures", "4")
    try:
        now = int(time.time())
        forged = make_jwt(key_for(99), 5, None, now)  # twin 5's id, someone else's key
        honest = make_jwt(key_for(5), 5, None, now)

        async def attack() -> list[tuple[int, dict[str, str]]]:
            return [await _upgrade_status(relay.port, f"/?{forged}") for _ in range(10)]

        async def log_in() -> list[int]:
            return [(await _upgrade_status(relay.port, f"/?{honest}", HONEST))[0] for _ in range(3)]

        flood, logins = await asyncio.gather(attack(), log_in())
        assert [status for status, _ in flood] == [401] * 4 + [429] * 6
        assert all(int(headers["retry-after"]) >= 1 for status, headers in flood if status == 429)
        assert logins == [101] * 3
        page = await scrape(*relay.address)
        assert page.value("rmb_relay_auth_throttled_total", dialect="rmb", reason="ip") == 6
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()


async def test_honest_rmb_logins_at_once_from_one_address_all_pass(tmp_path: Path) -> None:
    """A signature has nothing to guess, so RMB logins are charged only when they fail: more
    honest logins at once from one address (a NAT, rmb-load with many pairs) than
    --auth-failures all pass, where charging each at its start refused all but the first."""
    from rmb_relay.identity import make_jwt
    from rmb_relay.twins import Twin
    from rmb_relay.twins.local import SqliteTwinDirectory
    from tests.rmb_fixtures import key_for

    db = tmp_path / "twins.sqlite3"
    with SqliteTwinDirectory(db) as twins:
        for twin in range(1, 21):
            twins.add(Twin(twin, key_for(twin).public_key, None))
    relay = RelayProcess("--twins", f"sqlite:{db}", "--no-tunnel", "--auth-failures", "4")
    try:
        now = int(time.time())
        tokens = [make_jwt(key_for(twin), twin, None, now) for twin in range(1, 21)]
        logins = await asyncio.gather(*(_upgrade_status(relay.port, f"/?{t}") for t in tokens))
        assert [status for status, _ in logins] == [101] * 20
        page = await scrape(*relay.address)
        assert {"dialect": "rmb", "reason": "ip"} not in page.series(
            "rmb_relay_auth_throttled_total"
        )
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()


async def test_a_full_auth_pool_answers_503_at_once(tmp_path: Path) -> None:
    """One hashing thread and no queue: of 32 token requests at once, the ones that find the
    pool busy are answered 503 with Retry-After at once instead of waiting in line."""
    db = f"sqlite:{tmp_path / 'relay.sqlite3'}"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    await add_tenant(db, env, "acme", SECRET)
    relay = RelayProcess(
        "--twins", db, "--no-sbd", "--auth-workers", "1", "--auth-queue", "0",
        "--auth-failures", "1000",
    )  # fmt: skip
    try:
        rss_before = relay.rss_mib()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{relay.port}", timeout=WAIT) as c:
            answers = await asyncio.gather(
                *(c.post("/tunnel/token", data=_form("wrong")) for _ in range(32))
            )
            tally = Counter(answer.status_code for answer in answers)
            assert set(tally) == {401, 503}, tally
            assert tally[401] >= 1
            for answer in answers:
                if answer.status_code == 503:
                    assert answer.headers["retry-after"] == "1"
            # the pool is free again: an honest login passes
            assert (await c.post("/tunnel/token", data=_form(SECRET))).status_code == 200
        page = await scrape(*relay.address)
        busy = page.value("rmb_relay_auth_throttled_total", dialect="tunnel", reason="busy")
        assert busy == tally[503]
        assert relay.rss_mib() - rss_before < RSS_GROWTH_MIB
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()


async def test_sbd_tokens_handed_out_are_bounded() -> None:
    """Without an auth hook anyone gets an SBD token; the live ones are bounded
    (--sbd-max-tokens), the rest 503 with Retry-After, counted as busy."""
    relay = RelayProcess("--no-tunnel", "--sbd-max-tokens", "3")
    try:
        rss_before = relay.rss_mib()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{relay.port}", timeout=WAIT) as c:
            answers = [await c.put("/authenticate", content=b"{}") for _ in range(5)]
        assert [a.status_code for a in answers] == [200, 200, 200, 503, 503]
        assert answers[3].headers["retry-after"] == "1"
        assert "3 tokens are live" in answers[3].text
        page = await scrape(*relay.address)
        assert page.value("rmb_relay_auth_throttled_total", dialect="sbd", reason="busy") == 2
        assert relay.rss_mib() - rss_before < RSS_GROWTH_MIB
        assert relay.stop() == 0
        assert not relay.problems, relay.problems
    finally:
        relay.close()
