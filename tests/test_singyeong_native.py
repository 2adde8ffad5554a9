"""The native SEND/BROADCAST path (rust/singyeong.rs, native.py) against the Python path.

Property-style: many generated frames, in every text form a client may send, through both
readers; whatever the Rust core answers must be byte for byte the frame Python writes, to
the receivers Python's index picks. Then over real sockets: delivery, metrics, order with
frames that fall back to Python, and a malformed frame after native ones.
"""

from __future__ import annotations

import json
import math
import random
import struct
from typing import Any

import pytest

from rmb_relay._core import SgIndex
from rmb_relay.dialects.singyeong import frames
from rmb_relay.dialects.singyeong.clients import Client, ClientIndex
from rmb_relay.dialects.singyeong.codec import DecodeError, Encoding, decode, encode
from rmb_relay.dialects.singyeong.native import index_values
from rmb_relay.dialects.singyeong.query import QueryError, parse
from tests.helpers import eventually
from tests.scrape import scrape
from tests.sg_client import SgClient
from tests.sg_fixtures import Gateway, MakeGateway, make_gateway

__all__ = ["make_gateway"]

TS = 1_700_000_000_123

#: payload texts Python re-encodes differently (or refuses), besides generated ones
TRICKY = [
    '"\\u0041"',
    '"a\\/b"',
    '{"a":1,"a":2}',
    "-0",
    "1e5",
    "1.0",
    "2.5",
    '"\\u001f"',
    '"\\u001F"',
    '"\\ud83d\\ude00"',
    '"\\ud800"',
    "12345678901234567890123",
    "[ ]",
    "{}",
    "[]",
    '""',
    '"\\t\\b\\f\\n\\r\\"\\\\"',
    '"\\u0000"',
    '"\\u000a"',
    '"é✓😀"',
    "NaN",
    "Infinity",
    "01",
    "[1,]",
    '{"a":1,}',
    "tru",
    '"\t"',
    '{"k":[1,{"z":null,"y":false}],"é":"\\u0007"}',
]


def float_texts(count: int) -> list[str]:
    """Texts of random finite doubles (random bits): Python's repr, which the native path may
    copy, and other spellings of the same value, which it must not."""
    rng = random.Random(5)
    out: list[str] = []
    while len(out) < count * 4:
        (x,) = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))
        if not math.isfinite(x):
            continue
        out += [repr(x), f"{x:.17g}", f"{x:.15g}", f"{x:e}"]
    return out


TRICKY += ["1.50", "1E5", "0.1e1", "1e-05", "1e+16", "-0.0", "5e-324", "1.7976931348623157e308"]
#: float texts, offered as often as the tricky texts above
FLOATS = float_texts(100)

STRINGS = ["x", "y", "é", 'q"uote', "back\\slash", "line\nbreak", "1.2.3", "", "\x07", "😀"]


def scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            rng.randrange(-3, 6),
            rng.choice(STRINGS),
            rng.choice([True, False]),
            rng.choice([1.0, 2.5, 3.0]),
            None,
            10**20,
        ]
    )


def value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return scalar(rng)
    if roll < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(STRINGS): value(rng, depth + 1) for _ in range(rng.randrange(3))}


def render(rng: random.Random, v: Any) -> str:
    """JSON text of `v` in one of the forms clients write."""
    form = rng.randrange(4)
    if form == 0:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    if form == 1:
        return json.dumps(v)
    if form == 2:
        return json.dumps(v, separators=(",", ":"))
    return rng.choice(TRICKY if rng.random() < 0.5 else FLOATS)


def condition(rng: random.Random) -> Any:
    if rng.random() < 0.5:  # what most clients send: an `$eq` on a value someone holds
        key, v = rng.choice([("id", rng.randrange(0, 4)), ("g", rng.choice(["x", "y"]))])
        return {key: {"$eq": v}}
    key = rng.choice(["id", "g", "flag", "f", "v", "lst", "last_heartbeat_time", "/id", "$x"])
    v = scalar(rng)
    form = rng.randrange(8)
    if form <= 2:
        return {key: {"$eq": v}}
    if form == 3:
        return {"path": "/" + key.lstrip("/"), "op": "$eq", "to": {"value": v}}
    if form == 4:
        return {key: {rng.choice(["$ne", "$gt", "$in"]): [v] if rng.random() < 0.5 else v}}
    if form == 5:
        return {"path": f"/{key}/0", "op": "$eq", "to": {"value": v}}
    if form == 6:
        return {"$and": [{key: {"$eq": v}}]}
    return {key: {"$eq": v, "$ne": scalar(rng)}}


