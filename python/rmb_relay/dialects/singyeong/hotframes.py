"""The JSON text of the two frames sent per queued message, built from pieces.

QUEUE_CONFIRM (to the producer) and the QUEUE dispatch (to the consumer) are the frames a
queued message costs; through the generic path (a `Struct` per level, then the encoder over the
whole tree) each took 2-3 us, more than the rest of the message's bookkeeping. Here the fixed
parts are literal text and only the variable values go through the encoder (`codec.py`), so
the text is exactly what `encode(Encoding.JSON, frames.dispatch(...))` gives
(tests/test_singyeong_codec.py checks it). A CONFIRM without a nonce, the common case, is
also kept for the millisecond its `ts` lasts: a burst of QUEUEs is confirmed with one text.
Other encodings keep the generic path.
"""

from __future__ import annotations

from typing import Any

from rmb_relay.dialects.singyeong.codec import json_text, json_text_of_str


class ConfirmCache:
    """The last nonce-less QUEUE_CONFIRM built, reused while its queue and `ts` are the same."""

    __slots__ = ("_data", "_name", "_ts")

    def __init__(self) -> None:
        self._name = ""
        self._ts = -1
        self._data = b""

    def confirm(self, name: str, nonce: Any, ts: int) -> bytes:
        if nonce is None:
            if ts == self._ts and name == self._name:
                return self._data
            data = queue_confirm(name, None, ts)
            self._name, self._ts, self._data = name, ts, data
            return data
        return queue_confirm(name, nonce, ts)


def queue_confirm(name: str, nonce: Any, ts: int) -> bytes:
    """`frames.dispatch("QUEUE_CONFIRM", {"queue": name}, ts, nonce, queue=name)` as JSON."""
    quoted = json_text_of_str(name)
    nonce_text = "null" if nonce is None else json_text(nonce)
    return (
        f'{{"op":4,"d":{{"target":null,"nonce":{nonce_text},"payload":{{"queue":{quoted}}},'
        f'"queue":{quoted}}},"t":"QUEUE_CONFIRM","ts":{ts}}}'
    ).encode()


def queue_dispatch(
    name: str,
    payload: Any,
    message_id: str,
    attempt: int,
    nonce: Any,
    ts: int,
    payload_json: str | None = None,
) -> bytes:
    """`frames.dispatch("QUEUE", Struct(queue=, payload=, id=, attempt=), ts, nonce)` as
    JSON (session.py's `deliver_queued`); `payload_json`, when known, is `json_text(payload)`."""
    nonce_text = "null" if nonce is None else json_text(nonce)
    payload_text = json_text(payload) if payload_json is None else payload_json
    return (
        f'{{"op":4,"d":{{"target":null,"nonce":{nonce_text},"payload":{{"queue":'
        f'{json_text_of_str(name)},"payload":{payload_text},"id":'
        f'{json_text_of_str(message_id)},"attempt":{attempt}}}}},"t":"QUEUE","ts":{ts}}}'
    ).encode()
