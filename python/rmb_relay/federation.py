"""Relay-to-relay delivery (spec/rmb.md §3.3, decisions 4-5).

The relay hands an envelope for a twin served by another relay to a `Federation`. Until the
federation issue lands, `FederationDisabled` answers every such message with a clear error the
sender receives as an rmb-rs-compatible error envelope, instead of silently dropping it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from rmb_relay.errors import FederationError

if TYPE_CHECKING:
    from rmb_relay.twins import Twin


class Federation(abc.ABC):
    @abc.abstractmethod
    async def forward(self, envelope: bytes, twin: Twin) -> None:
        """Deliver the raw envelope bytes to one of `twin.relays`; raise FederationError."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work."""


class FederationDisabled(Federation):
    """The sending side of federation is not built yet: refuse with a clear reason."""

    async def forward(self, envelope: bytes, twin: Twin) -> None:
        relays = ", ".join(sorted(twin.relays or ())) or "none"
        raise FederationError(
            f"destination twin {twin.id} is served by relay(s) {relays}; "
            "this relay does not federate to other relays"
        )
