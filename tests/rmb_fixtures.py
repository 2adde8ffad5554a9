"""Building blocks for RMB tests: twins with real keys, a relay with the RMB dialect, clients."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmb_relay._core import SigningKey
from rmb_relay.dialects.rmb import RmbDialect, RmbSettings
from rmb_relay.mailbox import Mailbox
from rmb_relay.sdk import RmbClient
from rmb_relay.server.listener import RelayServer
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.twins import Twin
from rmb_relay.twins.cache import CachedTwinDirectory
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import StartRelay
from tests.helpers import FakeClock as HandClock


def key_for(twin: int, key_type: str = "sr25519") -> SigningKey:
    """A deterministic test key per twin."""
    seed = hashlib.sha256(f"rmb-relay test twin {twin}".encode()).digest()
    return SigningKey.sr25519(seed) if key_type == "sr25519" else SigningKey.ed25519(seed)


class FakeClock(HandClock):
    """Unix time in nanoseconds the test moves by hand; starts at the real time, on a whole
    second, so JWTs look normal."""

    def __init__(self) -> None:
        super().__init__(int(time.time()) * 1_000_000_000)


@dataclass
class RmbRelay:
    server: RelayServer
    dialect: RmbDialect
    directory: SqliteTwinDirectory
    clients: list[RmbClient] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url + "/"

    async def client(
        self, twin: int, sid: str | None = None, key_type: str = "sr25519", **kwargs: Any
    ) -> RmbClient:
        client = await RmbClient.connect(self.url, twin, key_for(twin, key_type), sid=sid, **kwargs)
        self.clients.append(client)
        return client

    async def close_clients(self) -> None:
        for client in self.clients:
            await client.close()


async def start_rmb_relay(
    start_relay: StartRelay,
    tmp_path: Path,
    *,
    twins: dict[int, str] | None = None,
    relays: dict[int, frozenset[str] | None] | None = None,
    settings: RmbSettings | None = None,
    mailbox: Mailbox | None = None,
    clock: Callable[[], int] = time.time_ns,
    db_name: str = "twins.sqlite3",
    **listener: Any,
) -> RmbRelay:
    """A relay with the RMB dialect and an embedded directory holding `twins` (id -> key type)."""
    directory = SqliteTwinDirectory(tmp_path / db_name)
    for twin_id, key_type in (twins or {1: "sr25519", 2: "ed25519", 3: "sr25519"}).items():
        directory.add(
            Twin(
                twin_id,
                key_for(twin_id, key_type).public_key,
                (relays or {}).get(twin_id, frozenset({"relay.test"})),
                None,
            )
        )
    registry = Registry()
    dialect = RmbDialect(
        settings or RmbSettings(),
        CachedTwinDirectory(directory, ttl=0.0, negative_ttl=0.0),
        registry,
        mailbox=mailbox,
        clock=clock,
    )
    listener.setdefault("host", "127.0.0.1")
    server = await start_relay([dialect], registry=registry, **listener)
    return RmbRelay(server, dialect, directory)
