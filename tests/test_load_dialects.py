"""`rmb-load singyeong`, `tunnel`, `peer` and `rmb --relays` against real relay processes (and a
real connector, real rmb-peers on real redis-servers): exact counts, a JSON summary, one
refusal each (one line, exit 2), and every dialect's samples read by `rmb-analytics`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.federation_fixtures import Network, provision
from tests.peer_fixtures import add_twin, redis_servers, start_peer, start_relay
from tests.test_load import running_relay

SECRET = "load-secret-0123456789"
TIMEOUT = 180


def rmb_load(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rmb_relay.load.cli", *args, "--warmup", "0", "--quiet"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "COLUMNS": "160"},
    )


def summary_of(result: subprocess.CompletedProcess[str], path: Path) -> dict[str, Any]:
    assert result.returncode == 0, result.stdout + result.stderr
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def assert_exact(data: dict[str, Any], expected: int) -> None:
    assert data["expected"] == data["delivered"] == expected, data
    assert data["lost"] == 0
    assert data["duplicated"] == 0
    assert data["errors"] == {}
    assert data["failed"] is None
    assert data["latency_ms"]["p50"] > 0


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[str, str]]:
    with running_relay(tmp_path) as found:
        yield found


# ---- 신경 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "encoding", "fanout"),
    [("send_eq", "json", 1), ("send_range", "msgpack", 1), ("broadcast", "json", 5),
     ("queue", "msgpack", 1)],
)  # fmt: skip
def test_singyeong_modes_deliver_every_message(
    relay: tuple[str, str], tmp_path: Path, mode: str, encoding: str, fanout: int
) -> None:
    url, _ = relay
    out = tmp_path / "summary.json"
    result = rmb_load("singyeong", "--url", url, "--mode", mode, "--encoding", encoding,
                      "--clients", "10", "--group", "5", "--senders", "2", "--count", "300",
                      "--json", str(out))  # fmt: skip
    data = summary_of(result, out)
    assert data["sent"] == 600
    assert_exact(data, 600 * fanout)
    assert data["config"]["mode"] == mode


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_singyeong_stamps_are_read_from_a_dispatch_with_the_broadcast_copy_rule(
    encoding: str,
) -> None:
    """The receivers' stamp reader (rust/load.rs) on frames of the gateway's own codec: the
    stamp names its stream, a fan-out stream's copy is the receiver's, frames without a stamp
    (a heartbeat ack) and stamps of another process's streams are left to Python."""
    from rmb_relay._core import LoadRecorder, StampScanner
    from rmb_relay.dialects.singyeong.codec import Encoding, encode

    def dispatch(stream: int, seq: int) -> bytes:
        payload = f"{stream:06d}{seq:012d}{1_000:020d}" + "#" * 300  # a str16 header
        return encode(Encoding(encoding), {"op": 0, "t": "SEND", "d": {"payload": payload}})

    recorder = LoadRecorder()
    dialect = f"singyeong-{encoding}"
    readers = [StampScanner(recorder, {3: 1, 4: 10}, 64, dialect, receiver) for receiver in (0, 1)]
    for reader in readers:
        assert reader.record_message(dispatch(3, 5), 2_000)
        assert reader.record_message(dispatch(4, 5), 2_000)
        assert not reader.record_message(dispatch(9, 5), 2_000)  # not this process's stream
        assert not reader.record_message(encode(Encoding(encoding), {"op": 6, "d": {}}), 2_000)
    # stream 3 is delivered once: the second receiver's copy is a duplicate; stream 4 fans out
    assert (recorder.delivered(3), recorder.delivered(4), recorder.duplicated) == (1, 2, 1)
    with pytest.raises(ValueError, match="name their stream"):
        StampScanner(recorder, 3, 64, dialect)
    with pytest.raises(ValueError, match="carry no stream"):
        StampScanner(recorder, {3: 1}, 64, "rmb")


def test_singyeong_refused_password_stops_the_run(tmp_path: Path) -> None:
    with running_relay(tmp_path, "--sg-auth", "the-password") as (url, _):
        result = rmb_load("singyeong", "--url", url, "--password", "wrong", "--count", "10")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"rmb-load: singyeong: password refused by {url.rstrip('/')}/gateway/websocket"
        "?encoding=json (the client was admitted as restricted)"
    ]
    assert "sent" in result.stdout


# ---- the tunnel -------------------------------------------------------------------------------


def tunnel_relay(tmp_path: Path, **kwargs: Any) -> Any:
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    subprocess.run(
        [sys.executable, "-m", "rmb_relay", "tenants", "--twins", twins, "add", "load",
         "--secret", SECRET],
        check=True, capture_output=True, timeout=TIMEOUT,
    )  # fmt: skip
    return running_relay(tmp_path)


