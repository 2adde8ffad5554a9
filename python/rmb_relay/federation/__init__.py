"""Relay-to-relay delivery (spec/rmb.md §3.3-3.4, decisions 4-5).

```text
switch.federate(envelope, twin)
  └─ Federation.forward ── OutboundFederation (outbound.py)
        queue.py    MemoryQueue (bounded) | RedisQueue (stream + consumer group, claims)
        ranker.py   order of a twin's relays by recent failures (+ priors.py)
        sender.py   POST to the remote relay: aiohttp pools per remote, TLS verified
POST / from another relay ── InboundFederation (inbound.py): size, parse, ours?, signature
setup.py    the flags of `rmb-relay serve` and building all of it from them
metrics.py  rmb_relay_federation_* in /metrics
```

A relay with no federation route answers messages for other relays' twins with a clear error
(`Switch.federate`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay.twins import Twin


class Federation(abc.ABC):
    """The switch's route to other relays (`switch.FederationRoute`)."""

    @abc.abstractmethod
    async def forward(self, envelope: bytes, twin: Twin) -> None:
        """Accept the raw envelope bytes for one of `twin.relays`; raise FederationError."""

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start background work on the running loop."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work."""
