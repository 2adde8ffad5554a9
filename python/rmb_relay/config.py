"""The listener's configuration (`ListenerConfig`, built from `rmb-relay serve`'s flags in
commands/serve.py) and the parsing of a listen address.

Every default here is the documented default; `--help` prints them from these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from rmb_relay.errors import ConfigError

#: a request head larger than this is refused with 431 (a security limit, as in most servers)
DEFAULT_MAX_HTTP_HEAD = 16 * 1024
#: largest websocket message / HTTP body accepted (RMB decision 4: `--max-message`, 1 MiB)
DEFAULT_MAX_MESSAGE = 1 << 20
#: per-connection write buffer above which senders to it are paused (backpressure)
DEFAULT_WRITE_HIGH_WATER = 1 << 20
#: an HTTP connection waiting this long for a request head (its first, or the next one on a
#: keep-alive connection) is closed, with 408 when part of a head came; it also bounds each wait
#: for request-body bytes and for the client to read a streamed response
DEFAULT_HTTP_IDLE_TIMEOUT = 30.0
#: a handler that has not started its response this long after the request head is cut off
#: with 503 (time spent waiting for the client's body does not count); covers a dialect's
#: websocket `accept` too. Above the SBD auth hook's 10 s, so the hook's own error wins.
DEFAULT_HTTP_REQUEST_TIMEOUT = 30.0
#: open connections of one client IP (`server/limits.py`): far above one host's honest needs
#: (a load generator, a NAT with many twins), far below what it takes to starve everyone else
DEFAULT_MAX_CONNECTIONS_PER_IP = 4096
#: how long we wait for the peer's close frame before dropping TCP
DEFAULT_CLOSE_TIMEOUT = 5.0
#: how long a closed connection may keep output its peer has not read (then it is dropped): a
#: peer that stops reading (a zero TCP window) acknowledges the kernel's probes, so TCP never
#: gives up on it and the connection would hold its buffer and descriptor for ever. Longer than
#: the SDK's KEEP_READING (300 s: a client that gave a connection up for silence still reads
#: it that long) plus a 30 s margin, so a slow but honest reader gets what was queued for it
DEFAULT_CLOSE_LINGER = 330.0
#: how long a graceful shutdown waits for connections to finish their close handshake
DEFAULT_SHUTDOWN_TIMEOUT = 5.0


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (all interfaces) into (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ConfigError(f"listen address {text!r} must be HOST:PORT (e.g. 127.0.0.1:8080)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"listen address {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"listen address {text!r}: port must be 0-65535")
    return host or "::", port


@dataclass(slots=True)
class ListenerConfig:
    """What the shared listener needs, whatever dialects it serves."""

    host: str = "127.0.0.1"
    port: int = 8080
    tls_cert: str | None = None
    tls_key: str | None = None
    reuse_port: bool = False
    max_http_head: int = DEFAULT_MAX_HTTP_HEAD
    max_message: int = DEFAULT_MAX_MESSAGE
    write_high_water: int = DEFAULT_WRITE_HIGH_WATER
    http_idle_timeout: float = DEFAULT_HTTP_IDLE_TIMEOUT
    http_request_timeout: float = DEFAULT_HTTP_REQUEST_TIMEOUT
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT
    close_linger: float = DEFAULT_CLOSE_LINGER
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    #: open connections served normally (None: the file-descriptor limit minus a reserve,
    #: `server/limits.py`); a few more get /health and /metrics only, the rest 503
    max_connections: int | None = None
    #: open connections of one client IP; more are answered 429 and closed
    max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP
    #: IPv6 clients sharing this prefix count as one IP for the per-IP caps (throttle.py)
    ipv6_prefix: int = 64
    #: (host, port) of the operations listener (`--metrics-listen`): /health, /metrics and
    #: /monitor/ are served there, and no longer on the public one; None: on the public one
    metrics_listen: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        if self.max_message < 1024:
            raise ConfigError("--max-message must be at least 1024 bytes")
        if (
            self.max_connections is not None and self.max_connections <= 0
        ) or self.max_connections_per_ip <= 0:
            raise ConfigError("--max-connections and --max-connections-per-ip must be positive")
        if not 0 <= self.ipv6_prefix <= 128:
            raise ConfigError("--ipv6-prefix must be 0-128")
        for name in ("http_idle_timeout", "http_request_timeout", "close_timeout", "close_linger"):
            if not getattr(self, name) > 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive number of seconds")
