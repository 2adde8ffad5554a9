"""rmb-analytics on real Spark: the jobs against records whose content the test knows, bad
input, a standalone cluster, and a real relay's records end to end.

One local SparkSession serves the whole module (a JVM start costs seconds); the cluster test
runs the console script in its own process against a master and a worker started from the
pyspark package's own launcher."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rmb_relay.analytics.cli import main
from rmb_relay.analytics.pipeline import Plan, Progress, check, run
from rmb_relay.telemetry.record_schema import SCHEMA_KEY, SCHEMA_VERSION
from rmb_relay.telemetry.records import Recorder
from tests.conftest import WAIT, free_port
from tests.helpers import FakeClock
from tests.record_files import write_v1

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None:
    pytest.skip("PySpark needs a Java runtime (make system-deps)", allow_module_level=True)

from pyspark.sql import SparkSession  # noqa: E402

#: whichever test comes first pays for the JVM and the module's jobs (about 30 s on a quiet
#: 2-core machine, several times that when it is shared)
pytestmark = pytest.mark.timeout(300)

#: 2023-11-14 22:13:00 UTC: the start of a 60 s window
T0 = 1_699_999_980 * 1_000_000_000
S = 1_000_000_000
#: two SBD keys and their names in the records (base64url)
KEY_A, KEY_B = bytes([0]) * 32, bytes([0xFF]) * 32
A, B = "A" * 43, "_" * 42 + "8"


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    from rmb_relay.analytics.spark import session

    spark = session("local[2]", progress=False)
    yield spark
    spark.stop()


async def _known_records(root: Path) -> None:
    """Two 60 s windows of traffic whose every count the tests below know."""
    clock = FakeClock(T0)
    recorder = Recorder(root, "relay-a:8080", clock=clock)
    recorder.start()
    rmb, sbd = recorder.channel("rmb"), recorder.channel("sbd")
    # window 1: twin 1 -> 2 x 300 (100 B), twin 3 -> 4 x 100 (1000 B); sbd A -> B x 50
    for i in range(300):
        rmb.native.push(T0 + i * 1000, 1, 2, 100)  # as the scanners append the hot path
    for i in range(100):
        rmb.native.push(T0 + i * 1000, 3, 4, 1000)
    a, b = sbd.native.key_id(KEY_A), sbd.native.key_id(KEY_B)
    for i in range(50):
        sbd.native.push(T0 + i * 1000, a, b, 10)
    # mailbox: 5 queued with relay time 1..5 ms; 2 delivered; 2 expired; 1 lost to a full box
    for i in range(1, 6):
        clock.now = T0 + 10 * S
        rmb.add(1, 9, 200, "mailbox", "queued", received=clock.now - i * 1_000_000)
    clock.now = T0 + 20 * S
    for _ in range(2):
        rmb.add(None, 9, 200, "mailbox", "delivered")
    for _ in range(2):
        rmb.add(None, 9, 200, "mailbox", "expired", "mailbox expired")
    rmb.add(None, 9, 200, "mailbox", "rejected", "mailbox full")
    # drops: twin 3 rate-limited 7 times, twin 5 sends twice to an unknown twin
    for _ in range(7):
        rmb.add(3, 4, 1000, "none", "rate-limited", "rate limited")
    for _ in range(2):
        rmb.add(5, 77, 10, "none", "rejected", "unknown twin")
    # federation, window 1: a.example 10 attempts, 3 fail; window 2: b.example 4, all fine
    for i in range(10):
        outcome = "rejected" if i < 3 else "delivered"
        rmb.add(1, 20, 100, "federation", outcome, remote="a.example", received=clock.now)
    clock.now = T0 + 70 * S
    for _ in range(4):
        rmb.add(1, 21, 100, "federation", "delivered", remote="b.example", received=clock.now)
    await recorder.close()
    # window 2: twin 2 -> 1 x 20, in a file of record schema version 1 (read alongside)
    rows = [
        {"time": (T0 + 70 * S) // 1000 + i, "src": "2", "dst": "1", "size": 100} for i in range(20)
    ]
    write_v1(root / "date=2023-11-14" / "hour=22" / "part-v1.parquet", rows)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("records")
    asyncio.run(_known_records(root))
    return root


@pytest.fixture(scope="module")
def tables(spark: SparkSession, records: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tables")
    plan = Plan(records=records, output=out, window=60)
    run(spark, plan, check(plan), Progress(out=io.StringIO()))
    return out


def rows(tables: Path, name: str) -> list[dict[str, Any]]:
    return pq.read_table(tables / name).to_pylist()  # type: ignore[no-any-return]


def test_throughput_counts_every_record_exactly(tables: Path) -> None:
    got = {
        (r["window_start"].timestamp(), r["dialect"], r["route"], r["outcome"]): r["messages"]
        for r in rows(tables, "throughput")
    }
    w1, w2 = T0 / S, T0 / S + 60
    assert got == {
        (w1, "rmb", "local", "delivered"): 400,
        (w1, "sbd", "local", "delivered"): 50,
        (w1, "rmb", "mailbox", "queued"): 5,
        (w1, "rmb", "mailbox", "delivered"): 2,
        (w1, "rmb", "mailbox", "expired"): 2,
        (w1, "rmb", "mailbox", "rejected"): 1,
        (w1, "rmb", "none", "rate-limited"): 7,
        (w1, "rmb", "none", "rejected"): 2,
        (w1, "rmb", "federation", "rejected"): 3,
        (w1, "rmb", "federation", "delivered"): 7,
        (w2, "rmb", "federation", "delivered"): 4,
        (w2, "rmb", "local", "delivered"): 20,
    }


def test_traffic_per_twin_and_pair(tables: Path) -> None:
    twin = {(r["window_start"].timestamp(), r["twin"]): r for r in rows(tables, "traffic_twin")}
    one = twin[(T0 / S, "1")]
    # 300 local + 5 queued + 10 federation attempts
    assert (one["sent_messages"], one["sent_bytes"]) == (315, 300 * 100 + 5 * 200 + 10 * 100)
    assert twin[(T0 / S, "2")]["received_messages"] == 300
    assert twin[(T0 / S + 60, "1")]["received_messages"] == 20
    pairs = {(r["src"], r["dst"]): r["messages"] for r in rows(tables, "traffic_pair")}
    assert pairs[("1", "2")] == 300
    assert pairs[("3", "4")] == 107  # 100 delivered + 7 rate-limited attempts
    assert pairs[(A, B)] == 50


def test_top_talkers_rank_senders(tables: Path) -> None:
    top = rows(tables, "top_talkers")
    assert [(r["rank"], r["twin"], r["messages"]) for r in top[:3]] == [
        (1, "1", 319),
        (2, "3", 107),
        (3, A, 50),
    ]
    assert sum(r["share"] for r in top) == pytest.approx(1.0)


def test_drop_reasons_and_abuse_candidates(tables: Path) -> None:
    drops = {
        (r["twin"], r["outcome"], r["reason"]): r["messages"] for r in rows(tables, "drop_reasons")
    }
    assert drops[("3", "rate-limited", "rate limited")] == 7
    assert drops[("5", "rejected", "unknown twin")] == 2
    assert drops[(None, "expired", "mailbox expired")] == 2
    abuse = rows(tables, "abuse_candidates")
    assert [(r["twin"], r["rate_limited"], r["rejected"]) for r in abuse] == [
        ("3", 7, 0),
        ("1", 0, 3),
        ("5", 0, 2),
    ]
    assert abuse[2]["refused_share"] == 1.0


def test_latency_percentiles_per_route(tables: Path) -> None:
    latency = {(r["dialect"], r["route"]): r for r in rows(tables, "latency")}
    mailbox = latency[("rmb", "mailbox")]
    assert mailbox["messages"] == 5  # the queued ones carry a time; the drained ones do not
    assert (mailbox["p50_us"], mailbox["p99_us"], mailbox["max_us"]) == (3000, 5000, 5000)
    assert latency[("rmb", "local")]["p99_us"] == 0
    cdf = [r for r in rows(tables, "latency_cdf") if r["route"] == "mailbox"]
    assert len(cdf) == 100
    assert sorted(r["relay_us"] for r in cdf) == [
        r["relay_us"] for r in sorted(cdf, key=lambda r: r["percentile"])
    ]


def test_federation_failure_rate_per_remote_and_priors(tables: Path) -> None:
    health = {
        (r["window_start"].timestamp(), r["remote"]): r for r in rows(tables, "federation_health")
    }
    a = health[(T0 / S, "a.example")]
    assert (a["attempts"], a["failures"], a["failure_rate"]) == (10, 3, 0.3)
    assert health[(T0 / S + 60, "b.example")]["failure_rate"] == 0.0
    assert json.loads((tables / "priors.json").read_text()) == {"a.example": 0.3, "b.example": 0.0}


def test_mailbox_backlog_and_expiry_loss(tables: Path) -> None:
    (window,) = rows(tables, "mailbox")
    assert {k: window[k] for k in ("queued", "delivered", "expired", "lost_full", "backlog")} == {
        "queued": 5,
        "delivered": 2,
        "expired": 2,
        "lost_full": 1,
        "backlog": 0,
    }
    assert window["expired_bytes"] == 400


def test_since_until_cut_the_records(spark: SparkSession, records: Path, tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from rmb_relay.analytics.jobs import federation_priors
    from rmb_relay.analytics.pipeline import read_records

    since = datetime.fromtimestamp(T0 / S + 60, UTC)
    plan = Plan(records=records, output=tmp_path, since=since, window=60)
    cut = read_records(spark, records, plan)
    assert cut.count() == 24  # window 2: 20 local + 4 federation
    priors = federation_priors(cut, 60).collect()
    assert [(r["remote"], r["attempts"]) for r in priors] == [("b.example", 4)]
    until = Plan(records=records, output=tmp_path, until=since, window=60)
    assert read_records(spark, records, until).count() == 479  # window 1, [start, since)


def test_report_is_one_self_contained_page(tables: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    assert main(["report", "--input", str(tables), "--output", str(page)]) == 0
    text = page.read_text()
    assert text.count('src="data:image/png;base64,') >= 5
    assert not re.search(r'(src|href)="(?!data:)', text)  # nothing fetched from elsewhere
    for heading in ("Throughput", "Latency CDF", "Top talkers", "Drops", "Federation", "Mailbox"):
        assert heading in text


# ---- bad input: one line, exit code 2, no JVM ----------------------------------------------


def _bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("rmb-analytics: ")
    assert "Exception" not in err
    assert "at org." not in err
    return err


def test_corrupt_parquet_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part-1.parquet").write_bytes(b"PAR1 not really")
    err = _bad(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "o")], capsys)
    assert "not a readable Parquet file" in err


def test_foreign_parquet_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "other.parquet")
    err = _bad(
        ["--input", str(tmp_path / "other.parquet"), "--output", str(tmp_path / "o")], capsys
    )
    assert "not an rmb-relay route-record file" in err


def test_a_hidden_file_is_never_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A records file is hidden while the relay writes it (or when a killed writer left it
    without its footer): named directly it is refused in one line, in a folder it is skipped."""
    folder = tmp_path / "in" / "date=2026-11-23" / "hour=10"
    folder.mkdir(parents=True)
    partial = folder / ".part-r-full-0123456789ab.parquet"
    partial.write_bytes(b"PAR1 and no footer")
    err = _bad(["--input", str(partial), "--output", str(tmp_path / "o")], capsys)
    assert "a hidden file, never read" in err
    err = _bad(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "o")], capsys)
    assert "no route-record files (Parquet) found" in err


