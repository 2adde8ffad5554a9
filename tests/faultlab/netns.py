"""Hosts as network namespaces on one bridge: the fault lab's network.

Each `Host` is a network namespace with one veth pair, its outer end on the lab's bridge in
the root namespace, so hosts reach each other and the test process (which runs the clients,
the fault proxies and the checker) reaches every host over real interfaces. A host's
processes start with `ip netns exec`. `Host.link_down()` / `link_up()` cut a host off
entirely (packets dropped, as when a cable is pulled: no RST, connects time out); the finer
cuts (one link of a host, latency, resets) are `proxy.FaultProxy` instances placed on the
links a scenario names.

Cleanup. A lab is a context manager and also registers an atexit hook: its processes are
stopped, its namespaces and bridge deleted even when the test fails or is interrupted. Every
name carries the creating process's pid (`faultlab-<pid>-<n>-<host>`, interfaces
`fl<pid hex>.<n>...`): a new lab first removes what labs of processes no longer running left
behind (a SIGKILLed run), never what a live run (another test session) is using.

IPv6. On request (`Host.add_ipv6`, `Lab.address6`) the lab also has a ULA /48 of its own,
whose /64s are on the same bridge: addresses are added `nodad` (usable at once) and a host
routes the whole /48 on its link, so a test process can bind clients to several addresses of
one /64, or of different /64s, and reach a relay on a host (per-IP limits keyed by prefix).

Why not netem: the kernel this runs on has no netem qdisc, so latency and loss come from the
userspace proxy; namespaces still give every process its own address and real cut links.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from tests.processes import relay_env, stop_processes

NS_PREFIX = "faultlab-"
IF_PREFIX = "fl"
#: the lab networks are /24s of this range, one free one per lab
NETWORKS = ipaddress.ip_network("10.213.0.0/16")
_labs = itertools.count()


class LabUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2): tests skip with this."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale() -> None:
    """Delete namespaces and interfaces of labs whose process is gone (and kill what still
    runs in those namespaces: processes of a run that was SIGKILLed)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX):
            continue
        parts = name[len(NS_PREFIX) :].split("-")
        if parts and parts[0].isdigit() and not _alive(int(parts[0])):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":")
        if len(fields) < 2:
            continue
        ifname = fields[1].strip().split("@")[0]
        if ifname.startswith(IF_PREFIX) and "." in ifname:
            owner = ifname[len(IF_PREFIX) :].split(".")[0]
            with contextlib.suppress(ValueError):
                if not _alive(int(owner, 16)):
                    _ip("link", "del", ifname, check=False)


def check_available() -> None:
    """Raise LabUnavailable with the reason when namespaces cannot be made here."""
    if shutil.which("ip") is None:
        raise LabUnavailable("iproute2 (`ip`) is not installed: `make system-deps` installs it")
    if os.geteuid() != 0:
        raise LabUnavailable("network namespaces need root (CI runs as root)")
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise LabUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def skip_unless_available() -> None:
    """For a test: skip it, saying why, where namespaces cannot be made (`check_available`)."""
    import pytest  # the bench uses this module without pytest

    try:
        check_available()
    except LabUnavailable as err:
        pytest.skip(f"fault lab unavailable: {err}")


def check_ipv6() -> None:
    """Raise LabUnavailable when this kernel has IPv6 off (`Host.add_ipv6` would fail)."""
    switch = Path("/proc/sys/net/ipv6/conf/all/disable_ipv6")
    if not switch.exists() or switch.read_text().strip() != "0":
        raise LabUnavailable("IPv6 is disabled in this kernel (net.ipv6.conf.all.disable_ipv6)")


def _free_network(seed: int) -> ipaddress.IPv4Network:
    """A /24 of `NETWORKS` no interface uses, starting at `seed` (the pid: two runs that
    start together pick apart)."""
    used = _ip("-4", "-o", "addr", "show", check=False).stdout
    nets = list(NETWORKS.subnets(new_prefix=24))
    for step in range(len(nets)):
        net = nets[(seed + step) % len(nets)]
        assert isinstance(net, ipaddress.IPv4Network)
        if f"inet {str(net.network_address).rsplit('.', 1)[0]}." not in used:
            return net
    raise LabUnavailable(f"no free /24 left in {NETWORKS}")


