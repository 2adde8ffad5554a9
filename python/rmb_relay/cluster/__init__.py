"""One relay service across many processes and hosts that share Redis (or Redis Cluster).

| module | what |
|---|---|
| `keys.py` | key names (hash-tagged) and address names |
| `wire.py` | the records instances hand each other, and their bytes |
| `bus.py` | each instance's stream: batched writes, reads through a consumer group |
| `presence.py` | which instance holds which address, with a TTL |
| `node.py` | `Cluster`: the switch's route to other instances, liveness, reaping dead ones |
| `endpoint.py` | a bus receiver that is not a connection (the tunnel's waiters) |
| `fanout.py` | replicated tables: every instance's entries everywhere (the 신경 gateway) |
| `workqueue.py` | work queues read by the instances holding X (the HTTP tunnel) |
| `connect.py` | one Redis client type for a server and for Redis Cluster |
| `options.py` | the flags and building a `Cluster` from them |
| `workers.py` | `rmb-relay --processes N`: N processes on one port (SO_REUSEPORT) |

docs/cluster.md tells operators how to run it and other dialects how to use it.
"""

from rmb_relay.cluster.node import DEFAULT_TTL, Cluster

__all__ = ["DEFAULT_TTL", "Cluster"]
