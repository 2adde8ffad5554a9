"""Write the seed corpus of the fuzz targets (`fuzz/corpus/<target>/`), deterministically.

The seeds are well-formed inputs of each parser, built with the relay's own encoders, so a
fuzzer starts from the shapes real peers send: request heads of every framing, websocket
frames of every opcode and length encoding, and RMB envelopes of every kind. The http and ws
targets read their first byte as a split point (see rust/fuzzing.rs): each seed starts with one.

Run: `.venv/bin/python fuzz/make_corpus.py` (commits the files it writes; idempotent).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rmb_relay._core import ClientFrameEncoder, SigningKey, build_error_envelope, build_pong
from rmb_relay.envelope import Envelope, sign

CORPUS = Path(__file__).parent / "corpus"

KEY = "dGhlIHNhbXBsZSBub25jZQ=="
HTTP = [
    b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n",
    b"HEAD /metrics HTTP/1.0\r\nAccept: text/plain\r\n\r\n",
    (
        "GET /?eyJhbGciOiJSUzUxMiJ9.eyJzdWIiOjd9.ZQ HTTP/1.1\r\nHost: relay\r\n"
        "Upgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n"
        f"Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode(),
    b"POST / HTTP/1.1\r\nHost: relay\r\nContent-Length: 5\r\n\r\nhello",
    b"PUT /authenticate HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;ext=1\r\nabc\r\n0\r\nX-Trailer: v\r\n\r\n",
    b"\r\n\r\nGET /a HTTP/1.1\r\nHost: r\r\n\r\nGET /b HTTP/1.1\r\nHost: r\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc",
    b"GET /x HTTP/1.1\nHost: bare-lf\n\n",
]


def ws_frames() -> list[bytes]:
    enc = ClientFrameEncoder(hashlib.sha256(b"fuzz corpus").digest())
    return [
        enc.binary(b"envelope bytes"),
        enc.text("text ok \u00e9"),
        enc.ping(b"p"),
        enc.pong(b""),
        enc.close(1000, "bye"),
        enc.binary(bytes(200)),  # 16-bit length
        enc.binary(bytes(70000)[:4000]) + enc.binary(b"second"),
        enc.binary_batch([b"a", b"bb", b"ccc"]),
        # a fragmented binary message: FIN=0 binary, then FIN=1 continuation, masked by hand
        bytes([0x02, 0x81, 1, 2, 3, 4, ord("x") ^ 1]) + bytes([0x80, 0x81, 0, 0, 0, 0, ord("y")]),
        # a 64-bit length header announcing more than the limit
        bytes([0x82, 0xFF]) + (1 << 40).to_bytes(8, "big") + bytes(4),
    ]


def envelopes() -> list[bytes]:
    key = SigningKey.ed25519(hashlib.sha256(b"fuzz twin").digest())
    out = []
    request = Envelope(uid="u1", timestamp=1_700_000_000, expiration=300)
    request.source.twin, request.source.connection = 7, "app"
    request.destination.twin = 9
    request.request.command = "calc.add"
    request.plain = b"[1, 2]"
    request.tags = "fail-fast"
    sign(request, key)
    out.append(request.SerializeToString())
    response = Envelope(uid="u2", timestamp=1, expiration=60)
    response.source.twin, response.destination.twin = 9, 7
    response.destination.connection = "app"
    response.response.SetInParent()
    response.cipher = bytes(48)
    out.append(response.SerializeToString())
    ping = Envelope(uid="p", timestamp=5)
    ping.source.twin = 7
    ping.ping.SetInParent()
    out.append(ping.SerializeToString())
    out.append(build_pong(ping.SerializeToString()))
    out.append(build_error_envelope("u3", "destination offline", 1_700_000_000, 7, "app"))
    return out


#: 신경 JSON frames: what the native reader answers (SEND, BROADCAST, queue frames) and what it
#: leaves to Python (a float payload, whitespace, another op)
SG_FRAMES = [
    b'{"op":4,"t":"SEND","d":{"target":{"application":"a","ops":[{"id":{"$eq":2}}]},'
    b'"payload":{"k":[1,"\\n",true,null]},"nonce":"x"}}',
    b'{"op":4,"t":"BROADCAST","d":{"target":{"application":"a","ops":[{"path":"/id",'
    b'"op":"$eq","to":{"value":1}}]},"payload":"p"}}',
    b'{ "op": 4, "t": "SEND", "d": {"payload": 1.5, "target": {"application": "a", '
    b'"ops": [{"id": {"$eq": "\\u00e9"}}]}}}',
    b'{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"ops":[]},"nonce":null,"payload":[1,2]}}',
    b'{"op":4,"t":"QUEUE_ACK","d":{"queue":"q","id":"abc"}}',
    b'{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q"}}',
    b'{"op":5,"d":null}',
]


#: target answers for the connector's response parser (rust/http_response.rs); the target
#: reads the first byte as flags (HEAD request, whole-body limit), the second as the cut
HTTP_RESPONSES = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.0 200 OK\r\n\r\nuntil the end",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1, 1\r\nConnection: close\r\n\r\nx",
]


def write(target: str, seeds: list[bytes], cut: bool) -> None:
    directory = CORPUS / target
    directory.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        data = bytes([(i * 37 + 11) % 256]) + seed if cut else seed
        (directory / f"seed-{i:02d}").write_bytes(data)


if __name__ == "__main__":
    write("http_request", HTTP, cut=True)
    write("ws_frames", ws_frames(), cut=True)
    write("rmb_envelope", envelopes(), cut=False)
    write("sg_frame", SG_FRAMES, cut=False)
    cut_responses = [bytes([i * 53 % 256]) + r for i, r in enumerate(HTTP_RESPONSES)]
    write("http_response", cut_responses, cut=True)
