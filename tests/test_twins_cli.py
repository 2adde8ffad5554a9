"""`rmb-relay twins add|list|rm|show`, and the substrate key derivation behind `--mnemonic` and
`--seed`, checked against independent implementations (py-sr25519-bindings, cryptography)."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sr25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from mnemonic import Mnemonic

from rmb_relay.errors import ConfigError
from rmb_relay.twins import Twin
from rmb_relay.twins.cli import main
from rmb_relay.twins.local import SqliteTwinDirectory, parse_twins_url
from tests.conftest import WAIT

#: BIP39's own test vector phrase (entropy 7f7f...7f)
PHRASE = "legal winner thank year wave sausage worth useful legal winner thank yellow"
#: substrate's development phrase; `subkey inspect "<phrase>"` publishes its accounts
DEV_PHRASE = "bottom drive obey lake curtain smoke basket hold race lonely fit walk"
DEV_SR25519 = "46ebddef8cd9bb167dc30878d7113b7e168e6f0646beffd77d69d39bad76b47a"
DEV_ED25519 = "345071da55e5dccefaaa440339415ef9f2663338a38f7da0df21be5ab4e055ef"
SEED = bytes(range(32))
ACCOUNT = "ab" * 32
PK = "02" + "cd" * 32


def mini_secret(phrase: str) -> bytes:
    """substrate-bip39, written out here rather than imported (spec/rmb.md §1.4): PBKDF2 over
    the phrase's ENTROPY, salt "mnemonic", 2048 rounds, first 32 bytes."""
    entropy = bytes(Mnemonic("english").to_entropy(phrase))
    return hashlib.pbkdf2_hmac("sha512", entropy, b"mnemonic", 2048)[:32]


def sr25519_public(secret: bytes) -> str:
    public, _ = sr25519.pair_from_seed(secret)
    return bytes(public).hex()


def ed25519_public(secret: bytes) -> str:
    key = Ed25519PrivateKey.from_private_bytes(secret).public_key()
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


