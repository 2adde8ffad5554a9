"""What every command-line program of ours shares: the `--help` formatter, logging set-up, the
event loop, and a quiet exit when stdout's reader leaves.

A leaf module (of the package it imports only log_budget.py, a leaf too), so any command,
and the programs `rmb-peer`, `rmb-load` and `rmb-analytics`, can use it without importing
the others.
Every flag's help ends with its default, so `--help` never lies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from rmb_relay.log_budget import DEFAULT_LOG_RATE, LogBudget


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it has none or its help already says it; the description
    and epilog are printed as written (callers wrap them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def setup_logging(debug: int, log_rate: float = DEFAULT_LOG_RATE) -> None:
    """Log to stderr; the same message at most `log_rate` lines a second (log_budget.py)."""
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if debug >= 2 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(LogBudget(log_rate))
    if debug == 1:
        logging.getLogger("rmb_relay").setLevel(logging.DEBUG)


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine on uvloop (the production loop)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(main)
        except OSError as err:
            raise SystemExit(f"rmb-relay: {err}") from None


def exit_with(command: Callable[[], int]) -> NoReturn:
    """Run a command that prints, and exit with its code. If stdout's reader leaves early
    (`rmb-relay twins list | head`), stop quietly as `cat` does instead of with a traceback:
    stdout is pointed at /dev/null so the interpreter's last flush cannot fail again, and the
    code is 141, what a shell reports for a SIGPIPE death."""
    try:
        code = command()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(141) from None
    raise SystemExit(code)
