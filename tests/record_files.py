"""Route-record files as relays before schema version 2 wrote them (every column in every row,
addresses as text), for the tests that hold readers to keep reading them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rmb_relay.telemetry.record_schema import SCHEMA, SCHEMA_KEY

#: a version-1 row's defaults: a hot-path delivery
V1_ROW: dict[str, Any] = {
    "instance": "relay-v1",
    "dialect": "rmb",
    "route": "local",
    "outcome": "delivered",
    "reason": None,
    "relay_us": 0,
    "remote": None,
    "weight": 1.0,
}


def write_v1(path: Path, rows: list[dict[str, Any]]) -> None:
    """One version-1 file of `rows` (time in µs since the epoch; other fields default to
    `V1_ROW`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{**V1_ROW, **row} for row in rows], schema=SCHEMA)
    with pq.ParquetWriter(path, SCHEMA, store_schema=False) as writer:  # as version 1 did
        writer.add_key_value_metadata({SCHEMA_KEY: b"1"})
        writer.write_table(table)
