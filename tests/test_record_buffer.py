"""Route records appended by the scanners inside `WsDecoder.feed` (rust/records.rs).

The relay's hot path records a delivered message without any Python per message: the scanner
appends (time, src, dst, size) to the four columns of a `RecordBuffer` for each message it
routes to a local connection, and the dialect retracts the few it then does not deliver. These
tests hold the scanners to exactly which messages get a record, the columns to what Python
views without a copy, and `Channel` to turning the buffer into a batch (retracted rows dropped,
SBD keys named, wall time in microseconds, sampling).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from rmb_relay._core import (
    MSG_PING,
    MSG_REQUEST,
    EnvelopeRouting,
    RecordBuffer,
    RmbScanner,
    RouteTable,
    SbdRouting,
    SbdScanner,
    WsDecoder,
    WsMessage,
)
from rmb_relay.telemetry.records import Channel
from tests.scan_helpers import DEST, SENDER, envelope, frames

NOW = 1_700_000_000_000_000_000
NOW_US = NOW // 1000


def feed(decoder: WsDecoder, data: bytes, now: int = NOW) -> list[WsMessage]:
    events = decoder.feed(data, now)
    assert all(isinstance(e, WsMessage) for e in events)
    return events  # type: ignore[return-value]


def rows(buffer: RecordBuffer) -> list[list[int]]:
    *columns, _ = buffer.take()
    views = [np.frombuffer(column, dtype=np.int64) for column in columns]
    return np.stack(views, axis=1).tolist()  # type: ignore[no-any-return]


def test_rmb_scan_records_exactly_the_messages_it_routes_locally() -> None:
    routes = RouteTable()
    routes.register_session(9, "svc", 42)
    buffer = RecordBuffer()
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, "app", buffer))
    routed = envelope((7, "app"), (9, "svc"), MSG_REQUEST)
    not_routed = [
        envelope((7, "other"), (9, "svc"), MSG_REQUEST),  # not this session's source
        envelope((7, "app"), (9, "absent"), MSG_REQUEST),  # no local destination
        envelope((7, "app"), (9, "svc"), MSG_PING),  # answered by the relay
        envelope((7, "app"), (0, None), MSG_REQUEST),  # no destination
    ]
    messages = feed(decoder, frames(routed, *not_routed, routed))
    records = [m.routing.record for m in messages if isinstance(m.routing, EnvelopeRouting)]
    assert records == [0, -1, -1, -1, -1, 1]
    assert len(buffer) == 2
    assert rows(buffer) == [[NOW_US, 7, 9, len(routed)], [NOW_US, 7, 9, len(routed)]]


def test_without_a_buffer_nothing_is_recorded() -> None:
    routes = RouteTable()
    routes.register_session(9, None, 42)
    scanner = RmbScanner(routes, 7, None)
    assert scanner.records is None
    (message,) = feed(WsDecoder(scanner=scanner), frames(envelope((7, None), (9, None), 1)))
    assert isinstance(message.routing, EnvelopeRouting)
    assert message.routing.record == -1


def test_retracted_records_keep_their_place_until_taken() -> None:
    routes = RouteTable()
    routes.register_session(9, None, 42)
    buffer = RecordBuffer()
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, None, buffer))
    data = envelope((7, None), (9, None), MSG_REQUEST)
    feed(decoder, frames(data, data, data))
    assert buffer.retract(1)
    assert not buffer.retract(1)
    assert not buffer.retract(3)
    assert [r[3] for r in rows(buffer)] == [len(data), len(data)]  # the retracted one left out
    (late,) = feed(decoder, frames(data))
    assert isinstance(late.routing, EnvelopeRouting)
    assert late.routing.record == 3  # indexes keep counting across takes
    assert not buffer.retract(0)


def test_sbd_scan_records_routed_forwards_with_interned_keys() -> None:
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    buffer = RecordBuffer()
    buffer.offset = 1_000_000
    scanner = SbdScanner(routes, SENDER, None, "10.0.0.1", buffer)
    scanner.ready = True
    decoder = WsDecoder(max_message=20_000, scanner=scanner)
    forward = DEST + b"x" * 100
    unknown = bytes([3]) * 32 + b"y"
    command = bytes(28) + b"keep"
    messages = feed(decoder, frames(forward, unknown, command, forward), now=50_000)
    records = [m.routing.record for m in messages if isinstance(m.routing, SbdRouting)]
    assert records == [0, -1, -1, 1]
    *columns, keys = buffer.take()
    assert keys == [SENDER, DEST]  # id 0 the sender (first used), id 1 the destination
    grid = np.stack([np.frombuffer(c, dtype=np.int64) for c in columns], axis=1).tolist()
    assert grid == [[1_050, 0, 1, len(forward)], [1_050, 0, 1, len(forward)]]
    feed(decoder, frames(forward), now=60_000)
    time_us, src, dst, size, keys = buffer.take()
    assert keys == []  # handed over once
    assert [np.frombuffer(c, dtype=np.int64).tolist() for c in (time_us, src, dst, size)] == [
        [1_060],
        [0],
        [1],
        [len(forward)],
    ]


def test_taken_columns_are_read_only_views_that_outlive_the_buffer() -> None:
    buffer = RecordBuffer()
    for i in range(1000):
        buffer.push(i * 1000, i, -i, 3)
    time_us, src, *_ = buffer.take()
    del buffer
    assert len(time_us) == 1000
    view = memoryview(src)
    assert (view.readonly, view.nbytes, view.format) == (True, 8000, "B")
    assert np.frombuffer(src, dtype=np.int64)[-1] == 999
    assert np.frombuffer(time_us, dtype=np.int64).tolist() == list(range(1000))
    with pytest.raises(ValueError, match="read-only"):
        np.frombuffer(src, dtype=np.int64)[0] = 1
    # the numpy view keeps the column (and its memory) alive after the column object is gone
    values = np.frombuffer(src, dtype=np.int64)
    del src, view
    assert values[999] == 999


def test_sbd_records_name_each_destination_when_a_sender_alternates() -> None:
    """The scanner remembers the last destination's id (cheaper than hashing the key again);
    a sender switching between peers still gets each one's own id."""
    other = bytes([4]) * 32
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    routes.register_pubkey(other, 6)
    buffer = RecordBuffer()
    scanner = SbdScanner(routes, SENDER, None, "", buffer)
    scanner.ready = True
    decoder = WsDecoder(scanner=scanner)
    feed(decoder, frames(DEST + b"a", DEST + b"b", other + b"c", DEST + b"d", other + b"e"))
    _, src, dst, _, keys = buffer.take()
    assert keys == [SENDER, DEST, other]
    assert np.frombuffer(src, dtype=np.int64).tolist() == [0] * 5
    assert np.frombuffer(dst, dtype=np.int64).tolist() == [1, 1, 2, 1, 2]


