"""Command-line entry points (placeholder until the listener lands)."""


def relay_main() -> None:
    raise SystemExit("rmb-relay: not built yet")
