"""What rmb-analytics reads, checked before Spark sees it.

A Spark job over a corrupt or foreign Parquet file fails deep inside an executor with a Java
stack trace. Every file's footer is cheap to read with pyarrow (no data pages), so each input
file is checked here first: it is Parquet, it carries the route-record columns, and its schema
version is one this program understands. A problem becomes one `InputError` line naming the file.
The footers also give each file's layout (telemetry/record_schema.py), which the Spark loader
needs to put the columns a version-2 file stores once back on its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rmb_relay.telemetry.record_schema import (
    Layout,
    RecordFileError,
    is_hidden,
    layout,
    visible_files,
)

#: the columns of `rmb-load --samples FILE.parquet`
SAMPLE_COLUMNS = {
    "timestamp_ns": pa.int64(),
    "pair": pa.int64(),
    "size": pa.int64(),
    "latency_ns": pa.int64(),
    "dialect": pa.string(),
}


class InputError(Exception):
    """Bad input for the pipeline (the user's to fix): printed as one line, exit code 2."""


@dataclass(frozen=True, slots=True)
class Inputs:
    """Checked input files: their paths and how many rows their footers announce."""

    files: list[Path]
    rows: int
    #: route records only: each file's layout, in the order of `files`
    layouts: list[Layout] = field(default_factory=list)


def parquet_files(root: Path) -> list[Path]:
    """The visible Parquet files under `root` (a file or a directory tree); hidden and `_`
    files are skipped as Spark skips them (files still being written are hidden)."""
    if not root.exists():
        raise InputError(f"{root}: no such file or directory")
    if root.is_file() and is_hidden(root):
        raise InputError(
            f"{root}: a hidden file, never read (rmb-relay writes a records file under a "
            "hidden name and renames it when complete; a killed writer's leftover is renamed "
            "or removed when the writer starts again)"
        )
    return visible_files(root)


def _footer(path: Path) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path)
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: not a readable Parquet file ({_short(err)})") from None


def check_records(root: Path) -> Inputs:
    """Every file under `root` must be a route-record file of a version we understand."""
    files = parquet_files(root)
    if not files:
        raise InputError(f"{root}: no route-record files (Parquet) found")
    rows = 0
    layouts = []
    for path in files:
        meta = _footer(path)
        try:
            layouts.append(layout(meta))
        except RecordFileError as err:
            raise InputError(f"{path}: {err}") from None
        rows += meta.num_rows
    return Inputs(files, rows, layouts)


def check_samples(root: Path) -> Inputs:
    """`rmb-load --samples` Parquet: the columns the load jobs use."""
    files = parquet_files(root)
    if not files:
        raise InputError(f"{root}: no rmb-load sample files (Parquet) found")
    rows = 0
    for path in files:
        meta = _footer(path)
        schema = meta.schema.to_arrow_schema()
        for name, kind in SAMPLE_COLUMNS.items():
            index = schema.get_field_index(name)
            if index < 0 or schema.field(index).type != kind:
                raise InputError(f"{path}: not rmb-load samples (column {name!r} missing)")
        rows += meta.num_rows
    return Inputs(files, rows)


def overlaps(inputs: Inputs, since: datetime | None, until: datetime | None) -> bool:
    """Whether any row group's `time` range (footer statistics) meets [since, until)."""
    if since is None and until is None:
        return inputs.rows > 0
    for path in inputs.files:
        meta = _footer(path)
        column = meta.schema.to_arrow_schema().get_field_index("time")
        for index in range(meta.num_row_groups):
            group = meta.row_group(index)
            if group.num_rows == 0:
                continue
            stats = group.column(column).statistics
            if stats is None or not stats.has_min_max:
                return True  # cannot tell: let Spark look
            low, high = _utc(stats.min), _utc(stats.max)
            if (until is None or low < until) and (since is None or high >= since):
                return True
    return False


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def parse_time(text: str, flag: str) -> datetime:
    """ISO 8601 date or date-time; without a zone it is UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise InputError(f"{flag} {text!r}: not an ISO 8601 date or date-time") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
