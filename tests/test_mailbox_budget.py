"""The in-memory mailbox within its memory budgets, over real sockets (issue 9, item 1): bytes
per twin and in all, sessions per twin, refusals the sender hears of, expiry swept on its own
timer (not only when `--limit` is on), and the books back at zero once mail is gone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rmb_relay.errors import MailboxFull
from rmb_relay.mailbox import MailboxBudget, MemoryMailbox
from tests.conftest import WAIT, StartRelay
from tests.helpers import eventually
from tests.rmb_fixtures import FakeClock, start_rmb_relay

FULL = "destination offline and its mailbox is full"


async def test_twin_byte_budget_refuses_with_an_error_to_the_sender(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    mailbox = MemoryMailbox(budget=MailboxBudget(twin_bytes=100_000))
    relay = await start_rmb_relay(start_relay, tmp_path, mailbox=mailbox)
    alice = await relay.client(1)
    payload = b"x" * 30_000
    futures = [alice.send_request(3, "m", payload) for _ in range(3)]
    await eventually(lambda: mailbox.stats.stored == 3)
    refused = await asyncio.wait_for(alice.send_request(3, "m", payload), WAIT)
    assert refused.error == (0, FULL)
    assert mailbox.stats.refused == 1
    assert 90_000 < mailbox.held_bytes() <= 100_000
    # another twin's mailbox has a budget of its own
    waiting = alice.send_request(2, "m", payload)
    await eventually(lambda: mailbox.stats.stored == 4)
    # draining gives the budget back (twin 2's envelope stays), and everything is delivered
    carol = await relay.client(3)
    carol.handle("m", lambda r: b"ok")
    await asyncio.wait_for(asyncio.gather(*futures), WAIT)
    assert mailbox.depth() == 1
    assert len(payload) < mailbox.held_bytes() < len(payload) + 1000
    waiting.cancel()
    await relay.close_clients()


async def test_total_byte_budget_spans_twins(start_relay: StartRelay, tmp_path: Path) -> None:
    mailbox = MemoryMailbox(budget=MailboxBudget(total_bytes=50_000))
    relay = await start_rmb_relay(start_relay, tmp_path, mailbox=mailbox)
    alice = await relay.client(1)
    alice.send_request(3, "m", b"y" * 30_000)
    await eventually(lambda: mailbox.stats.stored == 1)
    refused = await asyncio.wait_for(alice.send_request(2, "m", b"y" * 30_000), WAIT)
    assert refused.error == (0, FULL)
    assert mailbox.held_bytes() <= 50_000
    await relay.close_clients()


async def test_distinct_sids_per_twin_are_capped(start_relay: StartRelay, tmp_path: Path) -> None:
    mailbox = MemoryMailbox(budget=MailboxBudget(sessions_per_twin=4))
    relay = await start_rmb_relay(start_relay, tmp_path, mailbox=mailbox)
    alice = await relay.client(1)
    for i in range(4):
        alice.send_request(3, "m", b"z", dest_sid=f"s{i}")
    await eventually(lambda: mailbox.stats.stored == 4)
    refused = await asyncio.wait_for(alice.send_request(3, "m", b"z", dest_sid="s9"), WAIT)
    assert refused.error == (0, FULL)
    # a sid that already has mail still gets more
    alice.send_request(3, "m", b"z", dest_sid="s0")
    await eventually(lambda: mailbox.stats.stored == 5)
    await relay.close_clients()


async def test_expiry_is_swept_without_a_rate_limit_and_memory_is_returned(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    """Before: the sweep ran only with `--limit`, so expired mail stayed in memory for good."""
    clock = FakeClock()
    mailbox = MemoryMailbox(clock=clock, sweep_interval=0.02)
    relay = await start_rmb_relay(start_relay, tmp_path, mailbox=mailbox, clock=clock)
    assert relay.dialect.limiter is None
    alice = await relay.client(1, clock=clock)
    for i in range(50):
        alice.send_request(3, "m", b"w" * 1000, expiration=5, dest_sid=f"s{i % 10}")
    await eventually(lambda: mailbox.depth() == 50)
    assert mailbox.held_bytes() > 50_000
    clock.advance(10)
    await eventually(lambda: mailbox.depth() == 0)
    assert mailbox.held_bytes() == 0
    assert mailbox.stats.expired == 50
    assert not mailbox._boxes
    assert not mailbox.books.holders()
    assert mailbox.books.held == 0
    await relay.close_clients()


async def test_budget_refusal_is_a_mailbox_error_and_budgets_must_be_positive() -> None:
    mailbox = MemoryMailbox(budget=MailboxBudget(twin_bytes=10))
    with pytest.raises(MailboxFull):
        await mailbox.put((1, None), b"x" * 11, 2**40)
    with pytest.raises(ValueError, match="positive"):
        MailboxBudget(total_bytes=0)
    await mailbox.close()


async def test_one_source_twin_gets_its_share_not_the_whole_budget(
    start_relay: StartRelay, tmp_path: Path
) -> None:
    """A flood from one sender stops at its share (--mailbox-source-bytes); another sender's
    mail to the same twin is still stored, and everything stored is delivered (issue 33)."""
    mailbox = MemoryMailbox(budget=MailboxBudget(source_bytes=70_000))
    relay = await start_rmb_relay(start_relay, tmp_path, mailbox=mailbox)
    alice, bob = await relay.client(1), await relay.client(2, key_type="ed25519")
    payload = b"f" * 30_000
    flood = [alice.send_request(3, "m", payload) for _ in range(2)]
    await eventually(lambda: mailbox.stats.stored == 2)
    refused = await asyncio.wait_for(alice.send_request(3, "m", payload), WAIT)
    assert refused.error == (0, FULL)
    honest = bob.send_request(3, "m", b"from bob")
    await eventually(lambda: mailbox.stats.stored == 3)
    carol = await relay.client(3)
    carol.handle("m", lambda r: r.data[:8])
    replies = await asyncio.wait_for(asyncio.gather(*flood, honest), WAIT)
    assert [r.data for r in replies] == [b"ffffffff", b"ffffffff", b"from bob"]
    assert mailbox.held_bytes() == 0
    await relay.close_clients()
