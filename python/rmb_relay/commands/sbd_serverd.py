"""`rmb-relay sbd-serverd [flags]`: holochain's `sbd-serverd` (sbd-server 0.4.0) command line,
so its unit files and the tooling that waits for its stdout run us unchanged.

The flags are sbd-server's, with its defaults; each maps onto one of ours (docs/dropin.md has
the table) and the relay that runs is `rmb-relay serve` with those flags, the tunnel and the
신경 gateway off: one implementation of SBD, whichever command line started it. RMB stays on the
listener (it is not an option of the relay), standalone, on its own `GET /?<jwt>` path.

Stdout is sbd-serverd's: `#sbd-serverd#note# <config>`, one `#sbd-serverd#listening# ADDR` per
bound address, then `#sbd-serverd#ready#`. As sbd-server, every `--bind` is an IP literal and
port; binds after the first that ask for port 0 get the first one's port when it is free. Without
any `--bind` sbd-server listens nowhere, which is never what was meant: we refuse, saying so.
The backchannel (`--back-*`) and TLS reload (`--watch-reload-tls-dir`) of its `unstable`
feature are refused: a launch line that needs them cannot be served as it means.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from collections.abc import Callable, Sequence

from rmb_relay.cli_support import HelpFormatter
from rmb_relay.errors import ConfigError
from rmb_relay.server.acceptor import Acceptor, bind_sockets
from rmb_relay.server.http_connection import HttpConnection
from rmb_relay.server.listener import RelayServer

NAME = "sbd-serverd"
HELP = "the SBD relay with sbd-server 0.4.0's flags and stdout lines (sbd-serverd)"

log = logging.getLogger("rmb_relay")

#: sbd-server 0.4.0's defaults (rust/sbd-server/src/config.rs)
DEF_LIMIT_CLIENTS = 32768
DEF_LIMIT_IP_KBPS = 1000
DEF_LIMIT_IP_BYTE_BURST = 16 * 16 * 1024
DEF_LIMIT_IDLE_MILLIS = 10_000
DEF_IP_DENY_S = 600
DEF_IP_DENY_DIR = "."
#: sbd-server blocks forever with `--ip-deny-s 0`; ours takes seconds, so a century
FOREVER_S = 100 * 365 * 24 * 3600


def parser(prog: str = "rmb-relay sbd-serverd") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Configure and execute an SBD server (sbd-server 0.4.0's flags, served by "
        "rmb-relay's SBD dialect).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--cert-pem-file", metavar="PATH", help="TLS certificate path (pem)")
    p.add_argument("--priv-key-pem-file", metavar="PATH", help="TLS private key path (pem)")
    p.add_argument(
        "--bind",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="bind to this interface and port (repeatable), e.g. 127.0.0.1:0 or [::1]:443",
    )
    p.add_argument(
        "--trusted-ip-header", metavar="NAME", help="take the client IP from this header"
    )
    p.add_argument(
        "--ip-deny-dir",
        default=DEF_IP_DENY_DIR,
        metavar="DIR",
        help="accepted; blocked IPs are kept in memory, not in files",
    )
    p.add_argument(
        "--ip-deny-s",
        type=int,
        default=DEF_IP_DENY_S,
        metavar="SECONDS",
        help="how long to block an IP that broke its rate limit (0: for good)",
    )
    p.add_argument(
        "--bind-prometheus",
        metavar="IP:PORT",
        help="also serve GET /metrics (and the relay) on this address",
    )
    p.add_argument(
        "--limit-clients", type=int, default=DEF_LIMIT_CLIENTS, help="limit client connections"
    )
    p.add_argument(
        "--disable-rate-limiting",
        action="store_true",
        help="no rate limit (clients hear the lowest lbrt)",
    )
    p.add_argument(
        "--limit-ip-kbps",
        type=int,
        default=DEF_LIMIT_IP_KBPS,
        help="rate limit per IP in kilobits per second",
    )
    p.add_argument(
        "--limit-ip-byte-burst",
        type=int,
        default=DEF_LIMIT_IP_BYTE_BURST,
        help="bytes an IP may burst beyond its rate",
    )
    p.add_argument(
        "--limit-idle-millis",
        type=int,
        default=DEF_LIMIT_IDLE_MILLIS,
        help="close a connection idle this long",
    )
    p.add_argument(
        "--authentication-hook-server",
        metavar="URL",
        help="spec-auth hook server: PUT /authenticate bodies are forwarded there",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="accepted; metrics are served as Prometheus text (GET /metrics), not pushed",
    )
    for unsupported in ("--watch-reload-tls-dir", "--back-bind", "--back-allow-ip", "--back-open"):
        p.add_argument(unsupported, action="append", default=[], help=argparse.SUPPRESS)
    return p


def parse_bind(text: str) -> tuple[str, int]:
    """An sbd-server bind (a Rust SocketAddr: `IP:PORT`, `[V6]:PORT`) as (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
        port = int(port_text)
        if not sep or not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--bind {text!r}: must be IP:PORT, e.g. 127.0.0.1:0 or [::1]:443"
        ) from None
    return host, port


