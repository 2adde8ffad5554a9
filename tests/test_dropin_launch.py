"""Issue 34: every public launch line of rmb-rs's relay (its docs/readme.md and Helm chart) and
seed 000's starts our relay unchanged, which then serves a probe, a real login and a message.

Only the hosts are stand-ins: the tfchain nodes are `rmb-relay devchain`, the Redis a real
redis-server with the chart's password, and ports are free ones (the chart's `-l 0.0.0.0:80`
keeps its interface). Each line is written here as the public text has it, hosts substituted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from pathlib import Path

import pytest

from rmb_relay.commands import serve
from rmb_relay.identity import signing_key
from rmb_relay.peer.cli import parse_args
from rmb_relay.sdk import IncomingRequest, RmbClient
from rmb_relay.server.limits import default_max_connections
from tests.conftest import WAIT, start_redis
from tests.dropin_fixtures import Launched, add_local_twin, banner_port, get, launch
from tests.helpers import eventually
from tests.peer_fixtures import mnemonic_for
from tests.scrape import scrape
from tests.tfchain_fixtures import put_twin, start_devchain

#: the Helm chart's values.yaml
CHART_DOMAIN = "relay.dev.grid.tf"
CHART_REDIS_PASSWORD = "redis-password"
CHART_USER_PER_WORKER = "1000"
CHART_WORKERS = "500"


def twin_client(twin: int) -> RmbClient:
    return RmbClient(twin, signing_key(mnemonic_for(twin)))


async def echo_twin(url: str, twin: int) -> RmbClient:
    """Twin `twin` logged in, answering every request with its payload reversed."""
    client = twin_client(twin)

    def reverse(request: IncomingRequest) -> bytes:
        return request.data[::-1]

    client.handle_all(reverse)
    await client.open(url)
    return client


async def exchange_through(port: int, sender: int, receiver: int) -> None:
    """The probe the Helm chart runs, then `sender` asks `receiver` (online) and gets the reply."""
    assert (await get(port, "/metrics"))[0] == 200
    url = f"ws://127.0.0.1:{port}/"
    bob = await echo_twin(url, receiver)
    alice = twin_client(sender)
    await alice.open(url)
    try:
        reply = await alice.request(receiver, "echo", b"launch line", timeout=WAIT)
        assert reply.data == b"enil hcnual"
    finally:
        await alice.close()
        await bob.close()


async def mailbox_through(port: int, sender: int, receiver: int) -> None:
    """`receiver` is offline: a request to it is kept (its relay domain is one of ours, so it
    is local, not federated) and answered once it logs in."""
    url = f"ws://127.0.0.1:{port}/"
    alice = twin_client(sender)
    await alice.open(url)
    try:
        pending = asyncio.ensure_future(alice.request(receiver, "later", b"kept", timeout=WAIT))

        async def kept() -> bool:
            page = await scrape("127.0.0.1", port)
            return page.value("rmb_relay_mailbox_depth") >= 1

        await eventually(kept)  # in the mailbox, not federated to the domain's host
        bob = await echo_twin(url, receiver)
        try:
            assert (await pending).data == b"tpek"
        finally:
            await bob.close()
    finally:
        await alice.close()


def stopped(relay: Launched) -> None:
    assert relay.stop() == 0, "\n".join(relay.output.lines[-30:])


@pytest.mark.parametrize(
    "line",
    [
        # seed 000, "multiple domains"
        "rmb-relay --domain relay.example.com relay1.example.com",
        # rmb-rs docs/readme.md, "Relay Domains"
        "rmb-relay --domain relay.example.com --domain relay1.example.com",
        "rmb-relay -m relay.example.com -m relay1.example.com",
    ],
)
async def test_multiple_domain_lines_make_both_domains_local(tmp_path: Path, line: str) -> None:
    add_local_twin(tmp_path, 1, "relay.example.com")
    add_local_twin(tmp_path, 2, "relay1.example.com")
    relay = launch([*line.split(), "-l", "127.0.0.1:0"], data_home=tmp_path)
    try:
        port = banner_port(relay)
        await exchange_through(port, 2, 1)
        await mailbox_through(port, 1, 2)  # twin 2's relay is relay1.example.com: local too
    finally:
        stopped(relay)


async def test_readme_ranker_line_with_a_chain(tmp_path: Path) -> None:
    """docs/readme.md, "Federations": `--substrate wss://tfchain.dev.grid.tf:443 --domain
    r1.3x0.me --ranker-period 1800`, the chain a devchain."""
    chain = start_devchain(tmp_path / "chain.sqlite3")
    try:
        for twin in (1, 2):
            put_twin(chain.url, twin, "r1.3x0.me")
        line = f"rmb-relay --substrate {chain.url} --domain r1.3x0.me --ranker-period 1800"
        relay = launch([*line.split(), "-l", "127.0.0.1:0"], data_home=tmp_path)
        try:
            port = banner_port(relay)
            await exchange_through(port, 1, 2)
            await mailbox_through(port, 2, 1)
        finally:
            stopped(relay)
    finally:
        chain.stop()


async def test_helm_chart_line(tmp_path: Path) -> None:
    """charts/rmb-relay/templates/deployment.yaml with values.yaml's values: `--domain D -r
    redis://:PW@HOST:6379 -s URL -u 1000 -w 500 -l 0.0.0.0:80`, readiness on GET /metrics."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    redis = start_redis(str(redis_dir), extra=("--requirepass", CHART_REDIS_PASSWORD))
    chain = start_devchain(tmp_path / "chain.sqlite3")
    try:
        for twin in (1, 2):
            put_twin(chain.url, twin, CHART_DOMAIN)
        command = [
            "rmb-relay",
            "--domain",
            CHART_DOMAIN,
            "-r",
            f"redis://:{CHART_REDIS_PASSWORD}@127.0.0.1:{redis.port}",
            "-s",
            chain.url,
            "-u",
            CHART_USER_PER_WORKER,
            "-w",
            CHART_WORKERS,
            "-l",
            "0.0.0.0:0",
        ]
        relay = launch(command, data_home=tmp_path)
        try:
            port = banner_port(relay)
            await exchange_through(port, 1, 2)
            await mailbox_through(port, 2, 1)  # the mailbox is the chart's Redis
        finally:
            stopped(relay)
        assert relay.output.count("rmb-relay listening on") == 1, "-w 500 forked relays"
    finally:
        chain.stop()
        redis.stop()


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


