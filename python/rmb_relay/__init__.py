"""rmb-relay: a high-performance message relay.

RMB (ThreeFold's Reliable Message Bus) and SBD (holochain's simple websocket relay) on one
listener; asyncio on uvloop orchestrates, a Rust core (`rmb_relay._core`) does the per-byte work.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
