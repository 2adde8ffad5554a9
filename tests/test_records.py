"""Route records (telemetry/records.py): what the relay writes, where, and what it sheds.

The recorder runs for real (its writer thread, pyarrow, Parquet on disk); time comes from a fake
clock so partitions and times are exact."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rmb_relay.errors import ConfigError, MailboxFull
from rmb_relay.mailbox import MemoryMailbox
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.telemetry.record_flags import add_record_arguments, recorder_from_args
from rmb_relay.telemetry.record_process import FullRecord
from rmb_relay.telemetry.record_schema import (
    CONSTANTS_KEY,
    SCHEMA,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    RecordFileError,
    layout,
    read_table,
)
from rmb_relay.telemetry.records import Channel, Recorder
from tests.helpers import FakeClock, eventually
from tests.record_files import write_v1
from tests.tunnel_fixtures import StartTunnel, raw_client
from tests.tunnel_fixtures import start_tunnel as start_tunnel

#: 2023-11-14 22:59:59 UTC, one second before an hour boundary
T0 = 1_700_002_799 * 1_000_000_000
#: two SBD keys and the names records give them (base64url)
KEY_A, KEY_B = bytes([0]) * 32, bytes([0xFF]) * 32
NAME_A, NAME_B = "A" * 43, "_" * 42 + "8"


def visible(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet") if not p.name.startswith("."))


def hidden(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.parquet"))


async def test_records_land_in_hour_partitions_with_every_field(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    recorder = Recorder(tmp_path, "relay-a:8080", clock=clock)
    recorder.start()
    rmb = recorder.channel("rmb")
    rmb.native.push(T0, 7, 8, 100)  # as the scanner appends a delivered message
    received = clock.now
    clock.now += 1_500_000_000  # into the next hour, 1.5 s after the message arrived
    rmb.add(7, 9, 50, "mailbox", "queued", received=received)
    rmb.add(7, 10, 60, "federation", "rejected", "federation", remote="far.example")
    sbd = recorder.channel("sbd")
    sbd.native.push(clock.now, sbd.native.key_id(KEY_A), sbd.native.key_id(KEY_B), 1000)
    await recorder.close()

    files = visible(tmp_path)
    assert [p.parent.relative_to(tmp_path).as_posix() for p in files] == [
        "date=2023-11-14/hour=22",
        "date=2023-11-14/hour=23",
        "date=2023-11-14/hour=23",
    ]
    assert hidden(tmp_path) == []  # nothing left half-written
    for path in files:
        assert pq.read_metadata(path).metadata[SCHEMA_KEY] == str(SCHEMA_VERSION).encode()
    rows = read_table(tmp_path).sort_by("time").to_pylist()
    first = rows[0]
    assert (first["dialect"], first["src"], first["dst"], first["size"]) == ("rmb", "7", "8", 100)
    assert (first["route"], first["outcome"], first["relay_us"]) == ("local", "delivered", 0)
    assert first["instance"] == "relay-a:8080"
    assert first["time"].timestamp() == T0 / 1e9
    later = {(r["dialect"], r["route"]): r for r in rows[1:]}
    queued = later[("rmb", "mailbox")]
    assert (queued["outcome"], queued["relay_us"], queued["dst"]) == ("queued", 1_500_000, "9")
    failed = later[("rmb", "federation")]
    assert (failed["outcome"], failed["reason"], failed["remote"]) == (
        "rejected",
        "federation",
        "far.example",
    )
    assert failed["relay_us"] is None
    assert (later[("sbd", "local")]["src"], later[("sbd", "local")]["dst"]) == (NAME_A, NAME_B)
    assert {r["weight"] for r in rows} == {1.0}
    assert {r["instance"] for r in rows} == {"relay-a:8080"}
    assert recorder.stats.written == 4
    assert recorder.stats.writer_cpu_ns > 0


async def test_hot_path_files_hold_only_the_columns_that_vary(tmp_path: Path) -> None:
    """Schema version 2: the hot path's rows are four columns (twin ids as integers); what is
    the same for every row is written once, into the file's metadata."""
    recorder = Recorder(tmp_path, "relay-a:8080", clock=FakeClock(T0), sample=0.5)
    recorder.start()
    rmb = recorder.channel("rmb")
    for i in range(100):
        rmb.native.push(T0 + i * 1000, 7, 8, 100)
    await recorder.close()
    (path,) = visible(tmp_path)
    meta = pq.read_metadata(path)
    schema = meta.schema.to_arrow_schema()
    assert [(f.name, str(f.type)) for f in schema] == [
        ("time", "timestamp[us, tz=UTC]"),
        ("src", "int64"),
        ("dst", "int64"),
        ("size", "int64"),
    ]
    assert json.loads(meta.metadata[CONSTANTS_KEY]) == {
        "instance": "relay-a:8080",
        "dialect": "rmb",
        "route": "local",
        "outcome": "delivered",
        "reason": None,
        "relay_us": 0,
        "remote": None,
        "weight": 2.0,
    }
    table = read_table(tmp_path)
    assert table.schema == SCHEMA
    assert set(table.column("src").to_pylist()) == {"7"}


