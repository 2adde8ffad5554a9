"""rmb-relay: a high-performance message relay.

One listener speaks several relay dialects: RMB (ThreeFold's Reliable Message Bus, with
federation and scale-out over Redis), SBD (holochain's simple websocket relay), a 신경-style
gateway and an HTTP tunnel in the style of RelayServer. asyncio on uvloop orchestrates; a Rust
core (`rmb_relay._core`) does the per-byte and per-message work. Besides the relay
(`rmb-relay`), the package holds rmb-peer (`peer/`), the SDK (`sdk/`), the load harness
(`load/`, `rmb-load`) and the analytics jobs (`analytics/`, `rmb-analytics`).
docs/architecture.md draws the layers.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
