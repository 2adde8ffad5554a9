"""Issue 34: `rmb-relay sbd-serverd` takes sbd-server 0.4.0's launch lines (flag names and
defaults) and prints its stdout lines, then serves SBD; the public conformance suite passes
against it started that way (when `make sbd-conformance` has built the tester)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import WAIT
from tests.dropin_fixtures import Launched, get, launch
from tests.redis_process import free_port
from tests.sbd_client import SbdClient

ROOT = Path(__file__).resolve().parent.parent
TESTER = ROOT / ".tools" / "sbd-tester" / "bin" / "sbd-o-bahn-server-tester-bin"


def listening(relay: Launched) -> list[tuple[str, int]]:
    """The `#sbd-serverd#listening# ADDR` lines, once `#sbd-serverd#ready#` is printed."""
    relay.output.wait_for("#sbd-serverd#ready#")
    out = []
    for line in relay.output.lines:
        if line.startswith("#sbd-serverd#listening# "):
            host, _, port = line.split(" ", 1)[1].rpartition(":")
            out.append((host.strip("[]"), int(port)))
    return out


def stdout_protocol(relay: Launched) -> list[str]:
    return [line.split("#")[2] for line in relay.output.lines if line.startswith("#sbd-serverd#")]


async def test_launch_line_prints_sbd_serverds_lines_and_serves(tmp_path: Path) -> None:
    relay = launch(
        [
            "rmb-relay",
            "sbd-serverd",
            "--bind",
            "127.0.0.1:0",
            "--bind",
            "127.0.0.2:0",
            "--limit-clients",
            "10",
            "--limit-ip-kbps",
            "2000",
            "--limit-ip-byte-burst",
            "32768",
            "--limit-idle-millis",
            "5000",
            "--ip-deny-s",
            "30",
            "--trusted-ip-header",
            "x-real-ip",
        ],
        data_home=tmp_path,
    )
    try:
        addresses = listening(relay)
        assert stdout_protocol(relay) == ["note", "listening", "listening", "ready"]
        # later port-0 binds share the first one's port, as sbd-server's do
        assert [host for host, _ in addresses] == ["127.0.0.1", "127.0.0.2"]
        assert addresses[0][1] == addresses[1][1]
        for host, port in addresses:
            client = await SbdClient.connect(host, port)
            assert client.lbrt == [8_000_000 // 2000]
            assert client.lidl == 5000
            client.close()
        assert (await get(addresses[0][1], "/metrics"))[0] == 200
    finally:
        assert relay.stop() == 0


async def test_defaults_are_sbd_servers_and_rate_limiting_can_be_off(tmp_path: Path) -> None:
    prometheus = free_port()
    relay = launch(
        [
            "rmb-relay",
            "sbd-serverd",
            "--bind",
            "127.0.0.1:0",
            "--disable-rate-limiting",
            "--bind-prometheus",
            f"127.0.0.1:{prometheus}",
        ],
        data_home=tmp_path,
    )
    try:
        ((host, port),) = listening(relay)
        client = await SbdClient.connect(host, port)
        assert client.lbrt == [1]  # no limit
        assert client.lidl == 10_000  # sbd-server's --limit-idle-millis default
        client.close()
        status, body = await get(prometheus, "/metrics")
        assert status == 200
        assert b"rmb_relay_sessions" in body
    finally:
        assert relay.stop() == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "give at least one --bind"),
        (["--bind", "localhost:443"], "must be IP:PORT"),
        (["--bind", "127.0.0.1:0", "--back-bind", "127.0.0.1:1443"], "not supported"),
        (["--bind", "127.0.0.1:0", "--cert-pem-file", "c.pem"], "go together"),
    ],
)
def test_launch_lines_it_cannot_serve_are_refused_clearly(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rmb_relay", "sbd-serverd", *flags],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not TESTER.exists(), reason="run `make sbd-conformance` to build the tester")
def test_public_conformance_suite_passes_against_sbd_serverd() -> None:
    result = subprocess.run(
        [str(TESTER), sys.executable, "-u", "-m", "rmb_relay.commands.sbd_obahn", "--sbd-serverd"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    report = result.stdout[result.stdout.find("-- TEST RESULTS --") :]
    assert result.returncode == 0, report or result.stdout[-4000:] + result.stderr[-4000:]
    assert "failed: []" in report
    assert report.count('"') == 16  # the 8 suite rows, each quoted once
