"""`rmb-relay twins add|list|rm|show`: manage the embedded twin directory.

A relay that is running sees changes once its cache entry expires (`--twin-cache-ttl`, and 5 s
for twins it did not find).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rmb_relay.errors import ConfigError
from rmb_relay.twins import Twin
from rmb_relay.twins.local import SqliteTwinDirectory, default_twins_path

__all__ = ["add_twins_subcommands", "default_twins_path", "parse_twins_url", "twins_main"]


def parse_twins_url(text: str) -> Path:
    """`sqlite:PATH` -> PATH."""
    scheme, sep, rest = text.partition(":")
    if not sep or scheme != "sqlite" or not rest:
        raise ConfigError(
            f"--twins {text!r}: expected sqlite:PATH (the chain backend will be --substrate URL)"
        )
    return Path(rest).expanduser()


def _hex(text: str, length: int, what: str) -> bytes:
    text = text.removeprefix("0x")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{what} must be hex") from None
    if len(raw) != length:
        raise ConfigError(
            f"{what} must be {length} bytes ({2 * length} hex digits), got {len(raw)}"
        )
    return raw


def _directory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--twins",
        metavar="sqlite:PATH",
        default=None,
        help=f"twin directory (default: sqlite:{default_twins_path()})",
    )


def add_twins_subcommands(commands: Any) -> None:
    """Register `twins` and its subcommands on an argparse subparsers object."""
    twins = commands.add_parser(
        "twins",
        help="manage the embedded twin directory",
        description="Manage the embedded twin directory (a SQLite file) that logins check.",
    )
    actions = twins.add_subparsers(dest="twins_command", metavar="ACTION", required=True)

    add = actions.add_parser("add", help="add or replace a twin")
    _directory_argument(add)
    add.add_argument("--id", type=int, required=True, help="twin id")
    key = add.add_mutually_exclusive_group(required=True)
    key.add_argument("--account", metavar="HEX", help="32-byte account public key")
    key.add_argument("--mnemonic", metavar="WORDS", help="BIP39 phrase to derive the account from")
    key.add_argument("--seed", metavar="0xHEX", help="32-byte hex seed to derive the account from")
    add.add_argument(
        "--key-type",
        choices=("sr25519", "ed25519"),
        default="sr25519",
        help="scheme for --mnemonic/--seed (default: sr25519)",
    )
    add.add_argument(
        "--relay",
        action="append",
        metavar="DOMAIN",
        help="relay domain serving the twin (repeatable; omitted: relay info not set)",
    )
    add.add_argument("--pk", metavar="HEX", help="33-byte compressed secp256k1 key for e2e")

    lister = actions.add_parser("list", help="list twins")
    _directory_argument(lister)
    lister.add_argument("--json", action="store_true", help="JSON lines instead of a table")

    show = actions.add_parser("show", help="show one twin")
    _directory_argument(show)
    show.add_argument("id", type=int)
    show.add_argument("--json", action="store_true", help="JSON instead of text")

    remove = actions.add_parser("rm", help="remove a twin")
    _directory_argument(remove)
    remove.add_argument("id", type=int)


def _as_json(twin: Twin) -> dict[str, Any]:
    return {
        "id": twin.id,
        "account": twin.account.hex(),
        "relays": None if twin.relays is None else sorted(twin.relays),
        "pk": None if twin.pk is None else twin.pk.hex(),
    }


def _account(args: argparse.Namespace) -> bytes:
    if args.account:
        return _hex(args.account, 32, "--account")
    from rmb_relay.identity import signing_key

    secret = args.mnemonic if args.mnemonic else args.seed
    if args.seed and not args.seed.startswith("0x"):
        raise ConfigError("--seed must be 0x followed by 64 hex digits")
    return signing_key(secret, args.key_type).public_key


def twins_main(args: argparse.Namespace) -> int:
    """Run a `twins` action; returns the exit code (2 with one line on stderr on error)."""
    try:
        path = parse_twins_url(args.twins) if args.twins else default_twins_path()
        directory = SqliteTwinDirectory(path)
        action = args.twins_command
        if action == "add":
            relays = frozenset(args.relay) if args.relay else None
            pk = _hex(args.pk, 33, "--pk") if args.pk else None
            twin = Twin(args.id, _account(args), relays, pk)
            directory.add(twin)
            print(f"twin {twin.id} saved in {path} (account {twin.account.hex()})")
        elif action == "list":
            twins = directory.list()
            if args.json:
                for twin in twins:
                    print(json.dumps(_as_json(twin)))
            else:
                print(f"{'id':>10}  {'account':64}  {'e2e':3}  relays")
                for twin in twins:
                    shown = "(not set)" if twin.relays is None else ",".join(sorted(twin.relays))
                    e2e = "yes" if twin.pk else "no"
                    print(f"{twin.id:>10}  {twin.account.hex()}  {e2e:3}  {shown}")
        elif action == "show":
            found = directory.show(args.id)
            if found is None:
                raise ConfigError(f"no twin {args.id} in {path}")
            data = _as_json(found)
            if args.json:
                print(json.dumps(data))
            else:
                for name, value in data.items():
                    print(f"{name}: {value}")
        elif action == "rm":
            if not directory.remove(args.id):
                raise ConfigError(f"no twin {args.id} in {path}")
            print(f"twin {args.id} removed from {path}")
    except ConfigError as err:
        print(f"rmb-relay twins: {err}", file=sys.stderr)
        return 2
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="rmb-relay")
    add_twins_subcommands(parser.add_subparsers(dest="command", required=True))
    raise SystemExit(twins_main(parser.parse_args()))


if __name__ == "__main__":
    main()
