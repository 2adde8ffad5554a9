"""`rmb-load` against a real relay process: counts add up, files are written, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import WAIT


@contextmanager
def running_relay(tmp_path: Path, *flags: str) -> Iterator[tuple[str, str]]:
    """A relay process with `flags`; yields its websocket URL and twin directory."""
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    process = subprocess.Popen(
        [sys.executable, "-m", "rmb_relay", "-l", "127.0.0.1:0", "--twins", twins, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    address = process.stdout.readline().split()[3].rstrip(";")
    try:
        yield f"ws://{address}/", twins
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(WAIT)
        process.stdout.close()


@pytest.fixture
def relay_url(tmp_path: Path) -> Iterator[tuple[str, str]]:
    with running_relay(tmp_path, "--sbd-disable-rate-limit") as found:
        yield found


@pytest.mark.parametrize("dialect", ["rmb", "sbd"])
def test_load_run_counts_everything_and_writes_files(
    relay_url: tuple[str, str], tmp_path: Path, dialect: str
) -> None:
    url, twins = relay_url
    summary, samples = tmp_path / "summary.json", tmp_path / "samples.jsonl"
    args = [
        sys.executable,
        "-m",
        "rmb_relay.load.cli",
        dialect,
        "--url",
        url,
        "--pairs",
        "2",
        "--count",
        "500",
        "--warmup",
        "0",
        "--json",
        str(summary),
        "--samples",
        str(samples),
    ]
    if dialect == "rmb":
        args += ["--twins", twins]
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"}
    )
    assert result.returncode == 0, result.stderr
    assert "latency p99" in result.stdout
    data = json.loads(summary.read_text())
    assert data["sent"] == data["delivered"] == 1000
    assert data["lost"] == 0
    assert data["duplicated"] == 0
    assert data["latency_ms"]["p50"] > 0
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(records) == 1000
    assert {r["outcome"] for r in records} == {"delivered"}


@pytest.mark.parametrize("dialect", ["rmb", "sbd"])
def test_saturating_run_refilled_by_deliveries_loses_nothing(
    relay_url: tuple[str, str], tmp_path: Path, dialect: str
) -> None:
    # --duration without --rate: deliveries write the next batches themselves (Stream.refill),
    # a small window makes that happen many times a second; every message is accounted for
    url, twins = relay_url
    summary = tmp_path / "summary.json"
    args = [sys.executable, "-m", "rmb_relay.load.cli", dialect, "--url", url, "--pairs", "2",
            "--duration", "1", "--warmup", "0", "--window", "16",
            "--json", str(summary)]  # fmt: skip
    if dialect == "rmb":
        args += ["--twins", twins]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(summary.read_text())
    assert data["sent"] > 2 * 16 * 10  # the windows were refilled, not written once
    assert data["delivered"] == data["sent"]
    assert data["lost"] == data["duplicated"] == 0


@pytest.mark.parametrize(
    ("dialect", "where"), [("rmb", "ws://127.0.0.1:9/"), ("sbd", "ws://127.0.0.1:9")]
)
def test_load_against_nothing_fails_clearly(tmp_path: Path, dialect: str, where: str) -> None:
    twins = ["--twins", f"sqlite:{tmp_path / 't.sqlite3'}"] if dialect == "rmb" else []
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay.load.cli", dialect, "--url", "ws://127.0.0.1:9/",
         *twins, "--count", "1", "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"rmb-load: {dialect}: relay {where} unreachable: [Errno 111] Connection refused"
    ]
    assert "sent" in result.stdout  # the table of what was measured until then


def test_identities_file_uses_existing_twins(relay_url: tuple[str, str], tmp_path: Path) -> None:
    url, twins = relay_url
    identities = []
    for twin, key_type in ((501, "sr25519"), (502, "ed25519")):
        seed = "0x" + f"{twin:064x}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rmb_relay",
                "twins",
                "add",
                "--twins",
                twins,
                "--id",
                str(twin),
                "--seed",
                seed,
                "--key-type",
                key_type,
            ],
            check=True,
            capture_output=True,
        )
        identities.append({"twin": twin, "key_type": key_type, "secret": seed})
    path = tmp_path / "identities.json"
    path.write_text(json.dumps(identities))
    summary = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmb_relay.load.cli",
            "rmb",
            "--url",
            url,
            "--identities",
            str(path),
            "--count",
            "200",
            "--warmup",
            "0",
            "--json",
            str(summary),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(summary.read_text())
    assert data["config"]["pairs"] == 1
    assert data["delivered"] == 200
    assert data["lost"] == 0


def test_refused_messages_leave_the_window(tmp_path: Path) -> None:
    """A relay that refuses most messages (rate limit) answers each with an error envelope;
    the harness counts them and keeps sending instead of waiting for ever on a window full of
    messages that will never arrive."""
    with running_relay(tmp_path, "--limit", "50", "100000000", "--limit-window", "3600") as (
        url,
        twins,
    ):
        summary = tmp_path / "summary.json"
        result = subprocess.run(
            [sys.executable, "-m", "rmb_relay.load.cli", "rmb", "--url", url, "--twins", twins,
             "--count", "400", "--window", "16", "--warmup", "0", "--json", str(summary)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "160"},
        )  # fmt: skip
    data = json.loads(summary.read_text())
    assert data["sent"] == 400
    assert data["delivered"] == 50
    assert data["errors"] == {"exceeded rate limits, dropping message": 350}, result.stdout


@pytest.mark.parametrize("arrivals", ["even", "poisson"])
def test_two_processes_paced_merge_exactly(
    relay_url: tuple[str, str], tmp_path: Path, arrivals: str
) -> None:
    """`--procs 2` splits the pairs over two generator processes whose counts and samples
    merge; `--rate` paces them (the figures are counts, never times)."""
    url, twins = relay_url
    summary, samples = tmp_path / "summary.json", tmp_path / "samples.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "rmb_relay.load.cli", "rmb", "--url", url, "--twins", twins,
         "--pairs", "4", "--procs", "2", "--count", "100", "--rate", "4000",
         "--arrivals", arrivals, "--warmup", "0", "--json", str(summary),
         "--samples", str(samples)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(summary.read_text())
    assert data["config"]["procs"] == 2
    assert data["sent"] == data["delivered"] == 400
    assert (data["lost"], data["duplicated"]) == (0, 0)
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted({r["pair"] for r in records}) == [0, 1, 2, 3]
    assert {r["dialect"] for r in records} == {"rmb"}
    assert len(records) == 400
