"""rmb-peer: a twin's gateway between local programs (Redis msgbus JSON) and RMB relays.

- `cli.py`      the `rmb-peer` command: public flags, startup, the twin lookup and update
- `gateway.py`  the peer itself, built on the SDK (`rmb_relay.sdk`): an `RmbClient` on every
                relay, the msgbus in and out (`sdk/msgbus.py`, `sdk/resp.py`: the same shapes
                `RmbPeerClient` speaks from the other side), incoming checks, backlog,
                `rmb.version`
- `e2e.py`      end-to-end encryption (secp256k1 ECDH x-coordinate, AES-256-GCM)

See docs/peer.md.
"""
