"""The lean echo target, now part of the harness (`rmb_relay/load/echo_target.py`, what
`rmb-load tunnel --start-target` starts): `python -m bench.echo_target --port 8000` still works."""

from rmb_relay.load.echo_target import EchoProtocol, main, serve

__all__ = ["EchoProtocol", "main", "serve"]

if __name__ == "__main__":
    main()