def target(rng: random.Random) -> dict[str, Any]:
    t: dict[str, Any] = {}
    if rng.random() < 0.95:
        t["application"] = rng.choice(["a", "b", "a", "b", 3])
    if rng.random() < 0.95:
        t["ops"] = [condition(rng) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
    for flag in ("restricted", "droppable", "optional", "key", "selector"):
        if rng.random() < 0.08:
            t[flag] = rng.choice([True, False, None, "true", "k", {"$min": "id"}])
    return t


def frame_text(rng: random.Random) -> str:
    t = rng.choice(["SEND", "BROADCAST", "SEND", "QUEUE"])
    parts = [
        f'"target":{render(rng, target(rng)) if rng.random() < 0.2 else json.dumps(target(rng))}'
    ]
    parts.append(f'"payload":{render(rng, value(rng))}')
    if rng.random() < 0.5:
        parts.append(f'"nonce":{render(rng, scalar(rng))}')
    rng.shuffle(parts)
    body = "{" + ",".join(parts) + "}"
    return rng.choice(
        [
            f'{{"op":4,"t":"{t}","d":{body}}}',
            f'{{"d": {body}, "t": "{t}", "op": 4}}',
            f'{{"op":4,"t":"{t}","d":{body},"ts":5}}',
            f'{{"op":4.0,"t":"{t}","d":{body}}}',
        ]
    )


def population(rng: random.Random) -> tuple[ClientIndex, SgIndex, dict[int, Client]]:
    """The same clients in Python's index and the native one (conn id = position)."""
    py_index = ClientIndex()
    native = SgIndex(seed=rng.randrange(1 << 32))
    by_id: dict[int, Client] = {}
    for n in range(60):
        restricted = rng.random() < 0.1
        encoding = "json" if rng.random() < 0.97 else "msgpack"
        client = Client(
            rng.choice(["a", "b"]),
            f"c{n}",
            restricted=restricted,
            encoding=encoding,
            socket_ip="127.0.0.1",
        )
        client.metadata.update(
            {
                "id": rng.randrange(0, 4),
                "g": rng.choice(["x", "y", "x", "y", *STRINGS]),
                "flag": rng.choice([True, False, 1, 0]),
                "f": rng.choice([1.0, 2.5, 3, "x"]),
                "v": rng.choice(["1.2.3", "1.2.3+b", "x"]),
                "lst": [1, "x"],
                "last_heartbeat_time": 5,
                "restricted": restricted,
            }
        )
        client.types.update({"v": "version"} if rng.random() < 0.5 else {})
        py_index.add(client)
        by_id[n] = client
        if not restricted:
            native.set(n, client.app_id, encoding == "json", index_values(client))
    return py_index, native, by_id


def python_frame(text: str) -> tuple[str, Any, Any] | None:
    """What the Python path makes of a frame: (t, payload, nonce) of a SEND/BROADCAST it
    routes, else None."""
    try:
        payload = decode(Encoding.JSON, text.encode())
    except DecodeError:
        return None
    op = payload.get("op") if isinstance(payload, dict) else None
    if op != 4 or isinstance(op, bool) or not isinstance(op, int):
        return None
    t, d = payload.get("t"), payload.get("d")
    if t not in ("SEND", "BROADCAST") or not isinstance(d, dict):
        return None
    if "target" not in d or "payload" not in d:
        return None
    return t, d, d.get("nonce")


def test_native_frames_are_byte_identical_to_python_s_and_reach_python_s_receivers() -> None:
    rng = random.Random(12)
    routable = routed = sends = 0
    for _ in range(30):
        py_index, native, by_id = population(rng)
        for _ in range(300):
            text = frame_text(rng)
            data = text.encode()
            rust_text = native.dispatch_text(data, TS)
            receivers = native.receivers(data)
            if rust_text is None:
                assert receivers is None, text
                continue
            routable += 1
            seen = python_frame(text)
            assert seen is not None, text
            t, d, nonce = seen
            query = parse(d["target"])  # raises QueryError if Rust took an invalid query
            assert query.key is None
            assert query.selector is None
            assert not query.restricted
            expected = encode(Encoding.JSON, frames.dispatch(t, d["payload"], TS, nonce))
            assert rust_text == expected, text
            if receivers is None:
                continue
            routed += 1
            matches = {id(c) for c in py_index.match(query)}
            chosen = {id(by_id[n]) for n in receivers}
            if t == "BROADCAST":
                assert chosen == matches, text
            else:
                sends += 1
                assert len(receivers) == 1, text
                assert chosen <= matches, text
    # the generator reaches the native path often enough for the property to mean something
    assert min(routable - 400, routed - 250, sends - 150) > 0, (routable, routed, sends)


def test_invalid_queries_never_take_the_native_path() -> None:
    """Python answers these with op 3 `invalid query`: the native path must not route them."""
    for target in (
        {"application": "a", "ops": [{"id": {"$eq": 1}}], "selector": {"$nope": "x"}},
        {"application": "a", "ops": [{"$x": {"$eq": 1}}]},
        {"application": "a", "ops": [{"id": {"$eq": 1, "$what": 2}}]},
        {"application": "a", "ops": {"id": {"$eq": 1}}},
    ):
        text = json.dumps({"op": 4, "t": "SEND", "d": {"target": target, "payload": 1}})
        assert SgIndex(0).dispatch_text(text.encode(), TS) is None
        with pytest.raises(QueryError):
            parse(target)


# ---- over real sockets -----------------------------------------------------------------------


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


async def test_native_send_and_broadcast_are_delivered_and_counted(
    make_gateway: MakeGateway,
) -> None:
    gateway = await make_gateway()
    native = gateway.dialect.native
    assert native is not None
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
    assert native.counts() == (2, 1, 1, 4)
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
    for payload in payloads:  # native, Python (float), native, Python (space), Python, native
        await sender.ws.send(send_text(target, payload))
    got = [(await ws[0].expect(4, "SEND"))["d"]["payload"] for _ in payloads]
    assert got == [1, 2.5, 3, [4, 4], "5", 6]
    native = gateway.dialect.native
    # the first is native; the rest may be Python's too (once a frame of a read goes to
    # Python, the later ones of that read follow it)
    assert native is not None
    assert 1 <= native.counts()[1] <= 3


async def test_metadata_updates_and_disconnects_reach_the_native_index(
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


async def test_a_malformed_frame_after_native_ones_gets_op8_and_the_gateway_keeps_serving(
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


async def test_restricted_receivers_and_msgpack_receivers_are_left_to_python(
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
    native = gateway.dialect.native
    assert native is not None
    assert native.counts()[1] == 0


async def test_without_the_native_path_python_answers_everything(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(native=False)
    assert gateway.dialect.native is None
    (w,) = await workers(gateway, 1)
    sender = await gateway.client("s", "caller")
    await sender.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 0}}]}, "1"))
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 1