def test_sbd_scan_of_a_sender_not_ready_records_nothing() -> None:
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    buffer = RecordBuffer()
    decoder = WsDecoder(scanner=SbdScanner(routes, SENDER, None, "", buffer))
    (message,) = feed(decoder, frames(DEST + b"x"))
    assert isinstance(message.routing, SbdRouting)
    assert message.routing.record == -1
    assert len(buffer) == 0


def _key(key: bytes) -> str:
    return base64.urlsafe_b64encode(key).rstrip(b"=").decode()


def test_channel_takes_the_scanners_rows_as_local_records() -> None:
    now = [NOW]
    channel = Channel("sbd", 1.0, lambda: now[0])
    scan_now = [10_000]
    buffer = channel.scanner_buffer(lambda: scan_now[0])
    assert buffer.offset == NOW - 10_000
    routes = RouteTable()
    routes.register_pubkey(DEST, 5)
    scanner = SbdScanner(routes, SENDER, None, "", buffer)
    scanner.ready = True
    messages = feed(WsDecoder(scanner=scanner), frames(DEST + b"a", DEST + b"bb"), now=12_000)
    second = messages[1].routing
    assert isinstance(second, SbdRouting)
    channel.retract(second.record)
    channel.retract(-1)  # no record: nothing happens
    batch = channel.take(1.0)
    assert batch is not None
    assert batch.full == []
    assert batch.columns is not None
    assert batch.rows == 1
    assert [np.frombuffer(c, dtype=np.int64).tolist() for c in batch.columns] == [
        [NOW_US + 2],
        [0],
        [1],
        [33],
    ]
    assert (batch.names_offset, batch.names) == (0, [_key(SENDER), _key(DEST)])
    channel.names_sent = 2  # the writer has them now
    assert channel.take(1.0) is None  # nothing since
    feed(WsDecoder(scanner=scanner), frames(DEST + b"c"), now=13_000)
    later = channel.take(1.0)
    assert later is not None
    assert (later.names_offset, later.names) == (2, [])  # names go to the writer once