def test_tunnel_requests_reach_the_echo_target(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    with tunnel_relay(tmp_path) as (url, _):
        http = url.replace("ws://", "http://")
        result = rmb_load("tunnel", "--url", http, "--secret", SECRET, "--start-target",
                          "--concurrency", "4", "--size", "2048", "--count", "100",
                          "--json", str(out))  # fmt: skip
    data = summary_of(result, out)
    assert data["sent"] == 400
    assert_exact(data, 400)
    assert set(data["watched_cpu_us_per_msg"]) == {"echo target", "connector"}


def test_tunnel_wrong_secret_is_refused(tmp_path: Path) -> None:
    with tunnel_relay(tmp_path) as (url, _):
        http = url.replace("ws://", "http://")
        result = rmb_load("tunnel", "--url", http, "--secret", "not-the-secret-at-all",
                          "--start-target", "--count", "10")  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("rmb-load: tunnel: the relay refused tenant 'load''s secret (POST")
    assert "401" in line


# ---- rmb-peer ---------------------------------------------------------------------------------


def test_peer_round_trips_through_two_peers(tmp_path: Path) -> None:
    twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
    add_twin(twins, 1)
    add_twin(twins, 2, "ed25519")
    relay = start_relay(twins)
    out = tmp_path / "summary.json"
    try:
        with redis_servers(tmp_path, 2) as (redis_a, redis_b):
            peers = [
                start_peer(1, twins, redis_a, [relay], "--no-update"),
                start_peer(2, twins, redis_b, [relay], "--no-update", key_type="ed25519"),
            ]
            try:
                result = rmb_load("peer", "--redis", redis_a.url, "--serve-redis", redis_b.url,
                                  "--dst", "2", "--clients", "3", "--window", "8",
                                  "--count", "100", "--json", str(out))  # fmt: skip
            finally:
                for peer in peers:
                    peer.process.stop()
    finally:
        relay.process.stop()
    data = summary_of(result, out)
    assert data["sent"] == 300
    assert_exact(data, 300)


def test_peer_redis_down_is_refused(tmp_path: Path) -> None:
    from tests.redis_process import free_port

    port = free_port()
    result = rmb_load("peer", "--redis", f"redis://127.0.0.1:{port}", "--dst", "2",
                      "--count", "1")  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"rmb-load: peer: redis redis://127.0.0.1:{port} does not answer")


# ---- rmb across two relays ------------------------------------------------------------------


def test_rmb_relays_federate(tmp_path: Path) -> None:
    import asyncio

    from rmb_relay.load.rmb import DEFAULT_TWIN_BASE

    base = DEFAULT_TWIN_BASE
    federation = Network(tmp_path)
    twins = asyncio.run(provision(tmp_path / "fed.sqlite3", {}))
    # --domains names two domains: the harness signs each envelope and B checks them
    # (--verify-federated, on by default)
    a = federation.relay("127.0.0.2", twins)
    b = federation.relay("127.0.0.3", twins)
    out = tmp_path / "summary.json"
    try:
        result = rmb_load("rmb", "--relays", f"{a.url},{b.url}", "--twins", twins,
                          "--domains", "127.0.0.2,127.0.0.3", "--pairs", "2",
                          "--twin-base", str(base), "--count", "200",
                          "--watch-pid", str(a.process.pid), "--watch-pid", str(b.process.pid),
                          "--json", str(out))  # fmt: skip
    finally:
        asyncio.run(federation.close())
    data = summary_of(result, out)
    assert data["sent"] == 400
    assert_exact(data, 400)
    assert data["config"]["receiver_url"] == b.url
    assert data["config"]["signed"]  # two domains: federation
    # signing each envelope keeps the generator cheaper per message than the relays it measures
    relays = sum(data["watched_cpu_us_per_msg"].values())
    assert data["generator_cpu_us_per_msg"] < relays, data


# ---- a relay that drops a connection during the run ---------------------------------------


def test_sbd_dropped_connection_ends_the_run(tmp_path: Path) -> None:
    # the relay's per-IP rate limit drops the generator's connections (no close frame): the run
    # ends there, exit 2, with what it measured, not after waiting out a full window
    with running_relay(tmp_path, "--sbd-kbps", "1", "--sbd-burst", "20000") as (url, _):
        result = rmb_load("sbd", "--url", url, "--pairs", "1", "--duration", "30")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("rmb-load: sbd: stream 0 lost its connection: websocket closed")
    assert "lost" in result.stdout
