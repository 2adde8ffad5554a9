"""rmb-peer: a twin's gateway between local programs (Redis msgbus JSON) and RMB relays.

- `cli.py`      the `rmb-peer` command: public flags, startup, the twin lookup and update
- `gateway.py`  the peer itself, built on the SDK's `RmbClient` (client.py): msgbus in and out,
                incoming checks, backlog, `rmb.version`
- `msgbus.py`   the Redis keys and JSON shapes of the public rmb-peer
- `e2e.py`      end-to-end encryption (secp256k1 ECDH x-coordinate, AES-256-GCM)
- `resp.py`     a lean pipelined Redis client (the msgbus moves every message through Redis)

See docs/peer.md. Nothing is imported here, so `rmb_relay.client` can use `msgbus` and `resp`
without loading the gateway.
"""