@pytest.mark.parametrize(("rate", "in_relay"), [(0.05, True), (0.25, False)])
def test_the_hot_paths_columns_are_sampled_in_the_relay_or_by_the_writer(
    rate: float, in_relay: bool
) -> None:
    """`--records-sample R`: up to RELAY_SAMPLE_MAX, `take` keeps a Bernoulli sample of the
    scanned rows (whole rows: the four columns stay aligned) and the writer is handed only
    those; above it the writer samples what it is handed (where that costs less)."""
    from rmb_relay.telemetry.record_writer import make_batch

    channel = Channel("rmb", rate, lambda: NOW)
    buffer = channel.scanner_buffer(channel.clock)
    assert buffer.offset == 0
    routes = RouteTable()
    routes.register_session(9, None, 42)
    decoder = WsDecoder(scanner=RmbScanner(routes, 7, None, buffer))
    data = envelope((7, None), (9, None), MSG_REQUEST)
    feed(decoder, frames(*[data] * 4000))
    taken = channel.take(1 / rate)
    assert taken is not None
    assert taken.columns is not None
    assert taken.weight == 1 / rate
    expected, sigma = 4000 * rate, (4000 * rate * (1 - rate)) ** 0.5
    if in_relay:
        assert abs(taken.rows - expected) < 6 * sigma
        assert taken.sample == 1.0
    else:
        assert (taken.rows, taken.sample) == (4000, rate)
    batch = make_batch("rmb", 1 / rate, taken.sample, list(taken.columns), [], None)
    assert batch.local is not None
    assert abs(len(batch.local[0]) - expected) < 6 * sigma
    assert set(batch.local[3].tolist()) == {len(data)}
    assert set(batch.local[1].tolist()) == {7}
    assert set(batch.local[2].tolist()) == {9}


def test_sampled_rows_are_whole_rows_in_order() -> None:
    """`RowSampler.sample` keeps the rows `picks` draws, all four columns alike."""
    from array import array
    from random import Random

    from rmb_relay.telemetry.record_sample import RowSampler

    rows = 1000
    columns = [
        memoryview(array("q", [c * 10**6 + r for r in range(rows)])).cast("B") for c in range(4)
    ]
    picks = RowSampler(0.1, Random(7)).picks(rows)
    kept = RowSampler(0.1, Random(7)).sample(columns, rows)
    assert kept is not None
    assert [list(memoryview(c).cast("q")) for c in kept] == [
        [c * 10**6 + r for r in picks] for c in range(4)
    ]
    assert picks == sorted(set(picks))
    assert picks[0] >= 0
    assert picks[-1] < rows
    assert RowSampler(1e-9, Random(7)).sample(columns, rows) is None


@pytest.mark.parametrize("rate", [0.5, 0.1, 0.01])
def test_the_row_sampler_is_an_exact_bernoulli_sample(rate: float) -> None:
    """The table of gaps (record_sample.py) changes nothing about the distribution: the rows
    kept and the gaps between them are what independent coin flips give (bounds 6 standard
    deviations wide)."""
    from itertools import pairwise
    from random import Random

    from rmb_relay.telemetry.record_sample import RowSampler

    rows = 400_000
    picks = RowSampler(rate, Random(11)).picks(rows)
    expected = rows * rate
    assert abs(len(picks) - expected) < 6 * (expected * (1 - rate)) ** 0.5
    gaps = [b - a - 1 for a, b in pairwise(picks)]
    for gap in (0, 3, round(4 / rate)):  # P(G >= g) = (1 - rate)^g, into the tail
        share = sum(1 for g in gaps if g >= gap) / len(gaps)
        p = (1 - rate) ** gap
        assert abs(share - p) < 6 * (p * (1 - p) / len(gaps)) ** 0.5 + 1e-9


@pytest.mark.parametrize("index", [-5, 0, 10**12])
def test_retracting_what_is_not_buffered_is_false(index: int) -> None:
    assert not RecordBuffer().retract(index)