def test_newer_schema_is_one_line(
    records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = next(p for p in records.rglob("*.parquet") if not p.name.startswith("."))
    table = pq.read_table(source)
    newer = table.replace_schema_metadata({SCHEMA_KEY: str(SCHEMA_VERSION + 1).encode()})
    pq.write_table(newer, tmp_path / "newer.parquet")
    err = _bad(
        ["--input", str(tmp_path / "newer.parquet"), "--output", str(tmp_path / "o")], capsys
    )
    assert f"schema version {SCHEMA_VERSION + 1} is newer" in err


def test_empty_window_is_one_line(
    records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--input", str(records), "--output", str(tmp_path), "--since", "2030-01-01"]
    assert "no route records between" in _bad(args, capsys)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--since", "yesterday"], "not an ISO 8601"),
        (["--since", "2024-01-02", "--until", "2024-01-01"], "--since must be before"),
    ],
)
def test_bad_times_are_one_line(
    records: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    args = ["--input", str(records), "--output", str(tmp_path), *extra]
    assert message in _bad(args, capsys)


def test_unknown_job_is_one_line(
    records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--input", str(records), "--output", str(tmp_path), "--jobs", "latency,nope"]
    assert "--jobs: no such table nope" in _bad(args, capsys)


def test_missing_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")], capsys)
    assert "no such file or directory" in err


def test_report_of_a_folder_that_is_no_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "no summary.json" in _bad(
        ["report", "--input", str(tmp_path), "--output", "x.html"], capsys
    )


# ---- a standalone cluster --------------------------------------------------------------------


class _Daemon:
    """A Spark master or worker process from pyspark's own `spark-class`; `ready` is set when
    its log says so (no sleeping)."""

    def __init__(self, args: list[str], ready_line: str, env: dict[str, str]) -> None:
        spark_home = Path(pyspark.__file__).parent
        self.process = subprocess.Popen(
            [str(spark_home / "bin" / "spark-class"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "SPARK_HOME": str(spark_home)},
            start_new_session=True,
        )
        self.ready = threading.Event()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(ready_line,), daemon=True)
        self._reader.start()

    def _read(self, ready_line: str) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            if ready_line in line:
                self.ready.set()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(WAIT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(WAIT)
        self._reader.join(WAIT)
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(300)  # three JVMs (master, worker, driver) and an executor on 2 cores
def test_the_same_job_runs_on_a_standalone_cluster(
    records: Path, tables: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(tmp_path / "logs")}
    port = free_port()
    daemons = []
    try:
        master = _Daemon(
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", str(free_port())],
            "I have been elected leader",
            env,
        )  # fmt: skip
        daemons.append(master)
        assert master.ready.wait(60), "".join(master.log[-20:])
        worker = _Daemon(
            ["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
             "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
             "--webui-port", str(free_port()), "--work-dir", str(tmp_path / "work")],
            "Successfully registered with master",
            env,
        )  # fmt: skip
        daemons.append(worker)
        assert worker.ready.wait(60), "".join(worker.log[-20:])
        out = tmp_path / "cluster"
        script = Path(sys.executable).parent / "rmb-analytics"
        done = subprocess.run(
            [str(script), "--master", f"spark://127.0.0.1:{port}", "--input", str(records),
             "--output", str(out), "--driver-memory", "1g",
             "--jobs", "throughput,latency,mailbox,federation_priors"],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "[5/5] mailbox" in done.stderr  # progress was shown
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    # the cluster's tables are the local run's tables
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "federation_priors",
        "latency",
        "mailbox",
        "throughput",
    ]
    for name in ("throughput", "latency", "mailbox", "federation_priors"):
        assert rows(out, name) == rows(tables, name), name
    assert (out / "priors.json").read_text() == (tables / "priors.json").read_text()


# ---- end to end: a real relay with --records, real traffic, then rmb-analytics --------------


class _RelayProcess:
    """`rmb-relay` in its own process, with route records, a small rate limit and a short
    mailbox TTL (swept every second by the limiter's maintenance)."""

    def __init__(self, tmp_path: Path) -> None:
        self.twins = f"sqlite:{tmp_path / 'twins.sqlite3'}"
        self.records = tmp_path / "records"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rmb_relay", "-l", "127.0.0.1:0", "--twins", self.twins,
             "--records", str(self.records), "--records-instance", "e2e",
             "--limit", "100000", "300000", "--limit-window", "1", "--mailbox-ttl", "1",
             "--sbd-disable-rate-limit"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().split()[3].rstrip(";")
        host, port = self.address.rsplit(":", 1)
        self.host, self.port = host, int(port)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(WAIT)
        assert self.process.stdout is not None
        self.process.stdout.close()


def _load(dialect: str, url: str, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "rmb_relay.load.cli", dialect, "--url", url,
         "--warmup", "0", "--quiet", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


async def _drive_drops(relay: _RelayProcess, tmp_path: Path) -> dict[str, float]:
    """An abuser over the byte limit, requests to an unknown twin, mail for an offline twin
    that expires; returns the relay's own counters once all of it was handled."""
    from rmb_relay.sdk import RmbClient
    from rmb_relay.twins import Twin
    from rmb_relay.twins.local import SqliteTwinDirectory
    from tests.helpers import eventually
    from tests.rmb_fixtures import key_for
    from tests.scrape import scrape

    directory = SqliteTwinDirectory(Path(relay.twins.removeprefix("sqlite:")))
    for twin in (501, 502, 504, 505):
        directory.add(Twin(twin, key_for(twin).public_key, frozenset({"relay.test"}), None))
    url = f"ws://{relay.address}/"
    before = (await scrape(relay.host, relay.port)).value(
        "rmb_relay_messages_in_total", dialect="rmb"
    )
    abuser = await RmbClient.connect(url, 501, key_for(501))
    receiver = await RmbClient.connect(url, 504, key_for(504))
    other = await RmbClient.connect(url, 505, key_for(505))
    try:
        for _ in range(1000):  # 1 MB in well under 3 one-second windows of 300 kB
            env = abuser.envelope(504)
            env.response.SetInParent()
            env.plain = b"x" * 1000
            abuser.send(abuser.seal(env))
        for _ in range(3):
            _, wire = other.request_envelope(999, "nobody.home")
            other.send(wire)
        for _ in range(2):
            env = other.envelope(502, expiration=60)
            env.response.SetInParent()
            env.plain = b"mail"
            other.send(other.seal(env))

        async def handled() -> bool:
            page = await scrape(relay.host, relay.port)
            seen = page.value("rmb_relay_messages_in_total", dialect="rmb") - before
            expired = page.value("rmb_relay_mailbox_dropped_total", reason="expired")
            return seen == 1005 and expired == 2

        await eventually(handled, timeout=30)
        page = await scrape(relay.host, relay.port)
    finally:
        for client in (abuser, receiver, other):
            await client.close()
    return {
        "rate_limited": page.value("rmb_relay_messages_rate_limited_total", dialect="rmb"),
        "unknown": page.value(
            "rmb_relay_error_replies_total", dialect="rmb", reason="unknown twin"
        ),
    }


@pytest.mark.slow
def test_a_real_relays_records_through_the_pipeline(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    relay = _RelayProcess(tmp_path)
    try:
        url = f"ws://{relay.address}/"
        samples = tmp_path / "samples.parquet"
        _load("rmb", url, "--twins", relay.twins, "--pairs", "2", "--count", "200", "--size", "64",
              "--samples", str(samples))  # fmt: skip
        _load("sbd", url, "--pairs", "1", "--count", "100")
        counters = asyncio.run(_drive_drops(relay, tmp_path))
    finally:
        relay.stop()
    assert counters["rate_limited"] >= 100
    assert counters["unknown"] == 3

    out = tmp_path / "tables"
    args = ["--input", str(relay.records), "--samples", str(samples), "--output", str(out)]
    assert main(args) == 0
    assert "[13/13] load_latency" in capsys.readouterr().err  # progress

    flows: dict[tuple[str, str, str], int] = {}
    for row in rows(out, "throughput"):
        key = (row["dialect"], row["route"], row["outcome"])
        flows[key] = flows.get(key, 0) + row["messages"]
    limited = int(counters["rate_limited"])
    assert flows[("rmb", "local", "delivered")] == 400 + 1000 - limited
    assert flows[("rmb", "none", "rate-limited")] == limited
    assert flows[("rmb", "none", "rejected")] == 3
    assert flows[("rmb", "mailbox", "queued")] == 2
    assert flows[("rmb", "mailbox", "expired")] == 2
    assert flows[("sbd", "local", "delivered")] == 100
    abuse = rows(out, "abuse_candidates")
    assert (abuse[0]["twin"], abuse[0]["rate_limited"]) == ("501", limited)
    drops = {(r["twin"], r["reason"]): r["messages"] for r in rows(out, "drop_reasons")}
    assert drops[("505", "unknown twin")] == 3
    boxes = rows(out, "mailbox")
    assert (sum(b["queued"] for b in boxes), sum(b["expired"] for b in boxes)) == (2, 2)
    assert boxes[-1]["backlog"] == 0
    latency = {(r["dialect"], r["route"]): r for r in rows(out, "latency")}
    assert latency[("rmb", "mailbox")]["messages"] == 2
    load = rows(out, "load_latency")
    assert sum(r["messages"] for r in load) == 400
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in load)

    page = tmp_path / "report.html"
    assert main(["report", "--input", str(out), "--output", str(page)]) == 0
    assert "Load harness" in page.read_text()


def test_report_names_its_time_span_and_routes_with_nothing_to_draw() -> None:
    """Without --since/--until the header gives the traffic's own span; a route whose every
    record says 0 µs (the hot path) gets a sentence, not a vertical line at 0."""
    from datetime import datetime

    from rmb_relay.analytics.report import _latency, _span

    starts = [datetime(2026, 11, 23, 15, 54), datetime(2026, 11, 23, 16, 53)]
    span = _span({"since": None, "until": None}, [{"window_start": t} for t in starts], 60)
    assert span == "2026-11-23 15:54 → 2026-11-23 16:54 UTC (60 min of traffic)"
    cdf = [{"dialect": "rmb", "route": "local", "relay_us": 0, "percentile": p} for p in (50, 99)]
    page = _latency(cdf, [])
    assert "rmb local: every message left the relay within the read" in page
    assert "<img" not in page