async def test_old_workers_flag_sizes_the_pool_and_never_forks(tmp_path: Path) -> None:
    """`--workers N` is rmb-rs's pool size now: a unit file with `--workers 500` (either
    meaning) runs one relay process; several processes are `--processes N`."""
    relay = launch(["rmb-relay", "--workers", "500", "-l", "127.0.0.1:0"], data_home=tmp_path)
    try:
        port = banner_port(relay)
        assert (await get(port, "/health"))[0] == 200
        assert children_of(relay.popen.pid) == []
    finally:
        stopped(relay)


def limit_of(*argv: str) -> int | None:
    args: argparse.Namespace = serve.parser().parse_args(list(argv))
    return serve.connection_limit(args)


def test_workers_times_users_is_the_connection_limit() -> None:
    assert limit_of("-w", "2", "-u", "3") == 6
    assert limit_of("--workers", "4", "--user-per-worker", "10", "--max-connections", "30") == 30
    # rmb-rs's defaults (500 x 1000) leave the listener's own default in charge when it is lower
    expected = None if default_max_connections() <= 500 * 1000 else 500 * 1000
    assert limit_of() == expected
    for flags in (["-w", "0"], ["-u", "0"]):
        with pytest.raises(Exception, match="cannot be zero"):
            limit_of(*flags)


async def test_connections_beyond_workers_times_users_are_refused(tmp_path: Path) -> None:
    """rmb-rs refuses users past `workers x user_per_worker`; so do we (the listener's limit:
    operations-only slots, then 503)."""
    relay = launch(["rmb-relay", "-w", "1", "-u", "2", "-l", "127.0.0.1:0"], data_home=tmp_path)
    try:
        port = banner_port(relay)
        held = []
        for _ in range(2 + 32):  # each counted before the next: it got its answer
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append((reader, writer))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"ok\n"), WAIT)
        try:
            # refused at once, before any request is read
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), WAIT)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503"), answer
        finally:
            for _, writer in held:
                writer.close()
    finally:
        stopped(relay)


def test_domain_and_substrate_take_several_values_and_repeat() -> None:
    args = serve.parser().parse_args(
        ["--domain", "a", "b", "-m", "c", "-s", "ws://x:1", "ws://y:2", "--substrate", "ws://z:3"]
    )
    assert args.domain == ["a", "b", "c"]
    assert args.substrate == ["ws://x:1", "ws://y:2", "ws://z:3"]
    args = serve.parser().parse_args(["-d", "-d", "-p", "1800", "--limit", "10", "2048"])
    assert (args.debug, args.ranker_period, args.limit) == (2, 1800, [10, 2048])


@pytest.mark.parametrize(
    ("line", "substrate", "relays"),
    [
        # docs/readme.md, "Substrate connections"
        (
            'rmb-peer -m "{M}" --substrate wss://tfchain.grid.tf:443 '
            "--substrate wss://02.tfchain.grid.tf:443 --substrate wss://03.tfchain.grid.tf:443",
            (
                "wss://tfchain.grid.tf:443",
                "wss://02.tfchain.grid.tf:443",
                "wss://03.tfchain.grid.tf:443",
            ),
            ("wss://relay.grid.tf:443",),
        ),
        # docs/readme.md, "Relay connections"
        (
            'rmb-peer -m "{M}" --substrate wss://tfchain.dev.grid.tf:443 '
            "--relay wss://r1.dev.grid.tf --relay wss://r2.dev.grid.tf",
            ("wss://tfchain.dev.grid.tf:443",),
            ("wss://r1.dev.grid.tf", "wss://r2.dev.grid.tf"),
        ),
        # the defaults alone
        ('rmb-peer -m "{M}"', ("wss://tfchain.grid.tf:443",), ("wss://relay.grid.tf:443",)),
    ],
)
def test_peer_readme_lines_parse_as_upstream(
    line: str, substrate: tuple[str, ...], relays: tuple[str, ...]
) -> None:
    argv = shlex.split(line.replace("{M}", mnemonic_for(1)))[1:]
    config = parse_args(argv)
    assert (config.substrate, config.relays) == (substrate, relays)
