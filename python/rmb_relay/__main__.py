"""`python -m rmb_relay` runs the relay, exactly as the `rmb-relay` console script."""

from rmb_relay.cli import relay_main

if __name__ == "__main__":
    relay_main()
