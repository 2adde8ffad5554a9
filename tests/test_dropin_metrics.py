"""Issue 34: a scrape has every rmb-rs metric name, with rmb-rs's types and labels, and values
that move with traffic (two real relay processes: A federates to B, and to a relay that is down).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rmb_relay.identity import signing_key
from rmb_relay.sdk import RmbClient
from rmb_relay.telemetry.metrics import Registry
from rmb_relay.telemetry.upstream_names import families
from tests.conftest import WAIT, free_port
from tests.dropin_fixtures import add_local_twin, banner_port, launch
from tests.helpers import eventually
from tests.peer_fixtures import mnemonic_for
from tests.scrape import OPENMETRICS, Page, scrape

#: rmb-rs's names, types and labels (src/relay/switch/mod.rs, src/relay/federation/mod.rs)
RMB_RS = {
    "relay_message_rx": ("counter", ()),
    "relay_message_rx_bytes": ("counter", ()),
    "relay_message_tx": ("counter", ()),
    "relay_message_tx_bytes": ("counter", ()),
    "relay_worker_connections": ("gauge", ("worker",)),
    "relay_session_evictions_total": ("counter", ("reason",)),
    "federation_message_success": ("counter", ("relay",)),
    "federation_message_error": ("counter", ("relay",)),
    "relay_message_rx_twin": ("counter", ("twin",)),
}


def test_names_types_and_labels_are_rmb_rs() -> None:
    declared = {f.name: (f.kind, f.labels) for f in families(Registry())}
    assert declared == RMB_RS


def raw(page: Page, name: str, **labels: str) -> float:
    """The sample `name{labels}` as the page's text has it (prometheus_client's parser renames
    a counter's samples to `<name>_total`; Prometheus keeps the name as written)."""
    pairs = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{pairs}}}" if labels else name
    for line in page.body.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(series)


def client(twin: int, sid: str | None = None) -> RmbClient:
    return RmbClient(twin, signing_key(mnemonic_for(twin)), sid=sid)


