"""Connection caps of the listener: how many TCP connections the relay holds in all and per
client IP, so a flood of idle sockets from anyone cannot exhaust file descriptors and make
`/health` hang.

Theory of operation
-------------------
Every accepted connection is counted (by `admit`, until `release`). Up to `max_connections`
they are served normally. The next `OPS_RESERVE` connections are *operations-only*: they get
`/health` and `/metrics` (a load balancer still sees the truth) and a 503 for anything else.
Beyond that, and beyond `max_connections_per_ip` for one address, a connection is answered at
once with 503 or 429 and closed, without reading its request. The default `max_connections`
leaves `FD_RESERVE` file descriptors of the process limit for everything else (Redis, the
twin directory, logs, outbound HTTP), so the relay refuses before `accept` itself fails.

Crossing into and out of the cap is logged once each way (not once per refused socket, which
would turn a flood into a log flood); every refusal is counted in
`rmb_relay_connections_refused_total{reason}`.
"""

from __future__ import annotations

import enum
import logging
import resource

from rmb_relay.config import DEFAULT_MAX_CONNECTIONS_PER_IP

__all__ = ["DEFAULT_MAX_CONNECTIONS_PER_IP", "OPS_PATHS", "Admission", "ConnectionLimits"]

log = logging.getLogger("rmb_relay.server")

#: file descriptors left for everything that is not a client connection
FD_RESERVE = 256
#: connections over `max_connections` that may still be served `/health` and `/metrics`
OPS_RESERVE = 32


class _OpsPaths(frozenset[str]):
    """/health, /metrics and every monitoring route (monitoring/: under /monitor/)."""

    def __contains__(self, path: object) -> bool:
        return super().__contains__(path) or str(path).startswith("/monitor/")


#: the paths an operations-only connection is served
OPS_PATHS = _OpsPaths(("/health", "/metrics"))


def default_max_connections() -> int:
    """The process's file-descriptor limit minus what the relay needs for everything else."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft - FD_RESERVE - OPS_RESERVE)


class Admission(enum.Enum):
    SERVE = "serve"
    OPS_ONLY = "operations only"
    FULL = "limit"
    IP_FULL = "per-ip limit"


class ConnectionLimits:
    """Counts connections in all and per IP and decides each new one's `Admission`."""

    def __init__(self, max_connections: int, max_per_ip: int) -> None:
        self.max_connections = max_connections
        self.max_per_ip = max_per_ip
        self.total = 0
        self.by_ip: dict[str, int] = {}
        self.refused: dict[str, int] = {Admission.FULL.value: 0, Admission.IP_FULL.value: 0}
        self._at_cap = False

    def admit(self, ip: str) -> Admission:
        """Count a new connection from `ip` (always: `release` it when it closes)."""
        per_ip = self.by_ip.get(ip, 0)
        self.total += 1
        self.by_ip[ip] = per_ip + 1
        if per_ip >= self.max_per_ip:
            self.refused[Admission.IP_FULL.value] += 1
            return Admission.IP_FULL
        if self.total <= self.max_connections:
            return Admission.SERVE
        if not self._at_cap:
            self._at_cap = True
            log.warning(
                "connection cap of %d reached: new connections get /health and /metrics only, "
                "then are refused",
                self.max_connections,
            )
        if self.total <= self.max_connections + OPS_RESERVE:
            return Admission.OPS_ONLY
        self.refused[Admission.FULL.value] += 1
        return Admission.FULL

    def release(self, ip: str) -> None:
        self.total -= 1
        left = self.by_ip[ip] - 1
        if left:
            self.by_ip[ip] = left
        else:
            del self.by_ip[ip]
        if self._at_cap and self.total < self.max_connections:
            self._at_cap = False
            log.warning("back under the connection cap (%d open)", self.total)
