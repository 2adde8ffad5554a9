"""Names in Redis: address names, and the keys of presence, instance liveness and bus streams.

Every key carries a hash tag (`{...}`) so the same commands run on one Redis server and on
Redis Cluster: a key's slot is decided by its tag alone, and the keys one instance uses
together (its bus stream and its liveness key) share a tag, so they share a slot.

| key | type | what |
|---|---|---|
| `rmb:{a:<name>}:at` | string, TTL | presence: id of the instance holding address `<name>` |
| `rmb:{i:<id>}:alive` | string, TTL | instance `<id>` is alive (refreshed every TTL/3) |
| `rmb:{i:<id>}:bus` | stream | messages other instances hand to instance `<id>` |
| `rmb:{i:<id>}:reaper` | string, TTL | the live instance taking over dead `<id>`'s stream |
| `rmb:{cluster}:instances` | set | every instance id that has a bus stream (for the reaper) |
| `rmb:{f:<topic>}:log` | stream | changes to a replicated table (`fanout.py`), read by all |
| `rmb:{f:<topic>}:members` | set | instances with entries in that table |
| `rmb:{f:<topic>}:i:<id>` | hash | instance `<id>`'s entries of that table (a snapshot) |
| `rmb:{q:<topic>:<name>}:work` | stream | a work queue (`workqueue.py`), one consumer group |
| `rmb:{q:<topic>:<name>}:holders` | set | instances consuming that queue |
| `rmb:{q:<topic>:<name>}:claim:<c>` | string, TTL | a claim: `t:<id>` took it, `w` withdrawn |

A replicated table's keys share one tag, so one script can change an instance's entries and
append the change to the log atomically, and a newcomer reads the snapshot and the log
position it belongs to in one step. A work queue's keys share a tag of their own.

Topics in use: `sg` (the 신경 gateway's clients); work queues `tunnel:<TENANT>` (the HTTP
tunnel's requests). Dialects build their keys here and nowhere else.

The 신경 gateway's queues (`dialects/singyeong/redis_queues.py`) are a store of its own, not
routing: `sgq:{<queue>}:msgs|waiting|unacked|owner|attempts|dead` (one tag per queue),
`sgq:names` and the pub/sub channel `sgq:events`. Their names are kept from before the cluster
layer, so messages queued by a running deployment survive an upgrade.

The mailbox keeps rmb-rs's names (`stream:<twin>[:<sid>]`, `mailbox.py`): each is used alone,
one key per command or transaction, which Redis Cluster accepts without a tag.

An *address name* is the text form of a switch address: `r:<twin>` or `r:<twin>:<sid>` for an
RMB session, `s:<base64url key>` for an SBD key, `<kind>:<anything>` for a kind another dialect
registers with `Cluster.register_kind` (docs/cluster.md): `g` (신경 clients), `gm` (a 신경
frame for several clients of one instance), `t` (tunnel response waiters).
"""

from __future__ import annotations

import base64
import binascii

from rmb_relay.mailbox import SessionKey

#: the consumer group every bus stream is read through (owner and reapers alike)
GROUP = "relay"
INSTANCES_KEY = "rmb:{cluster}:instances"

#: RMB sessions and SBD keys, the kinds the switch's route table holds
KIND_RMB = "r"
KIND_SBD = "s"
#: the 신경 gateway's clients, its frames for several clients of one instance, and the
#: tunnel's response waiters (`Cluster.register_kind`)
KIND_GATEWAY = "g"
KIND_GATEWAY_MANY = "gm"
KIND_TUNNEL = "t"
#: an SBD address is an ed25519 public key
SBD_KEY_BYTES = 32


def presence_key(name: str) -> str:
    return f"rmb:{{a:{name}}}:at"


def alive_key(instance: str) -> str:
    return f"rmb:{{i:{instance}}}:alive"


def reaper_key(instance: str) -> str:
    return f"rmb:{{i:{instance}}}:reaper"


def bus_key(instance: str) -> str:
    return f"rmb:{{i:{instance}}}:bus"


def table_log_key(topic: str) -> str:
    return f"rmb:{{f:{topic}}}:log"


def table_members_key(topic: str) -> str:
    return f"rmb:{{f:{topic}}}:members"


def table_prefix(topic: str) -> str:
    """What an instance's id is appended to for its hash of `topic` (scripts build it)."""
    return f"rmb:{{f:{topic}}}:i:"


def table_key(topic: str, instance: str) -> str:
    return table_prefix(topic) + instance


def work_key(topic: str, name: str) -> str:
    return f"rmb:{{q:{topic}:{name}}}:work"


def work_holders_key(topic: str, name: str) -> str:
    return f"rmb:{{q:{topic}:{name}}}:holders"


def work_claim_key(topic: str, name: str, claim: str) -> str:
    return f"rmb:{{q:{topic}:{name}}}:claim:{claim}"


#: the 신경 queues' names (a set) and their wake-up channel (pub/sub)
SG_QUEUE_NAMES = "sgq:names"
SG_QUEUE_EVENTS = "sgq:events"
#: queue name -> the application that made it (--sg-queues-per-app with Redis)
SG_QUEUE_APPS = "sgq:apps"
#: bytes of messages all Redis-backed 신경 queues hold (--sg-queue-total-bytes)
SG_QUEUE_BYTES = "sgq:bytes"


def sg_queue_keys(queue: str) -> dict[str, str]:
    """One 신경 queue's keys by role (one hash tag: its scripts touch them together)."""
    base = f"sgq:{{{queue}}}:"
    return {
        k: base + k
        for k in ("msgs", "waiting", "unacked", "owner", "attempts", "dead", "bytes", "sizes")
    }


def address_name(address: SessionKey | bytes) -> str:
    """The name of a switch address (RMB session or SBD key)."""
    if isinstance(address, bytes):
        return KIND_SBD + ":" + base64.urlsafe_b64encode(address).rstrip(b"=").decode()
    twin, sid = address
    return f"{KIND_RMB}:{twin}" if sid is None else f"{KIND_RMB}:{twin}:{sid}"


def parse_address_name(name: str) -> SessionKey | bytes:
    """The switch address of an RMB or SBD name; raises ValueError saying what is wrong."""
    kind, sep, rest = name.partition(":")
    if not sep:
        raise ValueError(f"address name {name!r} has no kind prefix")
    if kind == KIND_RMB:
        twin_text, has_sid, sid = rest.partition(":")
        if not twin_text.isdigit() or not 0 < int(twin_text) < 1 << 32:
            raise ValueError(f"address name {name!r}: twin must be a number 1..2^32-1")
        return int(twin_text), sid if has_sid else None
    if kind == KIND_SBD:
        try:
            padded = rest + "=" * (-len(rest) % 4)
            key = base64.b64decode(padded, altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"address name {name!r}: key is not base64url") from None
        if len(key) != SBD_KEY_BYTES:
            raise ValueError(f"address name {name!r}: key must be {SBD_KEY_BYTES} bytes")
        return key
    raise ValueError(f"address name {name!r}: unknown kind {kind!r}")


def name_kind(name: str) -> str:
    return name.partition(":")[0]
