"""The load-testing harness behind `rmb-load`."""