async def test_a_scrape_has_every_rmb_rs_name_moving_with_traffic(tmp_path: Path) -> None:
    # relay domains are bare host names; two loopback addresses, B listening on the first
    b_port = free_port()
    b_domain, down_domain = "127.0.0.1", "127.0.0.2"
    add_local_twin(tmp_path, 1, "a.example")
    add_local_twin(tmp_path, 2, "a.example")
    add_local_twin(tmp_path, 3, b_domain)  # served by relay B
    add_local_twin(tmp_path, 4, down_domain)  # its relay is down
    template = ["--federation-url-template", f"http://{{domain}}:{b_port}/"]
    relay_a = launch(
        ["rmb-relay", "--domain", "a.example", "-l", "127.0.0.1:0", *template], data_home=tmp_path
    )
    relay_b = launch(
        ["rmb-relay", "--domain", b_domain, "-l", f"{b_domain}:{b_port}"], data_home=tmp_path
    )
    try:
        port = banner_port(relay_a)
        banner_port(relay_b)
        before = await scrape("127.0.0.1", port)
        for name in ("relay_message_rx", "relay_message_tx", "relay_message_rx_bytes"):
            assert raw(before, name) == 0
        assert raw(before, "relay_worker_connections", worker="0") == 0

        url = f"ws://127.0.0.1:{port}/"
        bob = client(2)
        bob.handle_all(lambda request: b"pong")
        await bob.open(url)
        alice = client(1)
        await alice.open(url)
        for _ in range(3):
            assert (await alice.request(2, "ping", b"x" * 100, timeout=WAIT)).data == b"pong"
        during = await scrape("127.0.0.1", port)
        assert raw(during, "relay_worker_connections", worker="0") == 2
        federated = [alice.send_request(twin, "far", b"away") for twin in (3, 4)]

        async def federated_both() -> bool:
            page = await scrape("127.0.0.1", port)
            lines = page.body.splitlines()
            return f'federation_message_success{{relay="{b_domain}"}} 1' in lines and any(
                line.startswith(f'federation_message_error{{relay="{down_domain}"}}')
                for line in lines
            )

        await eventually(federated_both)
        # a second login of twin 2 (same session) replaces the first: rmb-rs's "cancelled"
        bob_again = client(2)
        await bob_again.open(url)
        await bob_again.close()  # and this one ends: "closed"

        async def evicted() -> bool:
            page = await scrape("127.0.0.1", port)
            return raw(page, "relay_session_evictions_total", reason="closed") >= 1

        await eventually(evicted)
        after = await scrape("127.0.0.1", port)
        assert raw(after, "relay_message_rx") >= 3 + 3 + 2  # requests, replies, federated
        assert raw(after, "relay_message_tx") >= 6
        assert raw(after, "relay_message_rx_bytes") > 300
        assert raw(after, "relay_message_tx_bytes") > 300
        assert raw(after, "relay_session_evictions_total", reason="cancelled") == 1
        assert raw(after, "relay_session_evictions_total", reason="back_pressure_timeout") == 0
        assert raw(after, "federation_message_success", relay=b_domain) == 1
        assert raw(after, "federation_message_error", relay=down_domain) >= 1
        # per twin: alice's 3 requests and 2 federated ones, bob's 3 replies
        assert raw(after, "relay_message_rx_twin", twin="1") == 5
        assert raw(after, "relay_message_rx_twin", twin="2") == 3
        assert "relay_message_rx_twin{" not in before.body
        # the text format is rmb-rs's own lines (counters without `_total` stay so)
        for name, (kind, _) in RMB_RS.items():
            assert f"# TYPE {name} {kind}\n" in after.body
        assert "\nrelay_message_rx " in after.body
        # OpenMetrics: a valid document with every series under the same name
        om = await scrape("127.0.0.1", port, accept=OPENMETRICS)
        names = {sample for sample, _ in om.samples}
        assert names >= set(RMB_RS), set(RMB_RS) - names
        for future in federated:
            future.cancel()
        await asyncio.gather(*federated, return_exceptions=True)
        await alice.close()
        await bob.close()
    finally:
        assert relay_a.stop() == 0
        assert relay_b.stop() == 0


async def test_twins_beyond_the_cap_share_one_series(tmp_path: Path) -> None:
    add_local_twin(tmp_path, 1, "a.example")
    add_local_twin(tmp_path, 2, "a.example")
    relay = launch(
        ["rmb-relay", "--domain", "a.example", "-l", "127.0.0.1:0", "--metrics-max-twins", "1"],
        data_home=tmp_path,
    )
    try:
        port = banner_port(relay)
        url = f"ws://127.0.0.1:{port}/"
        alice = client(1)
        await alice.open(url)
        answer = alice.send_request(2, "ping", b"x")  # bob is offline: it waits in his mailbox

        async def counted(twin: str, n: int) -> bool:
            page = await scrape("127.0.0.1", port)
            return f'relay_message_rx_twin{{twin="{twin}"}} {n}' in page.body.splitlines()

        await eventually(lambda: counted("1", 1))  # alice takes the one series there is
        bob = client(2)
        bob.handle_all(lambda request: b"pong")
        await bob.open(url)
        assert (await asyncio.wait_for(answer, WAIT)).data == b"pong"
        await eventually(lambda: counted("(other)", 1))  # bob's reply
        page = await scrape("127.0.0.1", port)
        assert raw(page, "relay_message_rx_twin", twin="1") == 1
        assert 'twin="2"' not in page.body
        assert raw(page, "rmb_relay_twin_series_folded_total") == 1
        await bob.close()  # an ended session keeps its count where it was
        await eventually(lambda: counted("(other)", 1))
        page = await scrape("127.0.0.1", port)
        assert raw(page, "rmb_relay_twin_series_folded_total") == 1
        assert raw(page, "relay_message_rx_twin", twin="1") == 1
        await alice.close()
    finally:
        assert relay.stop() == 0
