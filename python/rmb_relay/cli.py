"""The `rmb-relay` entry point: `rmb-relay COMMAND [flags]`, one module per command under
`commands/`. Plain `rmb-relay [flags]` runs `serve`, so existing launch lines keep working.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rmb_relay.cli_support import exit_with


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