class Cli:
    """`rmb-relay twins` run in this process, against one file."""

    def __init__(self, path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.path = path
        self.url = f"sqlite:{path}"
        self.capsys = capsys

    def __call__(self, action: str, *args: str) -> tuple[int, str, str]:
        code = main([action, "--twins", self.url, *args])
        out, err = self.capsys.readouterr()
        return code, out, err

    def ok(self, action: str, *args: str) -> str:
        code, out, err = self(action, *args)
        assert (code, err) == (0, "")
        return out

    def fails(self, action: str, *args: str) -> str:
        """Runs a failing action; returns its one stderr line."""
        code, out, err = self(action, *args)
        assert code == 2
        assert out == ""
        assert err.startswith("rmb-relay twins: ")
        assert err.count("\n") == 1
        return err

    def stored(self, twin_id: int) -> Twin | None:
        with SqliteTwinDirectory(self.path) as directory:
            return directory.show(twin_id)


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(tmp_path / "twins.sqlite3", capsys)


# ---- key derivation ------------------------------------------------------------------------


@pytest.mark.parametrize("phrase", [PHRASE, DEV_PHRASE])
def test_mnemonic_account_matches_independent_sr25519(cli: Cli, phrase: str) -> None:
    cli.ok("add", "--id", "7", "--mnemonic", phrase)
    stored = cli.stored(7)
    assert stored is not None
    assert stored.account.hex() == sr25519_public(mini_secret(phrase))


@pytest.mark.parametrize("phrase", [PHRASE, DEV_PHRASE])
def test_mnemonic_account_matches_independent_ed25519(cli: Cli, phrase: str) -> None:
    cli.ok("add", "--id", "7", "--mnemonic", phrase, "--key-type", "ed25519")
    stored = cli.stored(7)
    assert stored is not None
    assert stored.account.hex() == ed25519_public(mini_secret(phrase))


def test_dev_phrase_gives_the_published_substrate_accounts(cli: Cli) -> None:
    assert sr25519_public(mini_secret(DEV_PHRASE)) == DEV_SR25519  # the test's own derivation
    assert ed25519_public(mini_secret(DEV_PHRASE)) == DEV_ED25519
    cli.ok("add", "--id", "1", "--mnemonic", DEV_PHRASE)
    cli.ok("add", "--id", "2", "--mnemonic", DEV_PHRASE, "--key-type", "ed25519")
    assert json.loads(cli.ok("show", "1", "--json"))["account"] == DEV_SR25519
    assert json.loads(cli.ok("show", "2", "--json"))["account"] == DEV_ED25519


def test_mnemonic_spacing_does_not_change_the_account(cli: Cli) -> None:
    cli.ok("add", "--id", "1", "--mnemonic", PHRASE)
    cli.ok("add", "--id", "2", "--mnemonic", "  " + PHRASE.replace(" ", "   ") + "\n")
    first, second = cli.stored(1), cli.stored(2)
    assert first is not None
    assert second is not None
    assert first.account == second.account


@pytest.mark.parametrize(
    ("key_type", "public"), [("sr25519", sr25519_public), ("ed25519", ed25519_public)]
)
def test_hex_seed_is_used_as_the_secret_directly(
    cli: Cli, key_type: str, public: Callable[[bytes], str]
) -> None:
    cli.ok("add", "--id", "3", "--seed", "0x" + SEED.hex(), "--key-type", key_type)
    stored = cli.stored(3)
    assert stored is not None
    assert stored.account.hex() == public(SEED)


# ---- the actions ---------------------------------------------------------------------------


def test_add_show_list_rm(cli: Cli) -> None:
    out = cli.ok(
        "add", "--id", "9", "--account", "0x" + ACCOUNT, "--relay", "r2.x", "--relay", "r1.x"
    )
    assert out == f"twin 9 saved in {cli.path} (account {ACCOUNT})\n"
    cli.ok("add", "--id", "10", "--account", ACCOUNT.upper(), "--pk", PK)
    assert cli.stored(9) == Twin(9, bytes.fromhex(ACCOUNT), frozenset({"r1.x", "r2.x"}), None)
    assert cli.stored(10) == Twin(10, bytes.fromhex(ACCOUNT), None, bytes.fromhex(PK))

    assert cli.ok("show", "9") == (
        f"id:      9\naccount: {ACCOUNT}\nrelays:  r1.x,r2.x\npk:      (none)\n"
    )
    assert json.loads(cli.ok("show", "10", "--json")) == {
        "id": 10,
        "account": ACCOUNT,
        "relays": None,
        "pk": PK,
    }
    table = [re.split(r"\s{2,}", line.strip()) for line in cli.ok("list").splitlines()]
    assert table == [
        ["id", "account", "pk", "relays"],
        ["9", ACCOUNT, "no", "r1.x,r2.x"],
        ["10", ACCOUNT, "yes", "(not set)"],
    ]
    listed = json.loads(cli.ok("list", "--json"))
    assert [entry["id"] for entry in listed] == [9, 10]
    assert listed[0]["relays"] == ["r1.x", "r2.x"]

    assert cli.ok("rm", "9") == f"twin 9 removed from {cli.path}\n"
    assert cli.stored(9) is None
    assert "no twin 9" in cli.fails("show", "9")
    assert "no twin 9" in cli.fails("rm", "9")


def test_add_again_replaces(cli: Cli) -> None:
    cli.ok("add", "--id", "9", "--account", ACCOUNT, "--relay", "r1.x")
    cli.ok("add", "--id", "9", "--account", "cd" * 32)
    assert cli.stored(9) == Twin(9, b"\xcd" * 32, None, None)


def test_list_of_an_empty_directory(cli: Cli) -> None:
    assert cli.ok("list").splitlines()[1:] == []
    assert json.loads(cli.ok("list", "--json")) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--account", "abcd"], "--account must be 32 bytes (64 hex digits), got 2 bytes"),
        (["--account", "zz" * 32], "--account must be hex"),
        (["--account", ACCOUNT, "--key-type", "ed25519"], "--key-type applies to --mnemonic"),
        (["--mnemonic", "not a real phrase"], "not a valid BIP39 English mnemonic"),
        (["--mnemonic", PHRASE.replace("yellow", "legal")], "not a valid BIP39"),  # checksum
        (["--seed", SEED.hex()], "--seed must be 0x followed by 64 hex digits"),
        (["--seed", "0x1234"], "hex seed must be 32 bytes"),
        (["--seed", "0x" + "g" * 64], "hex seed must be 0x followed by 64 hex digits"),
        (["--account", ACCOUNT, "--pk", "02" * 32], "--pk must be 33 bytes"),
        (["--account", ACCOUNT, "--pk", "04" + "cd" * 32], "starting 02 or 03"),
        (["--account", ACCOUNT, "--relay", "bad..domain"], "invalid relay domain 'bad..domain'"),
        (["--account", ACCOUNT, "--relay", "https://r.x"], "invalid relay domain"),
        (["--account", ACCOUNT, "--relay", "a_b"], "separates domains"),
    ],
)
def test_add_input_errors_are_one_line_and_create_no_file(
    cli: Cli, args: list[str], message: str
) -> None:
    assert message in cli.fails("add", "--id", "1", *args)
    assert not cli.path.exists()


