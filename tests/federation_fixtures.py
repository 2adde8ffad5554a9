"""Real relay processes that federate over real HTTP, and remotes that misbehave.

Every relay of a test listens on its own loopback address (127.0.0.2, 127.0.0.3, ...) and the
same port, and that address is its domain: `--federation-url-template http://{domain}:PORT/`
then maps each domain to its relay with no name resolution (decision 5).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory
from tests.conftest import WAIT, free_port
from tests.helpers import eventually
from tests.processes import relay_env
from tests.rmb_fixtures import key_for
from tests.scrape import Page, scrape


async def provision(path: Path, twins: dict[int, Iterable[str]], key_type: str = "sr25519") -> str:
    """A twin directory file holding `twins` (id -> relay domains); returns its --twins value."""
    directory = SqliteTwinDirectory(path)
    directory.add_many(
        Twin(twin, key_for(twin, key_type).public_key, frozenset(relays), None)
        for twin, relays in twins.items()
    )
    await directory.close()
    return f"sqlite:{path}"


class RelayProcess:
    """`python -m rmb_relay` serving `domain` on `domain:port`."""

    def __init__(self, domain: str, port: int, twins: str, *extra: str, log: Path) -> None:
        self.domain = domain
        self.log = log
        self.port = port
        self.args = [
            sys.executable,
            "-m",
            "rmb_relay",
            "-l",
            f"{domain}:{port}",
            "--twins",
            twins,
            "-m",
            domain,
            "--twin-cache-ttl",
            "0.5",
            "--federation-url-template",
            f"http://{{domain}}:{port}/",
            "-d",
            *extra,
        ]
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> RelayProcess:
        with self.log.open("a") as log:  # the relay's log, for a failing test to show
            self.process = subprocess.Popen(
                self.args, env=relay_env(), stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self.process.stdout is not None
        banner = self.process.stdout.readline()
        assert banner.startswith("rmb-relay listening on "), banner
        return self

    @property
    def url(self) -> str:
        return f"ws://{self.domain}:{self.port}/"

    async def metrics(self) -> Page:
        return await scrape(self.domain, self.port)

    async def metric(self, name: str, **labels: str) -> float:
        try:
            return (await self.metrics()).value(name, **labels)
        except KeyError:
            return 0.0

    def kill(self) -> None:
        """SIGKILL: the crash case (nothing flushed, nothing acknowledged)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(WAIT)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(WAIT)
        if self.process.stdout is not None:
            self.process.stdout.close()


class Network:
    """Relays on 127.0.0.N sharing one port; stopped at the end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        self.relays: list[RelayProcess] = []
        self.remotes: list[BadRemote] = []

    def relay(self, domain: str, twins: str, *extra: str, start: bool = True) -> RelayProcess:
        log = self.tmp_path / f"relay-{domain}.log"
        relay = RelayProcess(domain, self.port, twins, *extra, log=log)
        self.relays.append(relay)
        return relay.start() if start else relay

    async def bad_remote(self, domain: str, mode: str) -> BadRemote:
        remote = BadRemote(mode)
        await remote.start(domain, self.port)
        self.remotes.append(remote)
        return remote

    async def close(self) -> None:
        for relay in self.relays:
            relay.stop()
        for remote in self.remotes:
            await remote.close()


class BadRemote:
    """A remote relay that fails: `503` answers every POST with 503; `hang` reads the request
    and never answers (the sender's timeout must fire)."""

    def __init__(self, mode: str) -> None:
        assert mode in ("503", "hang")
        self.mode = mode
        self.requests = 0
        self.server: asyncio.Server | None = None
        self.connections: list[asyncio.StreamWriter] = []

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests += 1
                if self.mode == "hang":
                    continue
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        for writer in self.connections:
            writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def wait_metric(relay: RelayProcess, name: str, at_least: float, **labels: str) -> None:
    async def reached() -> bool:
        return await relay.metric(name, **labels) >= at_least

    await eventually(reached, WAIT * 3)


def make_ca_and_cert(directory: Path, ip: str) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate it signs for `ip` (an IP SAN): (ca.pem,
    cert.pem, key.pem). The relay serves cert/key; the other relay trusts ca.pem only."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rmb-relay test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths
