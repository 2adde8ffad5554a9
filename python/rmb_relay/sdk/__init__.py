"""The RMB SDK: the one implementation of "a twin talking to relays".

    key = identity.signing_key("<mnemonic>")
    async with await RmbClient.connect("ws://127.0.0.1:8080", twin=7, key=key, sid="app") as c:
        reply = await c.request(9, "calc.add", b"[1, 2]")

Everything that speaks RMB as a twin is built on this module, so login, signing, failover and
request matching exist once:

- the SDK (`RmbClient` directly; `RmbPeerClient` for programs that go through a local rmb-peer);
- the relay's tests;
- the load harness (`load/rmb.py`: a `RelayLink` per twin, envelope templates from `RmbClient`);
- rmb-peer (`peer/gateway.py`: an `RmbClient` on every `--relay`, with an inbound check that
  verifies and decrypts, and waiters that answer into Redis).

Modules, bottom up (the package imports nothing of the relay's, only the foundation: errors,
clock, identity and the Rust core; rmb-peer, the load harness and the relay's tests use it):

| module | what |
|---|---|
| `websocket.py` | `WebSocketClient`: a websocket client over asyncio (frames by the Rust core) |
| `envelope.py` | envelopes: building, signing, verifying, addresses |
| `link.py` | `RelayLink`: one relay connection logged in as a twin |
| `client.py` | `RmbClient`: a twin on one or more links |
| `resp.py` | `RespClient`: a small Redis client (RESP) for the msgbus |
| `msgbus.py` | rmb-peer's Redis msgbus JSON, both directions |
| `peer_client.py` | `RmbPeerClient`: requests and services through a local rmb-peer |

How the pieces behave:

`RelayLink` is one relay connection: login with a fresh JWT (spec/rmb.md §1.2) on every
(re)connect, a websocket ping once nothing has been written for 20 s, a new connection once
nothing has arrived for 40 s (the silent one is still read until the relay closes it: a cut
path delivers what the relay wrote once repaired), a reconnect 2 s after any loss (§5.3), and
outgoing envelopes batched into one write per event-loop turn.

`RmbClient` is a twin on one or more links. It builds and signs envelopes (§2.1), sends each
through the first link that is up and moves that link to the front when it was not (rmb-peer's
failover), matches replies to requests by uid through `Waiter`s, and serves incoming requests.
A relay that goes away may have swallowed requests, or the replies to them, so when a link is
lost every request still waiting for a reply is sent again through the links that are left (or
when one comes back), and once more a second later if still unanswered (the other side may have
answered through the dying relay before it noticed). Delivery is at-least-once: a service may
see a request twice, and a waiter takes one reply per destination, so the client does not.
A client made with `reconnect=True` keeps envelopes it cannot send yet until a link is up or
they expire; a plain client raises `ClientError` instead, and fails its pending requests when
its relay goes.

`RmbPeerClient` offers the same requests and services through rmb-peer's Redis msgbus JSON
(spec §5.4-§5.8) for programs that hold no keys themselves.
"""

from rmb_relay.sdk.client import (
    DEFAULT_EXPIRATION,
    Address,
    Handler,
    IncomingRequest,
    Reply,
    RequestOptions,
    RmbClient,
    Waiter,
)
from rmb_relay.sdk.envelope import address_text
from rmb_relay.sdk.link import RelayLink
from rmb_relay.sdk.msgbus import PeerReply, PeerRequest
from rmb_relay.sdk.peer_client import RmbPeerClient

__all__ = [
    "DEFAULT_EXPIRATION",
    "Address",
    "Handler",
    "IncomingRequest",
    "PeerReply",
    "PeerRequest",
    "RelayLink",
    "Reply",
    "RequestOptions",
    "RmbClient",
    "RmbPeerClient",
    "Waiter",
    "address_text",
]
