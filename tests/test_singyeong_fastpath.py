"""The fast path (rust/dialects/singyeong/): a JSON client's SEND/BROADCAST answered inside
the read, with the one query engine and index Python's path uses too.

The DISPATCH it writes is the one layout Python's JSON frames use (`dispatch_json`), byte for
byte what the generic encoder gives; then over real sockets: delivery, metrics, order with
frames that go to Python, a malformed frame after fast ones, queue frames read by the scanner.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rmb_relay.dialects.singyeong import frames
from rmb_relay.dialects.singyeong.codec import Encoding, dispatch_json, encode, json_text
from tests.helpers import eventually
from tests.scrape import scrape
from tests.sg_client import SgClient
from tests.sg_fixtures import Gateway, MakeGateway, make_gateway

__all__ = ["make_gateway"]

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(payload=_JSON, nonce=_JSON, t=st.sampled_from(["SEND", "BROADCAST", "QUEUE"]))
def test_the_dispatch_layout_is_the_generic_encoder_s(payload: Any, nonce: Any, t: str) -> None:
    want = encode(Encoding.JSON, frames.dispatch(t, payload, 1_700_000_000_123, nonce))
    assert dispatch_json(t, json_text(payload), 1_700_000_000_123, nonce) == want


def send_text(target: dict[str, Any], payload: str, t: str = "SEND", nonce: str = "") -> str:
    """A frame as a compact client writes it (the payload text verbatim)."""
    extra = f',"nonce":{nonce}' if nonce else ""
    return (
        f'{{"op":4,"t":"{t}","d":{{"target":{json.dumps(target, separators=(",", ":"))},'
        f'"payload":{payload}{extra}}}}}'
    )


async def workers(gateway: Gateway, count: int) -> list[SgClient]:
    clients = []
    for n in range(count):
        client = await gateway.client(f"w{n}", "api")
        await client.update(n=("integer", n), group=("string", "g"))
        clients.append(client)
    for client in clients:  # every update applied (a heartbeat round trip)
        await client.send(5)
        await client.expect(6)
    return clients


async def test_fast_send_and_broadcast_are_delivered_and_counted(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    ws = await workers(gateway, 3)
    sender = await gateway.client("s", "caller")
    before = gateway.dialect.metrics.frames_in()
    await sender.ws.send(
        send_text({"application": "api", "ops": [{"n": {"$eq": 1}}]}, '{"a":[1,"é"]}', nonce='"n1"')
    )
    raw = await ws[1].ws.recv()
    ts = json.loads(raw)["ts"]
    assert raw == (
        f'{{"op":4,"d":{{"target":null,"nonce":"n1","payload":{{"a":[1,"é"]}}}},"t":"SEND","ts":{ts}}}'
    )
    await sender.ws.send(
        send_text(
            {"application": "api", "ops": [{"path": "/group", "op": "$eq", "to": {"value": "g"}}]},
            "7",
            "BROADCAST",
        )
    )
    for w in ws:
        frame = await w.expect(4, "BROADCAST")
        assert frame["d"] == {"target": None, "nonce": None, "payload": 7}
    assert gateway.dialect.fast_counts() == (2, 1, 1, 4)
    dispatches = gateway.dialect.metrics.dispatches()
    assert dispatches[("SEND", "delivered")] == 1
    assert dispatches[("BROADCAST", "delivered")] == 1
    assert gateway.dialect.metrics.frames_in() == before + 2
    page = await scrape(*gateway.address)
    assert page.value("rmb_relay_messages_out_total", dialect="singyeong") == 4


async def test_frames_that_fall_back_to_python_keep_their_order(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    ws = await workers(gateway, 2)
    sender = await gateway.client("s", "caller")
    target = {"application": "api", "ops": [{"n": {"$eq": 0}}]}
    payloads = ["1", "2.5", "3", "[4, 4]", '"\\u0035"', "6"]
    for payload in payloads:  # fast, fast, fast, Python (space), Python (escape), fast
        await sender.ws.send(send_text(target, payload))
    got = [(await ws[0].expect(4, "SEND"))["d"]["payload"] for _ in payloads]
    assert got == [1, 2.5, 3, [4, 4], "5", 6]
    # the first is the fast path's; the rest may be Python's too (once a frame of a read goes
    # to Python, the later ones of that read follow it)
    assert 1 <= gateway.dialect.fast_counts()[1] <= 4


async def test_metadata_updates_and_disconnects_reach_the_core_index(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    (w,) = await workers(gateway, 1)
    sender = await gateway.client("s", "caller")
    await w.update(n=("integer", 40))
    await w.send(5)
    await w.expect(6)
    await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 40}}]}, "1"))
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 1
    await w.close()
    await sender.send(5)
    await sender.expect(6)
    await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 40}}]}, "2"))
    frame = await sender.expect(3)
    assert frame["d"]["error"] == "no_route"


async def test_a_malformed_frame_after_fast_ones_gets_op8_and_the_gateway_keeps_serving(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    (w,) = await workers(gateway, 1)
    bad = await gateway.client("bad", "caller")
    good = await gateway.client("good", "caller")
    target = {"application": "api", "ops": [{"n": {"$eq": 0}}]}
    await bad.ws.send(send_text(target, "1"))
    await bad.ws.send('{"op":4,"t":"SEND","d":{"target":')
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 1
    frame = await bad.expect(8)
    assert frame["d"]["error"].startswith("decode: invalid json")
    await bad.closed()
    await good.ws.send(send_text(target, "2"))
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 2


async def test_msgpack_receivers_are_left_to_python_restricted_ones_to_the_query(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway(auth="pw")
    restricted = await gateway.client("r", "api")
    await restricted.update(n=("integer", 1))
    packed = await gateway.client("m", "api", encoding="msgpack", auth="pw")
    await packed.update(n=("integer", 1))
    sender = await gateway.client("s", "caller", auth="pw")
    for client in (restricted, packed):
        await client.send(5)
        await client.expect(6)
    await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 1}}]}, "9"))
    assert (await packed.expect(4, "SEND"))["d"]["payload"] == 9
    assert gateway.dialect.fast_counts()[1] == 0
    to_restricted = {"application": "api", "restricted": True, "ops": [{"n": {"$eq": 1}}]}
    await sender.ws.send(send_text(to_restricted, "8", "BROADCAST"))
    assert (await restricted.expect(4, "BROADCAST"))["d"]["payload"] == 8
    assert (await packed.expect(4, "BROADCAST"))["d"]["payload"] == 8


# ---- queue frames read by the scanner ------------------------------------------------------

QUEUE_SCRIPT = [
    # (who, frame text) — consumer "c" (metadata n=0), producer "p"
    ("c", '{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q"}}'),
    (
        "p",
        '{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"application":"api",'
        '"ops":[{"n":{"$eq":0}}]},"nonce":"a","payload":{"x": [1, 2.5, "é"]}}}',
    ),
    ("p", '{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"application":"api"},"payload":2}}'),
    (
        "p",
        '{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"application":"api"},'
        '"payload":{"k":[1.5,"é\\n",null]},"nonce":[1]}}',
    ),
    ("c", '{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q"}}'),
    ("p", '{"op":4,"t":"QUEUE","d":{"queue":"' + "q" * 300 + '","target":{},"payload":3}}'),
    ("p", '{"op":4,"t":"QUEUE","d":{"queue":"","target":{},"payload":3,"more":[1]}}'),
    ("p", '{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"ops":{"n":1}},"payload":4}}'),
    ("p", '{"op":4,"t":"QUEUE","d":{"queue":"q","target":{},"nonce":null}}'),
    ("c", '{"op":4,"t":"QUEUE_ACK","d":{"queue":"q","id":"ID0"}}'),
    ("c", '{"op":4,"t":"QUEUE_ACK","d":{"queue":"q","id":"nope"}}'),
    ("c", '{"op":4,"t":"QUEUE_ACK","d":{"queue":"","id":"x"}}'),
    ("c", '{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q"}}'),
    ("c", '{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"' + "r" * 300 + '"}}'),
    ("c", '{"op":4,"t":"QUEUE_REQUEST_CANCEL","d":{"queue":"q"}}'),
]


def normalized(frame: dict[str, Any], ids: list[str]) -> dict[str, Any]:
    """The frame without what differs between runs (`ts`, message ids)."""
    frame = dict(frame)
    frame.pop("ts", None)
    d = frame.get("d")
    if isinstance(d, dict) and isinstance(d.get("payload"), dict) and "id" in d["payload"]:
        ids.append(d["payload"]["id"])
        frame["d"] = {**d, "payload": {**d["payload"], "id": f"ID{len(ids) - 1}"}}
    return frame


async def run_queue_script(gateway: Gateway) -> tuple[list[Any], list[Any], dict[Any, int]]:
    (consumer,) = await workers(gateway, 1)
    producer = await gateway.client("p", "caller")
    ids: list[str] = []
    got: dict[str, list[Any]] = {"c": [], "p": []}
    clients = {"c": consumer, "p": producer}
    for who, text in QUEUE_SCRIPT:
        for n, real in enumerate(ids):
            text = text.replace(f"ID{n}", real)
        await clients[who].ws.send(text)
        for name, client in clients.items():  # settle: everything sent so far is answered
            await client.send(5)
            while (frame := await client.recv())["op"] != 6:
                got[name].append(normalized(frame, ids))
    return got["c"], got["p"], gateway.dialect.metrics.dispatches()


async def test_queue_frames_read_by_the_scanner_are_answered_in_order(
    make_gateway: MakeGateway,
) -> None:
    consumer, producer, dispatches = await run_queue_script(await make_gateway())
    assert [f["d"]["payload"]["payload"] for f in consumer if f["op"] == 4] == [
        {"x": [1, 2.5, "é"]},
        2,
        {"k": [1.5, "é\n", None]},
    ]
    assert [f["op"] for f in producer] == [4, 4, 4, 3, 3, 3, 3]
    assert dispatches[("QUEUE_ACK", "ok")] == 1


async def one_write(client: SgClient, *texts: str) -> None:
    """Send `texts` as WebSocket frames in a single TCP write, so the gateway reads them in
    one `feed` (as a client that batches its writes does)."""
    ws = client.ws
    for text in texts:
        ws.protocol.send_text(text.encode())
    ws.transport.write(b"".join(ws.protocol.data_to_send()))


async def run_batched(gateway: Gateway) -> list[Any]:
    """A QUEUE and a SEND to the sender itself in one write, then a QUEUE_REQUEST and a SEND
    to the worker itself in one write: the frames the sender, then the worker, get."""
    (w,) = await workers(gateway, 1)
    s = await gateway.client("s", "caller")
    to_self = {"application": "caller", "ops": []}
    queue = (
        '{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"application":"api"},"nonce":"a",'
        '"payload":1}}'
    )
    await one_write(s, queue, send_text(to_self, "2"))
    to_worker = {"application": "api", "ops": [{"n": {"$eq": 0}}]}
    await one_write(w, '{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q"}}', send_text(to_worker, "3"))
    got = []
    ids: list[str] = []
    for client in (s, w):  # settle: everything sent so far is answered
        await client.send(5)
        while (frame := await client.recv())["op"] != 6:
            got.append(normalized(frame, ids))
    return got


async def test_queue_frames_and_sends_of_one_read_keep_their_order(
    make_gateway: MakeGateway,
) -> None:
    """A SEND read after queue frames waits for them (they are answered by Python after the
    read): the DISPATCH never overtakes the QUEUE_CONFIRM, nor the QUEUE's delivery."""
    got = await run_batched(await make_gateway())
    assert [(f["op"], f.get("t")) for f in got] == [
        (4, "QUEUE_CONFIRM"),
        (4, "SEND"),
        (4, "QUEUE"),
        (4, "SEND"),
    ]


