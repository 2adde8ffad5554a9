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
