"""What becomes of an envelope handed to another instance: its route record once Redis
answered, and a refusal told to its sender as an error envelope."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from rmb_relay._core import EnvelopeRouting, scan_envelope

if TYPE_CHECKING:
    from rmb_relay.telemetry.records import Channel

log = logging.getLogger("rmb_relay.rmb")


class Sender(Protocol):
    """The session that sent a forwarded envelope (`RmbSession`)."""

    @property
    def twin(self) -> int: ...

    def fail(
        self,
        env: EnvelopeRouting,
        reason: str,
        label: str,
        size: int = 0,
        received: int | None = None,
    ) -> None: ...


#: `RmbDialect.fail_source`: tell the session that sent `env` (found by its source) it failed
FailSource = Callable[[EnvelopeRouting, str, str, int], None]
#: `Later.hold`: keep an envelope nobody can be told about for another try (True: kept); its
#: first argument is the `sender` the forward was made with (the dialect's own session type)
Later = Callable[[Any, EnvelopeRouting, bytes], bool]


class ClusterForward:
    """An envelope queued for another instance's stream (`switch.QueuedForward`): its route
    record is written when Redis answered, once, with how it ended; a refusal goes to the
    sender as an error envelope (and is that one record)."""

    __slots__ = ("data", "env", "later", "received", "records", "sender", "size")

    def __init__(
        self,
        records: Channel | None,
        sender: Sender,
        env: EnvelopeRouting,
        data: bytes,
        received: int | None,
        later: Later | None = None,
    ) -> None:
        self.records = records
        self.sender = sender
        self.env = env
        self.data = data
        self.size = len(data)
        self.received = received
        self.later = later

    def settled(self, route: str, outcome: str, reason: str | None = None) -> None:
        records = self.records
        if records is not None:
            env = self.env
            records.add(
                self.sender.twin, env.dest_twin, self.size, route, outcome, reason,
                received=self.received,
            )  # fmt: skip

    def refused(self, err: BaseException) -> None:
        env = self.env
        if self.later is not None and self.later(self.sender, env, self.data):
            return  # nobody to refuse it to: tried again (later.py)
        log.warning("redis unavailable, refusing envelope for %s: %s", env.dest_twin, err)
        self.sender.fail(
            env, "destination unreachable: the relay's redis is unavailable", "redis down",
            self.size, self.received,
        )  # fmt: skip


class CrossedForward:
    """An envelope the fast path queued for another instance (rust/crossing.rs), handed back
    by the cluster with its outcome only when that was not "stored" (`Cluster._crossed`):
    the sender is found again by the envelope's source, which the scanner checked was the
    sending session, and told as `ClusterForward` tells it."""

    __slots__ = ("data", "env", "fail_source", "later", "records")

    def __init__(
        self,
        records: Channel | None,
        fail_source: FailSource,
        data: bytes,
        later: Callable[[EnvelopeRouting, bytes], bool] | None = None,
    ) -> None:
        self.records = records
        self.fail_source = fail_source
        self.data = data
        self.env = scan_envelope(data)
        self.later = later

    def settled(self, route: str, outcome: str, reason: str | None = None) -> None:
        records = self.records
        if records is not None:
            env = self.env
            records.add(env.source_twin, env.dest_twin, len(self.data), route, outcome, reason)

    def refused(self, err: BaseException) -> None:
        env = self.env
        if self.later is not None and self.later(env, self.data):
            return  # nobody to refuse it to: tried again (later.py)
        log.warning("redis unavailable, refusing envelope for %s: %s", env.dest_twin, err)
        self.fail_source(
            env, "destination unreachable: the relay's redis is unavailable", "redis down",
            len(self.data),
        )  # fmt: skip
