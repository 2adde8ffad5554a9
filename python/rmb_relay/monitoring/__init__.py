"""Live monitoring: JSON views of the relay for operators, and `rmb-relay top` to watch them.

Served where `/metrics` is (with `--metrics-listen`, that operations listener only; else the
public listener) and protected the same way (an operations-only connection over the connection
cap is served these too). Each view reads the relay's own books when asked: nothing runs
while nobody looks.

- `GET /monitor/`: the routes below (endpoints.py, which serves them all);
- `GET /monitor/server`: version, uptime, CPU, RSS, connections per dialect, traffic totals
  and rates, mailbox depth, every budget's use (server/traffic.py, process.py, sections.py);
- `GET /monitor/connections`: a row per connection, sorted, filtered, paged (connections.py,
  identity.py);
- `GET /monitor/federation`: peer relays (accepted, failed, the ranker's score), the outbound
  queue's depth and age (sections.py);
- `GET /monitor/tunnel`: tenants (connectors, requests in flight and queued) (sections.py);
- `GET /monitor/cluster`: instances and their liveness, presence held here (sections.py).

`rmb-relay top` (top.py) draws them in a terminal.

The per-connection counters are kept by the connections themselves (server/connection_base.py,
the Rust decoder and outboxes): docs/monitoring.md says what they cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay.server.http import Router
    from rmb_relay.server.listener import RelayServer

__all__ = ["add_monitor_routes"]


def add_monitor_routes(router: Router, server: RelayServer) -> None:
    """Register every `/monitor/` route of `server` on `router`."""
    from rmb_relay.monitoring.endpoints import Monitor

    Monitor(server).add_routes(router)