async def test_version_1_files_are_read_alongside_version_2(tmp_path: Path) -> None:
    """Records written before schema version 2 (every column in every row) stay readable,
    mixed with new files in one directory."""
    old = tmp_path / "date=2023-11-14" / "hour=22" / "part-old.parquet"
    write_v1(old, [{"time": T0 // 1000 - 5_000_000, "src": "1", "dst": "2", "size": 10}])
    recorder = Recorder(tmp_path, "new", clock=FakeClock(T0))
    recorder.start()
    recorder.channel("rmb").native.push(T0, 3, 4, 20)
    await recorder.close()
    rows = read_table(tmp_path).sort_by("time").to_pylist()
    assert [(r["instance"], r["src"], r["dst"], r["size"]) for r in rows] == [
        ("relay-v1", "1", "2", 10),
        ("new", "3", "4", 20),
    ]


def _v2_file(path: Path, columns: dict[str, pa.Array], constants: bytes) -> pq.FileMetaData:
    with pq.ParquetWriter(path, pa.table(columns).schema) as writer:
        writer.add_key_value_metadata({SCHEMA_KEY: b"2", CONSTANTS_KEY: constants})
        writer.write_table(pa.table(columns))
    return pq.read_metadata(path)


@pytest.mark.parametrize(
    ("constants", "message"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"colour": "red"}', "no such constant column 'colour'"),
        (b'{"time": 0}', "no such constant column 'time'"),
        (b'{"relay_us": "fast"}', "'fast' is not int64"),
        (b'{"instance": null}', "cannot be null"),
        (b'{"size": 3}', "'size' is both stored and constant"),
        (b'{"instance": "r", "weight": 1.0}', "column 'dialect' (string) missing"),
    ],
)
def test_a_version_2_file_that_does_not_add_up_is_refused(
    tmp_path: Path, constants: bytes, message: str
) -> None:
    """The reader checks what a file's metadata claims against the schema, so a bad file is
    one clear error (rmb-analytics prints it as one line) and not a wrong table."""
    stored = {
        "time": pa.array([T0 // 1000], pa.timestamp("us", tz="UTC")),
        "src": pa.array([1]),
        "dst": pa.array([2]),
        "size": pa.array([3]),
    }
    meta = _v2_file(tmp_path / "bad.parquet", stored, constants)
    with pytest.raises(RecordFileError, match=re.escape(message)):
        layout(meta)


async def test_a_full_queue_sheds_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    """The writer is not running (as if it had fallen behind): the first batch waits in the
    queue, the next ones are shed and counted, and the hot path never blocks."""
    recorder = Recorder(tmp_path, "r", clock=FakeClock(T0), max_pending=1)
    channel = recorder.channel("rmb")
    for _ in range(10):
        channel.native.push(T0, 1, 2, 3)
    recorder.flush()
    for _ in range(25):
        channel.native.push(T0, 1, 2, 3)
    channel.add(1, 2, 3, "none", "rejected", "unknown twin")
    recorder.flush()
    assert recorder.stats.shed == 26
    assert channel.take(1.0) is None


async def test_a_writer_that_dies_is_restarted_and_recording_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The writer is a child process (the relay stays single-threaded): if it dies, the relay
    notices at its next flush, counts what it had not taken as shed and starts a new one, which
    gets the SBD key names again. The dead writer's open file has no footer: the new writer
    removes it at start and says so on stderr, naming the file."""
    recorder = Recorder(tmp_path, "r", clock=FakeClock(T0), flush_interval=0.01, restart_seconds=0)
    recorder.start()
    sbd = recorder.channel("sbd")
    a, b = sbd.native.key_id(KEY_A), sbd.native.key_id(KEY_B)
    sbd.native.push(T0, a, b, 10)
    await eventually(lambda: recorder.stats.written == 1)
    [partial] = hidden(tmp_path)
    first = recorder.writer_pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await eventually(lambda: recorder.writer_pid not in (first, None))
    await eventually(lambda: not partial.exists())
    sbd.native.push(T0 + 1000, b, a, 20)
    await recorder.close()
    rows = read_table(tmp_path).sort_by("time").to_pylist()
    # the first writer died with its file open (hidden, never renamed): its row is lost
    assert [(r["src"], r["dst"], r["size"]) for r in rows] == [(NAME_B, NAME_A, 20)]
    assert recorder.stats.written == 2  # counted by both writers
    assert recorder.writer_pid is None
    assert hidden(tmp_path) == []
    err = capfd.readouterr().err
    assert f"removed {partial}" in err
    assert "no Parquet footer, so its records" in err


async def test_a_starting_writer_renames_complete_leftovers_and_spares_live_files(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Leftovers of writers that died: one complete (killed between closing and renaming) is
    renamed into view, one cut short is removed. A hidden file someone holds locked is a live
    writer's (another instance sharing the directory): it is left alone."""
    source = Recorder(tmp_path / "source", "r", clock=FakeClock(T0))
    source.start()
    source.channel("rmb").native.push(T0, 1, 2, 3)
    await source.close()
    [complete] = visible(tmp_path / "source")
    data = complete.read_bytes()
    folder = tmp_path / "records" / complete.parent.relative_to(tmp_path / "source")
    folder.mkdir(parents=True)
    finished = folder / ".part-r-rmb-local-00000000000a.parquet"
    finished.write_bytes(data)
    cut = folder / ".part-r-rmb-local-00000000000b.parquet"
    cut.write_bytes(data[: len(data) // 2])
    live = folder / ".part-other-full-00000000000c.parquet"
    live.write_bytes(data[:4])
    with live.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        recorder = Recorder(tmp_path / "records", "r", clock=FakeClock(T0))
        recorder.start()
        await eventually(lambda: not cut.exists() and not finished.exists())
        await recorder.close()
        assert live.exists()
    assert visible(tmp_path / "records") == [folder / finished.name[1:]]
    assert read_table(tmp_path / "records").num_rows == 1
    err = capfd.readouterr().err
    assert f"removed {cut}" in err
    assert f"{finished} was complete (1 records)" in err
    assert str(live) not in err


async def test_open_files_are_hidden_until_rolled(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, "r", clock=FakeClock(T0), flush_interval=0.01, roll_seconds=3600)
    recorder.start()
    recorder.channel("rmb").native.push(T0, 1, 2, 3)
    recorder.flush()

    await eventually(lambda: recorder.stats.written == 1)
    assert visible(tmp_path) == []  # a reader (Spark) never sees a half-written file
    assert len(hidden(tmp_path)) == 1
    await recorder.close()
    assert len(visible(tmp_path)) == 1


@pytest.mark.parametrize("rate", [0.25, 0.05])  # sampled by the writer, by the relay
async def test_sampled_records_carry_their_weight(tmp_path: Path, rate: float) -> None:
    recorder = Recorder(tmp_path, "r", clock=FakeClock(T0), sample=rate)
    recorder.start()
    channel = recorder.channel("rmb")
    for _ in range(4000):
        channel.native.push(T0, 1, 2, 3)
    channel.add(1, 2, 3, "none", "rejected", "unknown twin")  # kept or not: weight 1/R if kept
    await recorder.close()
    table = read_table(tmp_path)
    expected, sigma = 4000 * rate, (4000 * rate * (1 - rate)) ** 0.5
    assert abs(table.num_rows - expected) < 6 * sigma + 1
    assert set(table.column("weight").to_pylist()) == {1 / rate}


def test_sample_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="sample"):
        Recorder(Path("unused"), "r", sample=0.0)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", default="[::]:8080")
    add_record_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("value", ["0", "1.5", "half"])
def test_records_sample_flag_rejects_bad_values(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse("--records", "x", "--records-sample", value)
    assert exit_info.value.code == 2
    assert "--records-sample" in capsys.readouterr().err


async def test_records_flag_refuses_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        recorder_from_args(_parse("--records", str(target)), Registry())


async def test_records_off_by_default() -> None:
    assert recorder_from_args(_parse(), Registry()) is None


async def test_records_flags_name_the_instance_and_register_metrics(tmp_path: Path) -> None:
    registry = Registry()
    args = _parse("--records", str(tmp_path), "--listen", "127.0.0.1:9999")
    recorder = recorder_from_args(args, registry)
    assert recorder is not None
    try:
        assert recorder.instance.endswith(":9999")
        assert "rmb_relay_records_shed_total" in registry.render()
        assert "rmb_relay_records_written_total" in registry.render()
        assert "rmb_relay_records_writer_cpu_seconds_total" in registry.render()
    finally:
        await recorder.close()


async def test_mailbox_reports_expiry_and_overflow_losses() -> None:
    clock = FakeClock(T0)
    mailbox = MemoryMailbox(ttl=60, max_per_session=2, clock=clock)
    lost: list[tuple[tuple[int, str | None], int, str]] = []
    mailbox.on_loss = lambda key, size, reason: lost.append((key, size, reason))
    now = T0 // 1_000_000_000
    await mailbox.put((5, None), b"a" * 10, now + 1)
    await mailbox.put((5, None), b"b" * 20, now + 100)
    with pytest.raises(MailboxFull):  # full: the new one is refused, nothing waiting goes
        await mailbox.put((5, None), b"c" * 30, now + 100)
    assert lost == []
    clock.now += 200 * 1_000_000_000
    assert mailbox.sweep() == 2
    assert lost == [((5, None), 10, "expired"), ((5, None), 20, "expired")]


async def test_tunnel_requests_are_recorded(start_tunnel: StartTunnel, tmp_path: Path) -> None:
    """The tunnel's hub records each request where it is answered: delivered through a local
    connector, refused for an unknown tenant, with the body size and the exchange time."""
    tunnel = await start_tunnel()
    recorder = Recorder(tmp_path / "records", "t")
    recorder.start()
    tunnel.dialect.record_into(recorder.channel("tunnel"))
    await tunnel.connect()
    async with raw_client(tunnel) as client:  # (head and body in one read: the fast paths)
        assert (await client.request("POST", "/relay/acme/app/echo", b"x" * 300))[0] == 200
        assert (await client.request("GET", "/relay/nobody/app/echo"))[0] == 404
    assert tunnel.dialect.hub.requests.value("acme", "app", "200") == 1
    await recorder.close()
    rows = read_table(tmp_path / "records").sort_by("time").to_pylist()
    assert [(r["dialect"], r["dst"], r["size"], r["route"], r["outcome"]) for r in rows] == [
        ("tunnel", "acme/app", 300, "local", "delivered"),
        ("tunnel", None, 0, "none", "rejected"),
    ]
    assert rows[0]["relay_us"] > 0
    assert rows[1]["reason"] == "unknown tenant"


def test_a_channels_sources_are_taken_with_its_records_and_sampled_alike() -> None:
    """`Channel.add_source`: records kept elsewhere (the tunnel's hub) join the
    channel's own at each take, once, and are sampled at the channel's rate."""
    clock = FakeClock(T0)
    kept: list[list[FullRecord]] = [
        [(T0, None, "acme/app", 2, "local", "delivered", None, 5, None)]
    ]
    channel = Channel("tunnel", 1.0, clock)
    channel.add_source(lambda: kept.pop() if kept else [])
    channel.add(None, "acme/app", 3, "none", "rejected", "unknown tenant")
    batch = channel.take(1.0)
    assert batch is not None
    assert [r[3] for r in batch.full] == [3, 2]
    assert channel.take(1.0) is None
    half = Channel("tunnel", 0.5, clock)
    row: FullRecord = (T0, None, "a/b", 1, "local", "delivered", None, 5, None)
    half.add_source(lambda: [row] * 1000)
    state = random.getstate()
    random.seed(13)  # (`add` draws from the module's generator: so do sources)
    try:
        batch = half.take(1.0)
    finally:
        random.setstate(state)
    assert batch is not None
    assert 400 < len(batch.full) < 600