# ---- text that is not valid Unicode (JSON's lone surrogates) -----------------------------


async def test_a_lone_surrogate_key_is_applied_and_fast_sends_still_route(
    make_gateway: MakeGateway,
) -> None:
    """JSON may carry "\\ud800", which metadata accepts: the core holds it as WTF-8, immediately
    or after the rate delay, and neither this client's nor others' updates stall."""
    gateway = await make_gateway(metadata_rate=1)  # burst of one: the second update waits
    (w, other) = await workers(gateway, 2)
    sender = await gateway.client("s", "caller")
    await w.update(**{"\ud800": ("string", "x"), "n": ("integer", 10)})  # waits for the rate
    await other.update(n=("integer", 11))  # waits too
    await w.send(5)
    await w.expect(6)
    stored = gateway.dialect.index.get("api", "w0")
    other_stored = gateway.dialect.index.get("api", "w1")
    assert stored is not None
    assert other_stored is not None
    await eventually(lambda: stored.metadata.get("n") == 10)
    await eventually(lambda: other_stored.metadata.get("n") == 11)
    assert stored.metadata["\ud800"] == "x"
    for n, client in ((10, w), (11, other)):
        await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": n}}]}, "1"))
        assert (await client.expect(4, "SEND"))["d"]["payload"] == 1
    # immediately applied (a fresh client, within its burst)
    fresh = await gateway.client("f", "api")
    await fresh.update(**{"\udfff": ("integer", 1), "n": ("integer", 12)})
    await fresh.send(5)
    await fresh.expect(6)
    await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 12}}]}, "2"))
    assert (await fresh.expect(4, "SEND"))["d"]["payload"] == 2
    assert gateway.dialect.fast_counts()[1] == 3
    await sender.send(4, {"target": {"ops": [{"\ud800": {"$eq": "x"}}]}, "payload": 3}, "SEND")
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 3


async def test_a_lone_surrogate_application_is_routed(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    odd = await gateway.client("o", "\ud800")
    await odd.update(n=("integer", 1))
    (w,) = await workers(gateway, 1)
    await odd.send(5)
    await odd.expect(6)
    sender = await gateway.client("s", "caller")
    await sender.send(4, {"target": {"application": "\ud800"}, "payload": 1}, "SEND")
    assert (await odd.expect(4, "SEND"))["d"]["payload"] == 1
    await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 0}}]}, "2"))
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 2
    # the odd client's own SENDs take the fast path
    await odd.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 0}}]}, "3"))
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 3