# ---- queue frames read natively ---------------------------------------------------------------

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


async def test_queue_frames_read_natively_behave_as_python_s(make_gateway: MakeGateway) -> None:
    native = await run_queue_script(await make_gateway())
    python = await run_queue_script(await make_gateway(native=False))
    assert native == python
    consumer, producer, dispatches = native
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
    native = await run_batched(await make_gateway())
    python = await run_batched(await make_gateway(native=False))
    assert native == python
    assert [(f["op"], f.get("t")) for f in native] == [
        (4, "QUEUE_CONFIRM"),
        (4, "SEND"),
        (4, "QUEUE"),
        (4, "SEND"),
    ]


# ---- metadata Rust strings cannot hold ---------------------------------------------------------


async def test_a_lone_surrogate_key_is_applied_and_native_sends_still_route(
    make_gateway: MakeGateway,
) -> None:
    """JSON may carry "\\ud800", which metadata accepts but a Rust string cannot hold: the
    key is left out of the native index (no native query can name it), immediately or after
    the rate delay, and neither this client's nor others' updates stall."""
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
    native = gateway.dialect.native
    assert native is not None
    assert native.counts()[1] == 3


async def test_a_lone_surrogate_application_is_left_to_python(make_gateway: MakeGateway) -> None:
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
    # the odd client sends natively itself
    await odd.ws.send(send_text({"application": "api", "ops": [{"n": {"$eq": 0}}]}, "3"))
    assert (await w.expect(4, "SEND"))["d"]["payload"] == 3
