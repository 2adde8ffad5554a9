"""The `rmb-relay` entry point: `rmb-relay COMMAND [flags]`, one module per command under
`commands/`. Plain `rmb-relay [flags]` runs `serve`, so existing launch lines keep working.

Every flag's help ends with its default, so `--help` never lies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default unless it has none or its help already says it; the description
    and epilog are printed as written (callers wrap them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def setup_logging(debug: int) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if debug >= 2 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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


def _commands_epilog() -> str:
    from rmb_relay.commands import commands

    lines = ["commands (`rmb-relay COMMAND --help` for each):"]
    lines += [f"  {name:<8} {command.help}" for name, command in commands().items()]
    lines.append("without a command, rmb-relay serves with the flags above")
    return "\n".join(lines)


def relay_main(argv: Sequence[str] | None = None) -> None:
    from rmb_relay.commands import commands, serve

    args = list(sys.argv[1:] if argv is None else argv)
    known = commands()
    if args and args[0] in known:
        name = args.pop(0)
        command = known[name]
        exit_with(lambda: command.main(args, f"rmb-relay {name}"))
    # plain `rmb-relay [flags]`: serve, with the commands listed under --help
    raise SystemExit(serve.main(args, "rmb-relay", _commands_epilog()))
