"""Opcodes and the frames the gateway sends (spec §2, §3; decision 2).

Every frame carries `op`, `d`, `t` and `ts` (server milliseconds); `t` is null except for op 4.
Server dispatches carry `d = {"target": null, "nonce": ..., "payload": ...}`. The builders
return `Struct`s so the ETF codec sends the envelope's keys as atoms, as the public server's
structs reach an Elixir client; JSON and msgpack see plain maps.
"""

from __future__ import annotations

import enum
from typing import Any

from rmb_relay.dialects.singyeong.etf import Struct


class Op(enum.IntEnum):
    HELLO = 0
    IDENTIFY = 1
    READY = 2
    INVALID = 3
    DISPATCH = 4
    HEARTBEAT = 5
    HEARTBEAT_ACK = 6
    GOODBYE = 7
    ERROR = 8


def frame(op: int, d: Any, ts: int, t: str | None = None) -> Struct:
    return Struct(op=op, d=d, t=t, ts=ts)


def hello(heartbeat_interval_ms: int, ts: int) -> Struct:
    return frame(Op.HELLO, Struct(heartbeat_interval=heartbeat_interval_ms), ts)


def ready(client_id: str, restricted: bool, ts: int) -> Struct:
    return frame(Op.READY, Struct(client_id=client_id, restricted=restricted), ts)


def invalid(error: str, ts: int, extra_info: Any = None) -> Struct:
    """Op 3: non-fatal, the socket stays open."""
    return frame(Op.INVALID, Struct(error=error, extra_info=extra_info), ts)


def error(error: str, ts: int, extra_info: Any = None) -> Struct:
    """Op 8: fatal, the gateway closes the socket right after it."""
    return frame(Op.ERROR, Struct(error=error, extra_info=extra_info), ts)


def heartbeat_ack(client_id: str | None, ts: int) -> Struct:
    return frame(Op.HEARTBEAT_ACK, Struct(client_id=client_id), ts)


def dispatch(event: str, payload: Any, ts: int, nonce: Any = None, **extra: Any) -> Struct:
    """Op 4 from the server. `extra` keys sit beside target/nonce/payload for the events whose
    public-server shape had them at the top of `d` (QUEUE_CONFIRM's `queue`, QUERY_NODES'
    `nodes`), so clients written against either shape read them."""
    return frame(Op.DISPATCH, Struct(target=None, nonce=nonce, payload=payload, **extra), ts, event)
