"""Every dialect's `rmb-load --samples` read by `rmb-analytics` into its load_latency table:
one Spark run (local mode is slow) over the samples of rmb, sbd, 신경, the tunnel and the peer,
each generated against real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.peer_fixtures import add_twin, redis_servers, start_peer, start_relay
from tests.test_load import running_relay
from tests.test_load_dialects import SECRET, rmb_load, tunnel_relay

pytest.importorskip("pyspark")
pytestmark = pytest.mark.timeout(400)  # five generators, three relays, then a JVM on 2 cores


def _ok(*args: str) -> None:
    result = rmb_load(*args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_every_dialects_samples_reach_the_latency_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow.parquet as pq

    from rmb_relay.analytics.cli import main

    samples = tmp_path / "samples"
    samples.mkdir()
    with tunnel_relay(tmp_path) as (url, twins):
        http = url.replace("ws://", "http://")
        _ok("rmb", "--url", url, "--twins", twins, "--count", "50",
            "--samples", str(samples / "rmb.parquet"))  # fmt: skip
        _ok("singyeong", "--url", url, "--count", "40", "--samples", str(samples / "sg.parquet"))
        _ok("tunnel", "--url", http, "--secret", SECRET, "--anonymous", "--start-target",
            "--concurrency", "2", "--count", "15",
            "--samples", str(samples / "tunnel.parquet"))  # fmt: skip
    with running_relay(tmp_path, "--sbd-disable-rate-limit") as (url, _):
        _ok("sbd", "--url", url, "--count", "30", "--samples", str(samples / "sbd.parquet"))
    peer_twins = f"sqlite:{tmp_path / 'peers.sqlite3'}"
    add_twin(peer_twins, 1)
    add_twin(peer_twins, 2)
    relay = start_relay(peer_twins)
    try:
        with redis_servers(tmp_path, 2) as (redis_a, redis_b):
            peers = [start_peer(t, peer_twins, r, [relay], "--no-update")
                     for t, r in ((1, redis_a), (2, redis_b))]  # fmt: skip
            try:
                _ok("peer", "--redis", redis_a.url, "--serve-redis", redis_b.url, "--dst", "2",
                    "--count", "20", "--samples", str(samples / "peer.parquet"))  # fmt: skip
            finally:
                for peer in peers:
                    peer.process.stop()
    finally:
        relay.process.stop()

    out = tmp_path / "tables"
    assert main(["--samples", str(samples), "--output", str(out)]) == 0
    assert "load_latency" in capsys.readouterr().err
    table = pq.read_table(out / "load_latency").to_pylist()
    by_dialect: dict[str, int] = {}
    for row in table:
        by_dialect[row["dialect"]] = by_dialect.get(row["dialect"], 0) + row["messages"]
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
    assert by_dialect == {"rmb": 50, "singyeong": 40, "tunnel": 30, "sbd": 30, "peer": 20}
