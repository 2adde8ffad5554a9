"""The embedded twin directory, its cache and the `rmb-relay twins` CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import sr25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from mnemonic import Mnemonic

from rmb_relay.errors import ConfigError, TwinLookupError
from rmb_relay.identity import secret_from_phrase, signing_key
from rmb_relay.twins import Twin, TwinDirectory, parse_relays
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory

PHRASE = "legal winner thank year wave sausage worth useful legal winner thank yellow"


def twin(twin_id: int, relays: frozenset[str] | None = frozenset({"r1.example"})) -> Twin:
    return Twin(twin_id, hashlib.sha256(str(twin_id).encode()).digest(), relays, None)


# ---- SQLite directory ----------------------------------------------------------------------


async def test_add_get_list_remove(tmp_path: Path) -> None:
    directory = SqliteTwinDirectory(tmp_path / "t.sqlite3")
    directory.add(twin(7))
    directory.add(twin(8, None))
    assert await directory.get(7) == twin(7)
    assert (await directory.get(8)) == twin(8, None)  # "relay info not set" survives storage
    assert await directory.get(9) is None
    assert [t.id for t in directory.list()] == [7, 8]
    assert directory.remove(7)
    assert not directory.remove(7)
    await directory.close()


def test_another_process_edit_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite3"
    directory = SqliteTwinDirectory(path)
    account = "ab" * 32
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rmb_relay",
            "twins",
            "add",
            "--twins",
            f"sqlite:{path}",
            "--id",
            "42",
            "--account",
            account,
            "--relay",
            "r.example",
        ],
        check=True,
        capture_output=True,
    )
    found = directory.show(42)
    assert found is not None
    assert found.account == bytes.fromhex(account)


def test_corrupt_file_is_a_clear_config_error(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match=str(path)):
        SqliteTwinDirectory(path)


def test_relay_domains_follow_chain_rules() -> None:
    assert parse_relays("r1.grid.tf_r2.grid.tf") == frozenset({"r1.grid.tf", "r2.grid.tf"})
    for bad in (".lead", "trail.", "a..b", "sp ace"):
        with pytest.raises(ConfigError):
            twin(1, frozenset({bad}))


# ---- cache ---------------------------------------------------------------------------------


class CountingDirectory(TwinDirectory):
    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.fail = False

    async def get(self, twin_id: int) -> Twin | None:
        self.calls += 1
        await self.gate.wait()
        if self.fail:
            raise TwinLookupError("backend down")
        return twin(twin_id) if twin_id < 100 else None

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_concurrent_lookups_are_single_flighted() -> None:
    backend = CountingDirectory()
    cache = CachedTwinDirectory(backend, clock=Clock())
    lookups = [asyncio.create_task(cache.get(5)) for _ in range(50)]
    await asyncio.sleep(0)
    backend.gate.set()
    results = await asyncio.gather(*lookups)
    assert backend.calls == 1
    assert all(r == twin(5) for r in results)


async def test_ttl_and_negative_ttl_follow_the_clock() -> None:
    backend = CountingDirectory()
    backend.gate.set()
    clock = Clock()
    cache = CachedTwinDirectory(backend, ttl=60, negative_ttl=5, clock=clock)
    await cache.get(5)
    await cache.get(500)
    clock.now = 30
    await cache.get(5)
    await cache.get(500)
    assert backend.calls == 3  # the miss expired after 5 s, the hit did not
    clock.now = 61
    await cache.get(5)
    assert backend.calls == 4


async def test_backend_errors_reach_every_waiter_and_are_not_cached() -> None:
    backend = CountingDirectory()
    backend.fail = True
    cache = CachedTwinDirectory(backend, clock=Clock())
    lookups = [asyncio.create_task(cache.get(5)) for _ in range(3)]
    await asyncio.sleep(0)
    backend.gate.set()
    results = await asyncio.gather(*lookups, return_exceptions=True)
    assert all(isinstance(r, TwinLookupError) for r in results)
    backend.fail = False
    assert await cache.get(5) == twin(5)
    assert backend.calls == 2


# ---- key derivation (checked independently) ------------------------------------------------


def test_mnemonic_derivation_matches_substrate() -> None:
    entropy = bytes(Mnemonic("english").to_entropy(PHRASE))
    mini_secret = hashlib.pbkdf2_hmac("sha512", entropy, b"mnemonic", 2048)[:32]
    assert secret_from_phrase(PHRASE) == mini_secret
    public, _ = sr25519.pair_from_seed(mini_secret)
    assert signing_key(PHRASE, "sr25519").public_key == public
    ed = Ed25519PrivateKey.from_private_bytes(mini_secret).public_key()
    assert signing_key(PHRASE, "ed25519").public_key == ed.public_bytes(
        Encoding.Raw, PublicFormat.Raw
    )


def test_bad_mnemonic_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mnemonic"):
        secret_from_phrase("not a real phrase at all")


# ---- CLI -----------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rmb_relay", "twins", *args], capture_output=True, text=True
    )


def test_cli_add_from_mnemonic_show_list_rm(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 't.sqlite3'}"
    added = cli("add", "--twins", url, "--id", "9", "--mnemonic", PHRASE, "--relay", "r.x")
    assert added.returncode == 0, added.stderr
    shown = cli("show", "--twins", url, "9", "--json")
    data = json.loads(shown.stdout)
    assert data["account"] == signing_key(PHRASE).public_key.hex()
    assert data["relays"] == ["r.x"]
    assert "9" in cli("list", "--twins", url).stdout
    assert cli("rm", "--twins", url, "9").returncode == 0
    missing = cli("show", "--twins", url, "9")
    assert missing.returncode == 2
    assert "no twin 9" in missing.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--account", "abcd"], "32 bytes"),
        (["--account", "zz" * 32], "must be hex"),
        (["--mnemonic", "nope"], "mnemonic"),
        (["--account", "ab" * 32, "--pk", "00"], "33 bytes"),
        (["--account", "ab" * 32, "--relay", "bad..domain"], "invalid relay domain"),
    ],
)
def test_cli_errors_are_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = cli("add", "--twins", f"sqlite:{tmp_path / 't.sqlite3'}", "--id", "1", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_refuses_other_directory_schemes(tmp_path: Path) -> None:
    result = cli("list", "--twins", "postgres://x")
    assert result.returncode == 2
    assert "sqlite:PATH" in result.stderr
