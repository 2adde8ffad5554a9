"""Answers held for another try while Redis or another instance cannot be reached
(dialects/rmb/later.py): bounded by `--retry-hold-bytes`, what does not fit refused and
counted, what was held routed again. A real relay, real signed envelopes from the SDK."""

from __future__ import annotations

import argparse
from pathlib import Path

from rmb_relay._core import scan_envelope
from rmb_relay.dialects.rmb import RmbSettings
from rmb_relay.dialects.rmb.settings import add_arguments
from rmb_relay.sdk import RmbClient
from tests.conftest import StartRelay
from tests.helpers import eventually
from tests.rmb_fixtures import key_for, start_rmb_relay


def _response(client: RmbClient, dest: int, size: int) -> bytes:
    env = client.envelope(dest)
    env.response.SetInParent()
    env.plain = b"x" * size
    return client.seal(env)


async def test_answers_held_for_another_try_are_bounded_and_the_rest_refused(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    limit = 10_000
    relay = await start_rmb_relay(
        start_relay, tmp_path, settings=RmbSettings(retry_hold_bytes=limit)
    )
    await relay.client(2, key_type="ed25519")
    sender = next(iter(relay.dialect.sessions.values()))
    later = relay.dialect.later
    twin2 = RmbClient(2, key_for(2, "ed25519"))
    # answers for twin 3 (offline), as the cluster path hands them over when Redis fails
    wires = [_response(twin2, 3, 1000) for _ in range(20)]
    kept = [later.hold(sender, scan_envelope(wire), wire) for wire in wires]
    assert all(kept)  # held or refused here: never the caller's to count again
    assert later.held_bytes <= limit
    held = later.held_bytes // len(wires[0])
    assert 0 < held < len(wires)
    assert later.refused == len(wires) - held
    text = relay.server.registry.render()
    assert f"rmb_relay_retry_held_bytes {later.held_bytes}" in text
    assert f"rmb_relay_retry_refused_total {len(wires) - held}" in text
    # the next try routes what was held (to twin 3's mailbox here): the budget is free again
    await eventually(lambda: relay.dialect.mailbox.depth() == held)
    assert later.held_bytes == 0
    await relay.close_clients()


def test_the_budget_is_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).retry_hold_bytes == 4 << 20
    assert parser.parse_args(["--retry-hold-bytes", "1000"]).retry_hold_bytes == 1000
