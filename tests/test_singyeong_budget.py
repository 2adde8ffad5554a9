"""The in-memory queues within their byte budget, over real sockets (issues #12, #13): a QUEUE
over the queue's or the gateway's budget gets op 3 `queue_full` and no QUEUE_CONFIRM (nothing
kept, nothing confirmed dropped); acks give the bytes back; a message at its last attempt
while the dead letters are full stays in its queue; the held bytes are on /metrics."""

from __future__ import annotations

import argparse
import json

import pytest

from rmb_relay.dialects.singyeong import SgSettings
from rmb_relay.dialects.singyeong.queues import MESSAGE_OVERHEAD
from rmb_relay.dialects.singyeong.settings import add_arguments
from rmb_relay.errors import ConfigError
from tests.helpers import FakeClock
from tests.scrape import scrape
from tests.sg_client import SgClient
from tests.sg_fixtures import MakeGateway, make_gateway
from tests.test_singyeong_queues import WORKERS, nothing_pending, take

__all__ = ["make_gateway"]

#: a QUEUE frame with this payload is a little over 1 KB on the wire; with the per-message
#: overhead and the payload's JSON text the scanner keeps, a message is charged about
#: 2,700 bytes
PAYLOAD = "x" * 1000


async def queue(client: SgClient, payload: str, name: str = "jobs") -> None:
    """QUEUE with a short nonce (the frame is the payload and ~100 bytes), confirmed."""
    d = {"queue": name, "target": WORKERS, "nonce": "n", "payload": payload}
    await client.dispatch("QUEUE", d)
    confirm = await client.expect(4, "QUEUE_CONFIRM")
    assert confirm["d"]["queue"] == name


async def refused(client: SgClient, name: str = "jobs", payload: str = PAYLOAD) -> dict[str, str]:
    await client.dispatch(
        "QUEUE", {"queue": name, "target": WORKERS, "nonce": "over", "payload": payload}
    )
    frame = await client.expect(3)
    assert frame["d"]["error"] == "queue_full"
    info: dict[str, str] = frame["d"]["extra_info"]
    assert (info["queue"], info["nonce"]) == (name, "over")
    assert info["reason"].startswith("the message was not stored")
    return info


async def test_queue_over_its_byte_budget_is_refused_not_dropped(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway(queue_bytes=6000)
    queues = gateway.dialect.queues
    producer = await gateway.client("p", "producers")
    await queue(producer, PAYLOAD)
    await queue(producer, PAYLOAD + "y")
    info = await refused(producer)
    assert info["limit"] == "key"
    assert "6000 allowed" in info["reason"]
    await nothing_pending(producer)  # no QUEUE_CONFIRM followed the refusal
    assert queues.depth() == (2, 0, 0)
    held = queues.held_bytes()[0]
    assert 4500 < held <= 6000
    # another queue has a budget of its own
    await queue(producer, PAYLOAD, name="other")
    # what was confirmed is all delivered; acks give the bytes back, and the queue takes more
    worker = await gateway.client("w", "workers")
    for expected in (PAYLOAD, PAYLOAD + "y"):
        body = await take(worker)
        assert body["payload"] == expected
        await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})
    await nothing_pending(worker)
    assert queues.held_bytes()[0] < 3000  # only "other" is left
    await queue(producer, PAYLOAD)
    page = await scrape(*gateway.address)
    assert page.value("rmb_relay_sg_queue_refused_total", limit="key") == 1
    assert page.value("rmb_relay_sg_queue_bytes", state="all") == queues.held_bytes()[0]
    assert page.value("rmb_relay_sg_dispatches_total", type="QUEUE", outcome="full") == 1


async def test_total_budget_spans_queues(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(queue_total_bytes=6000)
    producer = await gateway.client("p", "producers")
    await queue(producer, PAYLOAD, name="a")
    await queue(producer, PAYLOAD, name="b")
    info = await refused(producer, name="c")
    assert info["limit"] == "total"
    assert "in all" in info["reason"]
    assert gateway.dialect.queues.depth() == (2, 0, 0)


async def test_dead_letters_full_keeps_the_message_in_its_queue(
    make_gateway: MakeGateway,
) -> None:
    """Dead letters have a bound of their own: at it, a message that failed its last attempt
    is neither dead-lettered nor dropped but waits in its queue again; requeueing the dead
    letters makes room."""
    gateway = await make_gateway(
        fake_clock=True, ack_timeout=1.0, max_attempts=1, dead_letter_bytes=4000
    )
    clock = gateway.clock
    assert isinstance(clock, FakeClock)
    queues = gateway.dialect.queues
    producer = await gateway.client("p", "producers")
    await queue(producer, PAYLOAD)
    await queue(producer, PAYLOAD + "2")
    worker = await gateway.client("w", "workers")
    first = await take(worker)
    clock.advance(0.1)  # the first's ack deadline comes first
    second = await take(worker)
    clock.advance(1.5)
    gateway.dialect.sweep(clock())
    # the first fits the dead letters; the second does not and waits in line again
    assert queues.depth() == (1, 0, 1)
    assert [letter.message.id for letter in queues.dead_letters("jobs")] == [first["id"]]
    assert 2500 < queues.held_bytes()[1] <= 4000
    again = await take(worker)
    assert (again["id"], again["attempt"]) == (second["id"], 2)
    page = await scrape(*gateway.address)
    assert page.value("rmb_relay_sg_queue_refused_total", limit="dead_letters") == 1
    assert page.value("rmb_relay_sg_queue_bytes", state="dead") == queues.held_bytes()[1]
    # drained: requeue the dead letter, ack both, and every byte is given back
    assert queues.requeue("jobs") == 1
    assert queues.held_bytes()[1] == 0
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": again["id"]})
    body = await take(worker)
    assert body["id"] == first["id"]
    await worker.dispatch("QUEUE_ACK", {"queue": "jobs", "id": body["id"]})
    await nothing_pending(worker)
    assert queues.depth() == (0, 0, 0)
    assert queues.held_bytes() == (0, 0)
    assert not queues.budget.holders()


async def test_a_kept_payload_text_is_charged_and_refused_at_the_budget(
    make_gateway: MakeGateway,
) -> None:
    """The scanner keeps a QUEUE's payload text beside its value (a JSON consumer's dispatch
    copies it): the budget charges it, so the second message here does not fit (it would
    without the text)."""
    frame = json.dumps(
        {"op": 4, "d": {"queue": "jobs", "target": WORKERS, "nonce": "n", "payload": PAYLOAD}}
        | {"t": "QUEUE"}
    )
    message = len(frame) + MESSAGE_OVERHEAD
    text = len(json.dumps(PAYLOAD))
    budget = 2 * message + text  # two without their text, one with it
    gateway = await make_gateway(queue_bytes=budget)
    queues = gateway.dialect.queues
    producer = await gateway.client("p", "producers")
    await queue(producer, PAYLOAD)
    assert queues.held_bytes()[0] == message + text
    info = await refused(producer)
    assert info["limit"] == "key"
    assert queues.depth() == (1, 0, 0)


def test_budget_flags_parse_and_must_be_positive() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--sg-queue-bytes", "10", "--sg-queue-total-bytes", "20", "--sg-dead-letter-bytes", "5"]
    )
    settings = SgSettings.from_args(args)
    assert (settings.queue_bytes, settings.queue_total_bytes, settings.dead_letter_bytes) == (
        10,
        20,
        5,
    )
    assert "queue_full" in parser.format_help()
    with pytest.raises(ConfigError, match="--sg-queue-bytes"):
        SgSettings(queue_bytes=0)
