"""The route-record file format: the schema every reader sees, how a file stores it, and the one
pyarrow loader (`read_table`; Spark's is `analytics.pipeline.read_records`, built on `layout`).

Versions (the number is in every file's key-value metadata under `SCHEMA_KEY`)
------------------------------------------------------------------------------
1. Every file holds the twelve columns of `SCHEMA`, addresses as text.
2. A file holds only the columns that vary inside it. The columns that are the same for every
   row of the file are written once, into the key-value metadata (`CONSTANTS_KEY`: a JSON object
   `{column: value}`), instead of once per row: the relay instance and the sample weight in
   every file, and in the files of the hot path (messages delivered to a local connection in the
   read that decoded them, nine rows in ten) also the dialect, route, outcome, reason, relay_us
   and remote. Those columns cost the writer as much as the four that vary (time, src, dst,
   size) while telling nothing per row. Addresses may be stored as int64 (RMB twin ids, as the
   relay has them) instead of text.

Readers re-materialise `SCHEMA` from either version (constants as columns, int64 addresses as
text), so the analytics jobs see one table whatever mix of files they read. A later version may
add columns; it must not change the meaning of these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

#: the newest record file layout this code writes and reads
SCHEMA_VERSION = 2
SCHEMA_KEY = b"rmb.records.schema_version"
#: version 2: the columns stored once per file, as a JSON object {column: value}
CONSTANTS_KEY = b"rmb.records.constants"

#: the route records as every reader sees them (both versions)
SCHEMA = pa.schema(
    [
        pa.field("time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("instance", pa.string(), nullable=False),
        pa.field("dialect", pa.string(), nullable=False),
        pa.field("src", pa.string()),
        pa.field("dst", pa.string()),
        pa.field("size", pa.int64(), nullable=False),
        pa.field("route", pa.string(), nullable=False),
        pa.field("outcome", pa.string(), nullable=False),
        pa.field("reason", pa.string()),
        pa.field("relay_us", pa.int64()),
        pa.field("remote", pa.string()),
        pa.field("weight", pa.float64(), nullable=False),
    ]
)
#: version 2: address columns a file may store as int64 (twin ids); read back as text
ADDRESS_COLUMNS = frozenset({"src", "dst"})
#: columns that vary per row in every file (never constants)
ROW_COLUMNS = frozenset({"time"})


class RecordFileError(ValueError):
    """A Parquet file that is not a route-record file this code reads (the message says why;
    the caller names the file)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How one file stores `SCHEMA`: its version, the columns it holds once in its metadata,
    and the address columns it holds as int64. Files of equal layouts are read together."""

    version: int
    #: (column, value) of the constant columns, in `SCHEMA` order
    constants: tuple[tuple[str, Any], ...] = ()
    #: address columns stored as int64
    integer: frozenset[str] = frozenset()

    @property
    def stored(self) -> list[str]:
        """The columns the file holds, in `SCHEMA` order."""
        constant = {name for name, _ in self.constants}
        return [name for name in SCHEMA.names if name not in constant]


def file_metadata(constants: Mapping[str, Any]) -> dict[bytes, bytes]:
    """The key-value metadata of a version-2 file whose `constants` are stored once."""
    return {
        SCHEMA_KEY: str(SCHEMA_VERSION).encode(),
        CONSTANTS_KEY: json.dumps(dict(constants), separators=(",", ":")).encode(),
    }


def layout(meta: pq.FileMetaData) -> Layout:
    """The layout a file's footer announces; RecordFileError if it is not a route-record file
    of a version this code reads."""
    kv = meta.metadata or {}
    raw = kv.get(SCHEMA_KEY)
    if raw is None:
        raise RecordFileError("not an rmb-relay route-record file (no schema version)")
    try:
        version = int(raw)
    except ValueError:
        raise RecordFileError(f"unreadable schema version {raw!r}") from None
    if version > SCHEMA_VERSION:
        raise RecordFileError(
            f"record schema version {version} is newer than this rmb-analytics understands "
            f"({SCHEMA_VERSION}); upgrade rmb-analytics"
        )
    constants = _constants(kv.get(CONSTANTS_KEY)) if version >= 2 else {}
    schema = meta.schema.to_arrow_schema()
    for name in constants:
        if name in schema.names:
            raise RecordFileError(f"column {name!r} is both stored and constant")
    integer = set()
    for field in SCHEMA:
        if field.name in constants:
            continue
        index = schema.get_field_index(field.name)
        kind = schema.field(index).type if index >= 0 else None
        if version >= 2 and field.name in ADDRESS_COLUMNS and kind == pa.int64():
            integer.add(field.name)
        elif kind != field.type:
            raise RecordFileError(
                f"column {field.name!r} ({field.type}) missing or of another type"
            )
    ordered = tuple((name, constants[name]) for name in SCHEMA.names if name in constants)
    return Layout(version, ordered, frozenset(integer))


def _constants(raw: bytes | None) -> dict[str, Any]:
    """The constant columns of a version-2 file, checked against `SCHEMA`."""
    if raw is None:
        return {}
    try:
        constants = json.loads(raw)
    except ValueError:
        raise RecordFileError("unreadable constant columns (not JSON)") from None
    if not isinstance(constants, dict):
        raise RecordFileError("unreadable constant columns (not a JSON object)")
    for name, value in constants.items():
        if name not in SCHEMA.names or name in ROW_COLUMNS:
            raise RecordFileError(f"no such constant column {name!r}")
        field = SCHEMA.field(name)
        if value is None:
            if not field.nullable:
                raise RecordFileError(f"constant column {name!r} cannot be null")
            continue
        fits = {
            pa.string(): isinstance(value, str),
            pa.int64(): isinstance(value, int) and not isinstance(value, bool),
            pa.float64(): isinstance(value, int | float) and not isinstance(value, bool),
        }.get(field.type, False)
        if not fits:
            raise RecordFileError(f"constant column {name!r}: {value!r} is not {field.type}")
    return constants


def to_schema(table: pa.Table, found: Layout) -> pa.Table:
    """A table read from a file of layout `found` as `SCHEMA` (pyarrow's side of what
    `analytics.pipeline.read_records` does in Spark)."""
    constants = dict(found.constants)
    columns = []
    for field in SCHEMA:
        if field.name in constants:
            value = pa.scalar(constants[field.name], field.type)
            columns.append(pa.repeat(value, table.num_rows))
        else:
            columns.append(table.column(field.name).cast(field.type))
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def visible_files(root: Path) -> list[Path]:
    """The Parquet files under `root` a reader may read: hidden and `_` files are skipped, as
    Spark skips them (a file the relay is still writing is hidden, and so is one a killed
    writer left without its footer), even when `root` names one."""
    if root.is_file():
        return [] if is_hidden(root) else [root]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        found += [
            Path(folder) / name
            for name in sorted(names)
            if not name.startswith((".", "_")) and not name.endswith(".crc")
        ]
    return found


def is_hidden(path: Path) -> bool:
    """A name readers skip (`.` or `_` first), as Spark and pyarrow datasets do."""
    return path.name.startswith((".", "_"))


def read_table(root: Path) -> pa.Table:
    """Every route record under `root` (a file or a records directory, any mix of versions)
    as one table of `SCHEMA`; RecordFileError (naming the file) for a file that is not one."""
    parts = []
    for path in visible_files(root):
        try:
            found = layout(pq.read_metadata(path))
        except RecordFileError as err:
            raise RecordFileError(f"{path}: {err}") from None
        parts.append(to_schema(pq.read_table(path, columns=found.stored), found))
    return pa.concat_tables(parts) if parts else SCHEMA.empty_table()