@pytest.mark.parametrize("twin_id", ["0", "-1", str(2**32), str(2**70)])
def test_ids_outside_u32_are_refused(cli: Cli, twin_id: str) -> None:
    message = f"twin id must be 1..4294967295, got {twin_id}"
    assert message in cli.fails("add", "--id", twin_id, "--account", ACCOUNT)
    for action in ("show", "rm"):
        assert message in cli.fails(action, "--", twin_id)


def test_a_corrupt_file_is_named_in_one_line(cli: Cli) -> None:
    cli.path.write_bytes(b"garbage" * 1000)
    for action, args in (
        ("list", []),
        ("show", ["1"]),
        ("add", ["--id", "1", "--account", ACCOUNT]),
    ):
        assert f"cannot open twin directory {cli.path}" in cli.fails(action, *args)


def test_an_unusable_path_is_named_in_one_line(cli: Cli) -> None:
    cli.path.mkdir()
    assert f"cannot open twin directory {cli.path}" in cli.fails("list")


# ---- --twins ---------------------------------------------------------------------------------


def test_twins_url_takes_sqlite_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_twins_url("sqlite:/var/lib/t.db") == Path("/var/lib/t.db")
    assert parse_twins_url("sqlite:rel/t.db") == Path("rel/t.db")
    assert parse_twins_url("sqlite:~/t.db") == tmp_path / "t.db"


@pytest.mark.parametrize("text", ["/var/lib/t.db", "sqlite:", "postgres://x/y", "wss://tfchain"])
def test_twins_url_refuses_other_forms_and_points_at_substrate(text: str) -> None:
    with pytest.raises(ConfigError, match=r"expected sqlite:PATH .*--substrate"):
        parse_twins_url(text)


def test_other_schemes_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--twins", "wss://tfchain.grid.tf"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "--substrate" in err


def test_default_file_is_under_xdg_data_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert main(["add", "--id", "5", "--account", ACCOUNT]) == 0
    assert (tmp_path / "data" / "rmb-relay" / "twins.sqlite3").exists()
    assert "twin 5 saved in" in capsys.readouterr().out


# ---- as real processes ---------------------------------------------------------------------


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=WAIT
    )


def test_module_and_relay_entry_points_share_one_file(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 't.sqlite3'}"
    added = run("rmb_relay.twins.cli", "add", "--twins", url, "--id", "4", "--mnemonic", PHRASE)
    assert added.returncode == 0, added.stderr
    shown = run("rmb_relay", "twins", "show", "--twins", url, "4", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["account"] == sr25519_public(mini_secret(PHRASE))


def test_a_process_that_fails_prints_no_traceback(tmp_path: Path) -> None:
    for module in (["rmb_relay.twins.cli"], ["rmb_relay", "twins"]):
        result = run(*module, "add", "--twins", f"sqlite:{tmp_path}", "--id", "1", "--seed", "0x")
        assert result.returncode == 2
        assert result.stderr.startswith("rmb-relay twins: ")
        assert "Traceback" not in result.stderr


def test_usage_errors_exit_2_with_usage(tmp_path: Path) -> None:
    result = run("rmb_relay.twins.cli", "add", "--id", "1")  # no key at all
    assert result.returncode == 2
    assert "one of the arguments --account --mnemonic --seed is required" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_names_every_action_and_the_default_file() -> None:
    result = run("rmb_relay.twins.cli", "--help")
    for action in ("add", "list", "show", "rm"):
        assert action in result.stdout
    add_help = " ".join(run("rmb_relay.twins.cli", "add", "--help").stdout.split())
    assert "default: sqlite:" in add_help
    assert "--key-type" in add_help


@pytest.mark.parametrize("module", [["rmb_relay.twins.cli"], ["rmb_relay", "twins"]])
def test_list_into_a_reader_that_leaves_early_stops_quietly(
    tmp_path: Path, module: list[str]
) -> None:
    """`rmb-relay twins list | head -1` used to die with a BrokenPipeError traceback."""
    path = tmp_path / "many.sqlite3"
    with SqliteTwinDirectory(path) as directory:
        directory.add(Twin(1, bytes(32), frozenset({"relay.example.com"}), None))
    with sqlite3.connect(path) as db:  # one transaction: 3,000 twins is more than a pipe holds
        db.executemany(
            "INSERT INTO twins (id, account, relays) VALUES (?, ?, 'relay.example.com')",
            [(twin_id, bytes(32)) for twin_id in range(2, 3001)],
        )
    db.close()
    process = subprocess.Popen(
        [sys.executable, "-m", *module, "list", "--twins", f"sqlite:{path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stdout.readline()  # what `head -1` reads, then it exits
    process.stdout.close()
    _, stderr = process.communicate(timeout=WAIT)
    assert b"Traceback" not in stderr, stderr.decode()
    assert process.returncode == 141
