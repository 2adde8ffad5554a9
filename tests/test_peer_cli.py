"""`rmb-peer` as launch scripts call it: the public flags (spec/rmb.md §5.1) and the errors
before serving, in process and as a real process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rmb_relay import __version__
from rmb_relay.errors import ConfigError
from rmb_relay.peer.cli import DEFAULT_RELAY, DEFAULT_SUBSTRATE, parse_args
from tests.conftest import WAIT, free_port
from tests.peer_fixtures import add_twin, mnemonic_for, rmb_peer

PHRASE = mnemonic_for(1)


def test_public_flags_with_their_short_forms() -> None:
    config = parse_args(
        [
            "-m",
            PHRASE,
            "-k",
            "ED25519",
            "-r",
            "redis://127.0.0.1:7000",
            "--relay",
            "wss://r1.grid.tf",
            "--relay",
            "wss://r2.grid.tf:443",
            "--no-update",
            "-d",
            "-d",
            "-u",
            "/tmp/uploads",
            "--twins",
            "sqlite:/tmp/twins.sqlite3",
        ]
    )
    assert config.secret == PHRASE
    assert config.key_type == "ed25519"
    assert config.redis == "redis://127.0.0.1:7000"
    assert config.relays == ("wss://r1.grid.tf", "wss://r2.grid.tf:443")
    assert config.domains == frozenset({"r1.grid.tf", "r2.grid.tf"})
    assert not config.update
    assert config.debug == 2
    assert config.twins == Path("/tmp/twins.sqlite3")


def test_defaults_are_rmb_peers() -> None:
    config = parse_args(["--mnemonic", PHRASE, "--twins", "sqlite:/tmp/t.sqlite3"])
    assert config.key_type == "sr25519"
    assert config.redis == "redis://localhost:6379"
    assert config.relays == (DEFAULT_RELAY,)
    assert config.update


def test_without_twins_the_directory_is_upstreams_chain() -> None:
    """`rmb-peer -m "<words>"` alone does what it does upstream: tfchain's main node and the
    public relay; `--twins sqlite:PATH` is the explicit offline choice."""
    config = parse_args(["-m", PHRASE])
    assert config.substrate == (DEFAULT_SUBSTRATE,) == ("wss://tfchain.grid.tf:443",)
    assert config.relays == (DEFAULT_RELAY,) == ("wss://relay.grid.tf:443",)
    offline = parse_args(["-m", PHRASE, "--twins", "sqlite:/tmp/t.sqlite3"])
    assert offline.substrate == ()


@pytest.mark.parametrize("flag", ["--mnemonics", "--seed"])
def test_deprecated_secret_aliases(flag: str) -> None:
    assert parse_args([flag, "0x" + "11" * 32, "--twins", "sqlite:/x"]).secret == "0x" + "11" * 32


@pytest.mark.parametrize(
    "argv", [[], ["-m", PHRASE, "--seed", "0x" + "11" * 32], ["-m", PHRASE, "-k", "rsa"]]
)
def test_exactly_one_secret_and_a_known_key_type(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2


@pytest.mark.parametrize(
    ("relays", "message"),
    [
        (["wss://127.0.0.1:443"], "relay URL must contain a domain name"),
        (["ws://[::1]:80"], "relay URL must contain a domain name"),
        (["https://relay.grid.tf"], "ws:// or wss://"),
        (["wss://relay.grid.tf:x"], "bad port"),
        ([f"wss://r{i}.grid.tf" for i in range(5)], "at most 4 relays"),
    ],
)
def test_bad_relays_are_refused(relays: list[str], message: str) -> None:
    argv = ["-m", PHRASE, "--twins", "sqlite:/x"]
    for relay in relays:
        argv += ["--relay", relay]
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_substrate_reads_twins_from_the_chain_unless_twins_is_given() -> None:
    config = parse_args(["-m", PHRASE, "-s", "wss://a.example:443", "-s", "ws://b.example"])
    assert config.substrate == ("wss://a.example:443", "ws://b.example")
    both = parse_args(["-m", PHRASE, "-s", "wss://x", "--twins", "sqlite:/t"])
    assert (both.substrate, both.twins) == ((), Path("/t"))
    with pytest.raises(ConfigError, match="expected ws://HOST"):
        parse_args(["-m", PHRASE, "-s", "https://tfchain.grid.tf"])


def run_peer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(rmb_peer(*args), capture_output=True, text=True, timeout=WAIT)


def test_version() -> None:
    result = run_peer("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"rmb-peer {__version__}"


def test_unknown_key_exits_with_rmb_peers_message(tmp_path: Path) -> None:
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    add_twin(twins, 1)
    result = run_peer("-m", mnemonic_for(2), "--twins", twins, "--relay", "ws://localhost:1")
    assert result.returncode == 1
    assert "no twin found on this network with given key" in result.stderr


@pytest.mark.parametrize(
    ("secret", "message"),
    [("not a mnemonic", "not a valid BIP39"), ("0x1234", "32 bytes")],
)
def test_bad_secret_is_one_line_and_exit_1(tmp_path: Path, secret: str, message: str) -> None:
    result = run_peer("-m", secret, "--twins", f"sqlite:{tmp_path / 't.sqlite3'}")
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_chain_is_one_line_and_exit_1() -> None:
    result = run_peer(
        "-m", PHRASE, "-s", f"ws://127.0.0.1:{free_port()}", "--substrate-timeout", "1",
        "--relay", "ws://localhost:1",
    )  # fmt: skip
    assert result.returncode == 1
    assert "tfchain did not answer state_getStorage: 2 attempts over 1 node(s)" in result.stderr
    assert "Traceback" not in result.stderr
