"""Pure-Python baselines the Rust core is measured against, in the same run.

These are what a Python developer would reasonably write without a native core: a
straightforward frame parser, a dict-based limiter and route table. They are correct for the
inputs the benchmarks feed them, nothing more.
"""

from __future__ import annotations

import struct


class PyFrameDecoder:
    """A plain server-side RFC 6455 decoder: masked frames, no fragmentation support beyond
    what the benchmark sends (single-frame messages)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        out: list[bytes] = []
        buf = self.buffer
        pos = 0
        n = len(buf)
        while n - pos >= 2:
            b1 = buf[pos + 1]
            length = b1 & 0x7F
            header = 2
            if length == 126:
                if n - pos < 4:
                    break
                (length,) = struct.unpack_from("!H", buf, pos + 2)
                header = 4
            elif length == 127:
                if n - pos < 10:
                    break
                (length,) = struct.unpack_from("!Q", buf, pos + 2)
                header = 10
            masked = b1 & 0x80
            if masked:
                header += 4
            if n - pos < header + length:
                break
            payload = bytes(buf[pos + header : pos + header + length])
            if masked:
                mask = buf[pos + header - 4 : pos + header]
                # unmask via int XOR (the fast pure-Python idiom)
                repeated = (bytes(mask) * (length // 4 + 1))[:length]
                payload = (
                    int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")
                ).to_bytes(length, "big")
            out.append(payload)
            pos += header + length
        del buf[:pos]
        return out


def py_encode_binary(payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        return bytes((0x82, n)) + payload
    if n < 65536:
        return struct.pack("!BBH", 0x82, 126, n) + payload
    return struct.pack("!BBQ", 0x82, 127, n) + payload


def py_mask_frame(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = bytes((0x82, 0x80 | n))
    elif n < 65536:
        head = struct.pack("!BBH", 0x82, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x82, 0x80 | 127, n)
    repeated = (mask * (n // 4 + 1))[:n]
    body = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(n, "big")
    return head + mask + body


class PyFixedWindowLimiter:
    def __init__(self, count: int, size: int, window: int = 60) -> None:
        self.count = count
        self.size = size
        self.window = window
        self.state: dict[int, list[int]] = {}

    def check(self, key: int, size: int, now: int) -> bool:
        index = now // self.window
        entry = self.state.get(key)
        if entry is None or entry[0] != index:
            entry = self.state[key] = [index, 0, 0]
        entry[1] += 1
        entry[2] += size
        return entry[1] <= self.count and entry[2] <= self.size and size <= self.size


class PyRouteTable:
    def __init__(self) -> None:
        self.sessions: dict[tuple[int, str | None], int] = {}

    def register_session(self, twin: int, sid: str | None, conn: int) -> int | None:
        old = self.sessions.get((twin, sid))
        self.sessions[(twin, sid)] = conn
        return old

    def lookup_session(self, twin: int, sid: str | None) -> int | None:
        return self.sessions.get((twin, sid))


def write_records_v1(rows: bytes, instance: str, dialect: str, path: str) -> int:
    """The route-record writer before schema version 2 (commit b8ac2ac), for the hot path's
    records: the scanners' rows arrive as one row-major `bytes` of (time_ns, src, dst, size),
    copied into an `array` as `Channel.take` did, cut into twelve columns (the constant ones as
    dictionaries of one value) and written with the options of then. Returns the rows written.
    """
    from array import array

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from rmb_relay.telemetry.record_schema import SCHEMA, SCHEMA_KEY

    local = array("q")
    local.frombytes(rows)
    grid = np.frombuffer(local, dtype=np.int64).reshape(-1, 4)
    n = len(grid)
    zeros = pa.array(np.zeros(n, dtype=np.int32))

    def const(value: object, kind: pa.DataType | None = None) -> pa.Array:
        return pa.DictionaryArray.from_arrays(zeros, pa.array([value], kind or pa.string()))

    def address(column: int) -> pa.Array:
        found = pc.dictionary_encode(pa.array(grid[:, column]))
        return pa.DictionaryArray.from_arrays(found.indices, pc.cast(found.dictionary, pa.string()))

    dict_columns = [f.name for f in SCHEMA if f.type == pa.string()] + ["relay_us", "weight"]
    write_schema = pa.schema(
        [
            pa.field(f.name, pa.dictionary(pa.int32(), f.type), f.nullable)
            if f.name in dict_columns
            else f
            for f in SCHEMA
        ]
    )
    nulls = pa.DictionaryArray.from_arrays(pa.nulls(n, pa.int32()), pa.array([], pa.string()))
    times = pc.divide(pa.array(grid[:, 0]), 1000).cast(pa.timestamp("us", tz="UTC"))
    columns = [
        times,
        const(instance),
        const(dialect),
        address(1),
        address(2),
        pa.array(grid[:, 3]),
        const("local"),
        const("delivered"),
        nulls,
        const(0, pa.int64()),
        nulls,
        const(1.0, pa.float64()),
    ]
    table = pa.Table.from_arrays(columns, schema=write_schema)
    writer = pq.ParquetWriter(
        path,
        write_schema,
        compression="lz4",
        use_dictionary=dict_columns,
        write_statistics=["time"],
        store_schema=False,
    )
    writer.add_key_value_metadata({SCHEMA_KEY: b"1"})
    writer.write_table(table)
    writer.close()
    return n