@dataclass
class Host:
    """One network namespace on the lab's bridge, with its processes."""

    lab: Lab
    name: str
    namespace: str
    address: str
    outer: str
    #: the interface inside the namespace
    inner: str = ""
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdout: int | IO[str] | None = subprocess.PIPE,
        stderr: int | IO[str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start `argv` inside this host (stopped with the lab)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace, *argv],
            env=relay_env(env),
            stdout=stdout,
            stderr=stderr,
            text=True,
        )
        self.processes.append(process)
        return process

    def add_ipv6(self) -> str:
        """An IPv6 address for this host in the lab's first /64 (see the module docstring)."""
        address = self.lab.address6(on=None)
        inside = ("netns", "exec", self.namespace, "ip", "-6")
        _ip(*inside, "addr", "add", f"{address}/64", "dev", self.inner, "nodad")
        _ip(*inside, "route", "replace", str(self.lab.network6), "dev", self.inner)
        return address

    def link_down(self) -> None:
        """Cut this host off (its veth down: packets dropped both ways, nothing reset)."""
        _ip("link", "set", self.outer, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.outer, "up")


class Lab:
    """A bridge and the hosts on it; see the module docstring. `with Lab() as lab:`."""

    def __init__(self) -> None:
        check_available()
        remove_stale()
        self.tag = f"{os.getpid()}-{next(_labs)}"
        self._iftag = f"{IF_PREFIX}{os.getpid():x}.{self.tag.rsplit('-', 1)[1]}"
        self.network = _free_network(os.getpid() * 7 + int(self.tag.rsplit("-", 1)[1]))
        hosts = self.network.hosts()
        self.gateway = str(next(hosts))  # the bridge's address: the test process's side
        self._addresses = hosts
        self.bridge = f"{self._iftag}br"
        self.hosts: dict[str, Host] = {}
        pid, index = os.getpid(), int(self.tag.rsplit("-", 1)[1])
        #: the lab's IPv6 /48 (ULA, from the pid and the lab's number): used once asked for
        global_id = (pid & 0xFFFFFFFF) << 8 | (index & 0xFF)
        self.network6 = ipaddress.IPv6Network((0xFD << 120 | global_id << 80, 48))
        self._next6: dict[int, int] = {}
        self._closed = False
        _ip("link", "add", self.bridge, "type", "bridge")
        atexit.register(self.close)
        _ip("addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def address(self) -> str:
        """One more address of the test process's side (on the bridge): for a proxy that
        must listen on a port another one uses already (a federated relay's domain)."""
        address = str(next(self._addresses))
        _ip("addr", "add", f"{address}/{self.network.prefixlen}", "dev", self.bridge)
        return address

    def address6(self, subnet: int = 0, *, on: str | None = "bridge") -> str:
        """One more IPv6 address in /64 number `subnet` of the lab's /48, added to the bridge
        (the test process's side: clients bind to it) unless `on` is None."""
        self._next6[subnet] = self._next6.get(subnet, 0) + 1
        first = int(self.network6.network_address) + (subnet << 64)
        address = str(ipaddress.IPv6Address(first + self._next6[subnet]))
        if on is not None:
            _ip("-6", "addr", "add", f"{address}/64", "dev", self.bridge, "nodad")
        return address

    def host(self, name: str) -> Host:
        """A new host `name` (a namespace with an address on the bridge, loopback up)."""
        index = len(self.hosts)
        namespace = f"{NS_PREFIX}{self.tag}-{name}"
        outer, inner = f"{self._iftag}v{index}", f"{self._iftag}i{index}"
        address = str(next(self._addresses))
        _ip("netns", "add", namespace)
        host = Host(self, name, namespace, address, outer, inner)
        self.hosts[name] = host
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", namespace)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        inside = ("netns", "exec", namespace, "ip")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", inner)
        _ip(*inside, "link", "set", inner, "up")
        return host

    def close(self) -> None:
        """Stop every process, delete every namespace and the bridge (idempotent)."""
        if self._closed:
            return
        self._closed = True
        stop_processes(
            [process for host in self.hosts.values() for process in host.processes], grace=5.0
        )
        for host in self.hosts.values():
            _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", self.bridge, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
