"""The `rmb-relay` entry point as users run it: a real process, real signals, a real wheel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import WAIT
from tests.processes import relay_env

ROOT = Path(__file__).resolve().parent.parent


def stop(process: subprocess.Popen[str], sig: signal.Signals = signal.SIGTERM) -> int:
    process.send_signal(sig)
    code = process.wait(WAIT)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
    return code


def start_relay_process(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start `python -m rmb_relay` on a free port; returns it with its banner line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rmb_relay", "-l", "127.0.0.1:0", *args],
        env=relay_env({**os.environ, "XDG_DATA_HOME": tempfile.mkdtemp(prefix="rmb-cli-")}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    banner = process.stdout.readline()
    if not banner:
        process.wait(WAIT)
        assert process.stderr is not None
        pytest.fail(f"relay did not start: {process.stderr.read()}")
    return process, banner


def test_help_explains_every_flag_with_its_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "--listen" in result.stdout
    assert "(default: [::]:8080)" in result.stdout
    assert "--tls-cert" in result.stdout


def test_banner_names_address_and_dialects() -> None:
    process, banner = start_relay_process()
    try:
        assert banner.startswith("rmb-relay listening on 127.0.0.1:")
        assert "dialects: rmb" in banner
    finally:
        stop(process)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly_with_exit_0(sig: signal.Signals) -> None:
    process, _ = start_relay_process()
    assert stop(process, sig) == 0


def test_bad_listen_address_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "-l", "nonsense"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "must be HOST:PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_tls_needs_both_cert_and_key() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "--tls-cert", "x.pem"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "--tls-cert and --tls-key go together" in result.stderr


def test_help_lists_the_sbd_flags_with_their_defaults() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    for flag, default in [
        ("--sbd-limit-clients", "32768"),
        ("--sbd-kbps", "1000"),
        ("--sbd-burst", "262144"),
        ("--sbd-idle-ms", "10000"),
        ("--sbd-block-secs", "60"),
    ]:
        text = " ".join(result.stdout.split("SBD relay (", 1)[1].split())
        entry = text[text.index(flag + " ") :].split(" --", 1)[0]  # the flag's own help
        assert entry.endswith(f"(default: {default})"), entry
    for flag in ("--no-sbd", "--sbd-disable-rate-limit", "--trusted-ip-header", "--sbd-auth-hook"):
        assert flag in result.stdout


def test_no_sbd_leaves_sbd_out_of_the_banner() -> None:
    process, banner = start_relay_process()
    try:
        assert "dialects: rmb, sbd, singyeong" in banner
    finally:
        stop(process)
    process, banner = start_relay_process("--no-sbd", "--no-singyeong")
    try:
        assert "sbd" not in banner.split("dialects:")[1]
        assert "rmb" in banner.split("dialects:")[1]
    finally:
        stop(process)


@pytest.mark.parametrize(
    "flags",
    [
        ["--sbd-kbps", "0"],
        ["--sbd-burst", "0"],
        ["--sbd-idle-ms", "-1"],
        ["--sbd-block-secs", "-5"],
        ["--sbd-auth-hook", "ftp://x/authenticate"],
        ["--http-idle-timeout", "0"],
        ["--http-request-timeout", "-1"],
        ["--limit-window", "0"],
        ["--mailbox-ttl", "0"],
    ],
)
def test_bad_flags_are_clear_errors(flags: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "-l", "127.0.0.1:0", *flags],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env={**os.environ, "XDG_DATA_HOME": tempfile.mkdtemp(prefix="rmb-cli-")},
    )
    assert result.returncode != 0
    assert f"rmb-relay: {flags[0]}" in result.stderr


def test_serve_is_the_default_command_and_twins_refuses_serve_flags() -> None:
    env = {**os.environ, "XDG_DATA_HOME": tempfile.mkdtemp(prefix="rmb-cli-"), "COLUMNS": "200"}
    help_text = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    assert "--listen" in help_text
    assert "--sbd-kbps" in help_text
    plain = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "--help"], capture_output=True, text=True, env=env
    ).stdout
    assert "twins" in plain
    assert "without a command, rmb-relay serves" in plain
    refused = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "twins", "list", "--listen", "x"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert refused.returncode == 2
    assert "unrecognized arguments: --listen" in refused.stderr