def listen_text(host: str, port: int) -> str:
    """What sbd-serverd prints for a bound address (Rust's SocketAddr Debug form)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The `rmb-relay serve` flags that run what `args` asks for. Raises ConfigError."""
    for flag in ("watch_reload_tls_dir", "back_bind", "back_allow_ip", "back_open"):
        if getattr(args, flag):
            name = "--" + flag.replace("_", "-")
            raise ConfigError(
                f"{name} (sbd-server's unstable backchannel/TLS reload) is not supported"
            )
    if not args.bind:
        raise ConfigError("give at least one --bind IP:PORT (sbd-server listens nowhere without)")
    if (args.cert_pem_file is None) != (args.priv_key_pem_file is None):
        raise ConfigError("--cert-pem-file and --priv-key-pem-file go together")
    host, port = parse_bind(args.bind[0])
    argv = [
        "-l",
        listen_text(host, port),
        "--no-tunnel",
        "--no-singyeong",
        "--sbd-limit-clients",
        str(args.limit_clients),
        "--sbd-kbps",
        str(args.limit_ip_kbps),
        "--sbd-burst",
        str(args.limit_ip_byte_burst),
        "--sbd-idle-ms",
        str(args.limit_idle_millis),
        "--sbd-block-secs",
        str(args.ip_deny_s or FOREVER_S),
    ]
    if args.disable_rate_limiting:
        argv.append("--sbd-disable-rate-limit")
    if args.trusted_ip_header:
        argv += ["--trusted-ip-header", args.trusted_ip_header]
    if args.authentication_hook_server:
        argv += ["--sbd-auth-hook", args.authentication_hook_server]
    if args.cert_pem_file:
        argv += ["--tls-cert", args.cert_pem_file, "--tls-key", args.priv_key_pem_file]
    return argv


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def announcer(args: argparse.Namespace) -> Callable[[RelayServer], None]:
    """The `announce` step of `serve`: bind the other `--bind`s (and `--bind-prometheus`) on
    the same relay, then print sbd-serverd's lines."""
    extra = [parse_bind(text) for text in args.bind[1:]]
    prometheus = parse_bind(args.bind_prometheus) if args.bind_prometheus else None

    def announce(server: RelayServer) -> None:
        first_port = server.addresses[0][1]
        bound = list(server.addresses)
        ssl_context = server.acceptors[0].ssl_context if server.acceptors else None
        for host, port in extra:
            sockets = []
            if port == 0:
                try:  # sbd-server: later port-0 binds share the first one's port when they can
                    sockets = bind_sockets(host, first_port, reuse_port=False)
                except OSError:
                    sockets = []
            sockets = sockets or bind_sockets(host, port, reuse_port=False)
            acceptor = Acceptor(sockets, lambda: HttpConnection(server), ssl_context=ssl_context)
            acceptor.start()
            server.acceptors.append(acceptor)
            bound += [sock.getsockname()[:2] for sock in sockets]
        if prometheus is not None:
            sockets = bind_sockets(*prometheus, reuse_port=False)
            acceptor = Acceptor(sockets, lambda: HttpConnection(server), ssl_context=None)
            acceptor.start()
            server.acceptors.append(acceptor)
            for host, port in (sock.getsockname()[:2] for sock in sockets):
                log.info("sbd-serverd: GET /metrics also on %s", listen_text(host, port))
        for host, port in bound:
            _say(f"#sbd-serverd#listening# {listen_text(host, port)}")
        _say("#sbd-serverd#ready#")

    return announce


def main(argv: Sequence[str], prog: str = "rmb-relay sbd-serverd") -> int:
    from rmb_relay.commands import serve

    args = parser(prog).parse_args(argv)
    try:
        flags = serve_argv(args)
        announce = announcer(args)
    except ConfigError as err:
        raise SystemExit(f"{prog}: {err}") from None
    if args.otlp_endpoint:
        log.warning("sbd-serverd: --otlp-endpoint ignored; scrape GET /metrics instead")
    _say(f"#sbd-serverd#note# {vars(args)}")
    return serve.main(flags, prog, announce=announce)
